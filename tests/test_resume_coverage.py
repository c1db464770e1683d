"""Resume coverage: step 1's own SIGKILL and exact resume (2 ranks, ZeRO-3, dropout
on); the universal checkpoint (2 ranks -> 1, gradient accumulation 2) for step 2's reward model and for
step 3's actor, critic and EMA; DPO in half precision under ZeRO 0 and 1. Every combination tried resumes
(ZeRO-2/3, the hybrid engine, a weights-only engine, accumulation 2), so none is refused. Accumulation leaves
the position in the epoch unambiguous: a checkpoint is written at an optimizer step, the new ranks skip
exactly the rows the old ones had read (utils.train.checkpoint.Checkpointing.restore), and the next accumulation
window starts there.

Launches are the expensive part (tests/README.md): the SIGKILL test takes its uninterrupted metrics from
the killed run itself (the rows it wrote after its one checkpoint, before the kill), so it launches twice,
not three times; the universal-checkpoint tests launch the 2-rank run once and resume in this process
(rank 0 of 1, as tests/test_resume.py's step1())."""

import glob
import math
import os

import pytest
import torch

from tests.launch import metrics, run_deepspeed, tail
from tests.test_resume import comparable, kill_after_row_and_resume, max_relative_difference
from tests.test_step1_run import check_run, common_args, sft_data  # noqa: F401  (fixture)
from tests.test_step2_run import pair_data  # noqa: F401  (fixture)
from tests.test_step3_lr0 import write_prompts
from tests.test_step3_robustness import ppo_args

LN2 = math.log(2.0)


def _train_rows(rows: list[dict], last: int | None = None) -> list[dict]:
    return [r for r in rows if "train/loss" in r and (last is None or r["step"] <= last)]


def _weights(out: str) -> dict:
    """Every tensor of every *.safetensors file under `out` (the exported models), keyed by file and name."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(out, "**", "*.safetensors"), recursive=True))
    return {(os.path.relpath(f, out), k): v for f in files if "checkpoints" not in f for k, v in load_file(f).items()}


@pytest.mark.slow
def test_step1_two_rank_zero3_with_dropout_resumes_exactly_after_sigkill(tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """2 ranks, ZeRO-3, dropout 0.1, a warmed-up cosine schedule, one checkpoint (step 4) in 8 steps. The run
    is SIGKILLed once it has logged step 7: its rows after step 4 are an uninterrupted run's (the process
    that wrote the checkpoint went on from memory). The resumed run (weights, optimizer, scheduler, every
    rank's RNG and the loader's position from the checkpoint) logs the same figures: without the RNG
    states the dropout masks differ and the losses are ~1e-3 off. The resumed run is also step 1's 2-rank
    ZeRO-3 full fine-tune check (not a launch of its own in test_step1_run, to keep the suite short): it learns,
    its export reloads with the engine's logits and is not the empty tensors of a naive ZeRO-3 save."""
    out = str(tmp_path / "out")
    args = common_args(tiny_gpt2, sft_data, out, steps=8) + [
        "--zero_stage",
        3,
        "--dropout",
        0.1,
        "--save_interval",
        4,
        "--lr_scheduler_type",
        "cosine",
        "--num_warmup_steps",
        2,
    ]
    resumed_at, uninterrupted, proc = kill_after_row_and_resume("step1_sft.main", args, out, tmp_path, kill_at=7)
    uninterrupted = _train_rows(uninterrupted)
    assert resumed_at == 4, resumed_at
    assert os.path.isfile(os.path.join(out, "model.safetensors")), tail(proc)
    assert "resumed from" in proc.stdout and "step-00000004" in proc.stdout, tail(proc)
    resumed = _train_rows(metrics(out))
    assert [r["step"] for r in resumed] == list(range(1, 9))
    last = uninterrupted[-1]["step"]  # 7, or 8 when the kill came late
    expected, got = comparable(uninterrupted, 4), comparable(_train_rows(resumed, last), 4)
    assert {step for step, _ in expected} >= {5, 6, 7} and (5, "train/loss") in expected, sorted(expected)
    difference = max_relative_difference(expected, got)
    print(f"step 1 resumed at step 4: max relative difference {difference:.2e}")
    assert difference <= 1e-5

    check_run(out, proc)  # perplexity before (the killed run's step 0) and after, loss, export, memory
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.numel() > 0 for p in model.parameters())  # a naive ZeRO-3 save would write empty tensors


