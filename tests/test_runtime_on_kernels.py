"""The runtime on the Triton kernels (KVGATES_KERNELS=triton) decides and computes exactly what it does on the
torch reference, with no change to policy code: on a GPU the model runs there; on CPU (CI) under the Triton
interpreter (TRITON_INTERPRET=1)."""

import copy
import os

import pytest
import torch
from helpers import policy_on, teacher_forced_logits

from kvgates import BudgetCache
from kvgates.runtime.launches import Launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
)


@pytest.fixture(scope="module")
def model(tiny):
    """The tiny kvgates model where the kernels run: the GPU when there is one."""
    return copy.deepcopy(tiny[1]).to(DEVICE)


#: KVzip's reconstruction forwards in chunks of 16 of the 34-token prompt (the Triton chunk kernel's layout).
PARAMS = {"kvzip": {"repeat_ids": [5, 6, 7], "chunk_size": 16}}


def run(model, name, budget, ids, backend, monkeypatch):
    monkeypatch.setenv("KVGATES_KERNELS", backend)
    torch.manual_seed(0)  # same fresh gates for learned policies on both backends
    with policy_on(model, name, budget, **PARAMS.get(name, {})) as policy:
        cache = BudgetCache(model.config, policy)
        logits = teacher_forced_logits(model, cache, ids, 24)
    return logits, cache


@pytest.mark.parametrize("name", ["h2o", "snapkv", "tova", "morphkv", "adakv", "trimkv", "trimkv-global", "kvzip"])
def test_same_decisions_and_logits_on_both_backends(model, name, monkeypatch):
    ids = torch.randint(1, 128, (2, 34), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ref_logits, ref_cache = run(model, name, 12, ids, "reference", monkeypatch)
    tri_logits, tri_cache = run(model, name, 12, ids, "triton", monkeypatch)
    torch.testing.assert_close(tri_logits, ref_logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(ref_cache.budget_layers, tri_cache.budget_layers):
        assert a.head_slots == b.head_slots
        assert torch.equal(torch.sort(a.pos, -1).values, torch.sort(b.pos, -1).values)


def test_kvzip_scores_a_padded_batch_alike_on_both_backends(model, monkeypatch):
    """KVzip's reconstruction forwards over a left-padded batch (its tokens reuse the padding's empty slots: no
    chunk layout) give the same scores and kept tokens on the Triton kernel as on the reference's tiles."""
    from kvgates.policies.kvzip import SCORE

    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("KVGATES_KERNELS", backend)
        with policy_on(model, "kvzip", 12, **PARAMS["kvzip"]) as policy, torch.no_grad():
            cache = BudgetCache(model.config, policy)
            model(ids, attention_mask=mask, past_key_values=cache)
        results[backend] = cache
    for a, b in zip(results["reference"].budget_layers, results["triton"].budget_layers):
        torch.testing.assert_close(b.state[SCORE], a.state[SCORE], atol=1e-5, rtol=1e-4)
        assert torch.equal(torch.sort(a.pos, -1).values, torch.sort(b.pos, -1).values)


@pytest.mark.parametrize("name", ["h2o", "d2o", "kvmerger"])
def test_column_sums_of_a_chunked_prompt_alike_on_both_backends(model, name, monkeypatch):
    """A prompt fed in chunks of 10 (``masked_attention_colsum``: each chunk over what the cache holds) gives the
    column sums H2O, D2O and KVMerger accumulate, and so the same decisions and logits, on both backends."""
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("KVGATES_KERNELS", backend)
        with policy_on(model, name, 24) as policy:
            cache = BudgetCache(model.config, policy)
            results[backend] = teacher_forced_logits(model, cache, ids, 34, chunk=10), cache
    (ref_logits, ref_cache), (tri_logits, tri_cache) = results["reference"], results["triton"]
    torch.testing.assert_close(tri_logits, ref_logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(ref_cache.budget_layers, tri_cache.budget_layers):
        assert torch.equal(torch.sort(a.pos, -1).values, torch.sort(b.pos, -1).values)


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv", "tova", "trimkv", "locret", "d2o", "kvzip"])
def test_a_prompt_forward_on_the_kernels_reads_back_as_often_at_any_depth(name, monkeypatch):
    """On the kernels (the GPU's path: the torch reference's tiles read back where the kernels do not), a prompt
    forward of these policies reads back as often at 6 layers as at 2: nothing a layer, where each read drains a GPU's
    queue and leaves the next launches unhidden. KVzip read twice a layer and scoring forward (whether its queries
    were all real; what each layer kept when its tokens were dropped)."""
    from helpers import tiny_model

    monkeypatch.setenv("KVGATES_KERNELS", "triton")
    ids = torch.randint(1, 128, (2, 34), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    reads = {}
    for layers in (2, 6):
        model = tiny_model("llama", num_hidden_layers=layers)[1].to(DEVICE)
        torch.manual_seed(0)
        with policy_on(model, name, 12, **PARAMS.get(name, {})) as policy, torch.no_grad(), Launches() as prompt:
            model(ids, past_key_values=BudgetCache(model.config, policy))
        reads[layers] = prompt.sync_ops
    assert reads[2] == reads[6]
