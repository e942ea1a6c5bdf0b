"""Paired statistics of two arms on the same examples: bootstrap interval, win/tie/loss, McNemar, a verdict sentence.

Every comparison is *paired*: arm A and arm B ran on exactly the same examples, so the unit of analysis is the
per-example difference. ``improvement`` orients it so that a positive value always means "A did better" (for a
lower-is-better metric such as KL it is ``B - A``).

* ``bootstrap_ci``: percentile bootstrap interval of the mean difference (resampling examples with replacement),
  vectorised over any leading axes so that a thousand simulated experiments run in one call.
* ``sign_flip_p``: the paired sign-flip (randomisation) test of a zero mean difference, exact up to
  ``EXACT_FLIPS`` examples: the test that decides a verdict. The percentile bootstrap alone is too narrow at the
  handful of examples an A/B task may have (at 5 examples under no difference its interval excluded zero in 15% of
  simulated experiments, not 5%); the sign-flip test holds its level at any size.
* ``win_tie_loss``: how many examples A did better on, the same, worse.
* ``mcnemar_exact``: the exact (binomial) McNemar test for a binary outcome (answer correct or not).
* ``compare`` puts them together into a ``Comparison``; ``Comparison.sentence`` is the one-line verdict, which
  names the memory each arm held when it differs by more than ``MATCHED_KV`` (or when the two arms ran at
  different budgets: a comparison at matched memory, see ``eval.runner.comparisons``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

#: Fewer paired examples than this never make a verdict: with 5 the sign-flip test's smallest two-sided p is 2/32.
MIN_PAIRS = 6
#: A verdict needs a sign-flip p below this (and a bootstrap interval excluding zero).
LEVEL = 0.05
#: ``sign_flip_p`` enumerates every sign pattern up to this many examples, and draws ``FLIPS`` patterns past it.
EXACT_FLIPS = 16
FLIPS = 20000
#: Sign patterns ``sign_flip_p`` weighs at once.
FLIP_BLOCK = 2048
#: Per-example differences within this of zero are ties: no win, no loss, nothing for a test to weigh.
TIE = 1e-9
#: Two points hold matched memory when the larger mean KV is at most this many times the smaller.
MATCHED_KV = 1.1


def matched_memory(kv_a: float, kv_b: float) -> bool:
    """Whether two points held matched memory: the larger mean KV at most ``MATCHED_KV`` times the smaller."""
    return max(kv_a, kv_b) <= MATCHED_KV * min(kv_a, kv_b)


def bootstrap_ci(diffs: np.ndarray, n_boot: int = 2000, level: float = 0.95, seed: int = 0, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap ``(low, high)`` interval of the mean of ``diffs`` over its last axis.

    Args:
        diffs: ``[..., n]`` paired differences; leading axes are independent experiments.
        n_boot: bootstrap resamples.
        level: coverage of the interval.
        seed: seeds the resampling (same inputs and seed, same interval).
        chunk: experiments resampled at once (bounds memory at ``chunk * n_boot * n`` floats).
    """
    diffs = np.asarray(diffs, dtype=np.float64)
    if diffs.shape[-1] < 1:
        raise ValueError("bootstrap_ci needs at least one paired difference")
    flat = diffs.reshape(-1, diffs.shape[-1])
    n = flat.shape[1]
    rng = np.random.default_rng(seed)
    alpha = (1.0 - level) / 2
    low, high = np.empty(len(flat)), np.empty(len(flat))
    for start in range(0, len(flat), chunk):
        part = flat[start : start + chunk]
        idx = rng.integers(0, n, size=(len(part), n_boot, n))
        means = np.take_along_axis(part[:, None, :], idx, axis=2).mean(-1)  # [chunk, n_boot]
        low[start : start + chunk], high[start : start + chunk] = np.quantile(means, [alpha, 1 - alpha], axis=1)
    return low.reshape(diffs.shape[:-1]), high.reshape(diffs.shape[:-1])


