"""Learned eviction: gate modules, TRIM-KV / global TRIM-KV / Locret policies, and the gate adapter format."""

import copy
import errno
import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import brute
import pytest
import torch
from fake_hub import FakeHub
from helpers import make_layer, random_positions, save_tiny_checkpoint, teacher_forced_logits, tiny_model
from safetensors.torch import load_file
from transformers import DynamicCache

import kvgates
from kvgates import AdapterError, BudgetCache, GateSet, GlobalRetentionGates, RetainingHeads, RetentionGates
from kvgates.gates.adapter import atomic_write, atomic_write_all
from kvgates.methods.dms import DecisionHeads
from kvgates.policies import Locret, TrimKV, TrimKVGlobal
from kvgates.policies.trimkv_global import global_keep
from kvgates.runtime.stats import AttnStats, Phase

KINDS = [RetentionGates, GlobalRetentionGates, RetainingHeads]


def zero_log_beta(gates):
    """Gates whose log beta is exactly 0 everywhere (beta = 1: keep everything)."""
    with torch.no_grad():
        for p in gates.parameters():
            p.zero_()
        for name, p in gates.named_parameters():
            if name.endswith("bias") and p.shape[-1] == gates.config.num_kv_heads:
                p.fill_(1e4)
    return gates


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_model("llama")


# ------------------------------------------------------------------------------------------------ modules
def test_the_base_class_makes_no_fresh_gates(tiny_pair):
    """``GateSet.for_model(model)`` returned a gate set of kind ``""`` without a module, which saved as an adapter that
    no kvgates loads (``names gate kind ''``)."""
    _, model = tiny_pair
    message = r"^GateSet is the base of the gate kinds and makes no gates; call for_model on one of them \(.*RetentionGates"
    with pytest.raises(TypeError, match=message):
        GateSet.for_model(model)


@pytest.mark.parametrize("hidden", [0, -3, 2.5, True])
def test_fresh_gates_refuse_a_width_no_gate_has(tiny_pair, hidden):
    """``gate_hidden=0`` was taken for the default width (and 2.5 failed inside ``nn.Linear``)."""
    with pytest.raises(ValueError, match=r"^gate_hidden must be a whole number of units, at least 1 \(None: the default\), got"):
        RetentionGates.for_model(tiny_pair[1], gate_hidden=hidden)
    assert RetentionGates.for_model(tiny_pair[1], gate_hidden=3).config.gate_hidden == 3


@pytest.mark.parametrize(
    "params, message",
    [
        # Saved an adapter load_gates refuses ("training_budget must be an integer or null, got 'x'; the file is corrupt").
        ({"training_budget": "x"}, "training_budget must be a whole number of tokens per KV head, at least 1 (None: not trained yet), got 'x'"),
        ({"training_budget": 0}, "training_budget must be a whole number of tokens per KV head, at least 1"),  # taken
        ({"init_bias": float("nan")}, "init_bias must be a finite number, got nan"),  # gates scoring NaN
        ({"init_bias": "x"}, "init_bias must be a finite number, got 'x'"),  # "could not convert string to float"
    ],
)
def test_fresh_gates_refuse_a_training_budget_or_bias_no_gate_has(tiny_pair, params, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        RetentionGates.for_model(tiny_pair[1], **params)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_fresh_gates_refuse_a_model_whose_layers_all_slide(family):
    """Mistral-7B-v0.1 and Phi-3-mini-4k declare a sliding window for every layer, none of which kvgates budgets:
    their gates had no layer and no parameter, saved an adapter no kvgates loads (``layer_ids must list ...``), and
    a training run stopped at its first loss with ``stack expects a non-empty TensorList``."""
    _, model = tiny_model(family, sliding_window=8)
    message = f"'{family}' has no full-attention layer (all layers use sliding or chunked attention), so there is no layer for gates"
    for cls in [*KINDS, DecisionHeads]:
        with pytest.raises(kvgates.UnsupportedModelError, match="^" + re.escape(message)):
            cls.for_model(model)


@pytest.mark.parametrize("cls", KINDS)
def test_fresh_gates_match_the_model(tiny_pair, cls):
    _, model = tiny_pair
    gates = cls.for_model(model, training_budget=64)
    assert gates.config.layer_ids == [0, 1, 2] and gates.config.fingerprint == kvgates.model_fingerprint(model)
    hidden = torch.randn(2, 5, 64)
    captured = (torch.randn(2, 5, 64), torch.randn(2, 5, 32), torch.randn(2, 5, 32)) if cls is RetainingHeads else hidden
    out = gates(1, captured)
    assert out.shape == (2, 5, 2)
    if cls is not RetainingHeads:
        assert torch.all(out <= 0) and torch.all(out > -1e-6)  # init bias 18: beta ~ 1


def test_zero_log_beta_with_room_reproduces_full_cache(tiny_pair):
    ref, model = tiny_pair
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = teacher_forced_logits(ref, DynamicCache(config=ref.config), ids, 24)
    for cls, name in [(RetentionGates, "trimkv"), (GlobalRetentionGates, "trimkv-global")]:
        gates = zero_log_beta(cls.for_model(model))
        with kvgates.make_policy(name, budget=64, gates=gates).attach(model) as policy:
            cache = BudgetCache(model.config, policy)
            got = teacher_forced_logits(model, cache, ids, 24)
            assert torch.all(cache.budget_layers[0].state["log_beta"][cache.budget_layers[0].valid] == 0)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_gate_scores_are_computed_from_the_layers_own_inputs(tiny_pair):
    """The log beta stored per slot is the gate applied to that token's normed hidden state."""
    _, model = tiny_pair
    gates = RetentionGates.for_model(model, init_bias=0.0)
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), TrimKV(budget=64, gates=gates).attach(model) as policy:
        cache = BudgetCache(model.config, policy)
        out = model(ids, past_key_values=cache, output_hidden_states=True)
        for layer_idx in range(3):
            normed = model.model.layers[layer_idx].input_layernorm(out.hidden_states[layer_idx])
            expected = gates(layer_idx, normed)[0].T  # [H_kv, T]
            layer = cache.layers[layer_idx]
            got = torch.gather(layer.state["log_beta"][0], 1, torch.argsort(layer.pos[0], -1))
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_retaining_heads_read_raw_qkv(tiny_pair):
    _, model = tiny_pair
    heads = RetainingHeads.for_model(model)
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), Locret(budget=64, gates=heads, stabilizers=2, local=2).attach(model) as policy:
        cache = BudgetCache(model.config, policy)
        out = model(ids, past_key_values=cache, output_hidden_states=True)
        attn = model.model.layers[2].self_attn
        normed = model.model.layers[2].input_layernorm(out.hidden_states[2])
        expected = heads(2, (attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)))[0].T
        torch.testing.assert_close(cache.layers[2].state["locret_score"][0, :, :10], expected, atol=1e-5, rtol=1e-5)


