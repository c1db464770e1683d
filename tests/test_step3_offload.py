"""--offload_reference_model / --offload_reward_model do what they say below an actor at ZeRO-3 (the
frozen models become ZeRO-3 engines with CPU-resident parameters), and the offloaded reference scores
exactly as the actor it was loaded from; the per-phase peak memory lands in the metrics."""

import pytest

from step3_ppo.main import parse_args, setup
from tests.test_step3_lr0 import prompt_batches, write_prompts


@pytest.fixture(scope="module")
def offload_run(tiny_llama, tiny_llama_reward, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    write_prompts(tmp / "prompts.jsonl")
    return setup(
        parse_args(
            [
                "--actor_model_name_or_path",
                tiny_llama,
                "--critic_model_name_or_path",
                tiny_llama_reward,
                "--data_path",
                str(tmp / "prompts.jsonl"),
                "--data_split",
                "0,0,10",
                "--output_dir",
                str(tmp / "out"),
                "--actor_zero_stage",
                "2",
                "--critic_zero_stage",
                "2",
                "--offload_reference_model",
                "--offload_reward_model",
                "--actor_learning_rate",
                "0",
                "--critic_learning_rate",
                "0",
                "--release_inference_cache",
                "--max_prompt_seq_len",
                "32",
                "--max_answer_seq_len",
                "8",
                "--per_device_generation_batch_size",
                "4",
                "--per_device_training_batch_size",
                "2",
                "--seed",
                "7",
            ]
        )
    )


def test_frozen_models_are_offloaded_below_an_actor_at_zero3(offload_run):
    engines = offload_run.engines
    assert engines.actor.zero_optimization_stage() == 2
    for frozen in (engines.ref, *engines.rewards.values()):
        assert frozen.zero_optimization_stage() == 3
        assert frozen.config["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_offloaded_reference_scores_like_the_actor_and_memory_is_reported(offload_run):
    metrics, rows = offload_run.trainer.step(prompt_batches(offload_run, 4), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    for row in rows:  # the reference is the actor's starting point: same log-probs
        assert (row.per_action["ref_logprobs"] - row.per_action["old_logprobs"]).abs().max() <= 1e-4
    # the trainer records each phase's peak; step3_ppo.main logs them (utils.train.loop.loop_metrics)
    phases = offload_run.trainer.memory.metrics()
    assert set(phases) == {"mem/generation_peak_gb", "mem/experience_peak_gb", "mem/training_peak_gb"}
    assert all(value > 0 for value in phases.values())
