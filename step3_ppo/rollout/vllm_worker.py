"""The vLLM worker process of `--rollout_engine vllm` and `--teacher_engine vllm` (started by
step3_ppo/rollout/vllm_engine.py and vllm_teacher.py, never by hand).

Runs as a plain script under the Python that has vLLM (`--vllm_python`: the project's venv on CPU, its own
environment on GPU), so it imports nothing of the project: only the standard library, torch and vllm. It
listens on a Unix socket (created once the model is built: its appearance says "ready"); each trainer rank of the node
connects and sends JSON requests (bytes framed by multiprocessing.connection, never pickles):
  {"op": "generate", "prompts": [[ids]], "params": {...}, "seeds": [...]}
      -> {"outputs": [{"ids": [...], "logprobs": [...] | null}]}: token ids in, token ids out, no text
  {"op": "load", "shm": name, "tensors": [[name, dtype, shape, offset], ...]}
      -> {"seconds": s}: checkpoint-format weights read from shared memory into the model in place
         (vLLM's reload_weights), then the prefix cache reset
  {"op": "sleep"} / {"op": "wake"} -> {}: vLLM's sleep mode, level 1 (started with --sleep)
  {"op": "score", "sequences": [[ids]], "prompt_len": [...], "temperature": 1.0}
      -> {"logprobs": [[...]]}: each sequence's log-probs of its tokens after the first prompt_len, each given its
         prefix (vLLM's prompt log-probs: a teacher scoring the student's tokens); at temperature 1 only, since
         vLLM 0.32 computes prompt log-probs from the raw logits (no temperature; another is answered an error)
  {"op": "close"} -> {} and the worker exits.
Requests that arrive together from several ranks are generated (or scored) in one batch. A rollout worker starts
with dummy weights (the trainer's arrive by sync: `--load_format dummy`); a teacher's reads its folder's
(`--load_format auto`). A failure is answered
{"error": "..."} and the worker keeps serving; the worker's own output goes to the log file the trainer
shows when it dies.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Listener, wait

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="the Unix socket to listen on (created once the model is built)")
    p.add_argument("--ranks", type=int, default=1, help="trainer ranks that connect")
    p.add_argument("--authkey_env", default="VLLM_WORKER_AUTHKEY", help="environment variable holding the key")
    p.add_argument("--model", required=True, help="a folder with the model's config.json (and its weights: auto)")
    p.add_argument(
        "--load_format",
        default="dummy",
        choices=["dummy", "auto"],
        help="dummy: random weights, the trainer's arrive by sync (the rollout); auto: the folder's (a teacher)",
    )
    p.add_argument("--dtype", default="float32", help="the actor's dtype (torch name)")
    p.add_argument("--max_model_len", type=int, required=True, help="longest prompt + answer served")
    p.add_argument(
        "--logprobs_mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "processed_logprobs"],
        help="vLLM's: raw (before temperature) when the rollout samples at temperature 1, else processed",
    )
    p.add_argument("--kv_cache_gib", type=float, default=1.0, help="KV cache size in GiB")
    p.add_argument(
        "--mode",
        choices=["auto", "eager", "compiled"],
        default="auto",
        help="eager: no compilation / CUDA graphs (fast start); auto: eager on CPU, compiled on GPU",
    )
    p.add_argument("--tensor_parallel_size", type=int, default=1, help="devices of this worker (GPU)")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.5, help="share of the GPU it may take (GPU)")
    p.add_argument("--sleep", action="store_true", help="vLLM's sleep mode (GPU; vLLM refuses it on CPU)")
    p.add_argument("--seed", type=int, default=0, help="vLLM's seed (each sampled request also gets its own)")
    return p.parse_args(argv)


def build_llm(args):
    """vLLM on the model's config with dummy weights (the trainer's weights arrive by the first sync) or the
    folder's own (`--load_format auto`), no tokenizer (token ids in and out) and no generation_config defaults (the
    trainer passes every setting)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(args.kv_cache_gib))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # this process is the worker: the model lives here
    from vllm import LLM  # lazy: vLLM reads the VLLM_* variables set just above when it is imported
    from vllm.platforms import current_platform  # lazy: as LLM

    # a reload that leaves a layer out (rotary tables; a LoRA sync's untouched layers) keeps its tensors: not news
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: "Failed to load weights" not in record.getMessage()
    )

    kwargs = {}
    eager = args.mode == "eager" or (args.mode == "auto" and current_platform.is_cpu())
    if not current_platform.is_cpu():
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return LLM(
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        skip_tokenizer_init=True,
        generation_config="vllm",
        max_model_len=args.max_model_len,
        enforce_eager=eager,
        tensor_parallel_size=args.tensor_parallel_size,
        logprobs_mode=args.logprobs_mode,
        seed=args.seed,
        enable_prefix_caching=True,
        enable_sleep_mode=args.sleep,
        **kwargs,
    )


