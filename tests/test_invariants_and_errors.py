"""Budgets hold after every eviction, sinks and windows survive, storage stays flat, bad input fails clearly."""

import dataclasses
import re
import typing

import numpy as np
import pytest
import torch
from helpers import LEARNED, POLICY_PARAMS, policy_kwargs, policy_on
from transformers import DynamicCache

import kvgates
from kvgates import POLICIES, BudgetCache, UnsupportedModelError, dynamic_cache_bytes, make_policy
from kvgates.typecheck import scalar_type

EVICTING = sorted(set(POLICIES) - {"full"})


def run_steps(model, cache, ids, prompt_len, check):
    with torch.no_grad():
        model(ids[:, :prompt_len], past_key_values=cache)
        check(cache, prompt_len)
        for t in range(prompt_len, ids.shape[1]):
            model(ids[:, t : t + 1], past_key_values=cache)
            check(cache, t + 1)


@pytest.mark.parametrize("name", EVICTING)
def test_every_layer_within_budget_after_every_step(tiny, name):
    _, model = tiny
    budget = 10
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(0))

    def check(cache, seen):
        grown = 0 if decode_evicts or seen == 30 else seen - 30  # appended since the prompt by prefill-only policies
        for layer in cache.budget_layers:
            held = layer.held()
            if layer.quota is not None:  # per head and sequence (Ada-KV's head budgets, D2O's layer budgets ...)
                assert bool((held <= layer.quota + grown).all())
            if cache.policy.name == "adakv":  # Ada-KV redistributes the layer total (rounding: < 1 per head)
                assert bool((held.sum(-1) <= (budget + 1 + grown) * layer.num_kv_heads).all())
        if cache.policy.name == "trimkv-global":  # one budget for every layer and head
            total = sum(layer.held().sum(-1) for layer in cache.budget_layers)
            assert int(total.max()) <= budget * len(cache.budget_layers) * cache.budget_layers[0].num_kv_heads
        assert cache.get_seq_length() == seen

    with policy_on(model, name, budget) as policy:
        decode_evicts = policy.schedule.decode_every > 0
        run_steps(model, BudgetCache(model.config, policy), ids, 30, check)


def test_streaming_llm_keeps_sinks_and_recent(tiny):
    _, model = tiny
    cache = BudgetCache(model.config, "streaming_llm", budget=8, sinks=3)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))

    def check(cache, seen):
        for layer in cache.budget_layers:
            for h in range(layer.num_kv_heads):
                kept = sorted(layer.pos[0, h][layer.pos[0, h] >= 0].tolist())
                assert kept == [0, 1, 2] + list(range(seen - 5, seen))

    run_steps(model, cache, ids, 20, check)


@pytest.mark.parametrize("name,window", [("h2o", "recent"), ("snapkv", "window"), ("pyramidkv", "window")])
def test_recent_window_always_kept(tiny, name, window):
    _, model = tiny
    cache = BudgetCache(model.config, name, **policy_kwargs(name, 12))
    w = getattr(cache.policy, window)
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(2))

    def check(cache, seen):
        for layer in cache.budget_layers:
            for h in range(layer.num_kv_heads):
                kept = set(layer.pos[0, h].tolist())
                assert set(range(seen - w, seen)) <= kept

    run_steps(model, cache, ids, 40, check)


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming_llm"])
def test_storage_is_flat_during_decode(tiny, name):
    _, model = tiny
    cache = BudgetCache(model.config, name, **policy_kwargs(name, 16))
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    sizes = []
    run_steps(model, cache, ids, 40, lambda c, seen: sizes.append(c.kv_bytes()))
    assert len(set(sizes)) == 1
    # budget + 1 slot of slack per head, 2 tensors, 3 layers, 2 KV heads, head_dim 16, float32
    assert sizes[0] == 3 * 2 * 2 * 17 * 16 * 4


