"""Model-directory builders: tiny random models (gpt2/llama/opt) and the converted default SmolLM2."""

import json
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from utils.models import default as default_model
from utils.models.tiny import ARCHS, make_tiny_model, make_tiny_model_cached
from utils.models.tiny import main as tiny_main


def mask_positions(attention_mask):
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, str(root / arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    out = {}
    for arch, path in tiny_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        out[arch] = (model, AutoTokenizer.from_pretrained(path))
    return out


def batch(tokenizer):
    """Two prompts of different lengths, left padded."""
    tokenizer.padding_side = "left"
    enc = tokenizer(["Hello world, this is a test.", "Hi"], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_dir_reloads_with_consistent_tokens(arch, tiny_dirs, loaded):
    path = tiny_dirs[arch]
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    model, tok = loaded[arch]
    assert model.config.model_type == arch
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<pad>"
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) == 50258
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)
    assert model.get_output_embeddings().weight.shape[0] >= len(tok)
    for cfg in (model.config, model.generation_config):
        assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (
            tok.eos_token_id,
            tok.pad_token_id,
            tok.bos_token_id,
        )
    assert tok.model_max_length == 512
    assert tok("hello world").input_ids == [31373, 995]  # real GPT-2 BPE ids
    assert tok.decode(tok("Some text.").input_ids) == "Some text."


def test_dropout_defaults(tiny_dirs):
    gpt2 = AutoConfig.from_pretrained(tiny_dirs["gpt2"])
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop) == (0.1, 0.1, 0.1)
    assert AutoConfig.from_pretrained(tiny_dirs["llama"]).attention_dropout == 0.0
    llama = AutoConfig.from_pretrained(tiny_dirs["llama"])
    assert llama.num_attention_heads % llama.num_key_value_heads == 0
    opt = AutoConfig.from_pretrained(tiny_dirs["opt"])
    assert opt.dropout == 0.1 and opt.word_embed_proj_dim == opt.hidden_size
    assert gpt2.n_positions == opt.max_position_embeddings == llama.max_position_embeddings == 512


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_accepts_mask_and_position_ids(arch, loaded):
    model, tok = loaded[arch]
    ids, mask = batch(tok)
    assert (mask == 0).any()  # really padded
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with_pos = model(input_ids=ids, attention_mask=mask, position_ids=mask_positions(mask), use_cache=False).logits
    for logits in (plain, with_pos):
        assert logits.shape == (*ids.shape, model.config.vocab_size)
        assert torch.isfinite(logits).all()


def test_gpt2_positions_are_absolute(loaded):
    """Shifting every position changes GPT-2's logits (learned absolute wpe) ..."""
    model, tok = loaded["gpt2"]
    ids = tok(["The quick brown fox jumps"], return_tensors="pt").input_ids
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        b = model(input_ids=ids, position_ids=pos + 7, use_cache=False).logits
    assert not torch.allclose(a, b, atol=1e-4)


def test_llama_rope_is_shift_invariant(loaded):
    """... while llama (RoPE, relative) is not changed by a uniform shift: why gpt2 is in the set."""
    model, tok = loaded["llama"]
    ids = tok(["The quick brown fox jumps"], return_tensors="pt").input_ids
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        b = model(input_ids=ids, position_ids=pos + 7, use_cache=False).logits
    assert torch.allclose(a, b, atol=1e-4)


def test_seeded_builds_are_identical(tmp_path):
    a = load_file(os.path.join(make_tiny_model("llama", str(tmp_path / "a"), seed=3), "model.safetensors"))
    b = load_file(os.path.join(make_tiny_model("llama", str(tmp_path / "b"), seed=3), "model.safetensors"))
    c = load_file(os.path.join(make_tiny_model("llama", str(tmp_path / "c"), seed=4), "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_zero3_model_alive_in_the_process_does_not_empty_a_tiny_build(tmp_path):
    """A ZeRO-3 run in this process keeps transformers' global ZeRO-3 flag set while its models live (a
    module-scoped step-3 fixture, say); a tiny model built after it came out partitioned, its weights empty."""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from utils.runtime.distributed import init_distributed

    init_distributed()
    alive = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    weights = load_file(os.path.join(make_tiny_model("llama", str(tmp_path / "m"), seed=3), "model.safetensors"))
    assert is_deepspeed_zero3_enabled()  # the run's flag is back
    del alive
    assert not is_deepspeed_zero3_enabled()
    reference = load_file(os.path.join(make_tiny_model("llama", str(tmp_path / "r"), seed=3), "model.safetensors"))
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    assert all(t.numel() > 0 for t in weights.values())


def test_cli_sizes(tmp_path):
    out = str(tmp_path / "cli")
    tiny_main(["--arch", "gpt2", "--out", out, "--seed", "1", "--hidden", "32", "--layers", "1"])
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.n_embd, cfg.n_layer) == (32, 1)


def test_unknown_arch_rejected(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model("bert", str(tmp_path / "x"))


def test_cached_build_once_and_concurrently(tmp_path):
    root = str(tmp_path / "cache")
    results, errors = [], []

    def call():
        try:
            results.append(make_tiny_model_cached("opt", cache_root=root))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    path = results[0]
    assert path == os.path.join(root, "opt")
    assert sorted(os.listdir(root)) == ["opt"]  # no temp dirs left behind
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert make_tiny_model_cached("opt", cache_root=root) == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime  # not rebuilt
    AutoModelForCausalLM.from_pretrained(path)


DEFAULT_DIR = default_model.default_model_dir()


@pytest.mark.skipif(
    not default_model.is_complete(DEFAULT_DIR),
    reason="default model not converted (run `python -m utils.models.default`)",
)
def test_converted_default_model():
    assert default_model.ensure_default_model() == DEFAULT_DIR  # returns at once: already complete
    with open(os.path.join(DEFAULT_DIR, "config.json")) as f:
        raw = json.load(f)
    assert "quantization_config" not in raw
    config = AutoConfig.from_pretrained(DEFAULT_DIR)
    assert not hasattr(config, "quantization_config")
    tok = AutoTokenizer.from_pretrained(DEFAULT_DIR)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_DIR, dtype=torch.float32).eval()
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids, use_cache=False).logits
    assert torch.isfinite(logits).all()


def _stdout_of(code_or_args, env_extra=None):
    import subprocess
    import sys

    from tests.launch import ROOT, subprocess_env

    env = subprocess_env()
    env.update(env_extra or {})
    args = [sys.executable] + (["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_print_path_keeps_library_noise_off_stdout():
    """Scripts read `$(python -m ... --print_path)`: prints and fd-level writes must go to stderr."""
    out = _stdout_of(
        "import os; from utils.runtime.cache_dir import print_path_for_scripts as p; "
        "p(lambda: (print('noise'), os.write(1, b'fd noise\\n'), '/some/dir')[-1])"
    )
    assert out == "/some/dir\n"


@pytest.mark.slow
def test_tiny_model_cli_prints_only_the_folder_on_a_cold_cache(tmp_path):
    """CI regression: on a cold cache DeepSpeed's import warning landed in the captured path."""
    out = _stdout_of(["-m", "utils.models.tiny", "--arch", "gpt2", "--print_path"], {"RLHF_CACHE": str(tmp_path)})
    lines = out.splitlines()
    assert len(lines) == 1 and os.path.isdir(lines[0]) and lines[0].startswith(str(tmp_path)), out