def sampling_params(params: dict, seed: int | None):
    """The trainer's settings as vLLM's: its stop tokens only (ignore_eos: the model's own EOS ends an answer
    only when the trainer lists it), greedy as temperature 0, the sampled token's log-prob when asked."""
    from vllm import SamplingParams  # lazy: vLLM only after build_llm set its VLLM_* variables

    sample = params["do_sample"]
    return SamplingParams(
        n=1,
        max_tokens=params["max_new_tokens"],
        min_tokens=params.get("min_new_tokens") or 0,
        temperature=params["temperature"] if sample else 0.0,
        top_p=params["top_p"] if sample else 1.0,
        top_k=params["top_k"] if sample and params["top_k"] > 0 else 0,
        stop_token_ids=list(params["stop_token_ids"]),
        ignore_eos=True,
        logprobs=0 if params.get("logprobs") else None,
        detokenize=False,
        seed=seed,
    )


def generate(llm, requests: list[dict]) -> list[dict]:
    """Every request's prompts in one `generate` call; each request's outputs in its prompts' order."""
    from vllm.inputs import TokensPrompt  # lazy: as SamplingParams

    prompts, params = [], []
    for request in requests:
        for prompt, seed in zip(request["prompts"], request["seeds"]):
            prompts.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(sampling_params(request["params"], seed))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    replies, start = [], 0
    for request in requests:
        answers = []
        for out in outputs[start : start + len(request["prompts"])]:
            completion = out.outputs[0]
            logprobs = None
            if completion.logprobs is not None:
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
            answers.append({"ids": list(completion.token_ids), "logprobs": logprobs})
        replies.append({"outputs": answers})
        start += len(request["prompts"])
    return replies


