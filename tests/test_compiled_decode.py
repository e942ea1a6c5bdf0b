"""Decode steps under ``torch.compile(fullgraph=True)``: kvgates' attention breaks no graph.

Compiled with the ``aot_eager`` backend (the graph capture is what is tested; inductor's code generation takes
tens of seconds on the CPU and is what ``bench/decode_speed.py --compiled`` measures).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import policy_on
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache

from kvgates import POLICIES, BudgetCache, make_policy
from kvgates.gates import GATE_KINDS

BACKEND = "aot_eager"
#: kvgates needs torch 2.13 (pyproject.toml). On a lent H200's torch 2.11 the graph breaks of a chunked prefill's
#: compiled forward tripped an assertion inside dynamo's guard builder (a CONSTANT_MATCH guard on ``HANDOFF.layer``,
#: "Unexpected type BudgetLayer"); 2.13 builds it.
BEFORE_2_13 = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def _decode_steps(forward, cache, token: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """Logits ``[B, steps, V]`` of ``steps`` greedy decode steps from ``token`` at position ``start``."""
    outs = []
    with torch.no_grad():
        for t in range(start, start + steps):
            pos = torch.tensor([t])
            logits = forward(token, position_ids=pos[None].expand(token.shape[0], 1), cache_position=pos, past_key_values=cache).logits
            outs.append(logits)
            token = logits[:, -1:].argmax(-1)
    return torch.cat(outs, dim=1)


def test_static_cache_compiles_with_kvgates_attention(tiny):
    """A transformers StaticCache on a model whose attention is kvgates' (plain sdpa there) compiles fullgraph and
    decodes what the sdpa model decodes."""
    ref, model = tiny
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, net, compile_ in (("sdpa", ref, False), ("kvgates", model, True)):
        torch._dynamo.reset()
        cache = StaticCache(config=net.config, max_cache_len=32)
        with torch.no_grad():
            token = net(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        forward = torch.compile(net.forward, fullgraph=True, backend=BACKEND) if compile_ else net.forward
        runs[name] = _decode_steps(forward, cache, token, ids.shape[1], 4)
    torch.testing.assert_close(runs["kvgates"], runs["sdpa"], atol=1e-5, rtol=1e-5)


#: Every policy the issue names, at defaults, amortised eviction (tolerance; eviction every k steps), and the other
#: policies declaring ``sync_free_decode``.
CASES = [
    ("snapkv", {}), ("h2o", {}), ("tova", {}), ("streaming_llm", {}), ("morphkv", {}), ("trimkv", {}),
    ("h2o", {"slack": 2}), ("morphkv", {"evict_every": 2}),
    ("pyramidkv", {}), ("trimkv-morph", {}),  # inherit the decode step of snapkv and morphkv
    ("kvmerger", {"budget": 12}),  # prompt merges, then decode appends (its heavy hitters and window need 8)
    ("kvzip", {}),  # the static layout settles after its scoring forwards
    ("dynamickv", {}),  # budgets across layers, decided after the prompt's last layer: every layer settles then
    ("adakv", {"ragged": False}),  # head budgets within one slot count per head
    ("d2o", {}), ("d2o", {"slack": 2}),  # merges each evicted token, one or several a step, nothing read back
    ("merge", {}),  # D2O's merging around H2O
]
BUDGET, PROMPT, STEPS = 8, 20, 6


def test_every_policy_declaring_a_sync_free_decode_is_tested():
    declared = {name for name, cls in POLICIES.items() if cls.sync_free_decode is True}
    assert declared == {name for name, _ in CASES} - {"streaming_llm", "adakv", "merge"}  # properties


def _held_positions(cache) -> list[list[list[list[int]]]]:
    """Per budgeted layer, sequence and KV head: the sorted positions held."""
    return [
        [[sorted(p[p >= 0].tolist()) for p in seq] for seq in layer.pos] for layer in cache.budget_layers
    ]


def _decode_slots(policy) -> int:
    return 0 if policy.schedule.decode_every else STEPS


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
def test_static_decode_compiles_fullgraph_and_matches_eager(tiny, name, params):
    """A static BudgetCache's decode step compiles without graph breaks or recompiles, and its logits and held
    tokens are those of the eager (dynamic) cache, step by step."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + STEPS + 1), generator=torch.Generator().manual_seed(3))
    params = dict(params)
    with policy_on(model, name, params.pop("budget", BUDGET), **params) as policy:
        eager = BudgetCache(model.config, policy)
        static = BudgetCache(model.config, policy, static=True, decode_slots=_decode_slots(policy))
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, fullgraph=True, backend=BACKEND)
        logits = {}
        for label, cache, forward in (("eager", eager, model.forward), ("static", static, compiled)):
            with torch.no_grad():
                model(ids[:, :PROMPT], past_key_values=cache)
            first = _teacher_forced(forward, cache, ids, PROMPT, 1)
            with torch.compiler.set_stance("fail_on_recompile"):
                logits[label] = torch.cat([first, _teacher_forced(forward, cache, ids, PROMPT + 1, STEPS - 1)], dim=1)
    torch.testing.assert_close(logits["static"], logits["eager"], atol=1e-5, rtol=1e-5)
    assert _held_positions(static) == _held_positions(eager)
    assert static.get_seq_length() == eager.get_seq_length() == PROMPT + STEPS