def sign_flip_p(diffs: np.ndarray, tol: float = TIE, seed: int = 0) -> np.ndarray:
    """Two-sided p-value of the paired sign-flip test that the mean of ``diffs`` (over its last axis) is zero.

    Under no difference each example's difference is as likely to have either sign, so the observed ``|sum|`` is
    ranked among the sums of every sign pattern (all ``2^n`` of them up to ``EXACT_FLIPS`` examples, else
    ``FLIPS`` random ones, seeded, counting the observed one as a draw). Differences within ``tol`` of zero are
    ties and weigh nothing; all ties give 1. An experiment with a difference that is not finite gives NaN (no
    verdict). Leading axes are independent experiments.
    """
    diffs = np.asarray(diffs, dtype=np.float64)
    if diffs.shape[-1] < 1:
        raise ValueError("sign_flip_p needs at least one paired difference")
    flat = diffs.reshape(-1, diffs.shape[-1])
    finite = np.isfinite(flat).all(-1)
    flat = np.where(finite[:, None] & (np.abs(flat) > tol), flat, 0.0)
    n = flat.shape[1]
    exact = n <= EXACT_FLIPS
    rng = np.random.default_rng(seed)
    # Sums equal to the observed one but for rounding count as at least as extreme.
    bar = np.abs(flat.sum(-1)) - 1e-9 * np.abs(flat).sum(-1)
    extreme, total = np.zeros(len(flat)), 0
    for start in range(0, 2**n if exact else FLIPS, FLIP_BLOCK):  # patterns in blocks: memory FLIP_BLOCK x n
        if exact:  # every sign pattern
            codes = np.arange(start, min(start + FLIP_BLOCK, 2**n))
            patterns = (1 - 2 * ((codes[:, None] >> np.arange(n)) & 1)).astype(np.float64)
        else:
            patterns = rng.choice([-1.0, 1.0], size=(min(FLIP_BLOCK, FLIPS - start), n))
        total += len(patterns)
        for first in range(0, len(flat), 64):  # (64 experiments at once)
            part = slice(first, first + 64)
            extreme[part] += (np.abs(flat[part] @ patterns.T) >= bar[part, None]).sum(-1)
    drawn = 0 if exact else 1  # a drawn test counts the observed pattern as one of its draws: p is never 0
    p = (extreme + drawn) / (total + drawn)
    return np.where(finite, p, np.nan).reshape(diffs.shape[:-1])


def win_tie_loss(improvement: np.ndarray, tol: float = TIE) -> tuple[int, int, int]:
    """``(wins, ties, losses)`` of A: examples with ``improvement`` above ``tol``, within it, below ``-tol``. A
    difference that is not finite (a score that is NaN or infinite) is none of the three."""
    improvement = np.asarray(improvement, dtype=np.float64)
    finite = np.isfinite(improvement)
    wins, losses = int((finite & (improvement > tol)).sum()), int((finite & (improvement < -tol)).sum())
    return wins, int(finite.sum()) - wins - losses, losses


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided exact McNemar p-value for paired binary outcomes ``a`` and ``b`` (1 = success).

    Only discordant pairs count: with ``n01`` (A failed, B succeeded) and ``n10`` (A succeeded, B failed), under
    the null each discordant pair goes either way with probability 1/2, so ``p = min(1, 2 P[X <= min(n01, n10)])``
    for ``X ~ Binomial(n01 + n10, 1/2)``. No discordant pair gives ``p = 1``.
    """
    a, b = np.asarray(a).astype(bool), np.asarray(b).astype(bool)
    n10, n01 = int((a & ~b).sum()), int((~a & b).sum())
    n = n10 + n01
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(n10, n01) + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass
class Comparison:
    """Arm ``a`` against arm ``b`` on one task at one budget, for one metric."""

    task: str
    budget: int
    a: str
    b: str
    metric: str
    higher_is_better: bool
    n: int
    mean_a: float
    mean_b: float
    improvement: float  # mean advantage of a (positive: a better)
    ci_low: float
    ci_high: float
    wins: int
    ties: int
    losses: int
    #: Binary tasks: exact answers of each arm and the exact McNemar p-value.
    exact_a: int | None = None
    exact_b: int | None = None
    mcnemar_p: float | None = None
    #: Mean KV MiB each arm held per sequence on the paired examples (None: not recorded).
    kv_a: float | None = None
    kv_b: float | None = None
    #: Arm b's budget when it differs from a's: a comparison across budgets at matched memory.
    budget_b: int | None = None

    #: The paired sign-flip test's two-sided p (``sign_flip_p``; None in results written before it was kept).
    sign_flip_p: float | None = None

    @property
    def decided(self) -> bool:
        """At least ``MIN_PAIRS`` examples, a sign-flip p below ``LEVEL`` and an interval that excludes zero."""
        tested = self.sign_flip_p is not None and self.sign_flip_p < LEVEL
        return self.n >= MIN_PAIRS and tested and (self.ci_low > 0 or self.ci_high < 0)

    def sentence(self) -> str:
        """The verdict in one plain sentence, the winner first (e.g. "trimkv beats snapkv at 256 by 0.31 KL ...")."""
        where = f"at {self.budget} on {self.task}" if self.budget_b is None else f"at matched memory on {self.task}"
        undefined = self.n - self.wins - self.ties - self.losses  # differences that are not finite (``win_tie_loss``)
        if undefined:  # no mean, interval or test to state
            text = (
                f"no verdict between {self.a} and {self.b} {where}: {undefined} of {self.n} examples have a {self.metric} "
                f"difference that is not finite (a score that is NaN or infinite); the others: {self.wins} wins {self.losses} losses"
            )
            text += f" {self.ties} ties" if self.ties else ""
            return text + self._exact() + self._memory() + "."
        if self.decided and self.improvement > 0:
            head = f"{self.a} beats {self.b} {where} by {self.improvement:.3g} {self.metric}"
            ci, wins, losses = (self.ci_low, self.ci_high), self.wins, self.losses
        elif self.decided:
            head = f"{self.b} beats {self.a} {where} by {-self.improvement:.3g} {self.metric}"
            ci, wins, losses = (-self.ci_high, -self.ci_low), self.losses, self.wins
        else:
            why = "no clear difference" if self.n >= MIN_PAIRS else f"too few examples ({self.n} < {MIN_PAIRS}) to decide"
            lead = f"{self.a} ahead by {self.improvement:.3g}" if self.improvement >= 0 else f"{self.a} behind by {-self.improvement:.3g}"
            head = f"{why} between {self.a} and {self.b} {where} ({lead} {self.metric})"
            ci, wins, losses = (self.ci_low, self.ci_high), self.wins, self.losses
        text = f"{head}, 95% CI {ci[0]:.3g} to {ci[1]:.3g}, {wins} wins {losses} losses"
        if self.ties:
            text += f" {self.ties} ties"
        if self.sign_flip_p is not None:
            text += f", sign-flip p = {self.sign_flip_p:.2g}"
        return text + self._exact() + self._memory() + "."

    def _exact(self) -> str:
        """McNemar's test on the exact answers, where the metric has them."""
        if self.mcnemar_p is None:
            return ""
        return f"; exact answers {self.exact_a} vs {self.exact_b} of {self.n}, McNemar p = {self.mcnemar_p:.3g}"

    def _memory(self) -> str:
        """What the verdict says about memory: both points' KV across budgets; otherwise which arm held more than
        ``MATCHED_KV`` times the other's, if one did."""
        if self.budget_b is not None:
            return f"; {self.a}@{self.budget} held {self.kv_a:.2f} MiB, {self.b}@{self.budget_b} {self.kv_b:.2f} MiB"
        if not (self.kv_a and self.kv_b) or matched_memory(self.kv_a, self.kv_b):
            return ""
        more, ratio = (self.a, self.kv_a / self.kv_b) if self.kv_a > self.kv_b else (self.b, self.kv_b / self.kv_a)
        return f"; {more} held {ratio:.2f}x the KV"

    def to_dict(self) -> dict:
        return {**asdict(self), "sentence": self.sentence()}