def test_hooks_are_removed_on_detach(tiny_pair):
    _, model = tiny_pair
    before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    policy = TrimKV(budget=8, gates=RetentionGates.for_model(model)).attach(model)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == before + 3
    policy.detach()
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == before


@pytest.mark.parametrize("cls,name", [(RetentionGates, "trimkv"), (GlobalRetentionGates, "trimkv-global"), (RetainingHeads, "locret")])
@pytest.mark.parametrize("gate_dtype", ["float32", "float16"])
def test_attach_and_detach_leave_the_callers_gates_unchanged(tiny_pair, cls, name, gate_dtype):
    """An evaluation in the middle of training must not freeze, cast or switch the mode of the gates it was given."""
    _, model = tiny_pair
    gates = cls.for_model(model, init_bias=2.0).train()
    before = {n: t.clone() for n, t in gates.state_dict().items()}

    def unchanged():
        assert gates.training and all(m.training for m in gates.modules())
        assert all(p.requires_grad and p.dtype == torch.float32 for p in gates.parameters())
        assert all(torch.equal(t, before[n]) for n, t in gates.state_dict().items())

    extra = {"stabilizers": 2, "local": 2} if name == "locret" else {}
    policy = kvgates.make_policy(name, budget=8, gates=gates, gate_dtype=gate_dtype, **extra).attach(model)
    unchanged()
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(0)), past_key_values=BudgetCache(model.config, policy))
    unchanged()
    policy.detach()
    unchanged()


@pytest.mark.parametrize("cls,name", [(RetentionGates, "trimkv"), (RetainingHeads, "locret")])
def test_gates_run_in_the_models_dtype_by_default(tiny_pair, cls, name):
    """``gate_dtype`` defaulted to float32: a bfloat16 model on a GPU ran float32 gates (Locret's prefill 1.33x a
    plain one on an H200, 1.05x with bfloat16 gates). By default the gates now run in the model's dtype: the
    caller's own on a float32 model, a bfloat16 copy on a bfloat16 one (which a forward of that model runs)."""
    _, model = tiny_pair
    gates = cls.for_model(model, init_bias=2.0)
    extra = {"stabilizers": 2, "local": 2} if name == "locret" else {}
    policy = kvgates.make_policy(name, budget=8, gates=gates, **extra)
    assert policy.gate_dtype == "auto"
    policy.attach(model)
    assert policy._running is gates
    policy.detach()
    half = copy.deepcopy(model).to(torch.bfloat16)
    policy.attach(half)
    assert policy._running is not gates and {p.dtype for p in policy._running.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in gates.parameters()} == {torch.float32}
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = BudgetCache(half.config, policy)
    with torch.no_grad():
        half(ids, past_key_values=cache)
    assert all(int(layer.held().max()) == 8 for layer in cache.budget_layers)
    policy.detach()
    pinned = kvgates.make_policy(name, budget=8, gates=gates, gate_dtype="float32", **extra).attach(half)
    assert pinned._running is gates  # float32 gates asked for by name: the caller's own
    pinned.detach()


def test_gate_dtype_refuses_a_dtype_it_does_not_know(tiny_pair):
    _, model = tiny_pair
    with pytest.raises(ValueError, match=r"^trimkv: gate_dtype must be one of \['auto', 'bfloat16', 'float16', 'float32'\], got 'fp8'$"):
        TrimKV(budget=8, gates=RetentionGates.for_model(model), gate_dtype="fp8")


def test_unattached_policy_fails_clearly(tiny_pair):
    _, model = tiny_pair
    policy = TrimKV(budget=8, gates=RetentionGates.for_model(model))
    with pytest.raises(RuntimeError, match="call policy.attach\\(model\\)"):
        model(torch.randint(1, 128, (1, 4)), past_key_values=BudgetCache(model.config, policy))


# ------------------------------------------------------------------------------------------------ decisions
def _stats():
    return AttnStats(phase=Phase.DECODE, new_slots=torch.zeros(2, 3, 1, dtype=torch.long))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [0, 3])
def test_trimkv_decisions_match_brute_force(tiny_pair, seed, window):
    _, model = tiny_pair
    policy = TrimKV(budget=9, window=window, gates=RetentionGates.for_model(model))
    layer = make_layer(policy, random_positions(2, 3, 24, held=18, seed=seed))
    layer.state["log_beta"] = -torch.rand(2, 3, 24, generator=torch.Generator().manual_seed(seed))
    keep = policy.select(layer, _stats(), 9)
    t = layer.pos.amax(dim=(1, 2))
    for b in range(2):
        for h in range(3):
            lbs = {int(p): float(x) for p, x in zip(layer.pos[b, h].tolist(), layer.state["log_beta"][b, h].tolist()) if p >= 0}
            assert set(layer.pos[b, h][keep[b, h]].tolist()) == brute.trimkv(lbs, int(t[b]), 9, window)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window,min_per_head", [(0, 1), (2, 3)])