def test_a_full_cache_holds_what_dynamic_cache_does_and_reports_held_bytes(tiny):
    """A cache that keeps everything holds DynamicCache's bytes; decode steps grow its storage geometrically (up to
    an eighth, at least 16 slots, allocated beyond what it holds); held and allocated bytes are reported apart."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(6))
    full, dynamic = BudgetCache(model.config, "full"), DynamicCache(config=model.config)
    snap = BudgetCache(model.config, "snapkv", budget=16, window=4, kernel=3)
    with torch.no_grad():
        for cache in (full, dynamic, snap):
            model(ids[:, :40], past_key_values=cache)
            for t in range(40, 60):
                model(ids[:, t : t + 1], past_key_values=cache)
    slot = 3 * 2 * 2 * 16 * 4 * 2  # one slot of every layer and KV head: K+V, head_dim 16, fp32, 2 sequences
    assert full.held_bytes() == dynamic_cache_bytes(dynamic) == 60 * slot
    assert full.kv_bytes() == (40 + 16 + 16) * slot  # the prompt exactly, then two decode growths of 16 slots
    assert snap.held_bytes() == int(snap.held_tokens().sum()) * 2 * 16 * 4 < snap.kv_bytes()  # K+V, head_dim, fp32

    snap.reset()
    assert snap.held_bytes() == snap.kv_bytes() == 0


def test_an_empty_cache_holds_no_tokens_of_no_sequence(tiny):
    """Before the first forward (and after ``reset()``) ``held_tokens()`` raised an AttributeError where
    ``held_bytes()`` and ``kv_bytes()`` said 0."""
    _, model = tiny
    cache = BudgetCache(model.config, "snapkv", budget=8, window=4)
    assert cache.held_tokens().shape == (3, 0, 2)
    with torch.no_grad():
        model(torch.randint(1, 128, (2, 12)), past_key_values=cache)
    assert cache.held_tokens().shape == (3, 2, 2)
    cache.reset()
    assert cache.held_tokens().shape == (3, 0, 2)

def test_prefill_chunks_bound_peak_memory(tiny):
    _, model = tiny
    cache = BudgetCache(model.config, "snapkv", budget=16, window=4, kernel=3)
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    peak = 0
    with torch.no_grad():
        for start in range(0, 200, 25):
            model(ids[:, start : start + 25], past_key_values=cache)
            peak = max(peak, max(layer.max_slots for layer in cache.budget_layers))
            assert int(cache.held_tokens().max()) <= 16
    # The largest storage ever allocated is what was held plus one chunk.
    assert peak <= 16 + 1 + 25


def test_phase_comes_from_what_the_cache_has_seen_not_from_the_query_length(tiny):
    _, model = tiny
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # A one-token prompt is a prompt: D2O allocates its layer budgets there and evicts during decode.
        cache = BudgetCache(model.config, "d2o", budget=6, sinks=2)
        for t in range(20):
            model(ids[:, t : t + 1], past_key_values=cache)
        assert int(cache.held_tokens().max()) == 6
        # A multi-token step once decoding has begun (speculative decoding) is a decode step: SnapKV appends it.
        cache = BudgetCache(model.config, "snapkv", budget=8, window=4, kernel=3)
        model(ids[:, :16], past_key_values=cache)
        model(ids[:, 16:17], past_key_values=cache)
        model(ids[:, 17:21], past_key_values=cache)
        assert cache.held_tokens().unique().tolist() == [8 + 1 + 4]
        # Prompt chunks before the first decode step stay prompt: each is compressed.
        cache = BudgetCache(model.config, "snapkv", budget=8, window=4, kernel=3)
        model(ids[:, :12], past_key_values=cache)
        model(ids[:, 12:20], past_key_values=cache)
        assert cache.held_tokens().unique().tolist() == [8]


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "name,params,message",
    [
        ("h2o", {"budget": 0}, "at least 1"),
        ("h2o", {"budget": -5}, "at least 1"),
        ("snapkv", {"budget": 2.5}, "integer"),
        ("streaming_llm", {"budget": 4, "sinks": 4}, "must be larger than sinks=4"),
        ("snapkv", {"budget": 32, "window": 32}, "observation window"),
        ("snapkv", {"budget": 16, "window": 40}, "observation window"),
        ("h2o", {"budget": 8, "recent": 8}, "recent window"),
        ("pyramidkv", {"budget": 8, "window": 10}, "observation window"),
        ("snapkv", {"budget": 64, "kernel": 4}, "odd"),
        ("h2o", {"budget": 64, "group_reduce": "median"}, "group_reduce"),
        ("full", {"budget": 64}, "takes no budget"),
        ("snapkv", {}, "budget is required"),
        ("adakv", {"budget": 64, "base_params": {"budget": 16}}, "base_params sets a budget; .* pass it as budget"),
        ("merge", {"budget": 64, "base_params": "window=8,budget=16"}, "base_params sets a budget"),
        # A wrapper's base said its own sentence as if it were the wrapper's (adakv at budget 8: "snapkv: budget 8 must be
        # larger than the observation window", with no window among adakv's parameters; around full: "takes no budget").
        ("adakv", {"budget": 8}, r"^adakv's base snapkv: budget 8 must be larger than the observation window .*base_params\)$"),
        ("adakv", {"budget": 64, "base": "full"}, "base 'full' evicts nothing, so there is nothing to wrap"),
        # A wrapper around a wrapper said the advice twice: "... kept (the base's parameters go in base_params) (the base's ...)".
        ("merge", {"budget": 8, "base": "adakv"}, r"^merge's base adakv's base snapkv: .* kept \(the base's parameters go in base_params\)$"),
        ("merge", {"budget": 64, "base": "full"}, "base 'full' evicts nothing"),
        ("d2o", {"budget": 64, "sinks": -1}, "sinks must be >= 0, got -1"),
        ("dynamickv", {"budget": 64, "r_max": float("nan")}, "r_max must be a finite number, got nan"),
        ("dynamickv", {"budget": 64, "r_max": float("inf")}, "r_max must be a finite number, got inf"),
        # Accepted and never read (decode never evicted; the merges were off), or NaN keys and logits (sigma):
        ("snapkv", {"budget": 64, "decode_every": 5}, "decode_every=5 spaces decode compressions, which run only with decode=True"),
        ("pyramidkv", {"budget": 64, "decode_every": 2}, "only with decode=True"),
        ("d2o", {"budget": 64, "merge": False, "beta": 0.5}, r"beta=0.5 would shape the merges, which merge=False turns off"),
        ("d2o", {"budget": 64, "merge": False, "merge_rule": "official"}, "merge_rule='official' would shape the merges"),
        ("kvmerger", {"budget": 64, "sigma": float("nan")}, "sigma must be a positive finite number, got nan"),
        ("kvmerger", {"budget": 64, "sigma": 0.0}, "sigma must be a positive finite number"),
        ("kvzip", {"budget": 64, "repeat_ids": [5, -3]}, r"repeat_ids must be a non-empty list of token ids \(whole numbers >= 0\)"),
    ],
)
def test_bad_policy_parameters(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_policy(name, **params)


@pytest.mark.parametrize("name", sorted(POLICY_PARAMS))
def test_a_policy_built_directly_with_a_parameter_of_the_wrong_type_says_so(name):
    """``SnapKV(budget=256, window="x")``, built directly (``make_policy`` checks types itself), failed with "'<' not
    supported between instances of 'str' and 'int'" from a check's comparison, ``window=2.5`` or ``True`` was
    taken, and ``decode="no"`` ran as ``decode=True``. Every ``int``, ``float`` and ``bool`` parameter of every policy
    says so in one sentence; a numpy integer or bool is taken as the int or bool it holds."""
    cls = POLICIES[name]
    hints = typing.get_type_hints(cls)
    scalars = {f.name: scalar_type(hints[f.name]) for f in dataclasses.fields(cls) if f.init and scalar_type(hints[f.name])}
    assert "budget" in scalars
    words = {int: "an integer", float: "a number", bool: "True or False"}
    for field, (kind, takes_none) in scalars.items():
        wanted = words[kind] + " or None" * takes_none
        bad_values = ["x", 1] if kind is bool else ["x", True] + [2.5] * (kind is int)
        for bad in bad_values + [None] * (not takes_none):
            message = rf"^{name}: {field} must be {wanted}, got {re.escape(repr(bad))}$"
            with pytest.raises(ValueError, match=message):
                cls(**{**policy_kwargs(name, 64), field: bad})
    if name not in LEARNED:  # (they need gates)
        plain = cls(**policy_kwargs(name, 64))
        as_numpy = {int: np.int64, bool: np.bool_}
        numpy = cls(**{k: as_numpy[type(v)](v) if type(v) in as_numpy else v for k, v in policy_kwargs(name, 64).items()})
        assert numpy == plain and all(type(getattr(numpy, f)) is type(getattr(plain, f)) for f in scalars)


@pytest.mark.parametrize("name", sorted(set(POLICY_PARAMS) - set(LEARNED)))
def test_a_policy_built_directly_takes_a_0d_tensor_or_array_as_the_number_it_holds(name):
    """``AdaKV(alpha=torch.tensor(0.2))`` was refused ("alpha must be a number") where ``budget=torch.tensor(64)`` was
    taken as 64 (and ``alpha`` was taken before its type was checked). A 0-d tensor or numpy array in any ``int``,
    ``float`` or ``bool`` parameter is the Python value it holds."""
    cls = POLICIES[name]
    hints = typing.get_type_hints(cls)
    plain = cls(**policy_kwargs(name, 64))
    values = {f.name: getattr(plain, f.name) for f in dataclasses.fields(cls) if f.init and scalar_type(hints[f.name])}
    values = {field: value for field, value in values.items() if value is not None}
    for wrap in (np.array, lambda value: torch.from_numpy(np.array(value))):  # (float64: the float the policy holds)
        built = cls(**{**policy_kwargs(name, 64), **{field: wrap(value) for field, value in values.items()}})
        assert built == plain and all(type(getattr(built, field)) is type(value) for field, value in values.items())


def test_a_policy_with_a_hint_that_cannot_be_resolved_is_built_and_its_numbers_checked(monkeypatch):
    """A policy of one's own whose field names a class imported only under ``TYPE_CHECKING`` (or local to a function, in
    a module of ``from __future__ import annotations``) could not be built at all: ``Policy._check_scalars`` read the
    class's hints with ``typing.get_type_hints``, a NameError for that name. Its other fields are checked as ever."""

    @dataclasses.dataclass
    class Helped(kvgates.Policy):
        name: typing.ClassVar[str] = "helped-test-policy"
        helper: "OnlyForTypeCheckers | None" = None  # noqa: F821 (the point: the name is nowhere at run time)
        window: int = 4

    assert Helped(budget=8, helper="anything").window == 4
    with pytest.raises(ValueError, match=r"^helped-test-policy: window must be an integer, got 'x'$"):
        Helped(budget=8, window="x")
    monkeypatch.setitem(POLICIES, Helped.name, Helped)  # make_policy's own check of the types (undone after the test)
    assert make_policy(Helped.name, budget=8, helper=1).helper == 1
    with pytest.raises(ValueError, match="window must be an integer, got 'x'"):
        make_policy(Helped.name, budget=8, window="x")


