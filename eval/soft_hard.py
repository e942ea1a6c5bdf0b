"""The soft/hard gap of retention gates: the KL to the full cache that training optimises against the one
inference gets, on the same tokens.

    python -m eval softhard --budget 128 --gates smollm2-135m-trimkv-128 checkpoints/RUN/checkpoint-150

Training scores TRIM-KV gates with *soft* eviction: every token stays visible, its attention logit lowered by
``(t - i) log beta_i`` (``GateTraining.learn()``), and a capacity hinge keeps the soft retention mass
within the budget. Inference evicts *hard*: each KV head keeps the ``budget`` tokens with the highest decayed
score (``BudgetCache``). For windows of the *validation* essays (``prompt_tokens`` prompt, then ``new_tokens`` of the
essay's own text, teacher-forced one decode step at a time) this prints, per gate set, the mean KL to the full
cache over the continuation under both (a progress bar on stderr counts the windows), under a line naming the model
and the device and dtype it ran in. Gates whose training lowers the soft KL while the hard one rises are optimising
something inference does not reward.

The model runs where ``--device`` says (``cpu``, ``cuda`` or ``cuda:N``) with its weights and cache in ``--dtype``;
the defaults, the CPU in float32, are ``python -m eval ab``'s, and a GPU this machine lacks is refused in one
sentence before anything loads. The gates score in float32 under soft eviction, as training runs them, and in the
model's dtype under hard eviction, as inference does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvgates
from data.splits import check_corpus
from eval.config import ABConfig
from eval.fidelity import completion_fidelity, kl_divergence, make_batch, reference_logprobs
from kvgates.cli import OneLineParser, plain
from kvgates.gates.training import GateTraining
from kvgates.methods import method_of
from kvgates.methods.trimkv import TrimKVMethod
from kvgates.models import DTYPES, check_model_source, device_and_dtype, past_context


@dataclass
class SoftHard:
    """Mean KL to the full cache over one window's continuation, under soft and under hard eviction."""

    soft: float
    hard: float


def windows(tokenizer: PreTrainedTokenizerBase, count: int, length: int, split: str = "validation") -> list[list[int]]:
    """``count`` windows of ``length`` tokens evenly spread over the ``split`` essays (first and last included)."""
    from data.tasks import split_ids

    ids = split_ids(tokenizer, split)
    if len(ids) < length:
        raise ValueError(f"the {split} essays hold {len(ids)} tokens, fewer than one window of {length}")
    last = len(ids) - length
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)]
    return [list(ids[s : s + length]) for s in starts]


def evicted_context(prompt_tokens: int, new_tokens: int) -> int:
    """The tokens the cache holds at the last eviction a scored prediction reads, in a window of ``prompt_tokens``
    and ``new_tokens``: a budget of at least this many evicts nothing any prediction reads (the hard KL is 0).

    The prompt's forward attends every prompt token and predicts the first continuation token; each decode step then
    feeds one continuation token but the last (nothing it would predict is scored), attends, and evicts down to the
    budget. The step before the last prediction's leaves ``prompt_tokens + new_tokens - 2`` tokens in the cache."""
    return prompt_tokens + new_tokens - 2


def soft_trained(gates: kvgates.GateSet) -> bool:
    """Whether ``gates`` train with soft eviction (TRIM-KV's retention-biased student)."""
    return isinstance(method_of(gates), TrimKVMethod)


