"""Model directories and chat templates are untrusted input: weights are read from safetensors
only (a pickled-only directory is refused with the one-liner that converts it), a directory naming its own
Python code (auto_map) needs --trust_remote_code and then finishes step 1, and a chat template renders in
transformers' Jinja sandbox under a time limit. Every refusal is one line naming the directory or the
template (no traceback); so are a directory without weights, --dtype fp16 on a CPU and an unmatched
--lora_module_name. In process, apart from one step-1 run."""

import io
import json
import os
import re
import shutil
import signal
import threading
import time

import pytest

from utils.errors import ProjectError

CUSTOM_CONFIG = "from transformers import GPT2Config\n\n\nclass TinyXConfig(GPT2Config):\n    model_type = 'tinyx'\n"
CUSTOM_MODEL = (
    "from transformers import GPT2LMHeadModel, GPT2Model\n\nfrom .configuration_tinyx import TinyXConfig\n\n\n"
    "class TinyXForCausalLM(GPT2LMHeadModel):\n    config_class = TinyXConfig\n\n\n"
    "class TinyXModel(GPT2Model):\n    config_class = TinyXConfig\n"
)
TEMPLATES = {  # each plants one way a template misbehaves, and what the one line must say
    "mro": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox refused"),
    "open": ("{{ open('/etc/passwd').read() }}", "'open' is undefined"),
    "raise": (
        "{{ raise_exception('Only user and assistant roles are supported!') }}",
        "raised an error: Only user and assistant roles are supported!",
    ),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "big_range": ("{% for i in range(10**6) %}{% endfor %}", "Range too big"),
}
# ~0.3 s: a thread past the limit is abandoned, and this one ends soon after instead of burning a core
SHORT_LOOP = "{% for i in range(100000) %}{% for j in range(10) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]


def one_line(exc) -> str:
    text = str(exc.value)
    assert isinstance(exc.value, ProjectError) and "\n" not in text, text
    return text


def copy_without_weights(src: str, dst) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", ".tiny_model_complete"))
    return str(dst)