def _teacher_forced(forward, cache, ids: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """Logits ``[B, steps, V]`` of decode steps feeding ``ids[:, start : start + steps]`` one token at a time."""
    outs = []
    with torch.no_grad():
        for t in range(start, start + steps):
            pos = torch.tensor([t])
            outs.append(
                forward(ids[:, t : t + 1], position_ids=pos[None].expand(ids.shape[0], 1), cache_position=pos, past_key_values=cache).logits
            )
    return torch.cat(outs, dim=1)


def test_generate_compiles_the_static_cache_decode_steps(tiny):
    """generate() compiles the decode steps of a static cache (fullgraph, as it does on CUDA for compileable caches;
    forced here on the CPU) and generates what the eager dynamic cache generates."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(4))
    config = CompileConfig(fullgraph=True, dynamic=False, backend=BACKEND)
    config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
    out = {}
    for static in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cache = BudgetCache(model.config, "h2o", budget=BUDGET, slack=1, static=static)
        assert cache.is_compileable == static
        out[static] = model.generate(
            ids, past_key_values=cache, max_new_tokens=STEPS, do_sample=False, compile_config=config if static else None
        )
        assert counters["stats"]["unique_graphs"] == static  # one graph for every decode step
    assert torch.equal(out[True], out[False])


@pytest.mark.parametrize(("name", "params"), [("h2o", {}), ("kvzip", {}), ("morphkv", {"evict_every": 2})], ids=["h2o", "kvzip", "morphkv-every2"])
def test_generate_compiles_the_decode_step_of_a_static_cache_once_for_every_prompt_length_and_turn(tiny, name, params):
    """generate() compiles a static cache's decode step once (``dynamic=False``, as it compiles on CUDA): a second turn
    through the same cache, and a new cache for a prompt of another length, reuse the graph. The step tested the
    tokens a layer had seen (``phase``; KVzip's scoring hook too), got a mask as wide as them and read the decode steps
    counted on the host (an eviction every 2 steps): a recompile for every prompt length and every turn, until dynamo's
    limit of 8 left the steps uncompiled."""
    _, model = tiny
    config = CompileConfig(fullgraph=True, dynamic=False, backend=BACKEND)
    config._compile_all_devices = True
    torch._dynamo.reset()
    stance = "default"  # the first call compiles; no other may
    with policy_on(model, name, BUDGET, **params) as policy, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # KVzip keeps the second turn whole (several_after_decoding)
        for n in (PROMPT, PROMPT + 3):
            ids = torch.randint(1, 128, (2, n), generator=torch.Generator().manual_seed(n))
            cache = BudgetCache(model.config, policy, static=True, decode_slots=_decode_slots(policy))
            for _ in range(2):
                with torch.compiler.set_stance(stance):
                    out = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False, compile_config=config)
                stance, ids = "fail_on_recompile", torch.cat([out, ids[:, :2]], dim=1)


@pytest.mark.skipif(BEFORE_2_13, reason="torch before 2.13 (below kvgates' floor): dynamo's guard builder asserts on these graph breaks")
@pytest.mark.parametrize("name", ["h2o", "snapkv", "kvzip"])
def test_generate_with_chunked_prefill_compiles_only_the_decode_steps_of_a_static_cache(tiny, name):
    """generate() compiles its chunked prefill's forwards too for a compileable cache (on CUDA by default): the
    chunks run eagerly inside the compiled forward (graph breaks, the default fullgraph=False) and give the eager
    cache's tokens, a last chunk of one token included; fullgraph=True is refused with the reason (a dynamo
    traceback from the storage's host checks, and a misleading 'attention did not run' error without fullgraph,
    before). A static KVzip cache refuses a second prompt chunk with its own sentence there too."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + 1), generator=torch.Generator().manual_seed(10))
    out = {}
    with policy_on(model, name, BUDGET) as policy:
        for fullgraph in (None, False, True):
            torch._dynamo.reset()
            static = fullgraph is not None
            cache = BudgetCache(model.config, policy, static=static, decode_slots=_decode_slots(policy) if static else 0)
            config = CompileConfig(fullgraph=bool(fullgraph), dynamic=False, backend=BACKEND)
            config._compile_all_devices = True
            run = lambda: model.generate(  # noqa: E731
                ids, past_key_values=cache, max_new_tokens=STEPS, do_sample=False, prefill_chunk_size=5,
                compile_config=config if fullgraph is not None else None,
            )
            if fullgraph:
                with pytest.raises(torch._dynamo.exc.Unsupported, match="only a static cache's single-token decode steps compile"):
                    run()
            elif name == "kvzip" and fullgraph is False:
                with pytest.raises(ValueError, match="cannot once its layout is settled"):
                    run()
            else:
                out[fullgraph] = run()
    if name != "kvzip":
        assert torch.equal(out[False], out[None])


@pytest.mark.parametrize("name", ["kvzip", "snapkv", "kvmerger", "h2o"])
def test_a_left_padded_batch_through_generate_on_a_static_cache_gives_what_the_eager_cache_gives(tiny, name):
    """generate() gives a compileable cache's prompt forward a 4-D mask, where it gives an eager one the 2-D mask:
    KVzip's scoring read the 4-D one as 2-D and raised an IndexError on a left-padded batch (a static cache, eager
    decode steps here, as generate() runs them on the CPU)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    out = {}
    with policy_on(model, name, 12 if name == "kvmerger" else BUDGET) as policy:
        for static in (False, True):
            cache = BudgetCache(model.config, policy, static=static, decode_slots=_decode_slots(policy) if static else 0)
            out[static] = model.generate(
                ids.masked_fill(mask == 0, 0), attention_mask=mask, past_key_values=cache, max_new_tokens=STEPS, do_sample=False,
                pad_token_id=0, output_scores=True, return_dict_in_generate=True,
            )
    assert torch.equal(out[True].sequences, out[False].sequences)
    torch.testing.assert_close(torch.stack(out[True].scores), torch.stack(out[False].scores), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["d2o", "merge"])
def test_merging_static_caches_take_prompt_chunks_and_multi_token_calls_as_the_eager_cache(tiny, name):
    """A prompt in two forwards, decode steps, a multi-token call after them, more decode steps: the calls other
    than single-token steps evict several tokens a head on a static layer too, and must merge them all, as the
    eager cache does (the static step's bounded match took only the first, before)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(9))
    runs = {}
    for static in (False, True):
        with policy_on(model, name, BUDGET) as policy:
            cache = BudgetCache(model.config, policy, static=static)
            with torch.no_grad():
                logits = [model(ids[:, :12], past_key_values=cache).logits[:, -1:]]
                for start, n, steps in ((12, 8, 3), (23, 4, 2)):
                    chunk = torch.arange(start, start + n)
                    logits.append(model(ids[:, start : start + n], position_ids=chunk[None].expand(2, -1), cache_position=chunk,
                                        past_key_values=cache).logits)
                    logits.append(_teacher_forced(model.forward, cache, ids, start + n, steps))
            runs[static] = (torch.cat(logits, dim=1), _held_positions(cache))
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-5, rtol=1e-5)
    assert runs[True][1] == runs[False][1]


def test_static_cache_refusals(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="cannot run in a static BudgetCache"):
        BudgetCache(model.config, "adakv", budget=BUDGET, base_params={"window": 4}, static=True)
    gates = GATE_KINDS["retention"].for_model(model)
    around = make_policy("adakv", budget=BUDGET, ragged=False, base="trimkv-snap", base_params={"window": 4, "gate_keep": 3, "gates": gates})
    with pytest.raises(ValueError, match="adakv cannot run in a static BudgetCache"):  # uniform, but its base cannot
        BudgetCache(model.config, around, static=True, decode_slots=4)
    with pytest.raises(ValueError, match="needs decode_slots"):
        BudgetCache(model.config, "snapkv", budget=BUDGET, window=4, static=True)
    with pytest.raises(ValueError, match="pass static=True"):
        BudgetCache(model.config, "h2o", budget=BUDGET, decode_slots=4)


def test_a_static_kvzip_cache_scores_its_prompt_then_refuses_a_second_prompt_forward(tiny):
    """KVzip's scoring forwards add and drop tokens: the static layout settles after them (the prompt is evicted to
    the budget); a later prompt forward would need more scoring forwards in the settled layout, and is refused with
    nothing changed."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    with policy_on(model, "kvzip", BUDGET) as policy:
        cache = BudgetCache(model.config, policy, static=True, decode_slots=4)
        with torch.no_grad():
            model(ids[:, :PROMPT], past_key_values=cache)
            assert all(layer.static for layer in cache.budget_layers)
            assert cache.held_tokens().max() == BUDGET
            held = _held_positions(cache)
            chunk = torch.arange(PROMPT, PROMPT + 3)
            with pytest.raises(ValueError, match="cannot once its layout is settled"):
                model(ids[:, PROMPT : PROMPT + 3], position_ids=chunk[None], cache_position=chunk, past_key_values=cache)
        assert _held_positions(cache) == held and cache.get_seq_length() == PROMPT


def test_a_static_kvzip_cache_takes_a_multi_token_call_after_decoding_within_its_decode_slots_only(tiny):
    """After decode steps, a multi-token call is a decode call (not scored, as in an eager cache): it fills decode
    slots, and one that holds more than the static slots is refused with the host's sentence (it was taken, and the
    next decode step failed on a device assert)."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(7))
    for n, fits in ((2, True), (3, False)):
        with policy_on(model, "kvzip", BUDGET) as policy:
            cache = BudgetCache(model.config, policy, static=True, decode_slots=4)
            with torch.no_grad():
                model(ids[:, :PROMPT], past_key_values=cache)
                _teacher_forced(model.forward, cache, ids, PROMPT, 2)
                chunk = torch.arange(PROMPT + 2, PROMPT + 2 + n)
                call = lambda: model(ids[:, PROMPT + 2 : PROMPT + 2 + n], position_ids=chunk[None], cache_position=chunk,  # noqa: E731
                                     past_key_values=cache)
                if fits:
                    call()
                    assert cache.held_tokens().max() == BUDGET + 4
                else:
                    said = f"holds {BUDGET + 5} tokens in a head, more than its {BUDGET + 4} static slots"
                    with pytest.raises(ValueError, match=said + r" \(.*\): give the cache more decode_slots, or"):
                        call()