@torch.no_grad()
def soft_hard(
    model: PreTrainedModel, gates: kvgates.GateSet, budget: int, window: list[int], prompt_tokens: int
) -> SoftHard:
    """Soft and hard mean KL to the full cache over ``window[prompt_tokens:]`` (see the module docstring)."""
    if not soft_trained(gates):
        raise ValueError(f"gates of kind {gates.kind!r} are not trained with soft eviction (retention gates are)")
    if not 0 < prompt_tokens < len(window):
        raise ValueError(f"prompt_tokens must leave a continuation inside the {len(window)}-token window, got {prompt_tokens}")
    ids = torch.tensor(window)
    batch = make_batch([ids[:prompt_tokens]], [ids[prompt_tokens:]], pad_id=0)
    reference = reference_logprobs(model, batch)[0]
    n = batch.completion_len
    with GateTraining(model, gates) as training:
        training.learn()
        logits = model(batch.ids.to(model.device), use_cache=False, logits_to_keep=n + 1).logits[0, :n]
    soft = kl_divergence(reference, torch.log_softmax(logits.float(), -1).cpu()).mean()
    policy = kvgates.make_policy(method_of(gates).policy, budget=budget, gates=gates)
    with policy.attach(model):
        hard = completion_fidelity(model, policy, batch, reference[None])[0].kl.mean()
    return SoftHard(float(soft), float(hard))


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m eval softhard", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gates", nargs="+", required=True, help="adapters: shipped names, folders or Hub ids")
    parser.add_argument("--budget", type=int, default=128, help="tokens per KV head (default %(default)s)")
    parser.add_argument("--model", default="smollm2-135m", help="the embedded model, a Hub id or a model folder (default %(default)s)")
    parser.add_argument("--windows", type=int, default=3, help="validation-essay windows (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prompt tokens of each window (default %(default)s)")
    parser.add_argument(
        "--new-tokens", type=int, default=512,
        help="tokens of the essay teacher-forced after each prompt, at least 2: the prompt's forward predicts the first from every "
             "prompt token (default %(default)s)",
    )
    parser.add_argument("--device", default=ABConfig.device, help="where the model runs: cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--dtype", default=ABConfig.dtype, choices=DTYPES, help="the model's weights and cache (default %(default)s)")
    args = parser.parse_args(argv)
    for name, value, least in (("--budget", args.budget, 1), ("--windows", args.windows, 1), ("--prompt-tokens", args.prompt_tokens, 1),
                               ("--new-tokens", args.new_tokens, 2)):  # (one new token: its prediction evicts nothing)
        if value < least:
            parser.error(f"{name} must be at least {least}, got {value}")
    held = evicted_context(args.prompt_tokens, args.new_tokens)
    if args.budget >= held:  # no prediction reads an evicted cache: the hard KL would be 0, a comparison of nothing
        parser.error(
            f"--budget {args.budget} keeps every token the predictions read (the last eviction before one finds --prompt-tokens "
            f"{args.prompt_tokens} + --new-tokens {args.new_tokens} - 2 = {held} tokens in the cache), so nothing is evicted; "
            f"pass a budget below {held}"
        )
    try:
        device, dtype = device_and_dtype(args.device, args.dtype, prefix="--", command=parser.prog)
    except ValueError as err:
        parser.error(str(err))
    # Everything that can be checked without the model first: the adapters (readable, of a kind trained with soft
    # eviction) and the model's config; then the model, and each adapter against it, before any table line.
    adapters = {name: kvgates.load_gates(name).to(device=device, dtype=torch.float32) for name in args.gates}
    for name, gates in adapters.items():
        if not soft_trained(gates):
            raise kvgates.AdapterError(f"{name} holds {gates.kind!r} gates, which are not trained with soft eviction (retention gates are)")
    check_model_source(args.model)
    check_corpus()  # (the windows are the validation essays'; a ConfigError, not the parser's error sending to --help)
    model, tokenizer = kvgates.load_model(args.model, dtype=dtype, device=device)
    past = past_context(model, args.model, args.prompt_tokens + args.new_tokens)
    if past is not None:
        parser.error(f"--prompt-tokens {args.prompt_tokens} and --new-tokens {args.new_tokens} {past}")
    for gates in adapters.values():
        try:
            gates.check_model(model)
        except kvgates.AdapterError as err:  # (it offers strict=False, an option this command does not have)
            raise kvgates.AdapterError(str(err).replace("; pass strict=False to attach them anyway", "")) from None
    try:
        texts = windows(tokenizer, args.windows, args.prompt_tokens + args.new_tokens)
    except ValueError as err:  # essays shorter than one window (a model whose context is longer than they are)
        parser.error(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens}: {err}")
    print(f"KL to the full cache of {args.model} on {args.device} in {args.dtype}\n")
    print("| gates | budget | soft KL (training) | hard KL (inference) | per window (soft / hard) |\n|---|---|---|---|---|")
    for name, gates in adapters.items():
        # Each window teacher-forces new_tokens decode steps (tens of seconds on a CPU): a bar on stderr per gate set.
        rows = [soft_hard(model, gates, args.budget, w, args.prompt_tokens) for w in tqdm(texts, desc=name, unit="window", leave=False)]
        soft = sum(r.soft for r in rows) / len(rows)
        hard = sum(r.hard for r in rows) / len(rows)
        each = ", ".join(f"{r.soft:.4f} / {r.hard:.4f}" for r in rows)
        print(f"| {name} | {args.budget} | {soft:.4f} | {hard:.4f} | {each} |", flush=True)