@pytest.mark.parametrize(
    "name, params",
    [
        ("h2o", {"budget": np.int64(64), "slack": torch.tensor(2)}),
        ("snapkv", {"budget": np.int32(64), "decode": np.bool_(True), "window": np.array(8)}),
        ("adakv", {"budget": 64, "alpha": np.float32(0.25)}),
    ],
)
def test_make_policy_takes_a_numpy_or_tensor_scalar_as_the_value_it_holds(name, params):
    """``make_policy("h2o", budget=np.int64(64))`` (a budget from ``np.arange``), and so ``BudgetCache(config, "h2o",
    budget=...)``, was refused ("budget must be an integer or null, got np.int64(64)"), where the policy class built
    directly takes it."""
    plain = {key: value.item() for key, value in params.items() if hasattr(value, "item")}
    built = make_policy(name, **params)
    assert built == make_policy(name, **{**params, **plain})
    assert all(type(getattr(built, key)) is type(value) for key, value in plain.items())
    with pytest.raises(ValueError, match=r"^policy 'h2o': budget must be an integer or null, got 64.5$"):
        make_policy("h2o", budget=np.float64(64.5))


def test_a_registered_class_that_is_no_dataclass_is_named_when_it_is_built(monkeypatch):
    """A policy class registered without ``@dataclass`` made ``make_policy`` fail inside ``dataclasses.fields`` ("must be
    called with a dataclass type or instance")."""
    from kvgates import register_policy

    class Plain:
        name = "plain-test-policy"

    monkeypatch.setitem(POLICIES, Plain.name, Plain)  # (undone after the test)
    register_policy(Plain)
    with pytest.raises(TypeError, match=r"^policy 'plain-test-policy' is registered by Plain, which is no dataclass; decorate it with @dataclass$"):
        make_policy("plain-test-policy")


@pytest.mark.parametrize(
    "params,message",
    [
        ({"decode_every": -1}, r"^Schedule: decode_every must be a whole number >= 0, got -1$"),
        ({"tolerance": -3}, r"^Schedule: tolerance must be a whole number >= 0, got -3$"),
        ({"decode_every": 1.5}, r"^Schedule: decode_every must be a whole number >= 0, got 1.5$"),
        ({"prefill": "yes"}, r"^Schedule: prefill must be True or False, got 'yes'$"),
    ],
)
def test_a_schedule_no_eviction_can_follow_is_refused(params, message):
    """A policy author's ``Schedule(decode_every=-1)`` was taken: the layer counted it as evicting while decoding in some
    places and never evicted in others; ``tolerance=-3`` gave a static layer fewer slots than its quota."""
    with pytest.raises(ValueError, match=message):
        kvgates.Schedule(**params)


