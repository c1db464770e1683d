"""The memory plan (utils/train/memory_plan.py, plan.py): its arithmetic against hand-computed values on a tiny
Llama-shaped config, and the command on a config-only model directory."""

import json
from types import SimpleNamespace

import pytest

import plan as plan_cli
from utils.errors import run_main
from utils.train import memory_plan as mp

# hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 1000, tied embeddings
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
}
# per layer: q 64x64, k and v 64x32, o 64x64 = 12288; gate, up 64x128, down 128x64 = 24576
LAYER = 12288 + 24576
PARAMS = 1000 * 64 + 2 * LAYER + 5 * 64  # embedding, layers, 2 norms per layer and the final one = 138048
LORA_4 = 2 * 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))  # r x (in + out) = 8192


@pytest.fixture
def shape():
    return mp.shape_from_config(TINY)


def parts_of(model, dtype, ranks):
    return {p.name.split(" ", 1)[1]: p.bytes for p in mp.model_state_parts(model, dtype, ranks)}


def test_shape_counts(shape):
    assert shape.params == PARAMS == 138048
    assert shape.head_dim == 16 and shape.kv_heads == 2
    assert shape.lora_params(4) == LORA_4 == 8192


def test_zero2_mixed_precision_is_deepspeeds_2_plus_18_over_n(shape):
    got = parts_of(mp.ModelSpec("policy", shape, trained=True, zero_stage=2), "bf16", 4)
    bucket = PARAMS * 2  # the reduce bucket (5e7 elements) is larger than the model: the model's size
    assert got["parameters"] == PARAMS * 2
    assert got["gradients"] == PARAMS * 2 / 4 + bucket
    assert got["fp32 gradients"] == PARAMS * 4 / 4
    assert got["optimizer states"] == PARAMS * 12 / 4
    states = got["parameters"] + got["gradients"] - bucket + got["fp32 gradients"] + got["optimizer states"]
    assert states == 2 * PARAMS + 18 * PARAMS / 4  # estimate_zero2_model_states_mem_needs(cpu_offload=False)


def test_zero_stages_and_ranks(shape):
    fp32_0 = parts_of(mp.ModelSpec("m", shape, trained=True, zero_stage=0), "fp32", 2)
    assert fp32_0 == {"parameters": PARAMS * 4, "gradients": PARAMS * 4, "optimizer states": PARAMS * 8}
    fp32_1 = parts_of(mp.ModelSpec("m", shape, trained=True, zero_stage=1), "fp32", 2)
    assert fp32_1["gradients"] == PARAMS * 4 + PARAMS * 4  # whole, plus the reduce bucket
    assert fp32_1["optimizer states"] == PARAMS * 12 / 2  # the fp32 partition copy + 2 moments
    z3 = parts_of(mp.ModelSpec("m", shape, trained=True, zero_stage=3), "bf16", 8)
    assert z3["parameters"] == PARAMS * 2 / 8
    assert z3["gathered layers"] == PARAMS * 2  # stage3_max_live_parameters (3e7) exceeds the tiny model
    big = mp.Shape(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008)
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008  # one decoder layer, larger than the live bound
    assert parts_of(mp.ModelSpec("m", big, trained=True, zero_stage=3), "bf16", 8)["gathered layers"] == layer * 2
    frozen = parts_of(mp.ModelSpec("ref", shape, zero_stage=3), "bf16", 8)
    assert set(frozen) == {"parameters", "gathered layers"}  # scored layer by layer
    whole = parts_of(mp.ModelSpec("ref", shape, zero_stage=3, gathered_for=("experience",)), "bf16", 8)
    assert whole == {"parameters": PARAMS * 2 / 8, "gathered copy": PARAMS * 2 * 7 / 8}


def test_offload_moves_optimizer_and_zero3_params_to_cpu(shape):
    parts = mp.model_state_parts(mp.ModelSpec("m", shape, trained=True, zero_stage=3, offload=True), "bf16", 2)
    where = {p.name: p.where for p in parts}
    assert where == {
        "m parameters": "cpu",
        "m gradients": "device",
        "m fp32 gradients": "cpu",
        "m optimizer states": "cpu",
        "m gathered layers": "device",
    }


