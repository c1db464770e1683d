"""A model directory that is not what a flag expects is refused, naming the directory and what it lacks:
a causal-LM (step-1/SFT, base model) directory as a reward model / critic, a reward-model directory
(step 2's output) as a policy / actor. Step 2 itself still gets a fresh value head on a causal LM."""

import os
import re

import pytest
import torch

from utils.errors import UsageError
from utils.models.loading import ModelLoadError, load_tokenizer
from utils.models.reward_model import (
    CAUSAL_LM_KIND,
    REWARD_MODEL_FILE,
    REWARD_MODEL_KIND,
    VALUE_HEAD_FILE,
    RewardModel,
    check_policy_dir,
    check_reward_model_dir,
    model_dir_kind,
)


def _named(path: str) -> str:
    return re.escape(repr(path))


# --------------------------------------------------------------------------- pure helpers
def test_model_dir_kind(tiny_gpt2, tiny_gpt2_reward, tmp_path):
    assert model_dir_kind(tiny_gpt2) == CAUSAL_LM_KIND
    assert model_dir_kind(tiny_gpt2_reward) == REWARD_MODEL_KIND
    assert model_dir_kind(str(tmp_path / "missing")) is None
    assert model_dir_kind("org/some-hub-model") is None


def test_hub_names_and_right_kinds_pass(tiny_gpt2, tiny_gpt2_reward):
    check_policy_dir("org/some-hub-model")
    check_reward_model_dir("org/some-hub-model")
    check_policy_dir(tiny_gpt2)
    check_reward_model_dir(tiny_gpt2_reward)


def test_policy_check_names_either_reward_file(tmp_path):
    only_json = tmp_path / "rm_json"
    only_json.mkdir()
    (only_json / REWARD_MODEL_FILE).write_text("{}")
    with pytest.raises(ModelLoadError, match=_named(str(only_json)) + f".*{REWARD_MODEL_FILE}.*not a policy"):
        check_policy_dir(str(only_json), "--actor_model_name_or_path")


# --------------------------------------------------------------------------- RewardModel.from_pretrained
def test_require_value_head_refuses_a_causal_lm_before_loading(tiny_gpt2, monkeypatch):
    import utils.models.reward_model as reward_model

    def no_load(*args, **kwargs):
        raise AssertionError("the backbone was loaded before the check")

    monkeypatch.setattr(reward_model, "load_causal_lm", no_load)
    with pytest.raises(ModelLoadError) as error:
        RewardModel.from_pretrained(tiny_gpt2, require_value_head=True)
    message = str(error.value)
    assert repr(tiny_gpt2) in message and VALUE_HEAD_FILE in message and "value_head" in message
    assert "not a reward model from step 2" in message and "step2_reward" in message
    assert "\n" not in message


def test_default_still_builds_a_fresh_head(tiny_gpt2):
    """Step 2's input is a causal LM: it gets the fixed-seed fresh head, as before."""
    tokenizer = load_tokenizer(tiny_gpt2)
    a = RewardModel.from_pretrained(tiny_gpt2, tokenizer)
    torch.manual_seed(123)  # the fresh head does not depend on the global RNG
    b = RewardModel.from_pretrained(tiny_gpt2, tokenizer)
    assert a.v_head.weight.shape == (1, a.config.hidden_size)
    assert torch.equal(a.v_head.weight, b.v_head.weight) and a.v_head.weight.abs().sum() > 0


def test_require_value_head_loads_a_reward_model_dir(tiny_gpt2, tiny_gpt2_reward):
    tokenizer = load_tokenizer(tiny_gpt2_reward)
    loaded = RewardModel.from_pretrained(tiny_gpt2_reward, tokenizer, require_value_head=True)
    fresh = RewardModel.from_pretrained(tiny_gpt2, load_tokenizer(tiny_gpt2))
    assert torch.equal(loaded.v_head.weight, fresh.v_head.weight)  # the fixture saved the fresh head


