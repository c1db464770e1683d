"""`--teacher_engine vllm`: a distillation teacher served by its own vLLM worker instead of a frozen DeepSpeed engine.

The worker (step3_ppo/rollout/vllm_worker.py, `--load_format auto`) loads the teacher's weights from its folder, once;
they never change, so there is no weight sync. Local rank 0 of each node starts it (NodeWorker, the rollout engine's
machinery: the same `--vllm_*` settings, its own KV cache of `--vllm_kv_cache_gib`), every rank of the node connects
and sends its own rows, and the rows that arrive together are scored in one batch: vLLM's prompt log-probs of the
sequence prompt + answer, the answer's part kept. The trainer's teacher phase calls `store`, which fills
`row.per_action[name]` as PPOTrainer.store_logprobs does for a teacher engine: one fp32 value per response token.

vLLM 0.32 computes prompt log-probs from the raw logits (the sampler's processing, temperature included, is for
sampled tokens only), so a teacher on vLLM scores at temperature 1: `check_teacher_args` refuses a run that samples
at another. The full-vocabulary signals need the teacher's hidden states in training, which a worker does
not give: only `--distill_signal reverse_kl_sampled` takes it.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

from step3_ppo.rollout.vllm_engine import NodeWorker, VLLMSettings
from utils.math.rows import Row
from utils.train.flags import fail, refuse_unread

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype as the worker's --dtype


class VLLMTeacher(NodeWorker):
    """A frozen teacher on its own vLLM worker: `store(rows, name, temperature)` scores the rows' answers."""

    def __init__(
        self,
        name: str,
        path: str,
        dtype: str,
        settings: VLLMSettings | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
    ):
        self.name, self.path, self.dtype, self.seed = name, path, TORCH_DTYPES.get(dtype, dtype), seed
        self.trust_remote_code = trust_remote_code
        self.what = f"vLLM worker of teacher {name!r}"
        self._open_worker(settings or VLLMSettings())

    def _worker_args(self) -> list[str]:
        config = AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        max_len = self.settings.max_model_len or min(getattr(config, "max_position_embeddings", 8192), 8192)
        return [
            "--model",
            self.path,
            "--load_format",
            "auto",
            "--dtype",
            self.dtype,
            "--max_model_len",
            str(max_len),
            "--seed",
            str(self.seed),
        ]

    @torch.no_grad()
    def store(self, rows: list[Row], name: str, temperature: float) -> None:
        """The teacher's log-prob of each response token given the tokens before it, fp32 [t] per row, stored as
        `row.per_action[name]` (the layout of PPOTrainer.store_logprobs). Every rank calls it with its own rows."""
        if temperature != 1.0:
            raise ValueError(
                f"a teacher on vLLM scores at temperature 1 only (vLLM's prompt log-probs), not {temperature}"
            )
        sequences = [torch.cat([row.prompt_ids, row.response_ids]).tolist() for row in rows]
        request = {
            "op": "score",
            "sequences": sequences,
            "prompt_len": [row.prompt_ids.numel() for row in rows],
            "temperature": temperature,
        }
        scored = self._call(request, "scoring")["logprobs"]
        for row, values in zip(rows, scored):
            row.per_action[name] = torch.tensor(values, dtype=torch.float32).reshape(row.response_ids.numel())


def check_teacher_args(args) -> None:
    """`--teacher_engine vllm`: its worker runs as the rollout's does (the same interpreter and `--vllm_*` set-up),
    gives the sampled tokens' log-probs only (not the hidden states a full-vocabulary signal reads in training),
    at temperature 1 only (vLLM's prompt log-probs skip the sampler's temperature), and holds its own weights."""
    if args.rollout_engine != "vllm":
        fail(
            "--teacher_engine vllm runs the teacher on a vLLM worker set up as the rollout's: it needs "
            "--rollout_engine vllm"
        )
    if args.distill_signal != "reverse_kl_sampled":
        fail(
            f"--teacher_engine vllm gives the sampled tokens' log-probs only: --distill_signal {args.distill_signal} "
            f"needs the teacher's hidden states in training (use reverse_kl_sampled, or --teacher_engine hf)"
        )
    temperature = args.temperature if args.do_sample else 1.0
    if temperature != 1.0:
        fail(
            f"--teacher_engine vllm scores at temperature 1 only (vLLM's prompt log-probs skip the temperature): "
            f"--temperature {temperature} (use --teacher_engine hf)"
        )
    refuse_unread(args, ["offload_teacher_model"], "with --teacher_engine vllm (the worker holds the teacher)")


def build_teacher(teacher, args) -> VLLMTeacher:
    """The client of `teacher` (a step3_ppo.teachers.Teacher): its worker loads the weights itself, in --dtype."""
    return VLLMTeacher(
        teacher.name, teacher.path, args.dtype, VLLMSettings.from_args(args), args.seed, args.trust_remote_code
    )
