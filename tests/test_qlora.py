"""--load_in_4bit (QLoRA): bitsandbytes NF4 base weights on CPU, LoRA training on them, a frozen 4-bit reference,
the refusals, the full-precision export and step 3's lr=0 log-ratio with a 4-bit actor."""

import json

import pytest
import torch
from torch import nn

from step1_sft.main import main as step1_main
from step2_dpo.main import main as dpo_main
from step2_reward.main import main as step2_main
from step2_reward.main import parse_args as step2_args
from step3_ppo.deepspeed_models import check_qlora_args
from step3_ppo.main import parse_args as step3_args
from step3_ppo.main import setup as step3_setup
from tests.launch import metrics, run_deepspeed, tail
from tests.test_step3_lr0 import prompt_batches, write_prompts
from utils.models.export import export_hf_model, plain_copy, reload_max_abs_diff
from utils.models.forward import causal_lm_logits
from utils.models.loading import (
    ModelFlagError,
    apply_lora,
    four_bit_loading,
    is_4bit,
    is_4bit_layer,
    load_causal_lm,
    load_tokenizer,
)
from utils.models.reward_model import RewardModel
from utils.models.tiny import make_tiny_model_cached
from utils.runtime.distributed import init_distributed
from utils.train.ds_config import train_ds_config
from utils.train.loop import EngineSpec, build_trained_engine

pytest.importorskip("bitsandbytes")

QLORA = ["--load_in_4bit", "--dtype", "bf16", "--actor_lora_dim", "4", "--critic_lora_dim", "4", "--only_optimize_lora"]