@pytest.mark.parametrize("number", [np.int64(2), torch.tensor(2)], ids=["numpy", "tensor"])
def test_a_policy_built_with_a_numpy_or_tensor_whole_number_schedules_as_with_the_int(tiny, number):
    """A policy built directly (or through ``make_policy``) with ``slack=np.int64(2)`` ran as
    with ``slack=2``; the Schedule its ``schedule`` builds refused it (``Schedule: tolerance must be a whole number``)."""
    _, model = tiny
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    texts = []
    for slack in (2, number):
        policy = POLICIES["h2o"](budget=8, slack=slack)
        assert policy.schedule == kvgates.Schedule(prefill=True, decode_every=1, tolerance=2)
        out = model.generate(ids, past_key_values=BudgetCache(model.config, policy), max_new_tokens=6, do_sample=False)
        texts.append(out[0, 40:].tolist())
    assert texts[0] == texts[1]
    assert type(kvgates.Schedule(decode_every=number).decode_every) is int


def test_unknown_policy_and_parameter():
    with pytest.raises(ValueError, match="unknown policy 'snapkvv'; available policies: .*snapkv"):
        make_policy("snapkvv", budget=4)
    with pytest.raises(ValueError, match="has no parameter windw"):
        make_policy("snapkv", budget=64, windw=4)


def test_a_parameter_called_name_is_an_unknown_parameter():
    """No policy has a parameter ``name``: given one (``make_policy("snapkv", name="h2o")``, a wrapper's
    ``base_params="name=h2o"``, a recipe's ``policy.name=...``), it was Python's TypeError "make_policy() got multiple
    values for argument 'name'", a traceback from ``kvgates generate --base-params name=h2o``."""
    with pytest.raises(ValueError, match="policy 'snapkv' has no parameter name; its parameters are: budget"):
        make_policy("snapkv", budget=64, name="h2o")
    with pytest.raises(ValueError, match="base policy 'snapkv' has no parameter name"):
        make_policy("adakv", budget=64, base_params="name=h2o")


def test_attention_not_switched_is_caught(tiny):
    ref, _ = tiny
    with pytest.raises(RuntimeError, match="set_attn_implementation\\('kvgates'\\)"):
        ref(torch.randint(1, 128, (1, 8)), past_key_values=BudgetCache(ref.config, "h2o", budget=4))



class Interrupted(Exception):
    """What a test raises inside a model's forward: an out-of-memory error or a Ctrl-C, as a user meets them."""


def _raise(*args, **kwargs):
    raise Interrupted


def _refused_until_reset(model, make_cache, ids: torch.Tensor, stop, said: str, monkeypatch) -> None:
    """A forward through ``make_cache()`` stopped by ``Interrupted`` where ``stop(cache)`` says (an object, and the name
    of its method that raises) leaves the next forward refused with ``said``, and after ``reset()`` the cache gives the
    logits of a fresh one."""
    with torch.no_grad():
        expected = model(ids, past_key_values=make_cache()).logits
        cache = make_cache()
        with monkeypatch.context() as patch:
            patch.setattr(*stop(cache), _raise)
            with pytest.raises(Interrupted):
                model(ids, past_key_values=cache)
        with pytest.raises(RuntimeError, match=said):
            model(ids, past_key_values=cache)
        cache.reset()
        torch.testing.assert_close(model(ids, past_key_values=cache).logits, expected)


@pytest.mark.parametrize("name", ["h2o", "kvmerger", "adakv", "snapkv"])
@pytest.mark.parametrize(("where", "said"), [("mlp", "after layer 1"), ("step", "in layer 0")])
def test_a_forward_that_stopped_part_way_is_refused_until_reset(tiny, name, where, said, monkeypatch):
    """A forward that raised at layer 1's MLP left layers 0-1 with the prompt and layer 2 without (and, for KVMerger and
    Ada-KV, layer 0's compaction or eviction deferred to layer 1's end undone): a second forward appended to layers that
    disagreed on what they had seen and gave wrong logits without an error. So did one that raised in layer 0's
    attention after storing its tokens (its policy step here). It is refused, and after ``reset()`` the cache gives
    what a fresh one does."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with policy_on(model, name, 12) as policy:
        stop = (lambda cache: (model.model.layers[1].mlp, "forward")) if where == "mlp" else (lambda cache: (cache.layers[0], "step"))
        _refused_until_reset(
            model, lambda: BudgetCache(model.config, policy), ids, stop, rf"stopped part-way \({said} of layers 0-2;.*reset\(\)", monkeypatch
        )


@pytest.mark.parametrize("stopped", [0, 2])
def test_a_forward_that_stopped_in_a_sliding_window_layer_is_refused_until_reset(stopped, monkeypatch):
    """Gemma 3's sliding-window layers keep transformers' cache, and the check followed the budgeted layers only: a
    forward stopped in a sliding layer before the first budgeted one (0) or after the last (2, of sliding, full,
    sliding, sliding) was not refused, and the next one failed on shapes or gave wrong logits."""
    from helpers import tiny_model

    _, model = tiny_model("gemma3", layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    _refused_until_reset(
        model, lambda: BudgetCache(model.config, "h2o", budget=8), ids, lambda cache: (model.model.layers[stopped].mlp, "forward"),
        rf"stopped part-way \(after layer {stopped} of layers 0-3;", monkeypatch,
    )


def test_a_forward_that_stopped_between_a_layers_update_and_its_attention_is_refused_until_reset(tiny, monkeypatch):
    """Stopped after layer 0 staged its keys: the next forward said the model's attention was not 'kvgates', and
    ``reset()`` did not clear the staged layer, so that message came back after it too."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = BudgetCache(model.config, "h2o", budget=8)
    with torch.no_grad():
        with monkeypatch.context() as patch:
            patch.setattr(cache.layers[0], "attend", _raise)
            with pytest.raises(Interrupted):
                model(ids, past_key_values=cache)
        said = "layer 0 stored keys in this BudgetCache and its attention did not run: either .* or the previous forward stopped there"
        with pytest.raises(RuntimeError, match=said):
            model(ids, past_key_values=cache)
        cache.reset()
        fresh = BudgetCache(model.config, "h2o", budget=8)
        torch.testing.assert_close(model(ids, past_key_values=cache).logits, model(ids, past_key_values=fresh).logits)