def test_static_cache_of_a_prompt_policy_stops_when_its_decode_slots_are_used(tiny):
    """Decoding past ``decode_slots`` would overwrite a held token: the device-side check fails instead."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + 3), generator=torch.Generator().manual_seed(5))
    cache = BudgetCache(model.config, "snapkv", budget=BUDGET, window=4, static=True, decode_slots=2)
    with torch.no_grad():
        model(ids[:, :PROMPT], past_key_values=cache)
        _teacher_forced(model.forward, cache, ids, PROMPT, 2)
        with pytest.raises(RuntimeError, match="no free slot"):
            _teacher_forced(model.forward, cache, ids, PROMPT + 2, 1)


def test_chunks_between_static_decode_steps_keep_what_a_dynamic_cache_keeps(tiny):
    """Multi-token calls (a second turn, speculative verification) after static decode steps: the mask sizes count
    those steps (an IndexError before) and the slots they filled are counted again before the chunk takes free
    ones (the host's floor of free slots went stale, and a chunk overwrote a held token)."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    runs = {}
    for label, kwargs in (("dynamic", {}), ("static", {"static": True, "decode_slots": 12})):
        cache = BudgetCache(model.config, "snapkv", budget=8, window=4, **kwargs)
        with torch.no_grad():
            model(ids[:, :20], past_key_values=cache)
            logits = [_teacher_forced(model.forward, cache, ids, 20, 2)]
            for start, steps in ((22, 3), (25, 3)):
                chunk = torch.arange(start, start + steps)
                logits.append(model(ids[:, start : start + steps], position_ids=chunk[None], cache_position=chunk,
                                    past_key_values=cache).logits)
                logits.append(_teacher_forced(model.forward, cache, ids, start + steps, 3 if start == 22 else 1))
        runs[label] = (torch.cat(logits, dim=1), _held_positions(cache))
    torch.testing.assert_close(runs["static"][0], runs["dynamic"][0], atol=1e-5, rtol=1e-5)
    assert runs["static"][1] == runs["dynamic"][1]


def test_a_chunk_past_the_decode_slots_of_a_static_cache_is_refused_not_written_over_held_tokens(tiny):
    """11 tokens after the prompt in a static cache with 10 decode slots: the last chunk finds 2 free slots. The
    host's floor of free slots, left stale by the static steps between the chunks, said 5, and the chunk
    overwrote a held token; now the slots are counted and the layer refuses to hold more than its static slots."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = BudgetCache(model.config, "snapkv", budget=8, window=4, static=True, decode_slots=10)
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache)
        _teacher_forced(model.forward, cache, ids, 20, 2)
        chunk = torch.arange(22, 25)
        model(ids[:, 22:25], position_ids=chunk[None], cache_position=chunk, past_key_values=cache)
        _teacher_forced(model.forward, cache, ids, 25, 3)
        chunk = torch.arange(28, 31)
        with pytest.raises(ValueError, match="holds 19 tokens in a head, more than its 18 static slots"):
            model(ids[:, 28:31], position_ids=chunk[None], cache_position=chunk, past_key_values=cache)


def test_compiled_steps_take_the_reference_kernels_on_a_gpu_too(monkeypatch):
    """Inside torch.compile the kernels' ``auto`` backend is the torch reference (inductor fuses it: the path these
    CPU tests compile), not kvgates' Triton kernels launched from a traced graph; outside it, CUDA tensors take
    Triton. A stand-in CUDA tensor, since CI has no GPU."""
    from types import SimpleNamespace

    from kvgates import kernels

    cuda_tensor = SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("KVGATES_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_triton_importable", lambda: True)
    assert kernels.backend(cuda_tensor) == "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert kernels.backend(cuda_tensor) == "reference"
    monkeypatch.setenv("KVGATES_KERNELS", "triton")  # forced in eager code only: dynamo cannot trace a launch
    assert kernels.backend(cuda_tensor) == kernels.backend(torch.zeros(1)) == "reference"


@pytest.mark.parametrize(("name", "params"), [("d2o", {}), ("d2o", {"slack": 2})], ids=["d2o", "d2o-slack2"])
def test_merging_decode_steps_compile_with_inductor(tiny, name, params):
    """The graphs above are captured with ``aot_eager``; inductor must also generate code for them (its CPU code had
    no max over a boolean tensor, which D2O's one-eviction match took). The merging steps, compiled by inductor,
    decode what the eager cache decodes."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + STEPS + 1), generator=torch.Generator().manual_seed(8))
    with policy_on(model, name, BUDGET, **params) as policy:
        logits = {}
        for label, cache, forward in (
            ("eager", BudgetCache(model.config, policy), model.forward),
            ("static", BudgetCache(model.config, policy, static=True), torch.compile(model.forward, fullgraph=True)),
        ):
            torch._dynamo.reset()
            with torch.no_grad():
                model(ids[:, :PROMPT], past_key_values=cache)
            logits[label] = _teacher_forced(forward, cache, ids, PROMPT, STEPS)
    torch.testing.assert_close(logits["static"], logits["eager"], atol=1e-5, rtol=1e-5)


def test_a_copy_of_a_static_cache_decodes_through_the_inductor_compiled_step(tiny):
    """A prompt's static cache copied (``copy.deepcopy``) for a second continuation: the copy's per-slot state views
    shared its storage but were no views of it, and the inductor-compiled decode step, built for the original's views
    of ``slot_data``, failed on the copy (an AssertionError from its generated code). Original and copy decode what
    the eager cache and its copy decode."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + 2), generator=torch.Generator().manual_seed(12))
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    runs = {}
    for static in (False, True):
        cache = BudgetCache(model.config, "h2o", budget=BUDGET, static=static)
        with torch.no_grad():
            model(ids[:, :PROMPT], past_key_values=cache)
        twin = copy.deepcopy(cache)
        runs[static] = [_teacher_forced(compiled if static else model.forward, c, ids, PROMPT, 2) for c in (cache, twin)]
    for static, eager in zip(runs[True], runs[False]):
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["h2o", "snapkv", "d2o"])
def test_beam_reorders_between_compiled_static_steps_follow_the_eager_cache_without_recompiles(tiny, name):
    """Beam search reorders the cache between decode steps (``reorder_cache``, a beam taken twice included): the
    compiled static step decodes what the eager cache decodes under the same reorders, and compiles once. D2O's
    per-sequence quota was an expanded view until the first reorder copied it with other strides: a recompile. The
    static storage keeps its addresses through the reorders (a CUDA graph captured from the step would record again
    at every reorder when they changed)."""
    _, model = tiny
    ids = torch.randint(1, 128, (3, PROMPT + STEPS), generator=torch.Generator().manual_seed(11))
    beams = [torch.tensor(order) for order in ([2, 0, 0], [1, 2, 0], [0, 0, 1], [2, 1, 1], [0, 1, 2])]
    runs = {}
    with policy_on(model, name, BUDGET) as policy:
        for static in (False, True):
            torch._dynamo.reset()
            cache = BudgetCache(model.config, policy, static=static, decode_slots=_decode_slots(policy) if static else 0)
            forward = torch.compile(model.forward, fullgraph=True, backend=BACKEND) if static else model.forward
            with torch.no_grad():
                model(ids[:, :PROMPT], past_key_values=cache)
            logits = [_teacher_forced(forward, cache, ids, PROMPT, 1)]
            addresses = [[t.data_ptr() for t in (layer.keys, layer.values, layer.pos, layer.slot_data)] for layer in cache.budget_layers]
            with torch.compiler.set_stance("fail_on_recompile"):
                for step, beam in enumerate(beams, start=PROMPT + 1):
                    cache.reorder_cache(beam)
                    logits.append(_teacher_forced(forward, cache, ids, step, 1))
            if static:
                assert addresses == [
                    [t.data_ptr() for t in (layer.keys, layer.values, layer.pos, layer.slot_data)] for layer in cache.budget_layers
                ]
            runs[static] = (torch.cat(logits, dim=1), _held_positions(cache))
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-5, rtol=1e-5)
    assert runs[True][1] == runs[False][1]


def test_a_static_cache_on_a_model_with_sliding_window_layers_is_refused():
    """Gemma-3's sliding-window layers keep transformers' dynamic cache layers, so a static cache there was not
    compileable: generate() ran its decode steps eagerly without a word (on CUDA), and a compiled forward recompiled at
    every step until dynamo's limit stopped it with its own error."""
    from helpers import tiny_model

    _, model = tiny_model("gemma3")
    with pytest.raises(ValueError, match="^a static BudgetCache compiles its decode steps, which 'gemma3_text'.s sliding_attention layers cannot"):
        BudgetCache(model.config, "h2o", budget=BUDGET, static=True)
    assert not BudgetCache(model.config, "h2o", budget=BUDGET).is_compileable
