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


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M (slow tests only)."""
    import kvgates

    return kvgates.load_model("smollm2-135m")
