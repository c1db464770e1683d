"""The life of one training run, the same for every entry point: restore -> steps -> after_step -> finish.

`Run` owns what every step would otherwise write out for itself: the loop position (`LoopState`), resumable
checkpoints (`Checkpointing`), the metrics logger, the bad-step guard, the per-phase peak memory, the
per-phase token counts and rates (`tokens/*`, `perf/*`), the progress bar, evaluation every `--eval_interval`
steps and the export with its reload check. A step's `main` keeps its flags, its models and what is truly
its own (a loss, an RL iteration):

    run = Run(args, "step1", "step1 sft", {"model": engine}, data_layout(args, rows), total_steps)
    state = run.restore(before)        # resume, or the evaluation before training
    for (batch,) in run.steps(loader, sampler):
        ...                             # one micro-batch (steps 1-2, DPO) or one RL iteration (step 3)
        run.after_step(metrics)         # log, progress, evaluation every K, checkpoint
    run.finish(export, check)           # the exported directory, reloaded and compared

The micro-batch loop with gradient accumulation is `utils.train.loop.train_micro_batches` over this.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from utils import errors
from utils.math.throughput import PhaseTokens, phase_rate_metrics, token_metrics
from utils.models.export import ExportWriteError, reload_max_abs_diff
from utils.runtime import distributed
from utils.runtime.accelerator import PhaseMemory, peak_flops
from utils.runtime.distributed import all_reduce_max_list, all_reduce_sum, run_output_dir, world_size
from utils.train.checkpoint import BadStepGuard, Checkpointing, LoopState, TrainingCheckpoints
from utils.train.config_file import write_deferred_run_config
from utils.train.metrics_logger import print_rank0, progress_bar
from utils.train.output_dir import release as release_output_dir

# what the checkpoint store writes into its shared state itself (not the run's)
_STORE_KEYS = ("step", "world_size", "engines", "total_steps")
_current = None  # this process's Run, once built (`resume_point`)


def resume_point() -> str | None:
    """The checkpoint a --resume of this process's run continues from: the last one its Run saved or resumed
    from; before the Run is built (loading models), the one the output directory's `latest` names."""
    if _current is not None:
        return _current.resume_point()
    out = run_output_dir()
    return TrainingCheckpoints(out).pointed() if out else None


errors.use_resume_point(resume_point)  # the line of an interrupted run (utils/errors.py) names it


def _phases_tracked(memory: PhaseMemory) -> PhaseMemory:
    """`memory`, whose `phase(name)` blocks (step 3's generation / experience / training, steps 1-2's training)
    also set this rank's phase (utils.runtime.distributed.phase: what a peer's lost-rank line names)."""
    if getattr(memory, "_tracks_phases", False):
        return memory
    measured = memory.phase

    @contextlib.contextmanager
    def phase(name: str):
        with distributed.phase(name), measured(name):
            yield

    memory.phase, memory._tracks_phases = phase, True
    return memory


def loop_metrics(loop: LoopState, memory: PhaseMemory) -> dict:
    """What every step logs with each optimizer step (PPO iteration in step 3) besides its own figures:
    the epoch, the updates skipped so far (non-finite, fp16 overflow), and each phase's peak memory
    since the last call (`mem/<phase>_peak_gb`, the largest over ranks; utils/runtime/accelerator.py says
    what is measured). Collective: every rank calls it."""
    peaks = memory.metrics()
    names = sorted(peaks)
    return {
        "epoch": loop.epoch,
        "train/bad_steps": loop.bad_steps,
        "train/overflow_steps": loop.overflow_steps,
        **dict(zip(names, all_reduce_max_list([peaks[n] for n in names]))),
    }