def restored_weights(monkeypatch) -> dict:
    """{engine name: its full weights} of every checkpointed engine right after `Run.restore` (filled in by
    the in-process run), to compare with the exports of the run that wrote the checkpoint."""
    from utils.models.export import gather_full_state_dict
    from utils.train.run import Run

    captured, original = {}, Run.restore

    def restore(self, *args, **kwargs):
        state = original(self, *args, **kwargs)
        for name, engine in self.checkpointing.engines.items():  # copies: on 1 rank, ZeRO-3's are the params
            captured[name] = {k: v.clone() for k, v in gather_full_state_dict(engine).items()}
        return state

    monkeypatch.setattr(Run, "restore", restore)
    return captured


def assert_restored_exactly(exported: dict, restored: dict, files: dict, start_model: str) -> None:
    """Every tensor the 2-rank run exported (`exported`, from _weights) equals the engine's restored one;
    `files` maps an exported file to (engine, key prefix in the engine's state dict). The exports moved
    away from `start_model` (the causal LM every trained model here began from), so equality says the
    checkpoint came back, not the starting weights."""
    from safetensors.torch import load_file

    assert {f for f, _ in exported} == set(files), sorted({f for f, _ in exported})
    differ = []
    for (file, key), tensor in exported.items():
        engine, prefix = files[file]
        if not torch.equal(tensor, restored[engine][prefix + key]):
            differ.append((file, key))
    assert not differ, differ[:5]
    start = load_file(os.path.join(start_model, "model.safetensors"))
    start = {k.removeprefix("transformer."): v for k, v in start.items()}
    moved = [
        (f, k)
        for (f, k), v in exported.items()
        if k.removeprefix("transformer.") in start and not torch.equal(v, start[k.removeprefix("transformer.")])
    ]
    assert {f for f, _ in moved} >= {f for f in files if f.endswith("model.safetensors")}, moved


@pytest.mark.slow
def test_reward_model_resumes_on_one_rank_from_two_ranks_zero3_with_accumulation(  # noqa: F811
    tiny_gpt2, pair_data, tmp_path, capsys, monkeypatch
):
    """Step 2, ZeRO-3, --gradient_accumulation_steps 2 on 2 ranks, checkpoint and export at step 2; resumed
    in this process on 1 rank with --universal_checkpoint: the checkpoint is converted, the loader's position
    re-sharded (each rank had read 4 micro-batches: 1 rank skips 8, a whole number of accumulation windows),
    the restored reward model (backbone and value head) is the 2-rank run's export exactly, and one more
    step trains from the restored optimizer at the same learning rate."""
    from step2_reward.main import main

    out = str(tmp_path / "out")
    args = [
        "--model_name_or_path",
        tiny_gpt2,
        "--data_path",
        pair_data,
        "--data_split",
        "0,10,0",
        "--output_dir",
        out,
        "--zero_stage",
        3,
        "--gradient_accumulation_steps",
        2,
        "--max_steps",
        2,
        "--save_interval",
        2,
        "--per_device_train_batch_size",
        4,
        "--per_device_eval_batch_size",
        16,
        "--max_seq_len",
        32,
        "--learning_rate",
        3e-3,
        "--lr_scheduler_type",
        "constant",
        "--seed",
        3,
        "--eval_iters",
        1,
    ]
    proc = run_deepspeed("step2_reward.main", args, log_path=str(tmp_path / "two_ranks.log"))
    exported = _weights(out)
    assert exported, tail(proc)
    full = _train_rows(metrics(out))

    restored = restored_weights(monkeypatch)
    capsys.readouterr()
    main([str(a) for a in args + ["--resume", "--universal_checkpoint", "--max_steps", 3]])
    printed = capsys.readouterr().out
    assert printed.count("converting") == 1 and "re-sharded" in printed and "skips 8 batches" in printed, printed
    assert "the run is now 3 steps long, not 2" in printed, printed  # the schedule's new length is said
    assert_restored_exactly(
        exported,
        restored,
        {"model.safetensors": ("model", "backbone."), "value_head.safetensors": ("model", "v_head.")},
        tiny_gpt2,
    )
    resumed = _train_rows(metrics(out))
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[:2] == full, resumed
    assert math.isfinite(resumed[2]["train/loss"]) and resumed[2]["train/lr"] == full[1]["train/lr"]