@pytest.fixture(scope="module")
def custom_code_dir(tiny_gpt2, tmp_path_factory) -> str:
    """tiny_gpt2 as a model that ships its own code: config.json's auto_map names two .py files in the directory."""
    path = tmp_path_factory.mktemp("custom") / "tinyx"
    shutil.copytree(tiny_gpt2, path)
    (path / "configuration_tinyx.py").write_text(CUSTOM_CONFIG)
    (path / "modeling_tinyx.py").write_text(CUSTOM_MODEL)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="tinyx",
        architectures=["TinyXForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tinyx.TinyXConfig",
            "AutoModel": "modeling_tinyx.TinyXModel",
            "AutoModelForCausalLM": "modeling_tinyx.TinyXForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


# ------------------------------------------------------------------ weights


def test_a_pickled_only_directory_is_refused_with_a_conversion_that_works(tiny_gpt2, tmp_path):
    """transformers 5 always saves safetensors, so the .bin is written as its older save_pretrained did."""
    import torch
    from transformers import AutoModelForCausalLM

    from utils.models.loading import ModelLoadError, load_causal_lm
    from utils.models.reward_model import RewardModel

    path = copy_without_weights(tiny_gpt2, tmp_path / "bin")
    torch.save(AutoModelForCausalLM.from_pretrained(tiny_gpt2).state_dict(), os.path.join(path, "pytorch_model.bin"))
    for load in (load_causal_lm, RewardModel.from_pretrained):
        with pytest.raises(ModelLoadError) as exc:
            load(path)
        line = one_line(exc)
        assert "pytorch_model.bin" in line and "safe_serialization=True" in line and "weights_only=True" in line, line
    command = re.search(r'python -c "(.*)"', line).group(1)
    exec(command, {})  # the message's own one-liner converts the directory in place
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    assert load_causal_lm(path).config.n_embd == 64


def test_sharded_pickles_are_refused_before_anything_is_read(tiny_gpt2, tmp_path):
    from utils.models.loading import ModelLoadError, load_causal_lm

    path = copy_without_weights(tiny_gpt2, tmp_path / "shards")
    for name in (
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ):
        open(os.path.join(path, name), "w").close()  # empty: refused by name, never unpickled
    with pytest.raises(ModelLoadError) as exc:
        load_causal_lm(path)
    assert "pytorch_model-00001-of-00002.bin" in one_line(exc) and "save_pretrained" in one_line(exc)


def test_a_directory_with_a_config_but_no_weights_is_one_line(tiny_gpt2, tmp_path):
    from utils.models.loading import ModelLoadError, load_causal_lm

    path = copy_without_weights(tiny_gpt2, tmp_path / "empty")
    with pytest.raises(ModelLoadError) as exc:
        load_causal_lm(path)
    assert path in one_line(exc) and "has no weights (model.safetensors" in one_line(exc)


def test_the_evaluation_refuses_a_pickled_directory_before_loading_anything(tiny_gpt2, tmp_path, capsys):
    from step3_ppo.eval import main
    from utils.errors import run_main

    path = copy_without_weights(tiny_gpt2, tmp_path / "bin")
    open(os.path.join(path, "pytorch_model.bin"), "w").close()
    with pytest.raises(SystemExit) as exc:
        run_main(main, ["--sft_model", tiny_gpt2, "--rlhf_model", path, "--reward_model", tiny_gpt2])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "--rlhf_model directory" in err and "pickled" in err, err


# ------------------------------------------------------------------ custom code


def test_auto_map_is_refused_without_trust_remote_code(custom_code_dir):
    from utils.models.loading import ModelLoadError, load_causal_lm, load_tokenizer

    for load in (load_tokenizer, load_causal_lm):
        with pytest.raises(ModelLoadError) as exc:
            load(custom_code_dir)
        line = one_line(exc)
        assert "auto_map" in line and "modeling_tinyx.py" in line and "--trust_remote_code" in line, line
    assert type(load_causal_lm(custom_code_dir, trust_remote_code=True)).__name__ == "TinyXForCausalLM"


@pytest.mark.slow
def test_a_trusted_custom_code_model_finishes_step1(custom_code_dir, tmp_path):
    """The export's reload check loads the output with the run's --trust_remote_code (it was refused)."""
    from tests.launch import metrics, run_module, tail
    from tests.test_step1_run import common_args

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Human: word {i}\n\nAssistant:", "response": f" {i}"}) + "\n" for i in range(24))
    )
    out = str(tmp_path / "out")
    proc = run_module(
        "step1_sft.main",
        common_args(custom_code_dir, str(data), out, steps=1)
        + ["--trust_remote_code", "--per_device_train_batch_size", 4],
    )
    assert proc.returncode == 0, tail(proc)
    assert os.path.isfile(os.path.join(out, "modeling_tinyx.py"))
    assert [r["export/logits_max_abs_diff"] for r in metrics(out) if "export/logits_max_abs_diff" in r] == [0.0]


# ------------------------------------------------------------------ flags


def test_fp16_on_a_device_without_it_is_one_line_before_loading(tiny_gpt2):
    from deepspeed.accelerator import get_accelerator

    from utils.models.loading import ModelFlagError, load_causal_lm
    from utils.train.ds_config import train_ds_config

    if get_accelerator().is_fp16_supported():
        pytest.skip("this accelerator has fp16")
    with pytest.raises(ModelFlagError) as exc:
        load_causal_lm(tiny_gpt2, ds_config=train_ds_config(0, 1, 2, 1, "fp16", False, 1.0))
    assert one_line(exc).startswith("--dtype fp16 is not supported on this device")


def test_an_unmatched_lora_module_name_is_one_line(tiny_gpt2):
    from utils.models.loading import ModelFlagError, apply_lora, load_causal_lm

    with pytest.raises(ModelFlagError) as exc:
        apply_lora(load_causal_lm(tiny_gpt2), 2, "q_proj")
    assert "--lora_module_name 'q_proj' matches no Linear layer" in one_line(exc) and "c_attn" in one_line(exc)


# ------------------------------------------------------------------ chat templates