def throughput_metrics(tokens: PhaseTokens) -> dict:
    """The training forwards' tokens since the last call, summed over ranks (`tokens/real`, `tokens/processed`,
    `tokens/padding_fraction`), and each phase's real tokens per second and MFU (`perf/<phase>_tokens_per_s`,
    `perf/<phase>_mfu`: all ranks' tokens and model FLOPs over the slowest rank's seconds, against all ranks'
    peak FLOP/s, `accelerator.peak_flops`). {} when nothing was counted (utils/math/throughput.py has the
    arithmetic). Collective: every rank calls it."""
    phases, (real, processed) = tokens.take()
    names = sorted(phases)
    if not names and not processed:
        return {}
    summed = all_reduce_sum([real, processed, peak_flops(), *(v for n in names for v in phases[n][:2])])
    seconds = all_reduce_max_list([phases[n][2] for n in names])
    out = token_metrics(summed[0], summed[1])
    for i, phase in enumerate(names):
        out.update(phase_rate_metrics(phase, summed[3 + 2 * i], summed[4 + 2 * i], seconds[i], summed[2]))
    return out


def memory_postfix(metrics: dict) -> dict:
    """{"mem": "<largest phase peak>G"} for a progress bar's postfix ({} when nothing was measured)."""
    peaks = [v for k, v in metrics.items() if k.startswith("mem/")]
    return {"mem": f"{max(peaks):.2f}G"} if peaks else {}


@dataclass
class ReloadCheck:
    """How `Run.finish` proves the exported directory holds the engine's model: `forward(model, batch)`
    of the engine and of `reload()` (the directory loaded unpartitioned, rank 0) on `batch`; the
    largest difference is logged as `export/<quantity>_max_abs_diff`."""

    quantity: str  # the metric's name: "logits", "score", "logp"
    described: str  # the same in the printed line: "logits", "scores", "sequence log-probs"
    engine: object
    reload: Callable
    forward: Callable
    batch: dict