def test_trimkv_global_decisions_match_brute_force(seed, window, min_per_head):
    g = torch.Generator().manual_seed(seed)
    layers = [random_positions(2, 3, 20, held=int(torch.randint(5, 20, (1,), generator=g)), seed=seed * 10 + i) for i in range(3)]
    log_beta = [-torch.rand(2, 3, 20, generator=g) for _ in range(3)]
    t = torch.stack([p.amax(dim=(1, 2)) for p in layers]).amax(0)
    scores = [torch.where(p >= 0, (t[:, None, None] - p) * lb, torch.full_like(lb, float("-inf"))) for p, lb in zip(layers, log_beta)]
    from kvgates.policies.selection import topk_mask

    forced = []
    for p, s in zip(layers, scores):
        valid = p >= 0
        recent = topk_mask(p, window, valid)
        forced.append(recent | topk_mask(s, min_per_head, valid, p))
    keeps = global_keep(scores, [p >= 0 for p in layers], forced, layers, total=30)
    for b in range(2):
        heads = [({int(q): float(x) for q, x in zip(p[b, h].tolist(), lb[b, h].tolist()) if q >= 0}, int(t[b]))
                 for p, lb in zip(layers, log_beta) for h in range(3)]
        expected = brute.trimkv_global(heads, 30, window, min_per_head)
        got = [set(p[b, h][k[b, h]].tolist()) for p, k in zip(layers, keeps) for h in range(3)]
        assert got == expected


def test_trimkv_global_refuses_more_tokens_per_head_than_the_budget(tiny_pair):
    _, model = tiny_pair
    gates = GlobalRetentionGates.for_model(model)
    with pytest.raises(ValueError, match=r"window \(4\) \+ min_per_head \(6\) must fit the budget \(8\)"):
        TrimKVGlobal(budget=8, gates=gates, window=4, min_per_head=6)
    with pytest.raises(ValueError, match=r"window \(0\) \+ min_per_head \(20\) must fit the budget \(8\)"):
        TrimKVGlobal(budget=8, gates=gates, min_per_head=20)  # was taken, and every head then held 20 tokens


def test_trimkv_global_runs_within_the_global_budget(tiny_pair):
    _, model = tiny_pair
    gates = GlobalRetentionGates.for_model(model, init_bias=0.0)
    with torch.no_grad():
        gates.shared.bias.copy_(torch.tensor([4.0, -4.0]))  # KV head 0 retains, head 1 forgets fast
    with TrimKVGlobal(budget=8, gates=gates, min_per_head=2).attach(model) as policy:
        cache = BudgetCache(model.config, policy)
        teacher_forced_logits(model, cache, torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(3)), 30)
    held = cache.held_tokens()  # [layers, B, H_kv]
    assert int(held.sum((0, 2)).max()) <= 8 * 3 * 2 and int(held.min()) >= 2
    assert all(len(set(layer.head_slots)) > 1 for layer in cache.budget_layers)  # ragged: storage follows the allocation
    assert bool((held[:, :, 0] > held[:, :, 1]).all())


def test_locret_with_chunked_prefill(tiny_pair):
    _, model = tiny_pair
    with Locret(budget=12, gates=RetainingHeads.for_model(model), stabilizers=3, local=4).attach(model) as policy:
        out = model.generate(
            torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(4)),
            past_key_values=(cache := BudgetCache(model.config, policy)), prefill_chunk_size=16, max_new_tokens=5, do_sample=False,
        )
    assert out.shape[1] == 65
    assert int(cache.held_tokens().max()) <= 12 + 4  # the last chunk's eviction, then 4 decode tokens appended


