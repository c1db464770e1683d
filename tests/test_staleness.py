"""`--max_staleness K` without a worker: how far ahead the trainer hands prompts to the engine (K // one iteration's
optimizer steps), the loader's look-ahead behind it, and the flag's refusals (one line each)."""

import functools
from types import SimpleNamespace

import pytest

from step3_ppo.main import parse_args
from step3_ppo.trainer import PPOTrainer
from utils.errors import UsageError

BASE = ["--data_path", "d.jsonl", "--actor_model_name_or_path", "m", "--output_dir", "/tmp/rlhf-staleness-out"]


class _Engine:
    def __init__(self):
        self.sent = []

    def prefetched(self, ids, mask, settings, logprobs=False):
        return ids in self.sent

    def prefetch(self, ids, mask, settings, logprobs=False):
        self.sent.append(ids)


def _trainer(max_staleness, ppo_epochs=1, batch=2, accumulation=1):
    config = SimpleNamespace(
        max_staleness=max_staleness,
        ppo_epochs=ppo_epochs,
        per_device_training_batch_size=batch,
        n_samples_per_prompt=1,
        generation=None,
    )
    trainer = SimpleNamespace(
        config=config,
        rollout=_Engine(),
        rollout_logprobs=False,
        said_too_stale=False,
        actor=SimpleNamespace(gradient_accumulation_steps=lambda: accumulation),
        rollout_inputs=lambda b, n, s: (b["input_ids"], b["attention_mask"], s),
    )
    trainer.optimizer_steps = functools.partial(PPOTrainer.optimizer_steps, trainer)
    return trainer


def _ahead(j):
    return [{"input_ids": f"iteration+{j}", "attention_mask": None}] if j <= 3 else None


@pytest.mark.parametrize(
    "k, epochs, accumulation, expected",
    [
        (0, 1, 1, []),  # (not called by step with K 0; nothing ahead)
        (1, 1, 1, ["iteration+1"]),  # 4 rows / 2 per mini-batch, 1 per step: 2 steps per iteration... see below
        (2, 1, 1, ["iteration+1"]),
        (4, 1, 1, ["iteration+1", "iteration+2"]),
        (4, 2, 1, ["iteration+1"]),  # 2 epochs: 4 steps per iteration
        (2, 1, 2, ["iteration+1", "iteration+2"]),  # 2 mini-batches per optimizer step: 1 step per iteration
        (9, 1, 2, ["iteration+1", "iteration+2", "iteration+3"]),  # the run ends 3 iterations ahead
    ],
)
def test_the_engine_works_k_over_the_iterations_steps_ahead(k, epochs, accumulation, expected, capsys):
    trainer = _trainer(k, ppo_epochs=epochs, accumulation=accumulation)
    rows = [None] * 4  # 4 rows, mini-batches of 2
    steps = trainer.optimizer_steps(len(rows))
    assert steps == -(-2 * epochs // accumulation)
    ahead = PPOTrainer.generate_ahead(trainer, rows, _ahead)
    if k == 1:
        expected = []  # 2 steps per iteration: one iteration ahead would be 2 steps stale
    assert trainer.rollout.sent == expected and ahead == bool(expected)
    said = capsys.readouterr().out
    assert ("is below the 2 optimizer steps of one iteration" in said) == (k in (0, 1))
    PPOTrainer.generate_ahead(trainer, rows, _ahead)  # the next call: nothing sent twice, nothing said twice
    assert trainer.rollout.sent == expected and "below" not in capsys.readouterr().out


def test_the_loader_peeks_the_batches_of_a_later_step_without_moving():
    from utils.train.run import Run

    run = SimpleNamespace(
        loop=SimpleNamespace(step=0, batches_in_epoch=2), total_steps=4, _peeked=[], _epoch=(iter(range(100, 110)), 10)
    )
    peek = functools.partial(Run.peek, run)
    assert peek(2) == [100, 101] and peek(2, 2) == [102, 103] and peek(2, 1) == [100, 101]
    assert peek(2, 4) is None  # past --max_steps
    run.loop.batches_in_epoch = 6
    assert peek(2, 3) is None  # past the epoch's end: the next epoch's order is not drawn yet
    assert run.loop.step == 0 and run._peeked == [100, 101, 102, 103]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--async_rollout"], "--async_rollout was renamed: use --max_staleness K"),
        (["--max_staleness", "2"], "--max_staleness: --rollout_engine hf cannot generate ahead (use vllm)"),
        (["--max_staleness", "-1"], "--max_staleness must be >= 0, got -1"),
        (
            ["--rollout_engine", "vllm", "--vllm_lora_sync", "merged"],
            "--vllm_lora_sync does nothing without --actor_lora_dim",
        ),
    ],
)
def test_refusals(flags, message):
    if "vllm" in flags:
        pytest.importorskip("vllm", reason="the vLLM engine's checks run vLLM's interpreter probe first")
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(BASE + flags)


def test_a_config_file_with_the_old_key_names_the_new_flag(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("async_rollout: true\n")
    with pytest.raises(UsageError, match="key 'async_rollout': --async_rollout was renamed: use --max_staleness"):
        parse_args(["--config", str(config), *BASE])
