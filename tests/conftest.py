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


@pytest.fixture(scope="session")
def tiny_gpt2() -> str:
    from utils.tiny_model import make_tiny_model_cached

    return make_tiny_model_cached("gpt2")


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    from utils.tiny_model import make_tiny_model_cached

    return make_tiny_model_cached("llama")


@pytest.fixture(scope="session")
def tiny_opt() -> str:
    from utils.tiny_model import make_tiny_model_cached

    return make_tiny_model_cached("opt")