# ------------------------------------------------------------------------------------------------ adapter format
@pytest.mark.parametrize("cls", KINDS)
def test_save_load_round_trip_is_bit_exact(tiny_pair, tmp_path, cls):
    _, model = tiny_pair
    gates = cls.for_model(model, training_budget=64)
    gates.config.results["needle@64"] = "7/10"
    gates.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = GateSet.from_pretrained(tmp_path)
    assert type(loaded) is cls and loaded.config == gates.config
    for (n1, a), (n2, b) in zip(gates.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    card = (tmp_path / "README.md").read_text()
    assert "base_model:" in card and "needle@64" in card


@pytest.mark.parametrize("failing", ["README.md", "config.json"])
def test_a_save_interrupted_while_writing_leaves_the_old_adapter_whole(tiny_pair, tmp_path, monkeypatch, failing):
    """Replacing an adapter, a Ctrl-C (or an error) while its card or config is written left the new weights (and
    config) beside the old config and card: it loaded, the new gates under the old results. Every file is now
    written before any replaces its old one."""
    _, model = tiny_pair
    old = RetentionGates.for_model(model, training_budget=64)
    old.config.results["needle@64"] = "7/10"
    old.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    new = RetentionGates.for_model(model, training_budget=32)
    with torch.no_grad():
        next(new.parameters()).add_(1.0)
    write_text = type(tmp_path).write_text

    def interrupted(path, text, *args, **kwargs):
        if f".{failing}." in path.name:  # its temporary file
            raise KeyboardInterrupt
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing replaced, no temporary file left
    assert GateSet.from_pretrained(tmp_path).config == old.config


@pytest.mark.parametrize("replacing", [True, False])
def test_a_save_interrupted_between_its_moves_undoes_the_moves_made(tiny_pair, tmp_path, monkeypatch, replacing):
    """Once every file was written, they were moved into place one by one: a Ctrl-C (or a failed move: a folder where
    the card goes) between two moves left the new weights beside the old config and card. The moves made are now
    undone: the old files are put back, and the files of a first save removed."""
    _, model = tiny_pair
    if replacing:
        old = RetentionGates.for_model(model, training_budget=64)
        old.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    new = RetentionGates.for_model(model, training_budget=32)
    with torch.no_grad():
        next(new.parameters()).add_(1.0)
    replace, moves = os.replace, []

    def interrupted(src, dst, *args, **kwargs):
        moves.append(dst)
        if len(moves) == 2:
            raise KeyboardInterrupt
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # as it was, no temporary file left
    (tmp_path / "README.md").unlink(missing_ok=True)
    (tmp_path / "README.md").mkdir()  # a move that fails on its own
    with pytest.raises(OSError):
        new.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == {k: v for k, v in before.items() if k != "README.md"}


def _move_files(paths: list, monkeypatch, interrupt_after: int | None = None, interrupt_before: int | None = None) -> None:
    """``atomic_write_all`` of ``paths`` (each to 'new'), a Ctrl-C raised as the ``interrupt_after``-th move returns (the
    file moved: a signal that arrives during the system call is raised then) or before the ``interrupt_before``-th."""
    replace, moves = os.replace, []

    def interrupted(src, dst, *args, **kwargs):
        moves.append(dst)
        if len(moves) == interrupt_before:
            raise KeyboardInterrupt
        replace(src, dst, *args, **kwargs)
        if len(moves) == interrupt_after:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", interrupted)
        atomic_write_all([(path, lambda tmp: Path(tmp).write_text("new")) for path in paths])


def test_a_ctrl_c_raised_as_a_move_returns_undoes_that_move_too(tmp_path, monkeypatch):
    """A Ctrl-C that arrives while a file is moved into place is raised as the move returns: that move was not undone
    with the others (it was recorded after it), its new file left beside the old others. Raised as the last move
    returns, the save is whole: nothing is undone (no old file is kept aside for the last move)."""
    paths = [tmp_path / name for name in ("a", "b", "c")]
    for path in paths:
        path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        _move_files(paths, monkeypatch, interrupt_after=2)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"] and [p.read_text() for p in paths] == ["old"] * 3
    with pytest.raises(KeyboardInterrupt):
        _move_files(paths, monkeypatch, interrupt_after=3)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"] and [p.read_text() for p in paths] == ["new"] * 3


def _fails(code: int) -> Callable[..., None]:
    """A stand-in for a file operation that fails with ``OSError(code)``."""

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def test_a_save_keeps_no_copy_of_the_file_its_last_move_replaces(tmp_path, monkeypatch):
    """The old file is kept aside to undo its move should a later move fail: after the last move (and after
    ``atomic_write``'s only one) none is left to fail, yet its old file was kept aside too, copied where the file
    system makes no hard link (a trainer's whole checkpoint, each save), and the save failed where the copy did not
    fit."""
    monkeypatch.setattr(os, "link", _fails(errno.EPERM))
    monkeypatch.setattr(shutil, "copy2", _fails(errno.ENOSPC))
    path = tmp_path / "checkpoint.pt"
    path.write_text("old")
    atomic_write(path, lambda tmp: Path(tmp).write_text("new"))
    assert os.listdir(tmp_path) == ["checkpoint.pt"] and path.read_text() == "new"


@pytest.mark.parametrize(("dangling", "hard_links"), [(False, True), (False, False), (True, True)])
def test_an_undone_save_puts_a_symlink_back_as_a_symlink(tmp_path, monkeypatch, dangling, hard_links):
    """A file that was a symbolic link (a hub snapshot's files are links into its blobs) came back from an undone move
    as a copy of the file it named where the file system makes no hard link (and as a hard link to it where
    ``os.link`` follows links, as its default asks), and a link naming no file not at all: the link itself is now
    kept aside and put back."""
    if not hard_links:
        monkeypatch.setattr(os, "link", _fails(errno.EPERM))
    store, folder = tmp_path / "store", tmp_path / "adapter"
    store.mkdir()
    folder.mkdir()
    if not dangling:
        (store / "a").write_text("old")
    (folder / "a").symlink_to(store / "a")
    (folder / "b").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        _move_files([folder / "a", folder / "b"], monkeypatch, interrupt_before=2)
    assert sorted(os.listdir(folder)) == ["a", "b"] and (folder / "a").is_symlink() and os.readlink(folder / "a") == str(store / "a")
    assert os.listdir(store) == ([] if dangling else ["a"]) and (folder / "b").read_text() == "old"


def test_adapter_files_get_the_permissions_of_any_written_file(tiny_pair, tmp_path):
    """Saved through temporary files, an adapter's files are still readable as the umask allows (mkstemp's files are
    owner-only: a trained adapter could not be read by another user of the machine)."""
    _, model = tiny_pair
    umask = os.umask(0o022)
    try:
        RetentionGates.for_model(model).save_pretrained(tmp_path / "gates")
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "gates").iterdir()}
    assert modes == {"README.md": 0o644, "config.json": 0o644, "model.safetensors": 0o644}, modes


def test_saving_the_same_weights_again_leaves_the_weights_file_as_it_is(tiny_pair, tmp_path):
    """safetensors orders header metadata at random: a re-save (re-shipping an adapter in place) must not change
    the file, whose digest keys the adapter's A/B results. Changed weights or dtype are written."""
    _, model = tiny_pair
    gates = RetentionGates.for_model(model)
    weights = gates.save_pretrained(tmp_path) / "model.safetensors"
    before = (weights.read_bytes(), weights.stat().st_ino)
    GateSet.from_pretrained(tmp_path).save_pretrained(tmp_path)
    assert (weights.read_bytes(), weights.stat().st_ino) == before
    gates.to(torch.float16).save_pretrained(tmp_path)
    assert weights.stat().st_ino != before[1] and load_file(weights)["gates.0.bias"].dtype == torch.float16
    with torch.no_grad():
        gates.gates[0].bias += 1
    gates.save_pretrained(tmp_path)
    assert torch.equal(load_file(weights)["gates.0.bias"], gates.gates[0].bias)


@pytest.mark.parametrize("offline", [False, True])
def test_push_and_pull_through_a_local_hub(tiny_pair, tmp_path, monkeypatch, offline):
    """Through the local Hub of the tests, also on a machine set offline (HF_HUB_OFFLINE=1 failed both ways)."""
    import huggingface_hub.constants

    _, model = tiny_pair
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    gates = RetentionGates.for_model(model)
    with FakeHub() as hub:
        url = gates.push_to_hub("team/tiny-trimkv", endpoint=hub.url, token="hf_test")
        assert "/team/tiny-trimkv/commit/" in url
        assert sorted(hub.repos["team/tiny-trimkv"]) == ["README.md", "config.json", "model.safetensors"]
        hub.repos["team/tiny-trimkv"]["original/other.pth"] = b"not the adapter's"
        pulled = RetentionGates.from_pretrained("team/tiny-trimkv", endpoint=hub.url, token="hf_test")
        assert hub.unhandled == []
    assert all(torch.equal(a, b) for a, b in zip(gates.state_dict().values(), pulled.state_dict().values()))
    assert not list((tmp_path / "hf").rglob("other.pth"))  # a kind's files only (every subfolder's were fetched)


