"""`--teacher_engine vllm`: a teacher on its own vLLM worker scores the student's tokens as the in-process teacher
does (utils.models.forward.token_logprobs on the same model, fp32), a step-3 iteration whose teacher is the student
gives a zero signal, and the flags that cannot go with it stop the run in one line. One module run: a rollout worker
and a teacher worker (tiny llama, eager), started once.

vLLM is installed by `scripts/setup.sh --with-vllm`, which scripts/test.sh runs: there (RLHF_TESTS_NEED_VLLM=1)
a missing vLLM fails these tests; a bare `pytest` without it skips them.
"""

import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from step3_ppo.main import parse_args, setup
from step3_ppo.rollout.vllm_teacher import VLLMTeacher
from tests.launch import vllm_python
from tests.test_step3_grpo import grpo_args, write_rows
from tests.test_step3_lr0 import prompt_batches
from utils.errors import UsageError
from utils.math.rows import from_token_layout, pack
from utils.models.forward import token_logprobs
from utils.models.tiny import make_tiny_model

if os.environ.get("RLHF_TESTS_NEED_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --with-vllm)")


@pytest.fixture(scope="module")
def llama_32(tmp_path_factory) -> str:
    """A tiny llama with head size 32 (2 heads of 64): vLLM's CPU attention takes multiples of 32 only."""
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("vllm_teacher") / "llama"), num_heads=2)


@pytest.fixture(scope="module")
def worker_python() -> list[str]:
    python = vllm_python()
    return ["--vllm_python", python] if python else []


def teacher_args(model, tmp, worker_python, *extra, rollout_engine="vllm"):
    """Step 3 at lr 0 (GRPO, no KL term) with the student as its own teacher on a vLLM worker."""
    write_rows(tmp)
    engine = ["--rollout_engine", "vllm", "--vllm_mode", "eager", *worker_python] if rollout_engine == "vllm" else []
    return grpo_args(
        model,
        tmp,
        "--actor_zero_stage",
        0,
        "--actor_learning_rate",
        0,
        "--kl_ctl",
        0,
        *engine,
        "--teacher_model_name_or_path",
        model,
        "--teacher_engine",
        "vllm",
        *extra,
    )


@pytest.fixture(scope="module")
def teacher_run(llama_32, tmp_path_factory, worker_python):
    """Step 3 at lr 0 whose teacher (on its own vLLM worker) is the student itself."""
    run = setup(parse_args(teacher_args(llama_32, tmp_path_factory.mktemp("run"), worker_python)))
    yield run
    run.trainer.rollout.close()
    for teacher in run.engines.teachers.values():
        teacher.close()


@pytest.mark.slow
def test_the_workers_logprobs_are_the_in_process_teachers(teacher_run, llama_32):
    trainer = teacher_run.trainer
    teacher = trainer.teachers["teacher"]
    assert isinstance(teacher, VLLMTeacher)
    torch.manual_seed(0)
    rows = trainer.generate_rows(prompt_batches(teacher_run, 4, n_rows=4)[0])  # 8 rows, prompts of 4 lengths
    for i, row in enumerate(rows):  # answers of 1 to 6 tokens (the tiny model rarely stops on its own)
        row.response_ids = row.response_ids[: 1 + i % 6]
    assert len({r.prompt_ids.numel() for r in rows}) > 1 and len({r.response_ids.numel() for r in rows}) > 1
    teacher.store(rows, "vllm", temperature=1.0)
    model = AutoModelForCausalLM.from_pretrained(llama_32, torch_dtype=torch.float32).eval()
    batch = pack(rows, trainer.config.pad_token_id)
    with torch.no_grad():
        from_token_layout(rows, "hf", token_logprobs(model, batch, 1.0), batch["prompt_len"])
    diff = max(float((r.per_action["vllm"] - r.per_action["hf"]).abs().max()) for r in rows)
    print(f"max |vLLM teacher - in-process teacher| = {diff:.2e}")
    assert all(r.per_action["vllm"].shape == r.response_ids.shape for r in rows)
    assert diff <= 1e-4, diff
    with pytest.raises(ValueError, match="temperature 1 only"):  # vLLM 0.32's prompt log-probs skip temperature
        teacher.store(rows, "vllm", temperature=0.7)


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_gives_a_zero_signal(teacher_run):
    torch.manual_seed(1)
    metrics, rows = teacher_run.trainer.step(prompt_batches(teacher_run, 2, n_rows=2), step=0)
    assert abs(metrics["distill/reverse_kl_sampled_token_mean"]) <= 1e-4, metrics
    assert metrics["distill/teacher_logprob_mean"] < 0
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4, metrics
    assert all("teacher_logprobs" in r.per_action for r in rows)


@pytest.mark.parametrize(
    "extra, says",
    [
        ([], "--teacher_engine vllm runs the teacher on a vLLM worker set up as the rollout's: it needs --rollout"),
        (["--distill_signal", "reverse_kl"], "--teacher_engine vllm gives the sampled tokens' log-probs only"),
        (["--temperature", "0.7"], "--teacher_engine vllm scores at temperature 1 only"),
        (["--offload_teacher_model"], "--offload_teacher_model does nothing with --teacher_engine vllm"),
    ],
)
def test_what_a_teacher_on_vllm_cannot_do_stops_the_run(llama_32, tmp_path, worker_python, extra, says):
    rollout_engine = "vllm" if extra else "hf"
    args = teacher_args(llama_32, tmp_path, worker_python, *extra, rollout_engine=rollout_engine)
    with pytest.raises(UsageError, match="^" + re.escape(says)):
        parse_args(args)


def test_teacher_engine_without_a_teacher_is_refused(llama_32, tmp_path):
    write_rows(tmp_path)
    with pytest.raises(UsageError, match="--teacher_engine does nothing without --teacher_model_name_or_path"):
        parse_args(grpo_args(llama_32, tmp_path, "--teacher_engine", "vllm"))