@pytest.mark.slow
def test_step3_engines_resume_on_one_rank_from_two_ranks_with_accumulation(
    tiny_gpt2, tiny_gpt2_reward, tmp_path, capsys, monkeypatch
):
    """Step 3's engines of each kind: the actor (ZeRO-3, hybrid engine), the critic (ZeRO-2) and the actor's
    EMA (weights only), --gradient_accumulation_steps 2, on 2 ranks to a checkpoint and export at iteration
    2; resumed in this process on 1 rank with --universal_checkpoint: actor and critic converted each on its
    own, every engine restored to the 2-rank run's exported weights exactly, and a third iteration trains."""
    from step3_ppo.main import main

    write_prompts(tmp_path / "prompts.jsonl", 32)
    out = str(tmp_path / "out")
    args = ppo_args(
        tiny_gpt2,
        tmp_path / "prompts.jsonl",
        out,
        "--actor_zero_stage",
        3,
        "--enable_hybrid_engine",
        "--critic_zero_stage",
        2,
        "--enable_ema",
        "--actor_learning_rate",
        1e-3,
        "--critic_learning_rate",
        1e-3,
        "--gradient_accumulation_steps",
        2,
        "--per_device_training_batch_size",
        1,
        "--max_steps",
        2,
        "--save_interval",
        2,
        critic=tiny_gpt2_reward,
    )
    proc = run_deepspeed("step3_ppo.main", args, log_path=str(tmp_path / "two_ranks.log"))
    exported = _weights(out)
    assert exported, tail(proc)
    full = metrics(out)

    restored = restored_weights(monkeypatch)
    capsys.readouterr()
    main(args + ["--resume", "--universal_checkpoint", "--max_steps", "3"])
    printed = capsys.readouterr().out
    assert printed.count("converting") == 2 and "re-sharded" in printed, printed
    assert_restored_exactly(
        exported,
        restored,
        {
            os.path.join("actor", "model.safetensors"): ("actor", ""),
            os.path.join("actor_ema", "model.safetensors"): ("actor_ema", ""),
            os.path.join("critic", "model.safetensors"): ("critic", "backbone."),
            os.path.join("critic", "value_head.safetensors"): ("critic", "v_head."),
        },
        tiny_gpt2,
    )
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[:2] == full[:2], resumed
    assert all(math.isfinite(v) for k, v in resumed[2].items() if k.startswith(("ppo/", "reward/")))


def _dpo_args(model, data, out, extra=()):
    return [
        "--model_name_or_path",
        model,
        "--data_path",
        data,
        "--data_split",
        "0,10,0",
        "--output_dir",
        out,
        "--max_steps",
        3,
        "--per_device_train_batch_size",
        8,
        "--per_device_eval_batch_size",
        16,
        "--eval_iters",
        1,
        "--max_seq_len",
        32,
        "--learning_rate",
        3e-3,
        "--lr_scheduler_type",
        "constant",
        "--seed",
        3,
        *extra,
    ]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_dpo_in_half_precision_trains_and_exports(zero_stage, tiny_gpt2, pair_data, tmp_path):  # noqa: F811
    """DPO with half-precision engines (policy and frozen reference) under ZeRO 0 and 1, in this process.
    fp16 where the accelerator has it; DeepSpeed's CPU accelerator has none here (is_fp16_supported() asks
    oneDNN, which has no fp16 kernels on this CPU, and the run refuses --dtype fp16 in one line,
    tests/test_safe_loading.py), so on CPU the half precision is bf16. The first update's loss is ln 2 (the
    policy is the reference, fp32 log-prob math), every loss is finite, no update is skipped, the policy moved,
    and the export is a full fp32 causal LM that the run reloads with the engine's log-probs (to bf16's
    precision)."""
    from deepspeed.accelerator import get_accelerator

    from step2_dpo.main import main

    half = "fp16" if get_accelerator().is_fp16_supported() else "bf16"
    out = str(tmp_path / f"{half}_zero{zero_stage}")
    main([str(a) for a in _dpo_args(tiny_gpt2, pair_data, out, ["--dtype", half, "--zero_stage", zero_stage])])
    rows = metrics(out)
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(train) == 3 and all(math.isfinite(x) for x in train), train
    assert train[0] == pytest.approx(LN2, abs=1e-6)
    assert [r["train/overflow_steps"] for r in rows if "train/loss" in r][-1] == 0
    # the reloaded directory's sequence log-probs (about -40) against the half-precision engine's
    assert [r["export/logp_max_abs_diff"] for r in rows if "export/logp_max_abs_diff" in r][0] <= 0.05
    from safetensors.torch import load_file

    exported = load_file(os.path.join(out, "model.safetensors"))
    assert exported and all(t.dtype == torch.float32 for t in exported.values())
    start = load_file(os.path.join(tiny_gpt2, "model.safetensors"))
    assert any(not torch.equal(exported[k], start[k]) for k in exported if k in start)  # it trained