def test_a_models_hub_id_or_folder_is_named_a_model_before_any_of_its_weights_download(tmp_path, monkeypatch):
    """``GateSet.from_pretrained("meta-llama/Llama-3.1-8B-Instruct")`` downloaded every file in a subfolder (16 GB of
    ``original/consolidated.00.pth`` on the real repository), then said there was no model.safetensors."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    config = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with FakeHub() as hub:
        hub.repos["org/model"] = {"config.json": config.encode(), "model.safetensors": b"w", "original/consolidated.00.pth": b"w"}
        hub.commits["org/model"] = "0" * 40
        with pytest.raises(AdapterError, match=r"^org/model/config.json is the config of a model \(llama\), not of a kvgates gate adapter;"):
            GateSet.from_pretrained("org/model", endpoint=hub.url)
    assert sorted(p.name for p in (tmp_path / "hf").rglob("*") if p.is_symlink()) == ["config.json"]
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text(config)  # sharded weights: "has no model.safetensors" came first
    with pytest.raises(AdapterError, match=r"folder/config.json is the config of a model \(llama\), not of a kvgates gate adapter;"):
        GateSet.from_pretrained(tmp_path / "folder")


def test_unreachable_hub_id_is_a_clear_error_that_names_the_shipped_adapters(tmp_path, monkeypatch):
    """A name that is no folder, no shipped adapter and not on the Hub (a mistyped shipped name, say) is refused in
    one sentence that lists the names that load offline (before, it did not say they exist)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with FakeHub() as hub, pytest.raises(AdapterError, match="could not be fetched from the Hub") as err:
        GateSet.from_pretrained("smollm2-135m-trimkvv", endpoint=hub.url)
    assert "a shipped adapter's name (smollm2-135m-dms, " in str(err.value) and "smollm2-135m-trimkv," in str(err.value)


def test_a_hub_id_is_refused_at_once_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    """``kvgates generate --gates user/name`` with no network retried the config's download for half a minute, with a
    line on stderr for each retry, before its one sentence: an id not in the local cache asks the Hub once and no
    download starts."""
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # (a lent GPU machine sets it)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kwargs: pytest.fail("a download (with its retries) started"))
    with socket.socket() as closed:  # a port nothing listens on: every connection is refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    refusal = r"^no local folder 'user/gates' and the Hub cannot be reached \(ConnectError\); pass"
    with pytest.raises(AdapterError, match=refusal):
        GateSet.from_pretrained("user/gates", endpoint=endpoint)
    # With HF_HUB_OFFLINE set the Hub is not asked, and the sentence names the setting (not 'OfflineModeIsEnabled').
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: pytest.fail("the Hub was asked"))
    offline = r"^no local folder 'user/gates' and it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; pass"
    with pytest.raises(AdapterError, match=offline):
        GateSet.from_pretrained("user/gates", endpoint=endpoint)


def test_fingerprint_mismatch_is_refused(tiny_pair):
    _, model = tiny_pair
    _, other = tiny_model("llama", seed=1)  # same shapes, other weights
    gates = RetentionGates.for_model(model)
    with pytest.raises(AdapterError, match="trained for .* not for this model"):
        TrimKV(budget=8, gates=gates).attach(other)
    TrimKV(budget=8, gates=gates, strict=False).attach(other).detach()  # same shapes: allowed when asked
    _, wider = tiny_model("llama", num_key_value_heads=4)
    with pytest.raises(AdapterError, match="do not fit"):
        TrimKV(budget=8, gates=gates, strict=False).attach(wider)


def test_gates_made_on_any_load_of_a_model_attach_to_its_other_loads(tiny_pair):
    """Training on CUDA loads the frozen model in bfloat16 (model_dtype auto) or float16 (``model_dtype: float16``),
    ``kvgates generate`` in float32: the fingerprint is the same for all three loads of one checkpoint (a float16
    run's gates were refused by the float32 and bfloat16 models), while other weights, even a small step away (a
    fine-tune's), are still told apart."""
    _, model = tiny_pair
    loads = [model, copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(model).to(torch.float16)]
    assert len({kvgates.model_fingerprint(m) for m in loads}) == 1
    for made_on in loads:
        gates = RetentionGates.for_model(made_on)
        for other in loads:
            gates.check_model(other)
    _, other = tiny_model("llama", seed=1)
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        for p in nudged.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
    assert kvgates.model_fingerprint(model) not in {kvgates.model_fingerprint(other.to(torch.float16)), kvgates.model_fingerprint(nudged)}


@pytest.mark.parametrize("version", [1, 2])
def test_an_adapter_of_an_earlier_format_version_checks_its_fingerprint_as_it_was_taken(tiny_pair, tmp_path, version):
    """Adapters written before the sign fingerprint (format version 3) recorded the weights as loaded (version 1) or
    rounded to bfloat16 (version 2, the shipped adapters): they still attach to that model, and to no other weights."""
    import dataclasses

    _, model = tiny_pair
    gates = RetentionGates.for_model(model)
    gates.config = dataclasses.replace(gates.config, version=version, fingerprint=kvgates.model_fingerprint(model, version))
    gates.save_pretrained(tmp_path / "old")
    old = kvgates.load_gates(tmp_path / "old")
    assert old.config.version == version and old.config.fingerprint != kvgates.model_fingerprint(model)
    old.check_model(model)
    _, other = tiny_model("llama", seed=1)
    with pytest.raises(AdapterError, match="trained for .* not for this model"):
        old.check_model(other)


def test_wrong_kind_for_policy(tiny_pair):
    _, model = tiny_pair
    with pytest.raises(ValueError, match="locret needs retaining-head gates"):
        Locret(budget=64, gates=RetentionGates.for_model(model))
    with pytest.raises(ValueError, match="gates are required"):
        TrimKV(budget=64)