def test_lora_trains_only_the_adapters(shape):
    got = parts_of(mp.ModelSpec("m", shape, trained=True, lora_dim=4, only_lora=True), "fp32", 1)
    assert got == {"parameters": (PARAMS + LORA_4) * 4, "gradients": LORA_4 * 4, "optimizer states": LORA_4 * 8}


def test_4bit_base_weights(shape):
    model = mp.ModelSpec("m", shape, trained=True, lora_dim=4, only_lora=True, load_in_4bit=True)
    nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits, an 8-bit absmax per 64, an fp32 scale per 256 absmaxes
    assert mp.parameter_bytes(model, "bf16") == pytest.approx(2 * LAYER * nf4 + (PARAMS - 2 * LAYER) * 2 + LORA_4 * 2)


def test_logits_with_and_without_chunking(shape):
    assert mp.logits_bytes(shape, 10) == 10 * 1000 * 4 * mp.LOGITS_COPIES
    assert mp.logits_bytes(shape, 10, chunk_tokens=4) == 4 * 1000 * 4 * mp.LOGITS_COPIES
    assert mp.logits_bytes(shape, 10, chunk_tokens=64) == mp.logits_bytes(shape, 10)


def test_a_token_budget_bounds_the_micro_batch(shape):
    model = mp.ModelSpec("actor", shape, trained=True)
    padded = mp.training_parts(model, "fp32", 4, 100, False, "sdpa", 0, True)
    budget = mp.training_parts(model, "fp32", 4, 100, False, "sdpa", 0, True, budget=150)
    assert "(400 tokens)" in padded[-2].name and "(150 tokens)" in budget[-2].name
    assert budget[-2].bytes == padded[-2].bytes * 150 / 400 and budget[-1].bytes == padded[-1].bytes * 150 / 400


def test_kv_cache(shape):
    # rows x length x layers x (k, v) x kv heads x head dim x bytes
    assert mp.kv_cache_bytes(shape, rows=3, length=20, dtype="bf16") == 3 * 20 * 2 * 2 * 2 * 16 * 2


def test_activations_checkpointing(shape):
    full = mp.activation_bytes_per_token(shape, "fp32", False, 32, "sdpa")
    ckpt = mp.activation_bytes_per_token(shape, "fp32", True, 32, "sdpa")
    per_layer = full / 2
    assert ckpt == 2 * 64 * 4 + per_layer  # each layer's input, and one layer recomputed
    assert mp.activation_bytes_per_token(shape, "fp32", False, 32, "eager") == full + 2 * 2 * 4 * 32 * 4


def rl_args(**overrides):
    values = dict(
        dtype="bf16",
        load_in_4bit=False,
        enable_hybrid_engine=True,
        no_gathered_experience=False,
        actor_model_name_or_path="a",
        critic_model_name_or_path="c",
        actor_lora_dim=0,
        critic_lora_dim=0,
        only_optimize_lora=False,
        actor_zero_stage=3,
        critic_zero_stage=3,
        offload=False,
        offload_reference_model=False,
        offload_reward_model=False,
        enable_ema=False,
        per_device_generation_batch_size=2,
        n_samples_per_prompt=2,
        generation_batches=1,
        max_prompt_seq_len=8,
        max_answer_seq_len=8,
        per_device_training_batch_size=2,
        actor_gradient_checkpointing=False,
        critic_gradient_checkpointing=False,
        attn_implementation=None,
        logprob_chunk_tokens=0,
    )
    return SimpleNamespace(**{**values, **overrides})


