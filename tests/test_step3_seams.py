"""The seams later estimators and rewards plug into, exercised with today's code: an advantage estimator
that needs no critic builds, scores and trains none (and keeps the lr=0 promise), and a reward that is a
plain function of the rows replaces the reward model behind the same interface."""
import pytest
import torch

from step3_ppo import advantages
from step3_ppo.main import parse_args, setup
from tests.test_step3_lr0 import prompt_batches, write_prompts


def sequence_reward_advantages(values, rewards, action_mask, gamma, lam):
    """A critic-free stand-in (REINFORCE-like): every action's advantage is its row's total reward."""
    total = (rewards * action_mask).sum(-1, keepdim=True)
    return total * action_mask, total * action_mask


class LengthReward:
    """A reward function without a model: the response length in tokens."""
    name, engine = "length", None

    def __call__(self, rows):
        return torch.tensor([float(r.response_ids.numel()) for r in rows])


@pytest.fixture(scope="module")
def critic_free_run(tiny_gpt2, tiny_gpt2_reward, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setitem(advantages.ESTIMATORS, "test_sequence_reward",
               advantages.Estimator(sequence_reward_advantages, needs_critic=False, help="test only"))
    tmp = tmp_path_factory.mktemp("seams")
    write_prompts(tmp / "prompts.jsonl")
    run = setup(parse_args([
        "--actor_model_name_or_path", tiny_gpt2, "--critic_model_name_or_path", tiny_gpt2_reward,
        "--data_path", str(tmp / "prompts.jsonl"), "--data_split", "0,0,10", "--output_dir", str(tmp / "out"),
        "--actor_zero_stage", "0", "--critic_zero_stage", "0", "--actor_learning_rate", "0",
        "--max_prompt_seq_len", "32", "--max_answer_seq_len", "8", "--per_device_generation_batch_size", "4",
        "--per_device_training_batch_size", "2", "--seed", "5", "--advantage_estimator", "test_sequence_reward"]))
    yield run
    mp.undo()


def test_critic_free_estimator_has_no_critic_and_keeps_lr0_promise(critic_free_run):
    run = critic_free_run
    assert run.engines.critic is None and run.trainer.critic is None
    metrics, rows = run.trainer.step(prompt_batches(run, 4), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    assert "loss/critic" not in metrics and "value/explained_variance" not in metrics
    assert all("old_values" not in r.per_action for r in rows)


def test_reward_function_replaces_the_reward_model(critic_free_run):
    run = critic_free_run
    run.trainer.reward = LengthReward()
    run.trainer.config.whiten_advantages = False
    metrics, rows = run.trainer.step(prompt_batches(run, 4, offset=4), step=1)
    assert [r.score for r in rows] == [float(r.response_ids.numel()) for r in rows]
    assert metrics["reward/score_mean"] == pytest.approx(sum(r.score for r in rows) / len(rows))
    # the score lands on the last action only; the KL penalty is on every action
    for r in rows:
        kl_part = -run.trainer.kl_ctl.value * r.per_action["kl"]
        assert torch.allclose(r.per_action["rewards"][:-1], kl_part[:-1])
        assert r.per_action["rewards"][-1].item() == pytest.approx(kl_part[-1].item() + min(r.score, 5.0), abs=1e-5)