def _edit(**fields):
    """A damage: ``config.json`` with ``fields`` changed (as a hand edit or a corrupt copy would)."""

    def damage(folder):
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))

    return damage


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:200]), "truncated or corrupt"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "truncated or corrupt"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "kind": "magic"})), "gate kind 'magic'"),
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "gate_hidden": 7})), "has shape"),
        (_edit(gate_hidden=10**12), "the config implies (2, 1000000000000)"),  # a RuntimeError from the allocator
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "version": 99})), "format version 99"),
        (lambda d: (d / "config.json").write_text(json.dumps({"kind": "retention"})), "lacks"),
        (_edit(num_kv_heads="three"), "num_kv_heads must be an integer, got 'three'"),
        (_edit(num_kv_heads=-1), "num_kv_heads must be at least 1, got -1"),
        (_edit(num_layers=None), "num_layers must be an integer, got None"),
        (_edit(head_dim=0), "head_dim must be at least 1, got 0"),
        (_edit(layer_ids=[0, 7]), "layer_ids must list distinct layers from 0 to num_layers - 1"),
        (_edit(activation="swishy"), "unknown activation 'swishy'"),
        (_edit(version="1"), "version must be an integer"),
        (_edit(version=0), "format version 0, which no kvgates wrote"),
        (_edit(kind=["retention"]), "kind must be a string"),
        (_edit(training_budget=0), "training_budget must be at least 1 (or null), got 0"),  # loaded; the card said budget=0
        (_edit(init_bias=float("nan")), "init_bias must be a finite number, got nan"),
    ],
)
def test_damaged_adapters_give_clear_errors(tiny_pair, tmp_path, damage, message):
    """Every damage is an ``AdapterError`` when the adapter is read, before any model is involved."""
    _, model = tiny_pair
    RetentionGates.for_model(model).save_pretrained(tmp_path)
    damage(tmp_path)
    with pytest.raises(AdapterError, match=re.escape(message)) as info:
        GateSet.from_pretrained(tmp_path)
    assert "\n" not in str(info.value)


def test_an_edited_activation_is_named_as_an_edit_not_another_model(tiny_pair, tmp_path):
    """``activation: tanh`` is valid on its own; against the very model the adapter was made for, the message says
    the config was edited rather than that the gates were trained for another model."""
    _, model = tiny_pair
    RetentionGates.for_model(model).save_pretrained(tmp_path)
    _edit(activation="tanh")(tmp_path)
    with pytest.raises(AdapterError, match=r"config does not fit it \(activation tanh vs silu\); the adapter's config.json is corrupt"):
        TrimKV(budget=8, gates=GateSet.from_pretrained(tmp_path)).attach(model)


def test_push_to_hub_without_a_hub_is_one_clear_error(tiny_pair, monkeypatch):
    import huggingface_hub

    _, model = tiny_pair
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="could not push the adapter to the Hub repository me/gates") as info:
        RetentionGates.for_model(model).push_to_hub("me/gates", token="hf_test")
    assert "\n" not in str(info.value)
    with pytest.raises(ConnectionError, match="could not push the adapter to the Hub repository me/gates"):
        RetentionGates.for_model(model).push_to_hub("me/gates", token="hf_test", endpoint="http://127.0.0.1:9")  # nothing listens


def test_a_bad_repository_id_is_named_as_such_not_as_the_network(tiny_pair):
    """``push_to_hub("bad id with spaces")`` was a HubPushError telling the user to check the network and token."""
    _, model = tiny_pair
    for repo_id in ("bad id with spaces", ""):
        with pytest.raises(ValueError, match=f"^{re.escape(repr(repo_id))} is not a Hub repository id") as info:
            RetentionGates.for_model(model).push_to_hub(repo_id, token="hf_test")
        assert not isinstance(info.value, ConnectionError)


def test_a_shipped_adapter_loads_in_the_precision_it_was_saved_in_and_saves_back_the_same(tmp_path):
    """Loaded into float32 modules, a shipped float16 adapter saved again was twice the size, under another weights
    digest (what A/B journals key an arm's results by): its results were neither matched nor reused."""
    from kvgates.gates.embedded import embedded_adapter_dir

    shipped = embedded_adapter_dir("smollm2-135m-trimkv")
    gates = kvgates.load_gates("smollm2-135m-trimkv")
    assert {p.dtype for p in gates.parameters()} == {torch.float16}
    gates.save_pretrained(tmp_path / "copy")
    assert kvgates.load_gates(tmp_path / "copy").loaded_digest == gates.loaded_digest
    assert (tmp_path / "copy" / "model.safetensors").stat().st_size == (shipped / "model.safetensors").stat().st_size


def test_saving_into_no_folder_a_file_or_another_kinds_adapter_is_refused(tiny_pair, tmp_path, monkeypatch):
    """``save_pretrained("")`` wrote the adapter into the current folder; a file was a FileExistsError; saving over a
    ``dms-lora`` adapter left its ``lora/`` beside the new kind's files."""
    _, model = tiny_pair
    gates = RetentionGates.for_model(model)
    monkeypatch.chdir(tmp_path)
    for folder, message in (("", "the folder name is empty"), (" ", "the folder name is empty")):
        with pytest.raises(AdapterError, match=message):
            gates.save_pretrained(folder)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterError, match="file is a file; name a folder to save the adapter in"):
        gates.save_pretrained(tmp_path / "file")
    with pytest.raises(AdapterError, match=rf"^{tmp_path / 'file'} is a file; name a folder to save the adapter in$"):
        gates.save_pretrained(tmp_path / "file" / "gates")  # (was: it holds a config.json that is not an adapter's)
    RetainingHeads.for_model(model).save_pretrained(tmp_path / "heads")
    before = {p.name: p.read_bytes() for p in (tmp_path / "heads").iterdir()}
    with pytest.raises(AdapterError, match="heads holds 'retaining-head' gates; save these 'retention' gates in another folder"):
        gates.save_pretrained(tmp_path / "heads")
    assert {p.name: p.read_bytes() for p in (tmp_path / "heads").iterdir()} == before
    gates.save_pretrained(tmp_path / "gates")
    gates.save_pretrained(tmp_path / "gates")  # the same kind again: replaced


