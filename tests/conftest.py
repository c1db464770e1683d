"""Shared fixtures: tiny model directories (built once into .cache/tiny) and offline mode."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        'slow: launches processes or trains for seconds; `bash scripts/test.sh -m "not slow"` is the '
        "fast tier for the edit-test loop (CI runs everything)",
    )
    if os.environ.get("PYTEST_XDIST_WORKER"):  # scripts/test.sh's workers: two of them share the cores
        import torch

        torch.set_num_threads(1)  # 2 threads each oversubscribed 2 cores: the fast tier took 113 s, not 95


def pytest_collection_modifyitems(config, items):
    """On scripts/test.sh's workers: the files with slow tests first (each file's tests stay together, in order, so
    a module's fixtures are built once). pytest-xdist's worksteal hands each worker a contiguous half and an idle
    worker steals the back of the other's queue: the launches then run beside fast tests, and the run ends on
    fast tests rather than on a 40 s launch with the other worker idle."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with_slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in with_slow)  # stable


@pytest.fixture(scope="module", autouse=True)
def _zero3_flag_ends_with_its_module():
    """A ZeRO-3 model built in this process sets transformers' global ZeRO-3 flag, which stays while the model
    lives (a module's fixture, or garbage not yet collected); any model another module's test then builds with
    `from_pretrained`/`from_config` came out partitioned (empty weights, "Padding_idx must be within
    num_embeddings"). Which module ran before which is decided by the workers' stealing, so the flag is cleared
    when its module ends."""
    yield
    if "transformers.integrations.deepspeed" in sys.modules:
        sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()


@pytest.fixture(autouse=True)
def _release_output_dir_locks():
    """An in-process run that stopped early keeps its output directory's lock (utils/train/output_dir.py) until the
    process exits; here that is the test session, so a later test or subprocess would find it taken."""
    yield
    from utils.train.output_dir import release

    release()


@pytest.fixture(scope="session")
def tiny_gpt2() -> str:
    from utils.models.tiny import make_tiny_model_cached

    return make_tiny_model_cached("gpt2")


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    from utils.models.tiny import make_tiny_model_cached

    return make_tiny_model_cached("llama")


@pytest.fixture(scope="session")
def tiny_opt() -> str:
    from utils.models.tiny import make_tiny_model_cached

    return make_tiny_model_cached("opt")


def _tiny_reward_model_dir(model_dir: str, out_dir: str) -> str:
    """A step-2-like reward-model directory of a tiny model (utils.models.reward_model.make_reward_model_dir):
    tests that used the plain model as step 3's critic see the same numbers."""
    from utils.models.reward_model import make_reward_model_dir

    return make_reward_model_dir(model_dir, out_dir)


@pytest.fixture(scope="session")
def tiny_gpt2_reward(tiny_gpt2, tmp_path_factory) -> str:
    """Reward-model directory of tiny_gpt2 (for step 3's --critic_model_name_or_path, the evaluation)."""
    return _tiny_reward_model_dir(tiny_gpt2, str(tmp_path_factory.mktemp("tiny_reward") / "gpt2"))


@pytest.fixture(scope="session")
def tiny_llama_reward(tiny_llama, tmp_path_factory) -> str:
    """Reward-model directory of tiny_llama (for step 3's --critic_model_name_or_path, the evaluation)."""
    return _tiny_reward_model_dir(tiny_llama, str(tmp_path_factory.mktemp("tiny_reward") / "llama"))


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> str:
    """tiny_llama's twin with a ChatML template whose end-of-turn token `<|im_end|>` is not EOS."""
    from utils.models.tiny import make_tiny_model

    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tiny_chat") / "llama"), chat=True)


@pytest.fixture(scope="session")
def tiny_chat_llama_reward(tiny_chat_llama, tmp_path_factory) -> str:
    return _tiny_reward_model_dir(tiny_chat_llama, str(tmp_path_factory.mktemp("tiny_chat_reward") / "llama"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    """The real SmolLM2-135M-Instruct tokenizer (ChatML, EOS = `<|im_end|>`), from the embedded default model:
    its converted directory when there is one, else the GGUF's tokenizer alone (4 s instead of the weights'
    ~25 s conversion, which no test needs)."""
    from utils.models.default import convert_tokenizer, default_model_dir, is_complete
    from utils.models.loading import load_tokenizer

    path = default_model_dir()
    if not is_complete(path):
        path = str(tmp_path_factory.mktemp("smollm2_tokenizer"))
        convert_tokenizer(path, with_config=True)
    return load_tokenizer(path)
