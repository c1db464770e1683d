"""No code runs from a checkpoint: `--resume` reads every .pt file of a training checkpoint (DeepSpeed's
model states and ZeRO optimizer partitions, our per-rank state) with `torch.load(weights_only=True)`,
so a pickle planted in any of them (its `__reduce__` calls os.system) is refused with a CheckpointError
naming the file, and its command never runs. In-process, one rank, tiny models, ZeRO 0, 2 and 3, for
the engines of each step (1: the SFT model, 2: the reward model, 3: actor and critic)."""

import glob
import os
import pickle
import shutil

import pytest
import torch

from utils.train.checkpoint import TrainingCheckpoints
from utils.train.safe_loading import CheckpointError, WeightsOnlyCheckpointEngine

STEPS = {"step1": {"model": "lm"}, "step2": {"model": "rm"}, "step3": {"actor": "lm", "critic": "rm"}}


class Planted:
    """What an attacker writes into a checkpoint file: unpickling it runs a shell command."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path: str, marker: str, raw: bool) -> None:
    """Replace `path` by the planted pickle: in torch.save's zip format, or a bare pickle stream
    (torch.load's legacy format)."""
    if raw:
        with open(path, "wb") as f:
            pickle.dump({"module": Planted(marker)}, f)
    else:
        torch.save({"module": Planted(marker), "optimizer_state_dict": Planted(marker)}, path)


@pytest.fixture(scope="module")
def dist():
    from utils.runtime.distributed import init_distributed

    init_distributed()


def build_engines(kinds: dict, model_dir: str, stage: int) -> dict:
    from utils.models.loading import load_causal_lm
    from utils.models.reward_model import RewardModel
    from utils.train.ds_config import train_ds_config
    from utils.train.loop import EngineSpec, build_trained_engine

    engines = {}
    for name, kind in kinds.items():
        config = train_ds_config(stage, 1, 2)
        model = (
            load_causal_lm(model_dir, ds_config=config)
            if kind == "lm"
            else RewardModel.from_pretrained(model_dir, ds_config=config)
        )
        engines[name] = build_trained_engine(model, config, EngineSpec(learning_rate=1e-3), total_steps=10)
    return engines


def one_step(engines: dict, kinds: dict) -> None:
    from utils.train.loop import APPLIED, backward_and_step

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for name, engine in engines.items():
        out = engine(input_ids=ids, attention_mask=torch.ones_like(ids))
        loss = (out.logits if kinds[name] == "lm" else out).float().pow(2).mean()
        assert backward_and_step(engine, loss) == APPLIED


def spy_on_torch_load(monkeypatch) -> list:
    """Every torch.load call from here on, as (path, weights_only)."""
    calls, real = [], torch.load

    def spy(f, *args, **kwargs):
        calls.append((str(f), kwargs.get("weights_only")))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_planted_pickle_in_any_checkpoint_file_is_refused(dist, tiny_gpt2, tmp_path, monkeypatch, stage, step):
    kinds = STEPS[step]
    engines = build_engines(kinds, tiny_gpt2, stage)
    one_step(engines, kinds)
    store = TrainingCheckpoints(str(tmp_path / "out"))
    path = store.save(1, engines, shared_state={}, rank_state={"loop": {"step": 1}, "numbers": torch.arange(3)})
    files = sorted(glob.glob(os.path.join(path, "**", "*.pt"), recursive=True))
    engine_files = [f for f in files if os.path.basename(f) != "rank00000.pt"]
    assert len(engine_files) >= len(engines) * (1 if stage == 0 else 2), files  # model states (+ ZeRO partitions)

    # a clean checkpoint loads, and every file it reads is read with weights_only=True
    calls = spy_on_torch_load(monkeypatch)
    shared, rank_state = store.load(engines, path)
    monkeypatch.undo()
    assert shared["step"] == 1 and rank_state["loop"] == {"step": 1} and rank_state["numbers"].tolist() == [0, 1, 2]
    assert {os.path.realpath(p) for p, _ in calls} == {os.path.realpath(f) for f in files}, calls
    assert all(weights_only is True for _, weights_only in calls), calls
    for engine in engines.values():  # saving uses DeepSpeed's own engine again
        assert not isinstance(engine.checkpoint_engine, WeightsOnlyCheckpointEngine)

    marker = str(tmp_path / "pwned")
    for file in files:
        original = file + ".orig"
        shutil.copyfile(file, original)
        for raw in (False, True):
            plant(file, marker, raw)
            with pytest.raises(CheckpointError) as refused:
                store.load(engines, path)
            message = str(refused.value)
            assert os.path.relpath(file, path) in message and "was not loaded" in message, message
            assert "\n" not in message, message
            assert not os.path.exists(marker), f"the pickle planted in {file} ran"
        os.replace(original, file)
        for engine in engines.values():
            assert not isinstance(engine.checkpoint_engine, WeightsOnlyCheckpointEngine)

    # the restored checkpoint still loads, and the engines still save
    store.load(engines, path)
    store.save(2, engines, shared_state={}, rank_state={"loop": {"step": 2}})
    assert store.load(engines)[1]["loop"] == {"step": 2}


def test_refusal_names_the_file_on_one_line(tmp_path):
    """The error a user sees: which file, and that it was not loaded (no torch advice, no traceback text)."""
    from utils.train.safe_loading import safe_torch_load

    file = str(tmp_path / "mp_rank_00_model_states.pt")
    plant(file, str(tmp_path / "pwned"), raw=False)
    with pytest.raises(CheckpointError, match="holds objects other than tensors and plain data") as refused:
        safe_torch_load(file)
    assert (
        str(refused.value) == f"{file} holds objects other than tensors and plain data (posix.system) "
        f"and was not loaded"
    )
    assert not os.path.exists(tmp_path / "pwned")
