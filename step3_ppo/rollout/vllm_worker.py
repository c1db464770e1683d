"""The vLLM worker process of `--rollout_engine vllm` and `--teacher_engine vllm` (started by
step3_ppo/rollout/vllm_engine.py and vllm_teacher.py, never by hand).

Runs as a plain script under the Python that has vLLM (`--vllm_python`: the project's venv on CPU, its own
environment on GPU), so it imports nothing of the project: only the standard library, torch and vllm. It
listens on a Unix socket (created once the model is built: its appearance says "ready"); each trainer rank of the node
connects and sends JSON requests (bytes framed by multiprocessing.connection, never pickles):
  {"op": "generate", "prompts": [[ids]], "params": {...}, "seeds": [...]}
      -> {"outputs": [{"ids": [...], "logprobs": [...] | null}], "version": v}: token ids in, token ids out, no
         text; `version` names the weights every one of its tokens came from (the last load's)
  {"op": "load", "shm": name, "tensors": [[name, dtype, shape, offset], ...], "version": v}
      -> {"seconds": s}: checkpoint-format weights read from shared memory into the model in place
         (vLLM's reload_weights), then the prefix cache reset
  {"op": "load_lora", "path": folder, "version": v, "modules": n}
      -> {"seconds": s}: a peft adapter folder (adapter_config.json, adapter_model.safetensors) added under a new
         name and id for version v (started with --max_loras): later generate requests use it, so neither an
         older adapter nor KV computed under one is reused; answered an error unless vLLM placed all n of the
         adapter's LoRA modules (a name mismatch would otherwise serve the bare base); adapters older than the
         last max_loras - 1 are removed
  {"op": "sleep"} / {"op": "wake"} -> {}: vLLM's sleep mode, level 1 (started with --sleep)
  {"op": "score", "sequences": [[ids]], "prompt_len": [...], "temperature": 1.0}
      -> {"logprobs": [[...]]}: each sequence's log-probs of its tokens after the first prompt_len, each given its
         prefix (vLLM's prompt log-probs: a teacher scoring the student's tokens); at temperature 1 only, since
         vLLM 0.32 computes prompt log-probs from the raw logits (no temperature; another is answered an error)
  {"op": "close"} -> {} and the worker exits.
Requests that arrive together from several ranks are generated (or scored) in one batch. The worker serves one
request batch at a time: a load waits until every generate request read before it is answered (a sync drains
the requests in flight), so no request generates with two versions' weights. A rollout worker starts
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
        "--max_loras",
        type=int,
        default=0,
        help="serve LoRA adapters (vLLM's enable_lora) with this many loaded at once; 0: no LoRA (whole weights)",
    )
    p.add_argument("--max_lora_rank", type=int, default=16, help="the largest adapter rank served")
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
        # the sampled tokens' log-probs after temperature, top-k and top-p: those of the distribution sampled
        logprobs_mode="processed_logprobs",
        seed=args.seed,
        enable_prefix_caching=True,
        enable_sleep_mode=args.sleep,
        **lora_kwargs(args),
        **kwargs,
    )


def lora_kwargs(args) -> dict:
    """vLLM's LoRA settings with --max_loras > 0: adapters of up to --max_lora_rank in the model's dtype, as many
    on the device as in the CPU cache (an adapter still in use is never evicted to make room)."""
    if not args.max_loras:
        return {}
    return {
        "enable_lora": True,
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
    }


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


class Weights:
    """Which weights the worker generates with: the version of the last load (None before the first) and, when it
    serves adapters, the LoRA requests of the loaded versions (oldest first; the last in use)."""

    def __init__(self, max_loras: int = 0):
        self.version, self.max_loras, self.adapters = None, max_loras, []

    @property
    def lora_request(self):
        return self.adapters[-1] if self.adapters else None


def generate(llm, requests: list[dict], weights: Weights | None = None) -> list[dict]:
    """Every request's prompts in one `generate` call (with the current adapter, if any); each request's outputs
    in its prompts' order, stamped with the weights' version."""
    from vllm.inputs import TokensPrompt  # lazy: as SamplingParams

    weights = weights or Weights()
    prompts, params = [], []
    for request in requests:
        for prompt, seed in zip(request["prompts"], request["seeds"]):
            prompts.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(sampling_params(request["params"], seed))
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=weights.lora_request)
    replies, start = [], 0
    for request in requests:
        answers = []
        for out in outputs[start : start + len(request["prompts"])]:
            completion = out.outputs[0]
            logprobs = None
            if completion.logprobs is not None:
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
            answers.append({"ids": list(completion.token_ids), "logprobs": logprobs})
        replies.append({"outputs": answers, "version": weights.version})
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


def _loaded_modules(worker, adapter_id: int) -> int:
    """Run in vLLM's worker (collective_rpc): how many of the adapter's LoRA modules vLLM placed on a layer of the
    model, counting each part of a packed layer (q, k, v of qkv_proj) on its own, as the trainer's model has them."""
    manager = worker.model_runner.lora_manager._adapter_manager
    adapter = manager._registered_adapters.get(adapter_id)
    if adapter is None:
        return 0
    count = 0
    for module_name in manager.modules:  # the model's layers that take LoRA: a tensor named otherwise is never used
        layer = adapter.loras.get(module_name)
        if layer is not None:
            parts = layer.lora_a if isinstance(layer.lora_a, list) else [layer.lora_a]
            count += sum(part is not None for part in parts)
    return count