def score(llm, requests: list[dict]) -> list[dict]:
    """Every request's sequences scored in one `generate` call of one token each (greedy; discarded): vLLM's
    prompt log-probs of the sequence's own tokens (the log-prob of token i given tokens before i; prompt_logprobs=0
    keeps just that one), from position prompt_len on. A request at another temperature than 1 is answered an
    error: vLLM 0.32's prompt log-probs skip the sampler's processing (its temperature included)."""
    from vllm import SamplingParams  # lazy: as generate's
    from vllm.inputs import TokensPrompt  # lazy: as generate's

    params = SamplingParams(n=1, max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    valid = [r for r in requests if r.get("temperature", 1.0) == 1.0]
    prompts = [TokensPrompt(prompt_token_ids=ids) for r in valid for ids in r["sequences"]]
    outputs = iter(llm.generate(prompts, params, use_tqdm=False) if prompts else [])
    replies = []
    for request in requests:
        if request.get("temperature", 1.0) != 1.0:
            replies.append(
                {"error": f"temperature {request['temperature']}: vLLM's prompt log-probs are at temperature 1 only"}
            )
            continue
        scored = []
        for ids, start in zip(request["sequences"], request["prompt_len"]):
            steps = next(outputs).prompt_logprobs  # [None, {id: Logprob} for each later token]
            scored.append([steps[i][ids[i]].logprob for i in range(max(start, 1), len(ids))])
        replies.append({"logprobs": scored})
    return replies


_blocks = {}  # shared-memory blocks by name, mapped once: the trainer unlinks the name after the first load


def load(llm, request: dict) -> dict:
    """Weights from the trainer's shared memory block into the model in place (checkpoint names and layout:
    vLLM fuses and repacks them itself), then the prefix cache dropped (its KV came from the old weights)."""
    t0 = time.perf_counter()
    if request["shm"] not in _blocks:
        shm = shared_memory.SharedMemory(name=request["shm"])
        resource_tracker.unregister(shm._name, "shared_memory")  # the trainer owns the block
        _blocks[request["shm"]] = (shm, torch.frombuffer(shm.buf, dtype=torch.uint8))
    flat = _blocks[request["shm"]][1]

    def weights():
        for name, dtype, shape, offset in request["tensors"]:
            dt = getattr(torch, dtype)
            count = 1
            for size in shape:
                count *= size
            nbytes = count * torch.empty((), dtype=dt).element_size()
            yield name, flat[offset : offset + nbytes].view(dt).view(shape)

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(), "is_checkpoint_format": True})
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - t0}


def serve(llm, listener, ranks: int, hello: dict) -> None:
    """Answer the ranks' requests until one sends "close" (or every rank has hung up)."""
    conns = [listener.accept() for _ in range(ranks)]
    for conn in conns:
        conn.send_bytes(json.dumps(hello).encode())
    while conns:
        ready = wait(conns)
        requests, closing = [], False
        for conn in ready:
            try:
                request = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                conns.remove(conn)
                continue
            requests.append((conn, request))
        for op, run in (("generate", generate), ("score", score)):  # each op's requests in one batch
            batch = [(c, r) for c, r in requests if r["op"] == op]
            if batch:
                try:
                    replies = run(llm, [r for _, r in batch])
                except Exception as e:  # answered, not fatal: the trainer stops with this line
                    traceback.print_exc()
                    replies = [{"error": f"{type(e).__name__}: {e}"}] * len(batch)
                for (conn, _), reply in zip(batch, replies):
                    conn.send_bytes(json.dumps(reply).encode())
        for conn, request in requests:
            if request["op"] == "load":
                try:
                    reply = load(llm, request)
                except Exception as e:
                    traceback.print_exc()
                    reply = {"error": f"{type(e).__name__}: {e}"}
                conn.send_bytes(json.dumps(reply).encode())
            elif request["op"] in ("sleep", "wake"):  # level 1: weights to CPU memory, KV cache dropped
                try:
                    llm.sleep(level=1) if request["op"] == "sleep" else llm.wake_up()
                    reply = {}
                except Exception as e:
                    traceback.print_exc()
                    reply = {"error": f"{type(e).__name__}: {e}"}
                conn.send_bytes(json.dumps(reply).encode())
            elif request["op"] == "close":
                conn.send_bytes(b"{}")
                closing = True
            elif request["op"] not in ("generate", "score"):
                conn.send_bytes(json.dumps({"error": f"unknown op {request['op']!r}"}).encode())
        if closing:
            return


def main(argv=None) -> None:
    args = parse_args(argv)
    key = os.environ.pop(args.authkey_env).encode()
    t0 = time.perf_counter()
    llm = build_llm(args)
    import vllm  # lazy: imported by build_llm, after its VLLM_* variables are set

    hello = {
        "vllm": vllm.__version__,
        "start_s": round(time.perf_counter() - t0, 2),
        "threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
    }
    # the socket appears once the model is built: the trainer ranks wait for it, connect and read `hello`
    listener = Listener(args.socket, family="AF_UNIX", authkey=key)
    serve(llm, listener, args.ranks, hello)
    listener.close()


if __name__ == "__main__":
    main()