def test_a_cache_of_another_model_or_batch_is_refused_in_one_sentence(tiny):
    """A cache built from a 6-layer config on a 3-layer model was refused next time as "stopped part-way (an exception
    or an interrupt)", neither of which happened; one of 3 layers on a 6-layer model failed with an IndexError inside
    transformers, and a cache reused for a batch of another size with a shape error in the storage. A policy class
    for an instance failed deep in the first forward."""
    from helpers import tiny_model

    _, model = tiny
    _, deeper = tiny_model(num_hidden_layers=6)
    _, wider = tiny_model(num_key_value_heads=4)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"this BudgetCache has 3 layers and the model's layer 3 attends: build the cache from this model"):
            deeper(ids, past_key_values=BudgetCache(model.config, "h2o", budget=8))
        cache = BudgetCache(deeper.config, "h2o", budget=8)
        model(ids, past_key_values=cache)
        with pytest.raises(RuntimeError, match="or a model with fewer layers than the config the cache was built from"):
            model(ids, past_key_values=cache)
        cache = BudgetCache(model.config, "h2o", budget=8)
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match=r"this BudgetCache holds 2 sequences and the forward brings 1: call cache.reset\(\)"):
            model(ids[:1], past_key_values=cache)
        with pytest.raises(ValueError, match="holds 2 KV heads of 16 dimensions and this forward brings 4 of 16: build a cache"):
            wider(ids, past_key_values=cache)
        model(ids[:, :3], past_key_values=cache)  # the refusals wrote nothing: the cache goes on (it said "stopped part-way")
    with pytest.raises(TypeError, match=r"a Policy instance \(H2O\(budget=...\)\) or a registered name, not the class"):
        BudgetCache(model.config, kvgates.policies.H2O)


@pytest.mark.parametrize("what", ["model", "dict", "none"])
def test_a_cache_built_from_what_is_not_a_config_is_refused_in_one_sentence(tiny, what):
    """``BudgetCache(model, ...)`` (the model for its config) failed with torch's AttributeError from
    ``nn.Module.__getattr__``; a mapping or None with an AttributeError naming ``get_text_config``."""
    _, model = tiny
    config = {"model": model, "dict": model.config.to_dict(), "none": None}[what]
    name = {"model": "LlamaForCausalLM", "dict": "dict", "none": "NoneType"}[what]
    with pytest.raises(TypeError, match=rf"^config must be the model's config \(BudgetCache\(model.config, ...\)\), got {name}$"):
        BudgetCache(config, "h2o", budget=8)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"static": "no"}, r"^static must be True or False, got 'no'$"),
        ({"static": 1}, r"^static must be True or False, got 1$"),
        ({"static": True, "decode_slots": "3"}, r"^decode_slots must be a whole number of tokens, got '3'$"),
        ({"static": True, "decode_slots": 2.5}, r"^decode_slots must be a whole number of tokens, got 2.5$"),
        ({"static": True, "decode_slots": True}, r"^decode_slots must be a whole number of tokens, got True$"),
    ],
)
def test_a_static_flag_or_decode_slots_of_another_type_is_refused(tiny, kwargs, message):
    """``static="no"`` built a static cache (any non-empty string is true); ``decode_slots="3"`` failed comparing a
    string with 0, and ``decode_slots=2.5`` was taken, to fail at the prompt's end with a slice's TypeError."""
    _, model = tiny
    with pytest.raises(TypeError, match=message):
        BudgetCache(model.config, "snapkv", budget=64, window=4, **kwargs)


@pytest.mark.parametrize("static,slots", [(np.True_, 8), (True, np.int64(8)), (True, torch.tensor(8)), (np.False_, np.int64(0))])
def test_a_static_flag_or_decode_slots_from_numpy_or_a_tensor_builds_the_cache_the_python_values_build(tiny, static, slots):
    """``static=np.True_`` and ``decode_slots=np.int64(8)`` or ``torch.tensor(8)`` built the cache ``True`` and ``8``
    build, until the type checks of ddbf8b6 refused them as no bool and no whole number."""
    _, model = tiny
    cache = BudgetCache(model.config, "snapkv", static=static, decode_slots=slots, budget=64, window=4)
    assert (cache.static, cache.decode_slots) == (bool(static), int(slots))
    assert type(cache.static) is bool and type(cache.decode_slots) is int