# --------------------------------------------------------------------------- evaluation loading
def test_load_policy_refuses_a_reward_model_dir(tiny_gpt2_reward):
    from utils.evaluation import load_policy

    with pytest.raises(ModelLoadError, match=_named(tiny_gpt2_reward) + ".*reward model from step 2, not a policy"):
        load_policy(tiny_gpt2_reward, "cpu")


def test_load_reward_model_refuses_an_sft_dir(tiny_gpt2):
    from utils.evaluation import load_reward_model

    with pytest.raises(ModelLoadError, match=_named(tiny_gpt2) + f".*no {re.escape(VALUE_HEAD_FILE)}"):
        load_reward_model(tiny_gpt2, "cpu")


def test_load_reward_model_accepts_a_reward_model_dir(tiny_gpt2_reward):
    from utils.evaluation import load_reward_model

    model, tokenizer = load_reward_model(tiny_gpt2_reward, "cpu")
    assert isinstance(model, RewardModel) and not model.training and tokenizer.pad_token_id is not None


# --------------------------------------------------------------------------- step 3
@pytest.fixture
def step3_argv(tmp_path):
    from tests.test_step3_lr0 import write_prompts

    write_prompts(tmp_path / "prompts.jsonl")

    def argv(actor, critic):
        return [
            "--actor_model_name_or_path",
            actor,
            "--critic_model_name_or_path",
            critic,
            "--data_path",
            str(tmp_path / "prompts.jsonl"),
            "--data_split",
            "0,0,10",
            "--output_dir",
            str(tmp_path / "out"),
            "--actor_zero_stage",
            "0",
            "--critic_zero_stage",
            "0",
            "--max_prompt_seq_len",
            "32",
            "--max_answer_seq_len",
            "4",
            "--per_device_generation_batch_size",
            "4",
            "--per_device_training_batch_size",
            "2",
            "--seed",
            "3",
        ]

    return argv


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any model load in step 3's build_engines fails the test: the refusal must come first."""
    import step3_ppo.deepspeed_models as engine

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the directory check")

    monkeypatch.setattr(engine, "load_causal_lm", no_load)
    monkeypatch.setattr(engine.RewardModel, "from_pretrained", classmethod(no_load))


def test_step3_refuses_a_causal_lm_as_critic(tiny_gpt2, step3_argv, no_model_loading):
    from step3_ppo.main import parse_args, setup

    with pytest.raises((ModelLoadError, UsageError)) as error:
        setup(parse_args(step3_argv(tiny_gpt2, tiny_gpt2)))
    message = str(error.value)
    assert "--critic_model_name_or_path" in message and repr(tiny_gpt2) in message and VALUE_HEAD_FILE in message


def test_step3_refuses_a_reward_model_as_actor(tiny_gpt2_reward, step3_argv, no_model_loading):
    from step3_ppo.main import parse_args, setup

    with pytest.raises((ModelLoadError, UsageError)) as error:
        setup(parse_args(step3_argv(tiny_gpt2_reward, tiny_gpt2_reward)))
    message = str(error.value)
    assert "--actor_model_name_or_path" in message and repr(tiny_gpt2_reward) in message
    assert "not a policy" in message


def test_fixture_reward_dir_is_a_step2_layout(tiny_gpt2_reward, tiny_llama_reward):
    for path in (tiny_gpt2_reward, tiny_llama_reward):
        for name in ("config.json", "model.safetensors", VALUE_HEAD_FILE, REWARD_MODEL_FILE, "tokenizer_config.json"):
            assert os.path.isfile(os.path.join(path, name)), (path, name)


def test_a_truncated_weights_file_is_named(tiny_gpt2, tmp_path):
    import shutil

    from utils.models.loading import ModelLoadError, load_causal_lm

    broken = tmp_path / "broken"
    shutil.copytree(tiny_gpt2, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors cannot be read .* truncated or corrupt"):
        load_causal_lm(str(broken))
