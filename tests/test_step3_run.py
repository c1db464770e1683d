"""Step 3 through the deepspeed launcher on 2 CPU ranks under ZeRO-3 (the reference setting)."""

import json
import os

import pytest

from tests.launch import metrics, run_deepspeed, tail
from tests.test_step3_lr0 import write_prompts


@pytest.mark.slow
def test_generation_modes_agree_and_repartition(tiny_llama, tmp_path):
    """Greedy tokens: plain ZeRO-3 generate == hybrid generation mode (LoRA merged) == hybrid unmerged;
    afterwards every parameter is partitioned again, the weights are bit-for-bit unchanged, DeepSpeed's
    hooks and recorded trace are as before (else the next training step loses its prefetch), a
    forward with the model gathered once (how the rollout is scored) equals the hooked one, and the
    generation mode runs plain layers (no LoRA wrappers, no ZeRO parameter dicts), then puts the
    same module objects back."""
    out = tmp_path / "generation.json"
    proc = run_deepspeed(
        "step3_ppo.generation_check",
        ["--model_name_or_path", tiny_llama, "--lora_dim", 4, "--zero_stage", 3, "--out", out],
    )
    assert out.exists(), tail(proc)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert result["tokens_equal"], result["tokens"]
    assert result["weights_unchanged"]
    assert all(mode["partitioned_after"] for mode in result["modes"].values())
    for mode in ("hybrid", "hybrid_unmerged"):
        state = result["modes"][mode]
        assert state["hooks_unchanged"] and state["trace_before"] == state["trace_after"] == "complete", state
    assert result["gathered_forward_max_abs_diff"] <= 1e-6
    tree = result["generation_mode_tree"]  # per token, the merged actor runs what the plain model runs
    assert tree["before"]["lora_wrappers"] > 0 and tree["before"]["zero_parameter_dicts"] > 0, tree
    assert tree["inside"]["lora_wrappers"] == tree["inside"]["zero_parameter_dicts"] == 0, tree
    assert tree["restored"] and tree["after"]["merged_wrappers"] == 0, tree


@pytest.mark.slow
@pytest.mark.parametrize("experience", ["gathered", "hooked"])
def test_two_rank_zero3_hybrid_lr0_log_ratio_and_exports(tiny_gpt2, tiny_gpt2_reward, tmp_path, experience):
    """lr 0 under ZeRO-3 + hybrid: the rollout scored on gathered models (default) or through the
    per-layer hooks (--no_gathered_experience) gives the same log-probs as the hooked training forward."""
    write_prompts(tmp_path / "prompts.jsonl", 40)
    out = str(tmp_path / "out")
    args = [
        "--actor_model_name_or_path",
        tiny_gpt2,
        "--critic_model_name_or_path",
        tiny_gpt2_reward,
        "--data_path",
        tmp_path / "prompts.jsonl",
        "--data_split",
        "0,0,10",
        "--output_dir",
        out,
        "--actor_zero_stage",
        3,
        "--critic_zero_stage",
        3,
        "--enable_hybrid_engine",
        "--actor_learning_rate",
        0,
        "--critic_learning_rate",
        0,
        "--max_prompt_seq_len",
        32,
        "--max_answer_seq_len",
        6,
        "--per_device_generation_batch_size",
        4,
        "--generation_batches",
        2,
        "--per_device_training_batch_size",
        2,
        "--ppo_epochs",
        2,
        "--max_steps",
        2,
        "--seed",
        5,
    ]
    if experience == "hooked":
        args.append("--no_gathered_experience")
    proc = run_deepspeed("step3_ppo.main", args, log_path=str(tmp_path / "log.txt"))
    assert os.path.exists(os.path.join(out, "critic", "value_head.safetensors")), tail(proc)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["ppo/log_ratio_max_abs"] <= 1e-4, row
        assert row["kl/ref_mean"] == pytest.approx(0.0, abs=1e-4)  # lr 0: actor == reference
        assert all(row[f"mem/{phase}_peak_gb"] > 0 for phase in ("generation", "experience", "training")), row
        assert row["train/overflow_skipped"] == 0 and row["train/overflow_steps"] == 0
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(os.path.join(out, "actor"))
    assert all(p.numel() > 0 for p in actor.parameters())
