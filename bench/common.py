"""Shared pieces of the bench scripts: model choice, long prompts, timing."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the workbench packages (data/) from a checkout

import kvgates  # noqa: E402
from data.corpus import paul_graham_essays  # noqa: E402
from kvgates.cli import OneLineParser, plain  # noqa: E402
from kvgates.gates import GATE_KINDS  # noqa: E402
from kvgates.kernels.host import PREFILL_CONFIG_ENV  # noqa: E402
from kvgates.models import device_and_dtype, tokenizer_source  # noqa: E402
from kvgates.policies.wrappers import learned_policy, parse_params, with_gates  # noqa: E402


def setup(
    doc: str,
    choices: dict[str, list[str]] | None = None,
    zero_ok: tuple[str, ...] = (),
    check: Callable[[argparse.Namespace], str | None] | None = None,
    **options: Any,
) -> tuple[argparse.Namespace, Any, Any]:
    """Parse a bench script's command line, load its model and print the run's header line.

    Every script takes ``--model`` (``random[:SHAPE]``: a ``RANDOM_SHAPES`` shape with random weights, ``--layers`` of them),
    ``--device`` and ``--dtype``; its own options are given as ``name=default`` (the type follows the default; a
    list default takes one or more values; ``None`` takes a string; ``False`` is a flag) with optional ``choices``. A
    number counts something, so it must be at least 1, or at least 0 where 0 means something: an option whose default
    is 0, or one named in ``zero_ok`` (``--slack 0``: no amortised rows). ``check`` is the script's own test of the
    parsed options (a sentence saying what is wrong, or None), run before the model loads as these are, and as the
    building of each ``--policies`` entry at ``--budget`` is (a learned policy's on placeholder gates; an entry given
    twice is refused: its rows would share a label); a model that cannot load (``UnsupportedModelError``, an
    ``OSError``) is refused in one sentence too. Returns
    ``(args, model, tokenizer)``; the tokenizer is None for the random model.
    """
    parser = OneLineParser(description=plain(doc), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="smollm2-135m",
        help=f"model to load, or random[:SHAPE] for random weights of a known shape ({', '.join(RANDOM_SHAPES)}; default smollm2-135m)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of a random model (default: the shape's own)")
    for name, default in options.items():
        if default is False:
            parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", help="default: off")
            continue
        kind = type(default[0] if isinstance(default, list) else default)
        parser.add_argument(
            f"--{name.replace('_', '-')}", default=default, type=None if default is None else kind,
            nargs="+" if isinstance(default, list) else None, choices=(choices or {}).get(name), help=f"default: {default}",
        )
    args = parser.parse_args()
    # Found before the model loads (an 8B random model takes minutes), each in one sentence rather than a traceback.
    numbers = {"layers": args.layers, **{name: getattr(args, name) for name in options}}
    for name, value in numbers.items():
        least = 0 if name in zero_ok or options.get(name) == 0 else 1
        for number in value if isinstance(value, list) else [value]:
            if isinstance(number, (int, float)) and not isinstance(number, bool) and number < least:
                parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {number}")
    if random_shape(args.model) not in (None, *RANDOM_SHAPES):
        parser.error(f"--model {args.model}: unknown random model shape; known: {', '.join(f'random:{n}' for n in RANDOM_SHAPES)}")
    if args.layers is not None and random_shape(args.model) is None:
        parser.error(f"--layers applies to --model random[:SHAPE] only; {args.model} runs with its own layers")
    try:
        device_and_dtype(args.device, "float32", prefix="--", command=parser.prog)
    except ValueError as err:
        parser.error(str(err))
    specs = getattr(args, "policies", None) or []
    unknown = [spec.partition(":")[0] for spec in specs if spec.partition(":")[0] not in kvgates.POLICIES]
    if unknown:
        parser.error(f"--policies: unknown policy {unknown[0]!r}; available policies: {', '.join(sorted(kvgates.POLICIES))}")
    twice = next((spec for i, spec in enumerate(specs) if spec in specs[:i]), None)
    if twice is not None:  # (prefill_speed's row took both entries' times, its range of ratios paired the wrong rounds)
        parser.error(f"--policies {twice} is given twice; give each entry once")
    budget = getattr(args, "budget", None)
    for spec in specs:
        problem = policy_problem(spec, budget if isinstance(budget, int) else None)
        if problem is not None:
            parser.error(problem)
    problem = None if check is None else check(args)
    if problem is not None:
        parser.error(problem)
    launch = os.environ.get(PREFILL_CONFIG_ENV)  # the prefill kernels' blocks, where a sweep set them (bench/kernels.py)
    shape = random_shape(args.model)
    if launch:  # checked with the defaults it leaves, for this run's head dim, dtype and device (a real model's: once loaded)
        _check_launch(parser, args, RANDOM_SHAPES[shape]["head_dim"] if shape else None)
    try:
        model, tokenizer = _load(args)
    except (ValueError, OSError) as err:  # UnsupportedModelError (a ValueError): not a model, unreachable, or unsupported
        parser.error(f"--model {args.model}: {(str(err).strip().splitlines() or [type(err).__name__])[0]}")
    if launch and not shape:
        config = model.config
        _check_launch(parser, args, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    facts = "; ".join(f"{name} {getattr(args, name)}" for name, default in options.items() if not isinstance(default, list))
    if launch:
        facts += f"; {PREFILL_CONFIG_ENV}={launch}"
    print(f"device: {device_name(args.device)}; model: {args.model} ({model.config.num_hidden_layers} layers); {facts}")
    return args, model, tokenizer


def policy_problem(spec: str, budget: int | None, source: str = "") -> str | None:
    """What is wrong with the ``--policies`` entry ``spec`` (``name`` or ``name:key=value,...``) built at ``budget``
    (its parameters alone where None; a learned policy's on placeholder gates), in one sentence that names the
    option the budget came from after the entry where ``source`` does (`` at --configs 160:32``), else None: what a
    bench checks before its model loads."""
    name, _, given = spec.partition(":")
    try:
        _build_on_placeholders(name, parse_params(given, "parameter"), budget)
    except ValueError as err:
        return f"--policies {spec}{source}: {err}"
    return None


def budget_problem(policies: dict[str, dict[str, Any]], budget: int) -> str | None:
    """What the first of ``policies`` (``{name: params}``: the policies a bench runs whatever its ``--policies``, a
    learned one's on placeholder gates) that refuses ``budget`` says, in one sentence that names ``--budget``, else
    None: what such a bench checks before its model loads."""
    for name, params in policies.items():
        try:
            _build_on_placeholders(name, params, budget)
        except ValueError as err:
            return f"--budget {budget}: {err}"
    return None


def _build_on_placeholders(name: str, params: dict[str, Any], budget: int | None) -> None:
    """Build policy ``name`` with ``params`` at ``budget`` (``full``: none), a learned policy on placeholder gates
    (its gates alone where ``budget`` is None): a ValueError says what it refuses."""
    params = _with_gates(name, params, lambda kind: GATE_KINDS[kind].placeholder())
    if budget is not None:
        kvgates.make_policy(name, **params, **({} if name == "full" else {"budget": budget}))


#: Model shapes the benches build with random weights (``--model random:NAME``; ``random`` alone is SmolLM2-135M),
#: taken from the models' published configs: the one place the training, decode and prefill benches read them from.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
}


def random_shape(model: str) -> str | None:
    """The shape a ``--model`` value asks for (``random`` or ``random:NAME``; ``setup`` refuses a NAME not in
    ``RANDOM_SHAPES``), None for a real model."""
    if model != "random" and not model.startswith("random:"):
        return None
    return model.partition(":")[2] or "smollm2-135m"


def random_model(shape: str, layers: int | None, device: str | torch.device, dtype: torch.dtype, max_positions: int = 32768):
    """A causal LM of ``RANDOM_SHAPES[shape]`` (``layers`` decoder layers, default the model's own) with random weights,
    built directly on ``device`` in ``dtype`` (an 8B shape never exists in float32 on the host)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(RANDOM_SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(fields.pop("model_type"), max_position_embeddings=max_positions, **fields)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def _dtype(args: argparse.Namespace) -> torch.dtype:
    """The run's dtype: ``--dtype``, else bfloat16 on a GPU and float32 on the CPU."""
    return getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)


def _check_launch(parser: argparse.ArgumentParser, args: argparse.Namespace, head_dim: int | None) -> None:
    """Refuse ``KVGATES_PREFILL_CONFIG`` in one sentence if it is malformed, or (``head_dim`` known) if the prefill
    configuration it makes with the defaults it leaves is (``_prefill_config``), rather than at the first prefill."""
    from kvgates.kernels.triton_ops import _prefill_config, _prefill_override

    try:
        _prefill_override(os.environ[PREFILL_CONFIG_ENV])
        if head_dim is not None:
            _prefill_config(head_dim, _dtype(args), torch.device(args.device))
    except ValueError as err:
        parser.error(str(err))


def _load(args: argparse.Namespace):
    """(model, tokenizer or None) on the requested device; ``random[:NAME]`` builds a model of that shape with random
    weights (``--layers`` of them)."""
    dtype = _dtype(args)
    shape = random_shape(args.model)
    if shape is not None:
        return kvgates.prepare_model(random_model(shape, args.layers, args.device, dtype)), None
    return kvgates.load_model(args.model, dtype=dtype, device=args.device)


def bench_policy(model, spec: str, budget: int, **params: Any) -> kvgates.Policy:
    """The policy ``spec`` (a name, or ``name:key=value,...`` as the benches' ``--policies`` take it, e.g.
    ``adakv:ragged=false``) at ``budget`` (``full``: no budget) with ``params``. Learned policies get fresh gates of
    the model's shape (untrained gates cost what trained ones do). Run it under ``attached``."""
    name, _, given = spec.partition(":")
    params = _with_gates(name, {**parse_params(given, "parameter"), **params}, lambda kind: GATE_KINDS[kind].for_model(model, training_budget=budget))
    if name != "full":
        params["budget"] = budget
    if name == "kvzip" and not tokenizer_source(model):  # random weights have no tokenizer; a 6-token repeat prompt
        params.setdefault("repeat_ids", [1, 2, 3, 4, 5, 6])
    return kvgates.make_policy(name, **params)


def short_context(option: str, contexts: list[int], budget: int, prefill: bool = False) -> str | None:
    """A context (a prompt) of ``option`` shorter than ``budget``, in one sentence (a cache of the budget would hold the
    whole prompt and nothing of it would be evicted), else None. ``prefill``: the bench measures the prompt's own
    eviction (its scoring and compression), so a context of the budget is refused too: a prompt of exactly the budget
    fills the cache and evicts nothing (a table of prefills that compressed nothing, under the policies' names)."""
    short = [n for n in contexts if n < budget or (prefill and n == budget)]
    if not short:
        return None
    relation = "less than" if short[0] < budget else "the same as"
    least = "more than" if prefill else "at least"
    return f"{option} {short[0]} is {relation} --budget {budget}: nothing would be evicted from the prompt; give contexts of {least} the budget"


def _with_gates(name: str, params: dict[str, Any], make: Callable[[str], Any]) -> dict[str, Any]:
    """``params`` of policy ``name`` with gates ``make(gate kind)`` for the learned policy it runs, itself or a
    wrapper's base (unchanged when it runs none, or ``name`` is unknown: make_policy's error lists the policies)."""
    learned = learned_policy(name, params) if name in kvgates.POLICIES else None
    return params if learned is None else with_gates(name, params, make(learned.gate_kinds[0]))


@contextmanager
def attached(model, cache) -> Iterator[None]:
    """``cache``'s policy attached to ``model`` for the block only (a learned policy hooks the model, and its hooks
    must not run in the other caches' forwards); nothing for a cache without a policy."""
    policy = cache.policy if isinstance(cache, kvgates.BudgetCache) else None
    if policy is not None:
        policy.attach(model)
    try:
        yield
    finally:
        if policy is not None:
            policy.detach()


#: Tokens between the starts of two rows of ``essay_ids``.
ROW_STRIDE = 4099


def essay_ids(tokenizer, n: int, device: str | torch.device, batch: int = 1) -> torch.Tensor:
    """``[batch, n]`` token ids of the Paul Graham essays (random ids when there is no tokenizer): row ``i`` starts
    ``i * ROW_STRIDE`` tokens in (the essays repeated past their end), so a batch's rows differ as a real batch's
    prompts do. (Where every row was the same prompt, every sequence kept as many tokens in every head, which the
    host then knows: policies whose budgets depend on the scores read back less than they do for real batches.)"""
    if tokenizer is None:
        return torch.randint(100, 40000, (batch, n), generator=torch.Generator().manual_seed(0)).to(device)
    ids = tokenizer(paul_graham_essays(), add_special_tokens=False)["input_ids"]
    need = (batch - 1) * ROW_STRIDE + n
    ids = ids * -(-need // len(ids))
    return torch.tensor([ids[i * ROW_STRIDE : i * ROW_STRIDE + n] for i in range(batch)], device=device)


def time_prefill(model, make_cache, ids: torch.Tensor, device: str | torch.device) -> tuple[float, Any]:
    """Seconds of one prefill of ``ids`` into a fresh ``make_cache()`` (its policy attached; only the last position's
    logits computed), and that cache."""
    cache = make_cache()
    with attached(model, cache), torch.no_grad():
        sync(device)
        start = time.perf_counter()
        model(ids, past_key_values=cache, logits_to_keep=1)
        sync(device)
        return time.perf_counter() - start, cache


def crop_to(cache, tokens: int | None) -> None:
    """Cut a DynamicCache back to ``tokens`` (its prompt) between rounds; budgeted caches (and ``tokens`` None) stay as
    they are."""
    if tokens is not None and isinstance(cache, DynamicCache) and cache.get_seq_length() > tokens:
        cache.crop(tokens - cache.get_seq_length())  # (transformers 5.x: a negative count of tokens to remove)


def sync(device: str | torch.device) -> None:
    """Wait for the work queued on ``device``: that GPU's (``--device cuda:1``), not the current one's; nothing on a CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int = 1) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def time_decode(model, cache, ids: torch.Tensor, steps: int, device, before_timing=None) -> float:
    """Prefill ``ids`` into ``cache``, run one warm-up decode step, call ``before_timing()`` if given, then
    return the seconds taken by ``steps`` greedy decode steps."""
    with torch.no_grad():
        token = model(ids, past_key_values=cache, logits_to_keep=1).logits.argmax(-1)
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        if before_timing is not None:
            before_timing()
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        sync(device)
    return time.perf_counter() - start


def timed_steps(cache, steps: int) -> int:
    """Decode steps to time ``cache`` over in a round: ``steps``, rounded up to a whole number of its policy's
    eviction periods (``Schedule.slack``) where it evicts every few steps (amortised eviction), since any run of a
    period's steps holds one eviction. (At ``--steps 8 --rounds 2 --slack 32`` the amortised rows decoded 20 tokens
    and never evicted: their steps were steps without eviction.)"""
    schedule = cache.policy.schedule if isinstance(cache, kvgates.BudgetCache) else None
    period = schedule.slack if schedule is not None and schedule.decode_every else 1
    return -(-steps // period) * period


def periods_note(windows: dict[str, int], steps: int) -> str:
    """What a decode table's title adds where some caches were timed over more than ``steps`` steps (``windows``:
    each cache's ``timed_steps``): `` (40 for the caches that evict every few steps: whole eviction periods)``, or
    nothing."""
    longer = " or ".join(str(n) for n in sorted(set(windows.values()) - {steps}))
    return f" ({longer} for the caches that evict every few steps: whole eviction periods)" if longer else ""


def round_order(labels: list[str], r: int) -> list[str]:
    """The arms of round ``r`` in the order they run: ``labels`` in even rounds, reversed in odd ones, so that a drift
    across a round (a first round's costs fading, a device warming up) falls alike on every arm over two rounds, not
    always on the first ones (the reference of every ratio)."""
    return labels[::-1] if r % 2 else labels


def decode_rounds(arms: dict[str, Any], rounds: int, step_ms: Callable[[str, Any], float], where: str = "") -> dict[str, list[float]]:
    """``{label: its ms/step in each of the rounds}`` of the arms ``{label: arm}``: ``step_ms(label, arm)`` (one timed
    decode of that arm) once per arm per round, interleaved, for ``rounds`` rounds after one untimed warm-up round (a
    first round's allocations, autotuning and compilation stay out of the medians), every other round in reverse order
    (``round_order``). Each measurement goes to stderr as it is taken, ``where`` (``, batch 8``) after its round."""
    times: dict[str, list[float]] = {label: [] for label in arms}
    for r in range(rounds + 1):
        for label in round_order(list(arms), r):
            ms = step_ms(label, arms[label])
            if r:
                times[label].append(ms)
            print(f"  {f'round {r}/{rounds}' if r else 'warm-up round'}{where}: {label} {ms:.2f} ms/step", file=sys.stderr, flush=True)
    return times


def device_name(device: str) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
