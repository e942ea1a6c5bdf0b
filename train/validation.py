"""Validation and the final held-out table of a training run, both with hard eviction (``eval.heldout``).

* ``Validator`` (every ``training.eval_steps`` and at the end): the gates being trained, run by their inference
  policy at the training budget on *validation* essays (rows of the config's mix, needles with train templates).
  The best checkpoint is the one with the lowest KL here; the test split is never used to choose anything.
* ``final_table``: the held-out comparison that ends a run, on *test* essays with *eval* templates: trained gates,
  the same gates untrained (or the adapter the run started from), the configured heuristics, and the full cache, all at the training budget.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvgates
from data.build import build_dataset
from data.tasks import NoRoomError, make_example
from eval.heldout import HeldOut
from kvgates.errors import ConfigError
from kvgates.methods.base import eval_mode
from train.config import TrainConfig


def needle_examples(
    tokenizer: PreTrainedTokenizerBase, split: str, template_set: str, count: int, tokens: int, seed: int, option: str, fix: str
) -> list[dict]:
    """``count`` single-needle examples of ``tokens`` tokens at evenly spaced depths; ``ConfigError`` (``option``:
    what does not fit; ``fix``) when a needle does not fit its tokens (the needle task's own hint names options these
    needles do not take), and (``option``: why) when their haystacks are longer than the ``split`` essays."""
    depths = [i / max(count - 1, 1) for i in range(count)]
    try:
        return [
            make_example("needle", tokenizer, split, tokens, seed=seed * 7919 + i, template_set=template_set, depth=d)
            for i, d in enumerate(depths)
        ]
    except NoRoomError as err:
        raise ConfigError(f"{option}: {err.fact}; {fix}") from None
    except ValueError as err:  # (not data.mix's, as the run named it: the needles' haystacks are longer than the essays)
        raise ConfigError(f"{option}: {err}") from None


def learned_policy(config: TrainConfig, gates: kvgates.GateSet) -> kvgates.Policy:
    """The inference policy of ``gates`` at the training budget, on a copy (attaching never touches the original)."""
    return kvgates.make_policy(config.learned_method.policy, budget=config.budget, gates=copy.deepcopy(gates), **config.policy)


class Validator:
    """Hard-eviction validation of the gates being trained (see the module docstring)."""

    def __init__(self, config: TrainConfig, tokenizer: PreTrainedTokenizerBase, heldout: HeldOut):
        self.config, self.tokenizer, self.heldout = config, tokenizer, heldout

    @classmethod
    def build(cls, config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> Validator:
        data = config.data
        rows = build_dataset(
            tokenizer, data.mix, "validation", data.validation_examples, data.seq_len, data.seed, data.format, model=config.model
        )
        tokens = config.validation.needle_tokens or data.seq_len
        length = "validation.needle_tokens" if config.validation.needle_tokens else "data.seq_len or set validation.needle_tokens"
        needles = needle_examples(
            tokenizer, "validation", "train", config.validation.needles, tokens, data.seed, "validation.needles",
            f"raise {length}, or set validation.needles: 0",
        )
        return cls(config, tokenizer, HeldOut.build(tokenizer, rows, needles))

    @torch.no_grad()
    def run(
        self, model: PreTrainedModel, gates: kvgates.GateSet, shard: tuple[int, int] = (0, 1), gather: Callable[[list], list] | None = None
    ) -> dict[str, float]:
        """The held-out metrics of ``gates`` on ``model``; over several processes, each runs its ``shard`` of the
        held-out batches and ``gather`` joins them (``eval.heldout.HeldOut.evaluate``)."""
        policy = learned_policy(self.config, gates).attach(model)
        try:
            return self.heldout.evaluate(model, self.tokenizer, policy, self.config.report.max_new_tokens, shard, gather)
        finally:
            policy.detach()


def start_label(config: TrainConfig) -> str:
    """What the run's gates were before training: ``untrained``, or the adapter it continued from."""
    return f"start: {config.gates.init_from}" if config.gates.init_from else "untrained"


def report_heldout(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> HeldOut:
    """The final table's needles and rows (test essays and the test rows of the mix, eval templates), made before
    training so that what cannot be made is refused then, not after the run's hours as a traceback without a report: a
    needle that does not fit ``data.seq_len`` (``ConfigError``), a source with no row in the test split (``ValueError``:
    a Hub dataset's or a packed source's splits are read only when its rows are built)."""
    data = config.data
    needles = needle_examples(
        tokenizer, "test", "eval", config.report.needles, data.seq_len, data.seed, "report.needles", "raise data.seq_len, or set report.needles: 0"
    )
    rows = build_dataset(
        tokenizer, data.mix, "test", config.report.examples, data.seq_len, data.seed, data.format, template_set="eval", model=config.model
    )
    return HeldOut.build(tokenizer, rows, needles)


@torch.no_grad()
def final_table(
    config: TrainConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, trained: kvgates.GateSet, start: kvgates.GateSet,
    heldout: HeldOut,
) -> dict[str, dict[str, float]]:
    """The held-out comparison at the training budget (test essays, eval templates; ``heldout``: ``report_heldout``);
    results by arm. The model runs in eval mode (a run ends in train mode, where a layer under activation checkpointing
    would drop the cache)."""
    report = config.report
    arms = {
        f"{config.kind} (trained)": lambda: learned_policy(config, trained),
        f"{config.kind} ({start_label(config)})": lambda: learned_policy(config, start),
    }
    for name in report.policies:
        arms[name] = lambda name=name: kvgates.make_policy(name, budget=config.budget)
    arms["full"] = lambda: kvgates.make_policy("full")
    with eval_mode(model):
        return heldout.compare(model, tokenizer, arms, report.max_new_tokens)
