"""The final export is written whole or not at all: a write that fails (a full disk: ENOSPC, raised by a
monkeypatched writer, as a plain OSError or as safetensors' SafetensorError wrapping one) is one ExportWriteError
line naming the directory, what failed and why; no temporary folder is left and an older export in the directory
is as it was. For a causal LM (export_hf_model) and a reward model (export_reward_model), in one process."""

import errno
import os

import pytest
import torch
from safetensors import SafetensorError

import utils.models.export as export
import utils.models.reward_model as reward_model
from tests.test_step1_run import common_args, sft_data  # noqa: F401  (sft_data: a fixture)
from utils.models.export import EXPORT_OLD, EXPORT_TMP, ExportWriteError, export_hf_model
from utils.models.loading import load_causal_lm, load_tokenizer
from utils.models.reward_model import RewardModel, export_reward_model
from utils.train.run import Run

NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"


class PlainEngine:
    """What the export reads of a DeepSpeed engine, for an unpartitioned module (ZeRO stage 0)."""

    def __init__(self, module):
        self.module = module

    def zero_optimization_stage(self) -> int:
        return 0


def snapshot(folder) -> dict:
    """Every file under `folder` (relative path -> bytes)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def no_leftovers(out) -> None:
    assert not (out / EXPORT_TMP).exists() and not (out / EXPORT_OLD).exists()
    assert not any(EXPORT_TMP in name for name in os.listdir(out.parent)), os.listdir(out.parent)


def one_line_naming(exc, out, why="no space left on device") -> str:
    message = str(exc)
    assert "\n" not in message and str(out) in message and why in message, message
    return message


@pytest.fixture(scope="module")
def causal_lm(tiny_gpt2):
    return PlainEngine(load_causal_lm(tiny_gpt2)), load_tokenizer(tiny_gpt2)


@pytest.fixture(scope="module")
def reward(tiny_gpt2):
    tokenizer = load_tokenizer(tiny_gpt2)
    return PlainEngine(RewardModel.from_pretrained(tiny_gpt2, tokenizer)), tokenizer


def weights_full(*args, **kwargs):
    raise SafetensorError(NO_SPACE)


def test_a_full_disk_keeps_the_older_export_of_a_causal_lm(causal_lm, tmp_path, monkeypatch):
    engine, tokenizer = causal_lm
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")  # a run's own files beside the model
    export_hf_model(engine, tokenizer, str(out))
    before = snapshot(out)
    assert "model.safetensors" in before and "config.json" in before
    with torch.no_grad():
        next(engine.module.parameters()).add_(1.0)  # the new export's weights differ
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", weights_full)
    with pytest.raises(ExportWriteError) as exc:
        export_hf_model(engine, tokenizer, str(out))
    message = one_line_naming(exc.value, out)
    assert "the model's weights and config" in message and "as it was before the export" in message
    assert snapshot(out) == before
    no_leftovers(out)
    monkeypatch.undo()
    export_hf_model(engine, tokenizer, str(out))  # with space again: replaced, the run's files kept
    after = snapshot(out)
    assert after["model.safetensors"] != before["model.safetensors"] and after["metrics.jsonl"] == b"{}\n"
    no_leftovers(out)


def test_a_full_disk_creates_no_directory(causal_lm, tmp_path, monkeypatch):
    """A target that did not exist (step 3's actor/) is not created half-written."""
    engine, tokenizer = causal_lm
    out = tmp_path / "actor"
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", weights_full)
    with pytest.raises(ExportWriteError) as exc:
        export_hf_model(engine, tokenizer, str(out))
    assert "not created" in one_line_naming(exc.value, out)
    assert not out.exists() and os.listdir(tmp_path) == []


def test_a_reward_model_whose_value_head_does_not_fit(reward, tmp_path, monkeypatch):
    """The backbone is written, the value head meets the full disk: nothing of the new export is kept."""
    engine, tokenizer = reward
    out = tmp_path / "critic"
    export_reward_model(engine, tokenizer, str(out))
    before = snapshot(out)
    assert {"value_head.safetensors", "reward_model.json", "model.safetensors"} <= set(before)

    def head_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(reward_model, "save_file", head_full)
    with pytest.raises(ExportWriteError) as exc:
        export_reward_model(engine, tokenizer, str(out))
    assert "the value head" in one_line_naming(exc.value, out)
    assert snapshot(out) == before
    no_leftovers(out)


def test_a_move_into_place_that_fails_puts_the_older_files_back(reward, tmp_path, monkeypatch):
    """os.replace failing half-way through the moves (ENOSPC on the directory itself): every older file is back."""
    engine, tokenizer = reward
    out = tmp_path / "critic"
    export_reward_model(engine, tokenizer, str(out))
    before = snapshot(out)
    real_replace, moved = os.replace, []

    def replace(src, dst):
        if EXPORT_TMP in str(src):
            moved.append(src)
            if len(moved) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_replace(src, dst)

    monkeypatch.setattr(export.os, "replace", replace)
    with pytest.raises(ExportWriteError) as exc:
        export_reward_model(engine, tokenizer, str(out))
    monkeypatch.undo()
    assert "into place" in one_line_naming(exc.value, out) and len(moved) == 3
    assert snapshot(out) == before
    no_leftovers(out)


def test_a_tensor_error_that_is_not_a_write_stays_a_bug(causal_lm, tmp_path, monkeypatch):
    engine, tokenizer = causal_lm

    def bad_tensors(*args, **kwargs):
        raise SafetensorError("Some tensors share memory")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", bad_tensors)
    with pytest.raises(SafetensorError):
        export_hf_model(engine, tokenizer, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("last_path", ["out/checkpoints/step-00000004", None])
def test_the_run_names_the_checkpoint_to_resume_from(last_path):
    """Run.finish adds where a --resume continues from (or that there is none) to the export's line."""
    run = Run.__new__(Run)
    run.checkpointing = type("Checkpointing", (), {"last_path": last_path})()

    def export_full():
        raise ExportWriteError("could not write the model's weights and config into out (no space left on device)")

    with pytest.raises(ExportWriteError) as exc:
        run.finish(export_full, "out", "the model")
    message = str(exc.value)
    assert "\n" not in message and message.startswith("could not write the model's weights")
    if last_path:
        assert f"--resume continues from {last_path}" in message
    else:
        assert "no checkpoint" in message and "lost" in message


@pytest.mark.slow
def test_a_step1_run_whose_export_meets_a_full_disk_resumes_and_exports(
    tiny_gpt2,
    sft_data,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """The line names the last checkpoint; a --resume from it (the run's last step) only exports."""
    from step1_sft.main import main

    out = tmp_path / "out"
    args = [str(a) for a in common_args(tiny_gpt2, sft_data, str(out), steps=4)]
    args += ["--zero_stage", "0", "--save_interval", "2"]
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", weights_full)
    with pytest.raises(ExportWriteError) as exc:
        main(args)
    message = one_line_naming(exc.value, out)
    last = out / "checkpoints" / "step-00000004"
    assert message.endswith(f"--resume continues from {last}, the last checkpoint (free space first)"), message
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    no_leftovers(out)
    monkeypatch.undo()
    main(args + ["--resume"])
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    no_leftovers(out)