def test_rl_plan_holds_four_models_and_the_generation_phase(shape):
    plan = mp.plan_rl(rl_args(), {"a": shape, "c": shape}, 2, True, True, ["c"])
    names = [p.name for p in plan.parts]
    for model in ("actor", "reference", "critic", "reward model"):
        assert f"{model} parameters" in names
    assert "actor gathered copy" in names and "KV cache (4 rows x 16 tokens)" in names
    scoring = [p for p in plan.parts if p.name.startswith("gathered for scoring")]
    assert len(scoring) == 1 and scoring[0].bytes == PARAMS * 2 / 2  # one model at a time
    gathered = next(p for p in plan.parts if p.name == "actor gathered copy")
    assert gathered.bytes == PARAMS * 2 / 2 and gathered.phases == ("generation",)
    assert set(plan.phases) == {"training", "generation", "experience"}
    no_critic = mp.plan_rl(rl_args(kl_ctl=0), {"a": shape, "c": shape}, 2, False, False, ["c"])
    assert not any(p.name.startswith(("critic", "reference")) for p in no_critic.parts)


def test_verdict_names_the_largest_parts(shape):
    plan = mp.Plan("sft", 1, "fp32", [mp.Part("optimizer states", 3 * mp.GIB, hint="--offload"), mp.Part("x", mp.GIB)])
    assert mp.verdict(plan, 8) == "fits: 4.0 of 8 GiB"
    assert mp.verdict(plan, 2) == "does not fit: 4.0 of 2 GiB; largest: optimizer states 3.0 (try --offload), x 1.0"


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def run_plan(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(run_main(plan_cli.main, list(argv)))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_cli_prints_the_parts_and_a_verdict(capsys, model_dir):
    code, out, _ = run_plan(capsys, "sft", "--model_name_or_path", model_dir, "--ranks", "2", "--device", "cpu")
    assert code == 0
    for part in ("policy parameters", "policy gradients", "policy optimizer states", "policy activations", "logits"):
        assert part in out
    assert out.strip().splitlines()[-1].startswith("fits: ")
    code, out, _ = run_plan(
        capsys, "sft", "--model_name_or_path", model_dir, "--device", "cpu", "--device_memory_gib", "0.001"
    )
    assert code == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("does not fit: ") and "largest: " in last and "(try " in last


def test_cli_rl_with_the_steps_own_config(capsys, model_dir):
    code, out, _ = run_plan(
        capsys,
        "rl",
        "--config",
        "configs/step3_ppo/ppo_cpu.yaml",
        "--actor_model_name_or_path",
        model_dir,
        "--critic_model_name_or_path",
        model_dir,
        "--ranks",
        "2",
        "--device",
        "cuda",
        "--device_memory_gib",
        "24",
    )
    assert code == 0 and "KV cache (8 rows x 56 tokens)" in out and "actor gathered copy" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ppo", "--model_name_or_path", "x"], "unknown STEP 'ppo'"),
        (["sft", "--model_name_or_path", "/nonexistent/model"], "no config.json at '/nonexistent/model'"),
    ],
)
def test_cli_errors_are_one_line(capsys, argv, message):
    code, out, err = run_plan(capsys, *argv, "--device", "cpu")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_cpu_heap_keeps_the_other_phases_blocks():
    states = mp.Part("states", 2 * mp.GIB)
    train, evaluate = mp.Part("act", mp.GIB, phases=("training",)), mp.Part("eval", mp.GIB / 2, phases=("evaluation",))
    plan = mp.Plan("sft", 1, "fp32", [states, train, evaluate], device="cpu", load_bytes=mp.GIB)
    plan.add_cpu_heap()
    kept = mp.Part("CPU heap kept from loading, evaluation", 1.5 * mp.GIB, "device", ("training",))
    assert plan.parts[-1] == kept
    assert plan.total() == 4.5 * mp.GIB and plan.peak_phase() == "training"


def test_value_head_models_have_no_lm_head():
    untied = mp.shape_from_config({**TINY, "tie_word_embeddings": False})
    assert untied.params == PARAMS + 1000 * 64 and mp.backbone(untied).params == PARAMS
    args = SimpleNamespace(
        lora_dim=0,
        only_optimize_lora=False,
        zero_stage=0,
        offload=False,
        dtype="fp32",
        max_seq_len=8,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        gradient_checkpointing=False,
    )
    plan = mp.plan_single("rm", args, untied, 1, 2, lm_head=False)
    parts = {p.name: p.bytes for p in plan.parts}
    assert parts["reward model parameters"] == PARAMS * 4 and not any("logits" in name for name in parts)