def test_saving_into_a_model_folder_or_beside_another_config_json_is_refused_and_writes_nothing(tiny_pair, tmp_path):
    """``gates.save_pretrained(model_folder)`` replaced the model's config.json with the adapter's and its
    model.safetensors with the gates' weights: the model was gone and its folder held an adapter."""
    _, model = tiny_pair
    gates = RetentionGates.for_model(model)
    save_tiny_checkpoint(tmp_path / "model")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"name": "a tool\'s settings"}')
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_bytes(b"\xff\xfe")
    for folder, message in (
        ("model", r"model holds a llama model \(its config.json and weights\), which saving gates there would overwrite; save"),
        ("other", "other holds a config.json that is not a kvgates gate adapter's, which saving gates there would overwrite"),
        ("garbled", "garbled holds a config.json that is not a kvgates gate adapter's"),
    ):
        before = {p.name: p.read_bytes() for p in (tmp_path / folder).iterdir()}
        with pytest.raises(AdapterError, match=message):
            gates.save_pretrained(tmp_path / folder)
        assert {p.name: p.read_bytes() for p in (tmp_path / folder).iterdir()} == before
    kvgates.load_model(tmp_path / "model")  # the model is still there


@pytest.mark.parametrize("where", [None, 3, ["gates"]])
def test_loading_or_saving_an_adapter_at_what_is_no_path_is_one_sentence(tiny_pair, where):
    """``load_gates(None)``, ``GateSet.from_pretrained(3)`` and ``gates.save_pretrained(3)`` failed in pathlib
    ("expected str, bytes or os.PathLike object")."""
    _, model = tiny_pair
    name = type(where).__name__
    for load in (kvgates.load_gates, RetentionGates.from_pretrained):
        with pytest.raises(TypeError, match=rf"^path_or_id must be an adapter folder, a shipped adapter's name or a Hub .*, got {name}$"):
            load(where)
    with pytest.raises(TypeError, match=rf"^folder must be a folder's path \(a string or a path\), got {name}$"):
        RetentionGates.for_model(model).save_pretrained(where)


@pytest.mark.parametrize("kind", ["retention", "dms-lora"])
def test_an_adapter_saved_and_loaded_by_a_path_that_begins_with_a_tilde_is_in_the_home_folder(tiny_pair, tmp_path, monkeypatch, kind):
    """``gates.save_pretrained("~/gates")`` made a folder named ``~`` in the current folder (and ``load_gates`` read it
    back from there); where none was there, ``load_gates("~/gates")`` said it was neither a folder nor a Hub id."""
    from kvgates.gates import GATE_KINDS

    _, model = tiny_pair
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "work")
    gates = GATE_KINDS[kind].for_model(model)
    assert gates.save_pretrained("~/gates") == tmp_path / "home" / "gates"
    assert list((tmp_path / "work").iterdir()) == []
    assert (tmp_path / "home" / "gates" / "model.safetensors").is_file()
    loaded = kvgates.load_gates("~/gates")
    assert type(loaded) is type(gates) and all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), gates.state_dict().values()))


def test_a_tilde_path_of_no_user_is_a_folder_name_as_before_not_a_runtime_error(tiny_pair, tmp_path, monkeypatch):
    """``Path.expanduser`` raises ``RuntimeError("Could not determine home directory.")`` for ``~name`` where no user is
    so named: ``load_gates("~kvgates-no-such-user/gates")`` was that traceback where it was one sentence (neither a
    folder nor a Hub id), and ``save_pretrained`` of it one where it made the folder a shell would name so."""
    _, model = tiny_pair
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterError, match=r"^~kvgates-no-such-user/gates is neither an adapter folder nor a Hub repository id"):
        kvgates.load_gates("~kvgates-no-such-user/gates")
    saved = RetentionGates.for_model(model).save_pretrained("~kvgates-no-such-user/gates")
    assert str(saved) == "~kvgates-no-such-user/gates" and (tmp_path / saved / "config.json").is_file()
    assert kvgates.load_gates("~kvgates-no-such-user/gates").kind == "retention"


def test_a_config_json_cannot_hold_is_one_sentence_and_leaves_the_adapter_there_whole(tiny_pair, tmp_path):
    """Saving 16-wide gates with a numpy number in their results over 8-wide ones replaced the weights, then failed
    writing the config (a TypeError traceback): the folder held 16-wide weights under an 8-wide config and failed to
    load."""
    import numpy as np

    _, model = tiny_pair
    RetentionGates.for_model(model, gate_hidden=8).save_pretrained(tmp_path / "gates")
    before = {p.name: p.read_bytes() for p in (tmp_path / "gates").iterdir()}
    wider = RetentionGates.for_model(model, gate_hidden=16)
    wider.config.results = {"kl": np.float32(0.1)}
    for folder in (tmp_path / "gates", tmp_path / "new"):
        with pytest.raises(AdapterError, match=r"^the adapter's config cannot be written as JSON \(Object of type float32 is not JSON") as info:
            wider.save_pretrained(folder)
        assert "\n" not in str(info.value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "gates").iterdir()} == before and not (tmp_path / "new").exists()
    assert GateSet.from_pretrained(tmp_path / "gates").config.gate_hidden == 8


def test_the_cards_usage_carries_the_policy_settings_the_gates_were_trained_with(tiny_pair):
    """A DMS run trained with ``policy.window: 4``; its card said ``make_policy("dms", budget=24, gates=...)``, whose
    default window of 16 is not the one the gates learned with."""
    _, model = tiny_pair
    gates = RetentionGates.for_model(model, training_budget=24)
    gates.config.training = {"recipe": {"policy": {"window": 4, "buffer": 8}}}
    assert 'make_policy("trimkv", budget=24, gates="<this repo id or folder>", window=4, buffer=8)' in gates.model_card()


