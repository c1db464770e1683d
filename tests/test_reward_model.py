"""RewardModel: score index, padding invariance, loss/metrics, save/reload, eval CLI (one process, no engine)."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from utils.data import DataError, pad_batch, split_pair_batch
from utils.errors import UsageError
from utils.math.losses import pair_metrics, pairwise_loss
from utils.math.ops import sequence_score
from utils.models.loading import apply_lora, load_tokenizer
from utils.models.reward_model import REWARD_MODEL_FILE, VALUE_HEAD_FILE, RewardModel, save_reward_model

PAD, EOS = 50257, 50256


def _mask(lengths, length, side):
    return pad_batch([[1] * n for n in lengths], 0, side, length=length)


# --------------------------------------------------------------------------- #
# score index
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("pad_id", [PAD, EOS], ids=["pad!=eos", "pad==eos"])
def test_sequence_score_reads_last_real_token(side, pad_id):
    seqs = [[11, 12, 13, EOS], [21, EOS], [31, 32, 33, 34, 35, EOS], [41]]
    ids = pad_batch(seqs, pad_id, side, length=8)
    mask = _mask([len(s) for s in seqs], 8, side)
    values = torch.arange(32, dtype=torch.float32).view(4, 8) + 0.5
    expected_index = [3, 1, 5, 0] if side == "right" else [7, 7, 7, 7]
    expected = torch.tensor([values[i, j].item() for i, j in enumerate(expected_index)])
    assert torch.equal(sequence_score(values, mask), expected)
    # the score is read at the last real token: that token is the EOS, whatever the pad id is
    last = ids.gather(1, torch.tensor(expected_index).unsqueeze(1)).squeeze(1)
    assert last.tolist() == [EOS, EOS, EOS, 41]


def test_sequence_score_rejects_empty_rows():
    with pytest.raises(ValueError, match="without any 1"):
        sequence_score(torch.zeros(2, 3), torch.tensor([[1, 1, 0], [0, 0, 0]]))


# --------------------------------------------------------------------------- #
# padding invariance on real (tiny) backbones
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def models(tiny_gpt2, tiny_llama):
    out = {}
    for arch, path in (("gpt2", tiny_gpt2), ("llama", tiny_llama)):
        tokenizer = load_tokenizer(path)
        torch.manual_seed(0)
        out[arch] = (RewardModel.from_pretrained(path, tokenizer, dropout=0.0).eval(), tokenizer, path)
    return out


def _sequences(tokenizer):
    texts = [
        "Human: Is this movie good?\n\nAssistant: It is a wonderful film.",
        "Human: Hi\n\nAssistant: Bad.",
        "Human: Tell me about the plot of this long film.\n\nAssistant: It meanders.",
    ]
    return [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_score_invariant_to_padding_side_and_amount(arch, models):
    model, tokenizer, _ = models[arch]
    seqs = _sequences(tokenizer)
    longest = max(map(len, seqs))
    reference = None
    with torch.no_grad():
        for side in ("right", "left"):
            for pad_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
                for extra in (0, 3, 11):
                    ids = pad_batch(seqs, pad_id, side, length=longest + extra)
                    mask = _mask([len(s) for s in seqs], longest + extra, side)
                    values = model(ids, mask)
                    assert values.dtype == torch.float32 and values.shape == ids.shape
                    score = sequence_score(values, mask)
                    assert torch.equal(score, model.score(ids, mask))
                    if reference is None:
                        reference = score
                    assert torch.allclose(score, reference, atol=1e-5, rtol=0), (side, pad_id, extra)
        # and each sequence alone, unpadded
        for i, s in enumerate(seqs):
            alone = model.score(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))
            assert abs(alone.item() - reference[i].item()) <= 1e-5


def test_score_changes_with_content(models):
    model, tokenizer, _ = models["gpt2"]
    seqs = _sequences(tokenizer)[:2]
    ids = pad_batch(seqs, tokenizer.pad_token_id, "right")
    scores = model.score(ids, _mask(list(map(len, seqs)), ids.shape[1], "right"))
    assert scores[0].item() != scores[1].item()


def test_fresh_v_head_is_deterministic_and_trainable_under_lora(tiny_gpt2):
    tokenizer = load_tokenizer(tiny_gpt2)
    torch.manual_seed(1)
    a = RewardModel.from_pretrained(tiny_gpt2, tokenizer)
    torch.manual_seed(2)
    b = RewardModel.from_pretrained(tiny_gpt2, tokenizer)
    assert torch.equal(a.v_head.weight, b.v_head.weight)  # same on every rank whatever the RNG state
    assert a.v_head.weight.abs().sum() > 0 and a.v_head.weight.std() < 0.5
    a.backbone = apply_lora(a.backbone, 4, "attn", only_optimize_lora=True)
    trainable = {n for n, p in a.named_parameters() if p.requires_grad}
    assert "v_head.weight" in trainable
    assert trainable - {"v_head.weight"} and all("lora_" in n for n in trainable - {"v_head.weight"})


def test_value_head_takes_the_backbones_dtype(tiny_gpt2):
    """A backbone built in bf16 (ZeRO-3's zero.Init) gets a bf16 head, fresh or loaded: DeepSpeed casts only
    non-ZeRO-3 modules, and an fp32 head among bf16 partitions breaks it."""
    from utils.models.loading import load_causal_lm

    backbone = load_causal_lm(tiny_gpt2, load_tokenizer(tiny_gpt2), base_model_only=True).to(torch.bfloat16)
    fresh = RewardModel(backbone)
    loaded = RewardModel(backbone, torch.nn.Linear(fresh.v_head.weight.shape[1], 1, bias=False))
    assert fresh.v_head.weight.dtype == loaded.v_head.weight.dtype == torch.bfloat16
    ids = torch.tensor([[1, 2, 3]])
    assert fresh(ids, torch.ones_like(ids)).dtype == torch.float32


# --------------------------------------------------------------------------- #
# loss and metrics
# --------------------------------------------------------------------------- #
def test_pairwise_loss_hand_computed():
    c, r = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    expected = (math.log1p(math.exp(-1.0)) + math.log(2.0) + math.log1p(math.exp(2.0))) / 3
    assert pairwise_loss(c, r).item() == pytest.approx(expected, abs=1e-6)
    # margin: -log sigmoid(c - r - m)
    expected_m = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(0.5)) + math.log1p(math.exp(2.5))) / 3
    assert pairwise_loss(c, r, margin=0.5).item() == pytest.approx(expected_m, abs=1e-6)
    # numerically stable for huge gaps (log(sigmoid) would give inf / lose the gradient)
    big = pairwise_loss(torch.tensor([0.0]), torch.tensor([200.0]))
    assert big.item() == pytest.approx(200.0, rel=1e-6)
    x = torch.tensor([-300.0], requires_grad=True)
    pairwise_loss(x, torch.tensor([0.0])).backward()
    assert x.grad.item() == pytest.approx(-1.0)


def test_pair_metrics_hand_computed():
    c, r = torch.tensor([2.0, 0.0, -1.0, 3.0]), torch.tensor([1.0, 0.0, 1.0, -1.0])
    m = pair_metrics(c, r)
    assert m["accuracy"] == 0.5  # ties do not count as correct
    assert m["chosen_mean"] == pytest.approx(1.0)
    assert m["rejected_mean"] == pytest.approx(0.25)
    assert m["margin_mean"] == pytest.approx(0.75)


def test_split_pair_batch_chosen_first():
    chosen, rejected = split_pair_batch(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert chosen.tolist() == [1.0, 2.0] and rejected.tolist() == [3.0, 4.0]
    with pytest.raises(ValueError):
        split_pair_batch(torch.zeros(3))


# --------------------------------------------------------------------------- #
# save / reload
# --------------------------------------------------------------------------- #
def _batch(tokenizer):
    seqs = _sequences(tokenizer)
    ids = pad_batch(seqs, tokenizer.pad_token_id, "left")
    return ids, _mask(list(map(len, seqs)), ids.shape[1], "left")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_save_reload_gives_identical_scores(lora, tiny_llama, tmp_path):
    tokenizer = load_tokenizer(tiny_llama)
    model = RewardModel.from_pretrained(tiny_llama, tokenizer, dropout=0.0)
    if lora:
        model.backbone = apply_lora(model.backbone, 4, "proj")
        with torch.no_grad():  # non-zero adapters so the merge matters
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    with torch.no_grad():
        model.v_head.weight.mul_(3.0)
    model.eval()
    ids, mask = _batch(tokenizer)
    with torch.no_grad():
        expected = model.score(ids, mask)
    out = str(tmp_path / "rm")
    save_reward_model(model, tokenizer, out)
    for name in ("config.json", "model.safetensors", VALUE_HEAD_FILE, REWARD_MODEL_FILE, "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert not any("lora" in k for k in load_file(os.path.join(out, "model.safetensors")))
    info = json.load(open(os.path.join(out, REWARD_MODEL_FILE)))
    assert info["hidden_size"] == 64 and "last real token" in info["score"]
    reloaded = RewardModel.from_pretrained(out, load_tokenizer(out)).eval()
    assert torch.equal(reloaded.v_head.weight, model.v_head.weight)
    with torch.no_grad():
        actual = reloaded.score(ids, mask)
    assert (actual - expected).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- #
# eval CLI
# --------------------------------------------------------------------------- #
def test_eval_cli_prints_table_and_pair_accuracy(models, tmp_path, capsys):
    from step2_reward import eval as rw_eval

    model, tokenizer, _ = models["gpt2"]
    out = str(tmp_path / "rm")
    save_reward_model(model, tokenizer, out)
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "Human: Say something\n\nAssistant:", "chosen": f" good {i}", "rejected": f" bad {i}"}
        for i in range(5)
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # "\\n" as typed in a shell: turned into a newline (the training template), unless --raw_text
    result = rw_eval.main(
        [
            "--model_name_or_path",
            out,
            "--prompt",
            "Human: Hi\\n\\nAssistant:",
            "--response",
            " Hello there.",
            "--response",
            " Go away.",
            "--prompt",
            "Human: Bye\n\nAssistant:",
            "--response",
            " Farewell.",
            "--pairs",
            str(pairs),
            "--batch_size",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    assert "score" in printed and "Hello there." in printed and "Go away." in printed and "Farewell." in printed
    assert len(result["scores"]) == 3
    assert "accuracy" in printed and result["pairs"]["pairs"] == 5
    # texts are scored exactly as training tokenizes them: prompt ids + response ids + eos
    ids = (
        tokenizer("Human: Hi\n\nAssistant:", add_special_tokens=False).input_ids
        + tokenizer(" Hello there.", add_special_tokens=False).input_ids
        + [tokenizer.eos_token_id]
    )
    with torch.no_grad():
        direct = model.score(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).item()
    assert result["scores"][0] == pytest.approx(direct, abs=1e-5)
    # the pair figures agree with scoring each side by hand
    c = rw_eval.score_texts(model, tokenizer, [(r["prompt"], r["chosen"]) for r in rows], 512, 4)
    r = rw_eval.score_texts(model, tokenizer, [(r["prompt"], r["rejected"]) for r in rows], 512, 4)
    assert result["pairs"]["accuracy"] == pytest.approx(sum(a > b for a, b in zip(c, r)) / 5)
    assert result["pairs"]["margin_mean"] == pytest.approx(sum(a - b for a, b in zip(c, r)) / 5, abs=1e-5)


def test_eval_unescape():
    from step2_reward.eval import parse_args, unescape

    assert unescape("a\\n\\tb\\\\n\\x") == "a\n\tb\\n\\x"
    args = parse_args(["--model_name_or_path", "m", "--prompt", "p\\n", "--response", "r", "--raw_text"])
    assert args.groups == [("p\\n", ["r"])]


def test_eval_cli_errors(tiny_gpt2, tiny_gpt2_reward, tmp_path):
    from step2_reward import eval as rw_eval
    from utils.models.loading import ModelLoadError

    path = tiny_gpt2_reward
    with pytest.raises(ModelLoadError, match="no value_head.safetensors"):  # an SFT/base directory is no RM
        rw_eval.main(["--model_name_or_path", tiny_gpt2, "--prompt", "p", "--response", "r"])
    with pytest.raises(UsageError, match="--response must follow a --prompt"):
        rw_eval.parse_args(["--model_name_or_path", path, "--response", "x"])
    with pytest.raises(UsageError, match="give --prompt/--response texts and/or --pairs FILE"):
        rw_eval.parse_args(["--model_name_or_path", path])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "c", "rejected": "r"}\n{"prompt": "p", "chosen": "c"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        rw_eval.main(["--model_name_or_path", path, "--pairs", str(bad)])


def test_saving_uses_the_export_module_not_the_training_checkpoints():
    """utils.models.reward_model writes its directories through utils.models.export (gather, plain copy with LoRA
    merged); importing it loads nothing of the resumable training checkpoints."""
    import subprocess
    import sys

    code = (
        "import sys; import utils.models.reward_model; "
        "print('utils.models.export' in sys.modules, 'utils.train.checkpoint' in sys.modules)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True).stdout
    assert out.split() == ["True", "False"]