@pytest.mark.parametrize("name,params", [("h2o", {"budget": 64}), ("full", {})])
def test_generate_with_prompt_lookup_is_refused_in_one_sentence(tiny, name, params):
    """generate()'s speculative decoding crops the cache after rejected drafts; the README said its multi-token steps
    worked. The refusal told users to run it "with a cache that keeps every token", which is what the full policy's
    BudgetCache is (``full``: "keeps every token"), refused the same way: it names the cache that can be cropped. The
    refusal came from the first crop, after a verification forward had run on the prompt and drafts; now before it."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    kwargs = dict(max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
    cache = BudgetCache(model.config, name, **params)
    with pytest.raises(NotImplementedError, match="cannot be cropped.*assisted decoding and prompt lookup.*with transformers' DynamicCache"):
        model.generate(ids, past_key_values=cache, **kwargs)
    assert cache.get_seq_length() == 0  # no forward ran
    assert model.generate(ids, past_key_values=DynamicCache(config=model.config), **kwargs).shape == (1, 40)  # the advice works


@pytest.mark.parametrize("prompt", [5, 20], ids=["within-window", "past-window"])
def test_cropping_a_cache_with_sliding_layers_is_refused_before_any_layer_changes(prompt):
    """Gemma-3's first layer is a sliding-window one, which ``Cache.crop`` cropped before the budgeted layer after it
    refused (a prompt within the window: the layers then held different tokens), or which refused first, past its
    window, with transformers' advice to call ``activate_past_recording`` (that cannot make a BudgetCache croppable)."""
    from helpers import tiny_model

    _, model = tiny_model("gemma3")
    cache = BudgetCache(model.config, "h2o", budget=8)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, prompt), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
    sliding = cache.layers[0].keys.clone()
    with pytest.raises(NotImplementedError, match="^a BudgetCache cannot be cropped: evicted tokens cannot"):
        cache.crop(prompt - 2)
    assert torch.equal(cache.layers[0].keys, sliding)


def test_model_without_attention_interface_is_refused():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="does not route attention through transformers' AttentionInterface"):
        kvgates.prepare_model(model)