class Run:
    """One entry point's run: `name` prefixes its printed lines (`[name] ...`), `label` its progress bar;
    `engines` are the trained engines a checkpoint holds; `layout` (checkpoint.data_layout) what a
    resume must find unchanged; `total_steps` the optimizer steps (RL iterations) to take.

    `evaluate(step) -> metrics` (optional) runs every `--eval_interval` steps before the last (and at
    the last with `evaluate_last`); its metrics join that step's row and its seconds are kept out of
    `train_s`. `state` is the run's shared state, saved with every checkpoint and given back by
    `restore` on resume."""

    def __init__(
        self,
        args,
        name: str,
        label: str,
        engines: dict,
        layout: dict | None,
        total_steps: int,
        memory: PhaseMemory | None = None,
        tokens: PhaseTokens | None = None,
        evaluate: Callable[[int], dict] | None = None,
        evaluate_last: bool = False,
    ):
        self.args, self.name, self.label, self.total_steps = args, name, label, total_steps
        self.checkpointing = Checkpointing(args, engines, layout)
        self.memory = _phases_tracked(memory if memory is not None else PhaseMemory())
        self.tokens = tokens if tokens is not None else PhaseTokens()  # the micro-batch loop's training tokens
        self._peak_logged = False  # perf/peak_flops: logged with the first step's row
        self.evaluate, self.evaluate_last = evaluate, evaluate_last
        self.eval_interval = getattr(args, "eval_interval", 0)
        self.state: dict = {}
        self.rank_state: dict = {}  # this rank's state restored from the checkpoint (step 3's reward moments)
        self.loop = LoopState()
        self.logger = self.guard = self.progress = None
        self.train_s = self.eval_s = 0.0
        self.restored_from: str | None = None
        global _current
        _current = self
        self._epoch = None  # (the batch iterator, its length) of the epoch `steps` is in, for `next_batch`
        self._peeked = []  # batches `peek` drew from that iterator ahead of the loop's position

    @property
    def resumed(self) -> bool:
        """Whether `restore` continued from a checkpoint (a save during this run does not count)."""
        return self.restored_from is not None

    # ------------------------------------------------------------------ restore
    def restore(self, before: Callable[[], tuple[dict, dict]] | None = None) -> dict:
        """Continue from the latest checkpoint when `--resume` finds one; else start fresh and run
        `before() -> (state, metrics)`: the state to keep with every checkpoint and the metrics logged
        at step 0 (the evaluation before training). Returns the run's state either way. Opens the
        logger (a resumed run keeps its metrics.jsonl rows up to the checkpoint) and the guard."""
        distributed.set_phase("restore")
        loop, shared, self.rank_state = self.checkpointing.restore()
        write_deferred_run_config(self.args)  # a --resume's config.yaml, once the checkpoint's checks passed
        self.restored_from = self.checkpointing.last_path
        self.loop = loop
        self.logger = self.checkpointing.metrics_logger(self.args, loop)
        self.guard = BadStepGuard(loop, self.args.max_bad_steps, self.checkpointing)
        if self.restored_from:
            self.state = {k: v for k, v in shared.items() if k not in _STORE_KEYS}
            print_rank0(f"[{self.name}] resumed from {self.restored_from} at step {loop.step}")
            saved_total = shared.get("total_steps")
            if saved_total is not None and saved_total != self.total_steps:
                # the scheduler's state comes back exactly, but its schedule is sized by the new length
                print_rank0(
                    f"[{self.name}] the run is now {self.total_steps} steps long, not {saved_total} "
                    f"(--max_steps, --num_train_epochs or the number of ranks changed): the learning-rate "
                    f"schedule continues from step {loop.step} over the new length"
                )
        elif before is not None:
            with distributed.phase("evaluation"):
                state, metrics = before()
            self.state = dict(state)
            if metrics:
                self.log(0, metrics)
        return self.state

    def log(self, step: int, metrics: dict) -> None:
        self.logger.log(step, metrics)

    # ------------------------------------------------------------------ steps
    def steps(self, loader, sampler, batches_per_step: int = 1) -> Iterator[list]:
        """The epoch loop, resumable: yields `batches_per_step` loader batches at a time (a micro-batch of
        steps 1-2, the prompt batches of one RL iteration) until `total_steps` optimizer steps are done
        (`after_step` counts them) or `--num_train_epochs` end; a resumed run first skips the batches its
        checkpoint had consumed. The time spent here, evaluations excluded, is `train_s`."""
        loop, epochs = self.loop, self.args.num_train_epochs
        if self.progress is None:
            self.progress = progress_bar(self.total_steps, loop.step, self.label)
        start = time.time()
        eval_before = self.eval_s
        distributed.set_phase("training")
        while loop.step < self.total_steps and loop.epoch < epochs:
            sampler.set_epoch(loop.epoch)
            batches = iter(loader)
            # consumed before the checkpoint this run resumed from (fewer rows since: --resume_ignore_data_change)
            for _ in range(min(loop.batches_in_epoch, len(loader))):
                next(batches)
            self._epoch, self._peeked = (batches, len(loader)), []
            while loop.batches_in_epoch + batches_per_step <= len(loader) and loop.step < self.total_steps:
                unit = [self._next() for _ in range(batches_per_step)]
                loop.batches_in_epoch += batches_per_step
                yield unit
            if loop.step < self.total_steps:
                loop.epoch, loop.batches_in_epoch = loop.epoch + 1, 0
        self._epoch = None
        if self.progress is not None:
            self.progress.close()
        self.train_s += time.time() - start - (self.eval_s - eval_before)

    def next_batch(self):
        """One more loader batch for the step `steps` just yielded (step 3's dynamic sampling draws further
        prompt batches), counted in the loop's position like the step's own, so a resumed run skips it too;
        None when the epoch has none left (the next step then starts the next epoch)."""
        if self._epoch is None or self.loop.batches_in_epoch >= self._epoch[1]:
            return None
        self.loop.batches_in_epoch += 1
        return self._next()

    def _next(self):
        return self._peeked.pop(0) if self._peeked else next(self._epoch[0])

    def peek(self, count: int, ahead: int = 1) -> list | None:
        """The `count` batches the step `ahead` steps from now will get (1: the next), without moving the loop's
        position (a checkpoint saved before that step still resumes at them): step 3's `--max_staleness`
        generates them while the current step trains. None when that step starts a new epoch or there is none."""
        loop, end = self.loop, count * ahead
        if self._epoch is None or loop.step + ahead >= self.total_steps or loop.batches_in_epoch + end > self._epoch[1]:
            return None
        while len(self._peeked) < end:
            self._peeked.append(next(self._epoch[0]))
        return list(self._peeked[end - count : end])

    def after_step(
        self,
        metrics: dict,
        postfix: dict | Callable[[dict], dict] | None = None,
        line: str | None = None,
        state: dict | None = None,
        rank_state: dict | None = None,
    ) -> dict:
        """One optimizer step (RL iteration) is done: count it, log `metrics` with the loop's own
        (`loop_metrics`, `throughput_metrics`), print `line` under `--print_loss`, evaluate when due, move the
        progress bar (`postfix`, or `postfix(evaluation)` to show the evaluation's figures), and checkpoint when
        `--save_interval` says so, with the run's state updated by `state` and this rank's `rank_state`.
        Collective. Returns the evaluation's metrics ({} if none)."""
        loop = self.loop
        loop.step += 1
        metrics = {**metrics, **loop_metrics(loop, self.memory)}
        metrics.update(throughput_metrics(self.tokens))
        if not self._peak_logged:  # once per process: one device's peak FLOP/s (the ranks' mean)
            metrics["perf/peak_flops"] = all_reduce_sum([peak_flops()])[0] / world_size()
            self._peak_logged = True
        evaluation = self._timed_evaluation() if self.evaluation_due() else {}
        self.log(loop.step, {**metrics, **evaluation})
        if line is not None and getattr(self.args, "print_loss", False):
            print_rank0(f"[{self.name}] step {loop.step} {line}")
        if self.progress is not None:
            self.progress.update(1)
            shown = postfix(evaluation) if callable(postfix) else postfix
            self.progress.set_postfix(**(shown or {}), **memory_postfix(metrics))
        self.state.update(state or {})
        interval = self.checkpointing.interval
        with (
            distributed.phase("checkpoint") if interval > 0 and loop.step % interval == 0 else contextlib.nullcontext()
        ):
            self.checkpointing.maybe_save(loop, {**self.state, "total_steps": self.total_steps}, rank_state)
        return evaluation

    def evaluation_due(self) -> bool:
        step, last = self.loop.step, self.loop.step >= self.total_steps
        if self.evaluate is None or not self.eval_interval:
            return False
        return (step % self.eval_interval == 0 and not last) or (last and self.evaluate_last)

    def _timed_evaluation(self) -> dict:
        start = time.time()
        with distributed.phase("evaluation"):
            metrics = self.evaluate(self.loop.step)
        self.eval_s += time.time() - start
        return metrics

    def evaluate_now(self) -> dict:
        """`evaluate(step)` at the current step (the final evaluation after training), logged as a row."""
        metrics = self._timed_evaluation()
        self.log(self.loop.step, metrics)
        return metrics

    # ------------------------------------------------------------------ finish
    def resume_point(self) -> str | None:
        """The checkpoint a --resume of this run continues from: the last one it saved or resumed from."""
        return self.checkpointing.last_path

    def finish(self, export: Callable[[], None], out_dir: str, what: str, check: ReloadCheck | None = None) -> float:
        """`export()` writes `what` into `out_dir`; `check` reloads it and compares its forward with the
        engine's. Prints one line; with a check, logs the difference and the seconds as a row. Closes the
        logger. Returns the difference (0.0 without a check). An export that could not be written
        (ExportWriteError: a full disk, a quota) is raised again saying where a --resume continues from."""
        start = time.time()
        distributed.set_phase("export")
        try:
            export()
        except ExportWriteError as exc:
            where = self.resume_point()
            raise ExportWriteError(
                f"{exc}; --resume continues from {where}, the last checkpoint (free space first)"
                if where
                else f"{exc}; the run saved no checkpoint to --resume from (--save_interval), so the trained "
                f"weights are lost"
            ) from None
        diff, compared = 0.0, ""
        if check is not None:
            diff = reload_max_abs_diff(check.engine, check.reload, check.forward, check.batch)
            compared = f"reloaded {check.described} differ from the engine's by at most {diff:.2e}; "
        seconds = time.time() - start
        print_rank0(
            f"[{self.name}] saved {what} to {out_dir} ({compared}export{' and check' * bool(compared)} {seconds:.1f} s)"
        )
        if check is not None:
            self.log(self.loop.step, {f"export/{check.quantity}_max_abs_diff": diff, "time/export_s": seconds})
        self.logger.close()
        release_output_dir(out_dir)  # the run is done (an in-process run: the next may use the directory)
        return diff