def load_lora(llm, request: dict, weights: Weights) -> dict:
    """The adapter folder of version v under the name `actor-v<v>` and id v + 1 (a new one each sync: vLLM keys its
    prefix cache and loaded adapters by it), checked to have placed every module sent; the oldest adapters beyond
    max_loras - 1 removed (the newest is in use, and none older than those can still be asked for)."""
    from vllm.lora.request import LoRARequest  # lazy: as SamplingParams

    t0 = time.perf_counter()
    version = request["version"]
    lora = LoRARequest(f"actor-v{version}", version + 1, request["path"])
    llm.llm_engine.add_lora(lora)
    placed = llm.collective_rpc(_loaded_modules, args=(lora.lora_int_id,))[0]
    if placed != request["modules"]:
        llm.llm_engine.remove_lora(lora.lora_int_id)
        raise ValueError(
            f"the adapter of version {version} has {request['modules']} LoRA modules and vLLM placed {placed} of "
            f"them (its tensor names do not match the model's modules: the worker would sample the bare base model)"
        )
    weights.adapters.append(lora)
    while len(weights.adapters) > max(weights.max_loras - 1, 1):
        llm.llm_engine.remove_lora(weights.adapters.pop(0).lora_int_id)
    weights.version = version
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - t0, "placed": placed}


def load(llm, request: dict, weights: Weights | None = None) -> dict:
    """Weights from the trainer's shared memory block into the model in place (checkpoint names and layout:
    vLLM fuses and repacks them itself), then the prefix cache dropped (its KV came from the old weights)."""
    t0 = time.perf_counter()
    if request["shm"] not in _blocks:
        shm = shared_memory.SharedMemory(name=request["shm"])
        resource_tracker.unregister(shm._name, "shared_memory")  # the trainer owns the block
        _blocks[request["shm"]] = (shm, torch.frombuffer(shm.buf, dtype=torch.uint8))
    flat = _blocks[request["shm"]][1]

    def tensors():
        for name, dtype, shape, offset in request["tensors"]:
            dt = getattr(torch, dtype)
            count = 1
            for size in shape:
                count *= size
            nbytes = count * torch.empty((), dtype=dt).element_size()
            yield name, flat[offset : offset + nbytes].view(dt).view(shape)

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors(), "is_checkpoint_format": True})
    llm.reset_prefix_cache()
    if weights is not None and request.get("version") is not None:
        weights.version = request["version"]
    return {"seconds": time.perf_counter() - t0}


def serve(llm, listener, ranks: int, hello: dict, weights: Weights | None = None) -> None:
    """Answer the ranks' requests until one sends "close" (or every rank has hung up). Each round answers the
    generate (and score) requests read first, then the loads: a sync drains what is in flight."""
    weights = weights or Weights()
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
                    replies = run(llm, [r for _, r in batch], *((weights,) if op == "generate" else ()))
                except Exception as e:  # answered, not fatal: the trainer stops with this line
                    traceback.print_exc()
                    replies = [{"error": f"{type(e).__name__}: {e}"}] * len(batch)
                for (conn, _), reply in zip(batch, replies):
                    conn.send_bytes(json.dumps(reply).encode())
        for conn, request in requests:
            if request["op"] in ("load", "load_lora"):
                try:
                    reply = (load if request["op"] == "load" else load_lora)(llm, request, weights)
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
    serve(llm, listener, args.ranks, hello, Weights(args.max_loras))
    listener.close()


if __name__ == "__main__":
    main()