def linear_kinds(model: nn.Module) -> dict:
    return {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def test_backbone_linears_are_4bit_heads_are_not(tiny_llama, tiny_llama_reward):
    tokenizer = load_tokenizer(tiny_llama)
    kinds = linear_kinds(load_causal_lm(tiny_llama, tokenizer, load_in_4bit=True))
    assert kinds.pop("lm_head") == "Linear"  # the LM head keeps the engine's dtype (transformers' convention)
    assert kinds and set(kinds.values()) == {"Linear4bit"}, kinds
    with four_bit_loading():
        reward = RewardModel.from_pretrained(tiny_llama_reward, tokenizer, require_value_head=True)
    kinds = linear_kinds(reward)
    assert kinds.pop("v_head") == "Linear" and reward.v_head.weight.dtype == torch.float32
    assert kinds and set(kinds.values()) == {"Linear4bit"}, kinds
    assert not is_4bit(load_causal_lm(tiny_llama, tokenizer))  # outside the block: full precision again


def test_4bit_weights_take_a_quarter_of_bf16(tiny_llama):
    """Bytes of the quantised Linear weights against the same weights in bf16: the packed NF4 weights are 0.5 byte
    per weight, a quarter; their double-quantised constants add ~0.13 bit per weight on a real model plus ~1.1 kB
    per layer (the 256-entry nested code book), which the tiny model's 64-wide layers feel."""
    model = load_causal_lm(tiny_llama, load_in_4bit=True)
    packed = constants = bf16 = 0
    for module in model.modules():
        if is_4bit_layer(module):
            weight = module.weight
            packed += weight.numel() * weight.element_size()
            constants += sum(t.numel() * t.element_size() for t in weight.quant_state.as_dict(packed=True).values())
            bf16 += module.in_features * module.out_features * 2
    assert bf16 > 0 and packed * 4 == bf16, (packed, bf16)
    assert (packed + constants) / bf16 < 0.4, (packed, constants, bf16)


def test_gradients_reach_the_lowest_adapters_after_an_eval_forward(tiny_llama):
    """A no-grad eval forward (step 3's rollout) must not switch the 4-bit layers to bitsandbytes' CPU inference
    kernel, which has no backward: the adapters' gradients after it are those of a model that never ran one."""

    def lora_grads(eval_first: bool) -> dict:
        torch.manual_seed(0)
        model = apply_lora(load_causal_lm(tiny_llama, load_in_4bit=True), 4, "", only_optimize_lora=True)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # non-zero B: gradients flow to every lora_A
                torch.nn.init.normal_(param, std=0.1)
        ids = torch.randint(3, 1000, (2, 9))
        if eval_first:
            with torch.no_grad():
                model.eval()(input_ids=ids)
        model.train()(input_ids=ids, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    plain, after_eval = lora_grads(False), lora_grads(True)
    lowest = next(name for name in plain if "layers.0." in name and "lora_A" in name)
    assert plain[lowest].abs().sum() > 0
    for name, grad in plain.items():
        torch.testing.assert_close(after_eval[name], grad, msg=name)


@pytest.fixture(scope="module")
def trained_qlora(tiny_llama, tmp_path_factory):
    """A 4-bit LoRA engine (ZeRO-2, bf16) after 4 steps on one batch, with its parameters before training."""
    init_distributed(600)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(tiny_llama)
    config = train_ds_config(2, 1, 2, 1, "bf16")
    model = load_causal_lm(tiny_llama, tokenizer, config, 0.0, load_in_4bit=True)
    spec = EngineSpec(learning_rate=1e-3, lora_dim=4, only_optimize_lora=True, lora_learning_rate=1e-2)
    engine = build_trained_engine(model, config, spec, 10)
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    ids = torch.randint(3, 1000, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    losses = []
    for _ in range(4):
        loss = engine(**batch, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, tokenizer, before, batch, losses, tmp_path_factory.mktemp("qlora")


def test_lora_trains_on_4bit_base_weights(trained_qlora):
    engine, _, before, _, losses, _ = trained_qlora
    assert losses[-1] < losses[0] - 1e-3, losses
    changed = {name for name, p in engine.module.named_parameters() if not torch.equal(before[name], p.detach())}
    assert changed and all("lora_" in name for name in changed), sorted(changed)[:5]
    frozen_4bit = [p for p in engine.module.parameters() if type(p).__name__ == "Params4bit"]
    assert frozen_4bit and not any(p.requires_grad for p in frozen_4bit)


def test_checkpoint_of_a_4bit_engine_resumes(trained_qlora):
    """A DeepSpeed checkpoint holds the 4-bit weights and their quantisation constants; loading it back (--resume)
    reads them and gives the same outputs."""
    engine, _, _, batch, _, tmp = trained_qlora
    with torch.no_grad():
        expected = engine(**batch).logits
    engine.save_checkpoint(str(tmp / "ckpt"), tag="t")
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if "lora_B" in name:
                p.zero_()
    engine.load_checkpoint(str(tmp / "ckpt"), tag="t")
    with torch.no_grad():
        assert torch.equal(engine(**batch).logits, expected)


def test_export_is_a_plain_full_precision_model(trained_qlora):
    """The export merges the adapters into the dequantised NF4 weights in fp32: a plain directory (no
    quantization_config, fp32, no 4-bit layer) whose logits are the engine's up to its bf16 compute."""
    engine, tokenizer, _, batch, _, tmp = trained_qlora
    out = tmp / "export"
    export_hf_model(engine, tokenizer, str(out))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    reloaded = load_causal_lm(str(out))
    assert not is_4bit(reloaded) and {p.dtype for p in reloaded.parameters()} == {torch.float32}

    def logits(model, batch):
        return causal_lm_logits(model, batch["input_ids"], batch["attention_mask"]).float()

    diff = reload_max_abs_diff(engine, lambda: load_causal_lm(str(out)), logits, batch)
    scale = logits(reloaded, batch).abs().max().item()
    assert diff <= 0.02 * scale, (diff, scale)  # bf16 compute of the engine vs the fp32 reload


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_merged_export_matches_the_4bit_model(arch):
    """plain_copy of a 4-bit LoRA model (adapters non-zero) computes what the 4-bit model computes, up to its bf16
    compute, on every architecture: GPT-2's Conv1D layers are quantised as Linear [out, in] and transposed back
    (a square one, attn.c_proj, too)."""
    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(make_tiny_model_cached(arch), load_in_4bit=True), 4, "", only_optimize_lora=True)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    plain = plain_copy(model, {k: v.detach() for k, v in model.state_dict().items()}).eval()
    assert not is_4bit(plain) and {p.dtype for p in plain.parameters()} == {torch.float32}
    ids = torch.randint(3, 1000, (2, 9))
    with torch.no_grad():
        expected, actual = model.eval()(input_ids=ids).logits.float(), plain(input_ids=ids).logits
    assert (actual - expected).abs().max() <= 0.02 * expected.abs().max(), arch


def test_refusals_are_one_line(tiny_llama, tiny_llama_reward, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "Human: hi\\n\\nAssistant:"}\n')
    base = [
        "--actor_model_name_or_path",
        tiny_llama,
        "--critic_model_name_or_path",
        tiny_llama_reward,
        "--data_path",
        str(tmp_path / "p.jsonl"),
        "--output_dir",
        str(tmp_path / "out"),
        "--kl_ctl",
        "0.1",
        "--actor_zero_stage",
        "2",
        "--critic_zero_stage",
        "2",
    ]
    refused = {
        "full fine-tuning": (["--load_in_4bit", "--dtype", "bf16"], "actor's base weights would train"),
        "LoRA without --only_optimize_lora": (
            ["--load_in_4bit", "--dtype", "bf16", "--actor_lora_dim", "4", "--critic_lora_dim", "4"],
            "add --actor_lora_dim R and --only_optimize_lora",
        ),
        "fp16": ([*QLORA[:1], "--dtype", "fp16", *QLORA[3:]], "needs --dtype bf16 or fp32"),
        "ZeRO-3": ([*QLORA, "--actor_zero_stage", "3"], "ZeRO stage 3 (the actor's)"),
        "offloaded reference": ([*QLORA, "--offload_reference_model"], "ZeRO stage 3 (the reference's)"),
        "merged LoRA rollout": ([*QLORA, "--enable_hybrid_engine"], "add --no_merge_lora_for_generation"),
    }
    for case, (flags, says) in refused.items():
        with pytest.raises(ModelFlagError) as info:
            check_qlora_args(step3_args(base + flags), [])
        assert says in str(info.value) and "\n" not in str(info.value), (case, str(info.value))
    step2 = ["--model_name_or_path", tiny_llama, "--data_path", str(tmp_path / "p.jsonl"), "--output_dir"]
    for flags, says in (
        (["--load_in_4bit", "--dtype", "bf16"], "the reward model's base weights would train"),
        (["--load_in_4bit", "--lora_dim", "4", "--only_optimize_lora", "--zero_stage", "3"], "ZeRO stage 3"),
    ):
        with pytest.raises(ModelFlagError) as info:
            step2_args([*step2, str(tmp_path / "out2"), *flags])
        assert says in str(info.value) and "\n" not in str(info.value), str(info.value)
    check_qlora_args(step3_args(base + QLORA + ["--enable_hybrid_engine", "--no_merge_lora_for_generation"]), [])
    check_qlora_args(step3_args(base + QLORA + ["--actor_zero_stage", "2", "--dtype", "fp32"]), [])


@pytest.mark.slow
def test_lr0_log_ratio_with_a_4bit_actor(tiny_llama, tiny_llama_reward, tmp_path):
    """Step 3 with a 4-bit actor and critic (LoRA), a 4-bit frozen reference and EMA, bf16, the hybrid engine
    generating through the unmerged adapters: at learning rate 0
    the old log-probs (no-grad forward of the rollout batch) and training's forward give the same fp32 log-probs
    when the mini-batch is the rollout batch. Mini-batches of another shape pad differently and bf16 compute
    rounds differently (~1e-3, as without 4-bit weights in bf16)."""
    write_prompts(tmp_path / "prompts.jsonl")
    lr0 = ["--actor_learning_rate", "0", "--critic_learning_rate", "0"]
    lr0 += ["--actor_lora_learning_rate", "0", "--critic_lora_learning_rate", "0"]
    run = step3_setup(
        step3_args(
            [
                *("--actor_model_name_or_path", tiny_llama, "--critic_model_name_or_path", tiny_llama_reward),
                *("--data_path", str(tmp_path / "prompts.jsonl"), "--data_split", "0,0,10"),
                *("--output_dir", str(tmp_path / "out"), "--actor_zero_stage", "0", "--critic_zero_stage", "2"),
                *("--max_prompt_seq_len", "32", "--max_answer_seq_len", "10", "--seed", "3"),
                *("--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4"),
                *("--actor_dropout", "0.0", "--critic_dropout", "0.0", "--kl_ctl", "0.1", "--enable_ema"),
                *("--enable_hybrid_engine", "--no_merge_lora_for_generation"),
                *lr0,
                *QLORA,
            ]
        )
    )
    assert all(is_4bit(e.module) for e in (run.engines.actor, run.engines.ref, run.engines.critic))
    assert is_4bit(run.engines.ema.engine.module)
    run.trainer.config.do_sample = True
    torch.manual_seed(1)
    metrics, _ = run.trainer.step(prompt_batches(run, 4, offset=4), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4, metrics["ppo/log_ratio_max_abs"]


@pytest.mark.slow
def test_step2_reward_model_in_4bit_trains_resumes_and_exports(tiny_llama, tmp_path):
    """Step 2 with --load_in_4bit (LoRA, ZeRO-2, bf16) in this process: 2 steps with a checkpoint, resumed to a 3rd,
    then exported as a plain full-precision reward model whose scores are the engine's up to its bf16 compute."""
    rows = [
        {"prompt": f"Human: the {t}?\n\nAssistant:", "chosen": " good and fine", "rejected": " bad and dull"}
        for t in ("movie", "film", "plot", "actor", "scene", "story", "music", "ending") * 4
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    flags = [
        *("--model_name_or_path", tiny_llama, "--data_path", str(tmp_path / "pairs.jsonl"), "--data_split", "0,10,0"),
        *("--output_dir", str(out), "--zero_stage", "2", "--per_device_train_batch_size", "4"),
        *("--per_device_eval_batch_size", "8", "--max_seq_len", "32", "--eval_iters", "1", "--save_interval", "2"),
        *("--load_in_4bit", "--dtype", "bf16", "--lora_dim", "4", "--only_optimize_lora"),
    ]
    step2_main([*flags, "--max_steps", "2"])
    step2_main([*flags, "--max_steps", "3", "--resume"])
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in logged) == 3
    diff = [r["export/score_max_abs_diff"] for r in logged if "export/score_max_abs_diff" in r][-1]
    assert diff < 0.05, diff
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    reloaded = RewardModel.from_pretrained(str(out), require_value_head=True)
    assert not is_4bit(reloaded) and {p.dtype for p in reloaded.parameters()} == {torch.float32}


@pytest.mark.slow
def test_two_rank_zero2_reward_model_in_4bit(tiny_llama, tmp_path):
    """Step 2 with --load_in_4bit on 2 ranks at ZeRO-2 (the adapters and value head partitioned, the 4-bit weights
    replicated): it trains, and the export reloads within the bf16 tolerance."""
    rows = [
        {"prompt": f"Human: the {t}?\n\nAssistant:", "chosen": " good and fine", "rejected": " bad and dull"}
        for t in ("movie", "film", "plot", "actor", "scene", "story", "music", "ending") * 4
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    flags = [
        *("--model_name_or_path", tiny_llama, "--data_path", str(tmp_path / "pairs.jsonl"), "--data_split", "0,10,0"),
        *("--output_dir", out, "--zero_stage", 2, "--per_device_train_batch_size", 4, "--max_steps", 3),
        *("--per_device_eval_batch_size", 8, "--max_seq_len", 32, "--eval_iters", 1, "--learning_rate", 3e-3),
        *("--load_in_4bit", "--dtype", "bf16", "--lora_dim", 4, "--only_optimize_lora", "--lora_learning_rate", 3e-2),
    ]
    proc = run_deepspeed("step2_reward.main", flags, num_ranks=2, log_path=str(tmp_path / "log.txt"))
    assert proc.returncode == 0, tail(proc)
    logged = metrics(out)
    train = [r["train/loss"] for r in logged if "train/loss" in r]
    assert len(train) == 3 and train[-1] < train[0], train
    diff = [r["export/score_max_abs_diff"] for r in logged if "export/score_max_abs_diff" in r]
    assert diff and diff[0] < 0.05, diff


@pytest.mark.slow
@pytest.mark.parametrize("step", ["sft", "dpo"])
def test_step1_and_dpo_in_4bit_train_and_export(step, tiny_llama, tmp_path):
    """Steps 1 and DPO with --load_in_4bit (LoRA, ZeRO-2, bf16) in this process: the policy trains and exports as a
    plain full-precision model whose reload matches the engine up to its bf16 compute."""
    rows = [
        {"prompt": f"Human: the {t}?\n\nAssistant:", "chosen": " good and fine", "rejected": " bad and dull"}
        for t in ("movie", "film", "plot", "actor", "scene", "story", "music", "ending") * 4
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    main, quantity, split = {
        "sft": (step1_main, "logits", "10,0,0"),
        "dpo": (dpo_main, "logp", "0,10,0"),
    }[step]
    main(
        [
            *("--model_name_or_path", tiny_llama, "--data_path", str(tmp_path / "pairs.jsonl"), "--data_split", split),
            *("--output_dir", str(out), "--zero_stage", "2", "--per_device_train_batch_size", "4"),
            *("--per_device_eval_batch_size", "8", "--max_seq_len", "32", "--max_steps", "2"),
            *("--load_in_4bit", "--dtype", "bf16", "--lora_dim", "4", "--only_optimize_lora"),
        ]
    )
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    diff = [r[f"export/{quantity}_max_abs_diff"] for r in logged if f"export/{quantity}_max_abs_diff" in r]
    assert diff and diff[-1] < 0.05, (diff, sorted(k for r in logged for k in r if k.startswith("export/")))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not is_4bit(load_causal_lm(str(out)))