@pytest.fixture
def template_file(tiny_gpt2, tmp_path):
    """A tokenizer given `text` as its --chat_template file (load_tokenizer, as the steps do), and the file."""
    from utils.models.loading import load_tokenizer

    def make(text: str, name: str = "bad.jinja"):
        path = tmp_path / name
        path.write_text(text)
        return load_tokenizer(tiny_gpt2, chat_template=str(path)), str(path)

    return make


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_a_misbehaving_template_is_one_line_naming_its_file(case, template_file):
    """The installed transformers compiles templates in Jinja's ImmutableSandboxedEnvironment (no attribute
    escapes, no builtins, no mutation of its inputs); what it refuses, and what a template raises, is one line."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from utils.data.chat import ChatTemplateError, render

    assert isinstance(_compile_jinja_template("{{ messages }}").environment, ImmutableSandboxedEnvironment)

    tokenizer, path = template_file(TEMPLATES[case][0] + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ChatTemplateError) as exc:
        render(tokenizer, CHAT)
    assert path in one_line(exc) and TEMPLATES[case][1] in one_line(exc), one_line(exc)


def test_a_template_that_loops_is_stopped_at_the_time_limit(template_file, monkeypatch):
    from utils.data import chat

    monkeypatch.setattr(chat, "RENDER_TIME_LIMIT_S", 0.3)
    tokenizer, path = template_file(LOOP, "loop.jinja")
    handler = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(chat.ChatTemplateError) as exc:
        chat.render(tokenizer, CHAT)
    assert time.monotonic() - started < 5
    assert path in one_line(exc) and "ran past 0.3 s" in one_line(exc)
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_the_tokenizers_own_template_is_named_by_its_directory(tiny_gpt2):
    from utils.data.chat import ChatTemplateError, render
    from utils.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_gpt2)
    tokenizer.chat_template = TEMPLATES["raise"][0]
    with pytest.raises(ChatTemplateError) as exc:
        render(tokenizer, CHAT)
    assert one_line(exc).startswith(f"chat template of the tokenizer {tiny_gpt2} failed: the template raised")


def test_with_someone_elses_timer_running_the_limit_holds_and_their_timer_survives(template_file, monkeypatch):
    from utils.data import chat

    monkeypatch.setattr(chat, "RENDER_TIME_LIMIT_S", 0.05)
    tokenizer, path = template_file(SHORT_LOOP, "short_loop.jinja")
    fired = []

    def mine(signum, frame):
        fired.append(signum)

    old = signal.signal(signal.SIGALRM, mine)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        with pytest.raises(chat.ChatTemplateError, match="ran past 0.05 s"):
            chat.render(tokenizer, CHAT)  # timed by a thread: their SIGALRM timer is left alone
        assert 25 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30 and not fired
        assert signal.getsignal(signal.SIGALRM) is mine
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_off_the_main_thread_the_limit_and_the_one_line_hold(template_file):
    from utils.data import chat

    tokenizer, path = template_file(TEMPLATES["raise"][0], "raise.jinja")
    caught = []

    def render_off_main():
        try:
            chat.render(tokenizer, CHAT)
        except chat.ChatTemplateError as exc:
            caught.append(str(exc))

    thread = threading.Thread(target=render_off_main)
    thread.start()
    thread.join()
    assert len(caught) == 1 and path in caught[0] and "\n" not in caught[0]
    with pytest.raises(chat._RenderTimeout):  # the fallback's own clock (a sleep: no loop left burning a core)
        chat._call_in_thread(lambda: time.sleep(2), 0.1)


def test_chat_py_ends_on_a_bad_template_with_one_line(tiny_gpt2, tmp_path, monkeypatch, capsys):
    import chat as chat_cli
    from utils.errors import run_main

    path = tmp_path / "raising"
    shutil.copytree(tiny_gpt2, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATES["raise"][0]}))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    with pytest.raises(SystemExit) as exc:
        run_main(chat_cli.main, ["--model_name_or_path", str(path), "--template", "chat", "--device", "cpu"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 1 and "Traceback" not in err, err
    assert len(errors) == 1 and f"chat template of the tokenizer {path} failed" in errors[0], err


def test_a_missing_template_says_where_the_tools_read_one():
    """step3_ppo.eval, step2_reward.eval and prompt_eval have no --chat_template: the message says where they look."""
    from utils.data import DataError, require_template

    class NoTemplate:
        chat_template, name_or_path = None, "some/dir"

    with pytest.raises(
        DataError,
        match=r"--chat_template FILE .* the evaluation tools and chat\.py read it from the "
        r"model directory",
    ):
        require_template(NoTemplate())