def test_model_with_only_sliding_layers_is_refused():
    from transformers import MistralConfig

    config = MistralConfig(num_hidden_layers=2, sliding_window=16, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        BudgetCache(config, "h2o", budget=8)


def test_policy_params_table_covers_registry():
    assert set(POLICIES) <= set(POLICY_PARAMS)


#: Policies overriding ``select`` that still keep exactly ``min(held, quota)`` (D2O where its forced slots fit its
#: smallest layer budget, merging and Ada-KV over such a base: an Ada-KV head budget is never below its forced
#: tokens; global TRIM-KV whose quota is what its selection keeps).
EXACT_OVERRIDES = ("d2o", "merge", "adakv", "trimkv-global")


@pytest.mark.parametrize("name", sorted(set(POLICIES) - set(EXACT_OVERRIDES)))
def test_exact_quota_only_where_select_is_the_base_selection(name):
    """``exact_quota`` (an eviction then trusts ``min(fill, quota)`` kept per head instead of reading the counts back)
    holds for policies whose ``select`` is ``Policy.select``; other overrides (wrappers, KVMerger) may keep another
    number."""
    from kvgates.policies.base import Policy

    policy = object.__new__(POLICIES[name])  # the class's property without its parameters (learned ones need gates)
    assert policy.exact_quota == (type(policy).select is Policy.select)
    if name == "kvmerger":
        assert not policy.exact_quota
    if name in ("h2o", "tova", "streaming_llm", "snapkv", "trimkv"):
        assert policy.exact_quota


def test_overrides_claim_an_exact_quota_only_where_they_keep_it():
    assert make_policy("d2o", budget=16).exact_quota
    assert not make_policy("d2o", budget=16, protect_edge_layers=True).exact_quota  # an edge layer keeps its prompt
    assert not make_policy("d2o", budget=16, recent_share=0.5).exact_quota  # 4 sinks + round(5 * 0.5) > 5
    assert make_policy("merge", budget=16, base="h2o").exact_quota
    assert make_policy("adakv", budget=64).exact_quota and make_policy("merge", budget=64, base="adakv").exact_quota
    assert not make_policy("adakv", budget=64, base="merge", base_params={"base": "h2o"}).exact_quota  # (not the base selection)
    assert POLICIES["trimkv-global"].exact_quota


@pytest.mark.parametrize("recent_share", [0.0, 0.25, 0.3, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("sinks", [1, 4])
def test_d2o_keeps_min_held_quota_at_every_layer_budget_where_it_claims_an_exact_quota(sinks, recent_share):
    """D2O's claim is tight: its selection keeps ``min(held, quota)`` at every layer budget it can give
    (``sinks + 1`` and up) exactly when it claims ``exact_quota``."""
    from helpers import make_layer, random_positions

    from kvgates.policies.h2o import CUMULATIVE

    policy = make_policy("d2o", budget=64, sinks=sinks, recent_share=recent_share, merge=False)  # (quotas below are told)
    layer = make_layer(policy, random_positions(2, 2, 30, held=24, seed=1))
    layer.state[CUMULATIVE].uniform_(generator=torch.Generator().manual_seed(2))
    kept = {}
    for q in range(sinks + 1, 27):
        kept[q] = (policy.select(layer, None, torch.full((2, 2), q)) & layer.valid).sum(-1)
    exact = all(bool((n == min(24, q)).all()) for q, n in kept.items())
    assert policy.exact_quota == exact


@pytest.mark.parametrize(("budget", "sinks", "recent_share"), [(12, 4, 1.0), (12, 4, 0.7), (8, 4, 0.5), (5, 4, 0.25)])
def test_d2o_refuses_a_budget_no_larger_than_its_sinks_and_recent_share(budget, sinks, recent_share):
    """The spec's edge case (budget <= sinks + window: a clear error): ``D2O(budget=12, sinks=4, recent_share=1.0)``
    was built and held 16 tokens a head, 4 over its budget, at matched memory."""
    recent = round(budget * recent_share)
    with pytest.raises(ValueError, match=rf"budget {budget} must be larger than sinks \+ the budget's recent share \({sinks} \+ {recent}\)"):
        make_policy("d2o", budget=budget, sinks=sinks, recent_share=recent_share)
    if recent_share < 1:  # a budget large enough for the same sinks and share builds
        assert make_policy("d2o", budget=4 * budget, sinks=sinks, recent_share=recent_share).budget == 4 * budget


def test_an_eviction_told_its_counts_checks_them_on_the_device():
    """``evict(counts=...)`` checks on the device (on the CPU at once) that every head kept ``min(held, quota)``
    instead of reading the counts back: against one number where every head was told as many, else against the
    quota."""
    from helpers import make_layer, random_positions

    from kvgates.runtime.storage import KeptCounts

    def evict(quota, kept):
        layer = make_layer(make_policy("h2o", budget=4, recent=2), random_positions(1, 2, 10, held=10, seed=0))
        keep = layer.valid.clone()
        keep[..., :6] = False  # keeps 4 per head
        layer.quota = torch.tensor([quota])
        layer.evict(keep, counts=KeptCounts(kept, kept, [10 - n for n in kept]))
        return layer

    for quota in ([5, 5], [4, 5]):
        with pytest.raises(RuntimeError, match=r"kept other than min\(held, quota\)"):
            evict(quota, quota)
    assert evict([4, 4], [4, 4]).held().tolist() == [[4, 4]]


def test_forcing_the_triton_kernels_on_cpu_without_the_interpreter_is_one_sentence(monkeypatch):
    """``KVGATES_KERNELS=triton`` on CPU tensors without ``TRITON_INTERPRET=1`` ended deep in a forward with Triton's
    "0 active drivers ([]). There should only be one."; a bad value is refused as well."""
    pytest.importorskip("triton")
    monkeypatch.setenv("KVGATES_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^KVGATES_KERNELS=triton on cpu tensors needs Triton's interpreter \(TRITON_INTERPRET=1\)"):
        kvgates.kernels.backend(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kvgates.kernels.backend(torch.zeros(1)) == "triton"
    monkeypatch.setenv("KVGATES_KERNELS", "tritn")
    with pytest.raises(ValueError, match="KVGATES_KERNELS must be one of"):
        kvgates.kernels.backend(torch.zeros(1))


def test_output_attentions_is_warned_about(tiny):
    """``output_attentions=True`` returned an empty tuple of attention weights and said nothing."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.warns(UserWarning, match="kvgates attention returns no attention weights"):
        model(ids, past_key_values=BudgetCache(model.config, "h2o", budget=8), output_attentions=True)


def test_base_params_text_keeps_lists_quoted_text_and_colons():
    """``--base-params`` split at every comma: ``repeat_ids=[1,2]`` was a YAML error, ``'Repeat, please:'`` too, and
    ``repeat_prompt=Say it again:`` became a mapping."""
    from kvgates.policies.wrappers import parse_params

    assert parse_params("repeat_ids=[1, 2],window=8") == {"repeat_ids": [1, 2], "window": 8}
    assert parse_params("repeat_prompt='Repeat, please:', decode=true") == {"repeat_prompt": "Repeat, please:", "decode": True}
    assert parse_params("repeat_prompt=Say it again:") == {"repeat_prompt": "Say it again:"}
    assert parse_params("base_params={window: 4}") == {"base_params": {"window": 4}}
    # An apostrophe or a bracket inside an unquoted value is text (they swallowed every parameter after them):
    assert parse_params("repeat_prompt=Don't stop,window=8") == {"repeat_prompt": "Don't stop", "window": 8}
    assert parse_params("repeat_prompt=a]b,window=8") == {"repeat_prompt": "a]b", "window": 8}
    with pytest.raises(ValueError, match=r"""^base parameter a: '"x' opens a quote it never closes$"""):
        parse_params('a="x')
    with pytest.raises(ValueError, match=r"^base parameter a: '\[1,2' opens a bracket it never closes$"):
        parse_params("a=[1,2")
    with pytest.raises(ValueError, match=r"""^base parameter a: cannot read '"x"y' as YAML"""):
        parse_params('a="x"y,b=1')


def test_a_parameter_without_a_value_says_so():
    """``snapkv:window=`` (a bench's --policies, or --base-params) read the empty value as YAML's None and said
    "window must be an integer, got None"; ``window=null`` still gives None."""
    from kvgates.policies.wrappers import parse_params

    for text in ("window=", "kernel=3, window= "):
        with pytest.raises(ValueError, match=r"^window= has no value; give one, or leave window out for its default$"):
            parse_params(text)
    with pytest.raises(ValueError, match="window= has no value"):
        make_policy("adakv", budget=8, base_params="window=")
    assert parse_params("window=null") == {"window": None}


@pytest.mark.parametrize("budget", [12, 100])
@pytest.mark.parametrize("name", sorted(POLICY_PARAMS))
def test_a_deep_copied_cache_continues_as_the_original(tiny, name, budget):
    """``copy.deepcopy(cache)``, the usual way to reuse a prompt's cache for several continuations, failed for every
    policy with per-slot state (``StateViews`` refused the copy's rebuild), and a copy that got past that ran a copy of
    the policy: the per-layer values keyed by the policy were lost, and a learned policy's copy had no hooks on the
    model. The copy shares the policy, holds copies of everything else, and decodes exactly as the original does."""
    import copy

    _, model = tiny
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with policy_on(model, name, None if name == "full" else budget) as policy, torch.no_grad():
        cache = BudgetCache(model.config, policy)
        model(ids, past_key_values=cache)
        twin = copy.deepcopy(cache)
        assert twin.policy is policy and twin.budget_layers[0].cache is twin
        original = [model(steps[:, i : i + 1], past_key_values=cache).logits for i in range(6)]
        copied = [model(steps[:, i : i + 1], past_key_values=twin).logits for i in range(6)]
    for a, b in zip(original, copied):
        torch.testing.assert_close(a, b)
    assert all(torch.equal(a.pos, b.pos) and a.keys.data_ptr() != b.keys.data_ptr() for a, b in zip(cache.budget_layers, twin.budget_layers))


def test_a_copied_cache_does_not_take_over_what_was_kept_with_its_original_s_position_versions(tiny):
    """A layer keeps ``valid`` and ``in_position_order`` with its positions' version counter; a copy's counter starts
    anew, and the copied marks held once it reached the original's count: a static cache copied after its first
    decode step read the token that step dropped as held (a device assert: no free slot), and a layer whose positions
    were reordered from outside was said to be in position order again once copied."""
    import copy

    _, model = tiny
    ids = torch.randint(1, 128, (2, 26), generator=torch.Generator().manual_seed(3))
    with policy_on(model, "h2o", 8) as policy, torch.no_grad():
        cache = BudgetCache(model.config, policy, static=True)
        model(ids[:, :21], past_key_values=cache)
        model(ids[:, 21:22], past_key_values=cache)
        twin = copy.deepcopy(cache)
        original = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(22, 26)]
        copied = [model(ids[:, t : t + 1], past_key_values=twin).logits for t in range(22, 26)]
    for a, b in zip(original, copied):
        torch.testing.assert_close(a, b)
    with policy_on(model, "full", None) as policy, torch.no_grad():
        cache = BudgetCache(model.config, policy)
        model(ids[:, :20], past_key_values=cache)
        layer = cache.budget_layers[0]
        assert layer.in_position_order and copy.deepcopy(cache).budget_layers[0].in_position_order
        layer.pos[..., :2] = layer.pos[..., :2].flip(-1)  # a write from outside the layer: out of order
        assert not layer.in_position_order and not copy.deepcopy(cache).budget_layers[0].in_position_order


@pytest.mark.parametrize("name", sorted(POLICY_PARAMS))
def test_a_new_turn_after_decoding_under_a_prompt_only_policy_is_said_to_stay_whole(tiny, name):
    """A call of several tokens after decoding began is taken for decode steps: SnapKV appended a 50-token new turn
    whole (87 tokens a head at budget 32) in silence. A policy that keeps two new turns whole warns once per cache;
    one that keeps the budget (or the full cache, which has none) says nothing. KVzip, whose scoring pass evicts its
    prompt and whose schedule evicts nothing, kept new turns whole without the warning."""
    import warnings

    _, model = tiny
    g = torch.Generator().manual_seed(0)
    with policy_on(model, name, None if name == "full" else 40) as policy, torch.no_grad():
        cache = BudgetCache(model.config, policy)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = model(torch.randint(3, 100, (1, 100), generator=g), past_key_values=cache)
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
            before = cache.held_tokens()
            for _ in range(2):
                model(torch.randint(3, 100, (1, 50), generator=g), past_key_values=cache)
    kept_whole = name != "full" and bool((cache.held_tokens() - before == 100).all())
    said = [str(w.message) for w in seen if "after decoding began" in str(w.message)]
    assert len(said) == int(kept_whole), (said, (cache.held_tokens() - before).tolist())
    if kept_whole:
        assert said[0].startswith(f"50 tokens given after decoding began are taken as decode steps, which {name} appends")


def test_a_reset_cache_warns_of_a_new_turn_again(tiny):
    """The warning's own advice is ``cache.reset()``: a reset cache holds another conversation, whose new turn kept
    whole went unsaid (the warning was once per cache object)."""
    import warnings

    _, model = tiny
    g = torch.Generator().manual_seed(0)
    cache = BudgetCache(model.config, "snapkv", budget=32, window=4)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            cache.reset()
            out = model(torch.randint(3, 100, (1, 60), generator=g), past_key_values=cache)
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
            for _ in range(2):
                model(torch.randint(3, 100, (1, 20), generator=g), past_key_values=cache)
    assert sum("after decoding began" in str(w.message) for w in seen) == 2


def in_slot_order(layer) -> bool:
    """Whether each head's tokens are its first slots, in ascending position order (``in_position_order``'s claim)."""
    pos = layer.pos
    valid = pos >= 0
    prefix = (valid[..., 1:] <= valid[..., :-1]).all()  # no token after a free slot
    ascending = ((pos[..., 1:] > pos[..., :-1]) | ~valid[..., 1:]).all()
    return bool(prefix and ascending)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_layer_said_to_be_in_position_order_is(tiny, name, padded):
    # Whenever a layer says that its slots hold its tokens first, in position order (what KVMerger then skips sorting
    # slots by), they do: after the prompt (with left padding, or without), every decode step and a second turn.
    _, model = tiny
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0
    said = []
    with policy_on(model, name, 10) as policy, torch.no_grad():
        cache = BudgetCache(model.config, policy)
        for a, z in [(0, 30)] + [(t, t + 1) for t in range(30, 40)] + [(40, 45)] + [(t, t + 1) for t in range(45, 50)]:
            model(ids[:, a:z], attention_mask=mask[:, :z], past_key_values=cache)
            for layer in cache.budget_layers:
                said.append(layer.in_position_order)
                assert not layer.in_position_order or in_slot_order(layer), (a, z, layer)
            if a == 0 and not padded:  # a prompt without padding into empty storage: known in order whatever evicted
                assert all(layer.in_position_order for layer in cache.budget_layers)
    if padded and name == "full":  # padding in storage, never compacted: never known to be in order
        assert not any(said)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", ["h2o", "streaming_llm"])
def test_a_cache_filled_in_inference_mode_is_refused_outside_it_and_continues_inside(tiny, name, static):
    """A prompt under ``torch.inference_mode()``, then a step under ``no_grad`` (``generate()``'s mode): torch's
    in-place error came from the cache's first write, after its counters had moved. It is one sentence before anything
    changes, and the cache continues under inference mode as one never refused. A static layout's (eager) decode step
    skipped the check and met torch's error."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    caches = [BudgetCache(model.config, make_policy(name, budget=12), static=static, decode_slots=4 if static else 0) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(ids, past_key_values=cache)
    step = {"position_ids": torch.tensor([[40]]), "cache_position": torch.tensor([40])}
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"filled under torch\.inference_mode\(\).*continue it under"):
        model(ids[:, :1], past_key_values=caches[0], **step)
    with torch.inference_mode():
        got, expected = (model(ids[:, :1], past_key_values=cache, **step).logits for cache in caches)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
