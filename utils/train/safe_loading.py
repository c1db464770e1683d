"""Loading training-state files so that no file can run code: `torch.load(weights_only=True)` admitting only the
plain classes DeepSpeed pickles, for our own reads and for DeepSpeed's `load_checkpoint` (its own loader unpickles
anything). The errors of a checkpoint that cannot be resumed from live here, below utils/train/checkpoint.py,
which uses them."""

from __future__ import annotations

import pickle
import re
from contextlib import contextmanager

import torch

from utils.errors import ProjectError, one_line


class CheckpointError(ProjectError, RuntimeError):
    """A checkpoint that cannot be resumed from (refused, incomplete, of another layout); str() names it."""


class BrokenCheckpoint(CheckpointError):
    """A checkpoint with a missing or unreadable file (an interrupted copy, a full disk): a resume falls
    back to the previous intact checkpoint. A file refused for what it holds is NOT this: that stops."""


def _deepspeed_state_classes() -> list:
    """The few classes DeepSpeed pickles into its checkpoint states besides tensors and containers:
    plain data, rebuilt from numbers/bools/dtypes only (found by saving ZeRO 0-3 checkpoints in fp32
    and bf16, with and without offload/LoRA, and asking `get_unsafe_globals_in_checkpoint`):
    - LossScaler: the ZeRO optimizers' `loss_scaler` (fp32/bf16): `cur_scale`, `dynamic`.
    - DynamicLossScaler: the same under fp16 dynamic loss scaling (scale, iteration counters,
      window, hysteresis, a torch dtype).
    - ZeroStageEnum: an int Enum, the ZeRO optimizers' `zero_stage`.
    - fragment_address: a dataclass of two ints (`numel`, `start`), ZeRO 1-2's param slice mappings.
    Unpickling one only calls the class with those values or sets its attributes: no code runs."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: +0.5 s on every --help
    from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: +0.5 s on every --help (deepspeed)
    from deepspeed.utils.tensor_fragment import fragment_address  # lazy: +0.5 s on every --help (deepspeed)

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str, map_location=None):
    """`torch.load(weights_only=True)` admitting DeepSpeed's plain state classes only; a file holding
    anything else (a planted pickle whose `__reduce__` calls os.system, ...) raises CheckpointError
    before any of it runs."""
    try:
        with torch.serialization.safe_globals(_deepspeed_state_classes()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise BrokenCheckpoint(f"{path} is missing") from None
    except (EOFError, RuntimeError) as e:  # a truncated zip: "PytorchStreamReader failed reading ..."
        raise BrokenCheckpoint(f"{path} cannot be read ({one_line(e, 160)})") from None
    except pickle.UnpicklingError as e:
        refused = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({refused.group(1)})" if refused else ""
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data{what} and was not loaded"
        ) from None


class WeightsOnlyCheckpointEngine:
    """An engine's own DeepSpeed checkpoint engine, except that `load` goes through `safe_torch_load`
    (DeepSpeed's TorchCheckpointEngine loads with weights_only=False: any pickle in a .pt file would
    run on --resume). Every other attribute and method is the wrapped engine's."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return safe_torch_load(path, map_location=map_location)


@contextmanager
def weights_only_loading(engine):
    """`engine.load_checkpoint` inside this block reads every file with `safe_torch_load`: the model
    states (state_dict_factory's loaders), the ZeRO optimizer partitions (`_get_all_zero_checkpoints`)
    and MoE expert/optimizer files all go through `engine.checkpoint_engine.load`."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(original)
    try:
        yield
    finally:
        engine.checkpoint_engine = original