def compare(
    values_a: np.ndarray,
    values_b: np.ndarray,
    *,
    task: str,
    budget: int,
    a: str,
    b: str,
    metric: str,
    higher_is_better: bool,
    binary_a: np.ndarray | None = None,
    binary_b: np.ndarray | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    kv_a: float | None = None,
    kv_b: float | None = None,
    budget_b: int | None = None,
) -> Comparison:
    """Paired comparison of per-example ``values_a`` and ``values_b`` (same examples, same order).

    ``binary_a``/``binary_b`` (optional): per-example binary outcomes (exact answers) for the McNemar test.
    ``kv_a``/``kv_b`` (optional): the mean KV MiB each arm held, named in the verdict when they differ by more
    than ``MATCHED_KV``; ``budget_b``: b's budget when it is not ``budget`` (a comparison at matched memory).
    """
    va, vb = np.asarray(values_a, dtype=np.float64), np.asarray(values_b, dtype=np.float64)
    if va.shape != vb.shape or va.ndim != 1 or not len(va):
        raise ValueError(f"paired values need the same non-empty 1-D shape, got {va.shape} and {vb.shape}")
    improvement = va - vb if higher_is_better else vb - va
    finite = bool(np.isfinite(improvement).all())  # (an infinite or NaN difference: no interval, no verdict)
    low, high = bootstrap_ci(improvement, n_boot=n_boot, seed=seed) if finite else (math.nan, math.nan)
    p = float(sign_flip_p(improvement, seed=seed))
    wins, ties, losses = win_tie_loss(improvement)
    extra = {}
    if binary_a is not None and binary_b is not None:
        extra = dict(
            exact_a=int(np.sum(binary_a)), exact_b=int(np.sum(binary_b)), mcnemar_p=mcnemar_exact(binary_a, binary_b)
        )
    return Comparison(
        task=task, budget=budget, a=a, b=b, metric=metric, higher_is_better=higher_is_better, n=len(va),
        mean_a=float(va.mean()), mean_b=float(vb.mean()), improvement=float(improvement.mean()),
        ci_low=float(low), ci_high=float(high), wins=wins, ties=ties, losses=losses, kv_a=kv_a, kv_b=kv_b,
        budget_b=budget_b, sign_flip_p=p, **extra,
    )
