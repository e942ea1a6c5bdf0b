"""Shared pieces of the bench scripts: model choice, long prompts, timing."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the workbench packages (data/) from a checkout

import kvgates  # noqa: E402
from data.corpus import paul_graham_essays  # noqa: E402
from kvgates.gates import GATE_KINDS  # noqa: E402
from kvgates.policies.learned import LearnedPolicy  # noqa: E402
from kvgates.policies.wrappers import parse_params  # noqa: E402


def setup(doc: str, choices: dict[str, list[str]] | None = None, **options: Any) -> tuple[argparse.Namespace, Any, Any]:
    """Parse a bench script's command line, load its model and print the run's header line.

    Every script takes ``--model`` (``random``: SmolLM2-135M's shape with random weights, ``--layers`` of them),
    ``--device`` and ``--dtype``; its own options are given as ``name=default`` (the type follows the default; a
    list default takes one or more values; ``None`` takes a string) with optional ``choices``. Returns
    ``(args, model, tokenizer)``; the tokenizer is None for the random model.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model to load, or 'random' for a random SmolLM2-135M")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the 'random' model (SmolLM2-135M has 30)")
    for name, default in options.items():
        kind = type(default[0] if isinstance(default, list) else default)
        parser.add_argument(
            f"--{name.replace('_', '-')}", default=default, type=None if default is None else kind,
            nargs="+" if isinstance(default, list) else None, choices=(choices or {}).get(name), help=f"default: {default}",
        )
    args = parser.parse_args()
    model, tokenizer = _load(args)
    facts = "; ".join(f"{name} {getattr(args, name)}" for name, default in options.items() if not isinstance(default, list))
    print(f"device: {device_name(args.device)}; model: {args.model} ({model.config.num_hidden_layers} layers); {facts}")
    return args, model, tokenizer


def _load(args: argparse.Namespace):
    """(model, tokenizer or None) on the requested device; ``random`` builds SmolLM2-135M's shape with random weights."""
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    if args.model == "random":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()
        return kvgates.prepare_model(model), None
    return kvgates.load_model(args.model, dtype=dtype, device=args.device)


def bench_policy(model, spec: str, budget: int, **params: Any) -> kvgates.Policy:
    """The policy ``spec`` (a name, or ``name:key=value,...`` as the benches' ``--policies`` take it, e.g.
    ``adakv:ragged=false``) at ``budget`` (``full``: no budget) with ``params``. Learned policies get fresh gates of
    the model's shape (untrained gates cost what trained ones do). Run it under ``attached``."""
    name, _, given = spec.partition(":")
    params = {**parse_params(given), **params}
    if name != "full":
        params["budget"] = budget
    cls = kvgates.POLICIES.get(name)  # an unknown name is make_policy's error, which lists the policies
    if cls is not None and issubclass(cls, LearnedPolicy):
        params["gates"] = GATE_KINDS[cls.gate_kinds[0]].for_model(model, training_budget=budget)
    return kvgates.make_policy(name, **params)


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


def essay_ids(tokenizer, n: int, device: str | torch.device) -> torch.Tensor:
    """``[1, n]`` token ids of the Paul Graham essays (random ids when there is no tokenizer)."""
    if tokenizer is None:
        return torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    ids = tokenizer(paul_graham_essays(), add_special_tokens=False)["input_ids"][:n]
    return torch.tensor([ids], device=device)


def sync(device: str | torch.device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


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
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        if before_timing is not None:
            before_timing()
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        sync(device)
    return time.perf_counter() - start


def device_name(device: str) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