def test_the_cards_results_say_they_are_the_validation_splits(tiny_pair):
    """A card's "## Results" table is the training run's last validation at the training budget: it was given
    without saying so, beside the held-out table on the test split. An untrained adapter's card says nothing of it."""
    _, model = tiny_pair
    gates = RetentionGates.for_model(model, training_budget=24)
    assert "validation split" not in gates.model_card() and "| (none recorded yet) | |" in gates.model_card()
    gates.config.results = {"eval_kl": 0.5}
    card = gates.model_card()
    assert "## Results\n\nThe training run's last evaluation, on the validation split" in card
    assert "at the training budget:\n\n| metric | value |\n|---|---|\n| eval_kl | 0.5 |" in card


@pytest.mark.parametrize("kind", ["retention", "retention-global", "retaining-head", "kvzap-mlp", "dms", "dms-lora", "kvzap-linear"])
def test_the_card_gives_a_gate_width_only_to_gates_with_a_hidden_layer(tiny_pair, kind):
    """DMS's cards said "gate width 1" (a kvzap-linear card "gate width 512"): those gates are linear, ``Linear(d_model
    -> H_kv)``, and their config records a gate_hidden they never read. The shipped cards are what the code writes."""
    from kvgates.gates import GATE_KINDS
    from kvgates.gates.embedded import embedded_adapter_dir, embedded_adapters

    _, model = tiny_pair
    card = GATE_KINDS[kind].for_model(model, gate_hidden=8).model_card()
    if kind in ("dms", "dms-lora", "kvzap-linear"):
        assert "KV heads, linear gates (no hidden layer)." in card and "gate width" not in card
    else:
        assert "KV heads, gate width 8." in card
    for name in embedded_adapters():
        folder = embedded_adapter_dir(name)
        assert kvgates.load_gates(folder).model_card() == (folder / "README.md").read_text(), name


def test_the_card_of_gates_for_a_model_from_a_folder_loads_the_folder_and_names_no_base_model_to_the_hub(tiny_pair, tmp_path):
    """The card's usage said ``load_model("local:tiny")``, a name load_model refuses; its front matter said
    ``base_model: local:tiny``, which the Hub's card validation refuses (the push after training failed)."""
    path = save_tiny_checkpoint(tmp_path / "tiny")
    model, _ = kvgates.load_model(str(path))
    card = RetentionGates.for_model(model).model_card()
    assert 'kvgates.load_model("<the folder of tiny, the base model>")' in card and 'load_model("local:' not in card
    assert card.startswith("---\nlibrary_name: kvgates\ntags: [") and "base_model:" not in card
    hub_model = RetentionGates.for_model(model)
    hub_model.config.base_model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\ntags: [" in hub_model.model_card()


def test_loading_never_unpickles(tiny_pair, tmp_path, monkeypatch):
    _, model = tiny_pair
    RetentionGates.for_model(model).save_pretrained(tmp_path)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load (pickle) was called"))
    GateSet.from_pretrained(tmp_path)


def test_cli_generate_with_gates(tmp_path, capsys):
    from kvgates.cli import main

    checkpoint = save_tiny_checkpoint(tmp_path / "model")
    model, _ = kvgates.load_model(str(checkpoint))
    RetentionGates.for_model(model, training_budget=16).save_pretrained(tmp_path / "gates")
    code = main(["generate", "--model", str(checkpoint), "--policy", "trimkv", "--budget", "16",
                 "--gates", str(tmp_path / "gates"), "--prompt", "the lazy dog sleeps " * 6, "--max-new-tokens", "4"])
    assert code == 0 and "policy=trimkv" in capsys.readouterr().err


def test_the_default_adapter_is_the_one_trained_nearest_the_budget(tmp_path, monkeypatch):
    from kvgates.gates import embedded

    for name, budget in (("m-256", 256), ("m-128", 128)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"training_budget": budget}))
    monkeypatch.setattr(embedded, "EMBEDDED_DIR", tmp_path)
    monkeypatch.setattr(embedded, "DEFAULTS", {("m", "trimkv"): ("m-256", "m-128", "m-missing")})
    pick = lambda budget: embedded.default_gates("m", "trimkv", budget)  # noqa: E731
    assert [pick(b) for b in (32, 128, 180, 182, 256, 1024)] == ["m-128", "m-128", "m-128", "m-256", "m-256", "m-256"]
    assert pick(None) == "m-256" and embedded.default_gates("m", "locret", 128) is None


@pytest.mark.parametrize("kind", ["trimkv", "trimkv-global"])
def test_a_retention_gate_run_in_bfloat16_adds_its_bias_in_float32(kind):
    """A gate run in a bf16 model's dtype (``gate_dtype="auto"``) added its large bias (about 8 trained) in bfloat16,
    whose spacing there is 1/32: most of what the projection adds was rounded away, and ``log_beta`` was off by about
    1% (0.8% in the median on the shipped TRIM-KV gate). With the sum in float32 only the projection's own rounding
    is left."""
    from kvgates.gates.modules import GlobalRetentionTrunk, RetentionGate, SharedRetentionHead

    torch.manual_seed(0)
    if kind == "trimkv":
        gate = torch.nn.Sequential(RetentionGate(64, 3, 32, init_bias=7.8))
    else:
        gate = torch.nn.Sequential(GlobalRetentionTrunk(64, 32), SharedRetentionHead(3, 32, init_bias=7.8))
    for name, weight in gate.named_parameters():  # a projection that adds something to the bias
        if not name.endswith(".bias"):
            torch.nn.init.normal_(weight, std=0.05)
    hidden = torch.randn(4, 50, 64)
    with torch.no_grad():
        half = copy.deepcopy(gate).to(torch.bfloat16)
        got = half(hidden.bfloat16())
        want = copy.deepcopy(half).float()(hidden.bfloat16().float())  # the same (bf16-rounded) weights and input, in float32
    assert got.dtype == torch.float32
    assert ((got - want).abs() / want.abs()).median() < 1e-3  # (0.5-0.8% with the bias added in bfloat16)
