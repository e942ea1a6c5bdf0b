"""The A/B harness's paired statistics, on simulated data with known differences and on hand-computed cases."""

import numpy as np
import pytest

from eval.stats import LEVEL, bootstrap_ci, compare, mcnemar_exact, sign_flip_p, win_tie_loss


def test_bootstrap_interval_covers_the_true_difference_95_percent_of_the_time():
    # 1,000 simulated paired experiments of 60 examples each: per-example difficulty shared by both arms (it cancels
    # in the pairing), skewed per-arm noise, and a true mean difference of 0.3. (Over other seeds the coverage of
    # this percentile interval ranges 0.934-0.944: the Monte Carlo error of 1,000 experiments is about 0.007.)
    rng = np.random.default_rng(13)
    experiments, n, true = 1000, 60, 0.3
    difficulty = rng.normal(0, 2, size=(experiments, n))
    a = difficulty + true + rng.exponential(1.0, size=(experiments, n))
    b = difficulty + rng.exponential(1.0, size=(experiments, n))
    low, high = bootstrap_ci(a - b, n_boot=1000, seed=3)
    coverage = float(((low <= true) & (true <= high)).mean())
    assert 0.93 <= coverage <= 0.97, coverage
    assert (low < high).all()


def test_bootstrap_is_deterministic_by_seed_and_shrinks_with_more_examples():
    d = np.random.default_rng(0).normal(1.0, 1.0, size=200)
    assert bootstrap_ci(d, seed=5) == bootstrap_ci(d, seed=5)
    small = np.subtract(*bootstrap_ci(d[:20])[::-1])
    large = np.subtract(*bootstrap_ci(d)[::-1])
    assert large < small
    assert bootstrap_ci(np.full(7, 0.25)) == (pytest.approx(0.25), pytest.approx(0.25))


@pytest.mark.parametrize("n", [6, 8, 12, 30])
def test_verdicts_hold_their_level_at_the_sizes_ab_tasks_have(n):
    """Under no difference a verdict is made in at most 5% of 2,000 simulated experiments, at every number of
    examples; the percentile bootstrap alone excluded zero in 15% at 5 examples and 10% at 10 (it decided "A beats
    B" from 3 wins 0 losses 2 ties, McNemar p = 0.25 in the same sentence)."""
    rng = np.random.default_rng(n)
    for diffs in (rng.standard_normal((2000, n)), rng.integers(0, 2, (2000, n)) - rng.integers(0, 2, (2000, n))):
        p = sign_flip_p(diffs)
        assert p.shape == (2000,) and (p < LEVEL).mean() <= 0.055
    few = compare([1, 1, 1, 0, 0], [0] * 5, task="t", budget=1, a="x", b="y", metric="exact", higher_is_better=True)
    assert few.ci_low > 0 and not few.decided


def test_sign_flip_p_matches_hand_computed_cases():
    """Exact enumeration: 6 differences of one sign are the 2 most extreme of 64 patterns; ties weigh nothing (a
    difference of 1e-12 everywhere decided "A beats B by 1e-12, 0 wins 0 losses 6 ties"); past ``EXACT_FLIPS``
    examples the p of a random draw is near the exact one and never 0."""
    assert sign_flip_p([1.0] * 6) == pytest.approx(2 / 64)
    assert sign_flip_p([1.0, -1.0] * 3) == 1.0
    # Sum 6; flipping values summing to s gives 6 - 2s, as extreme for s <= 0 (none, the -1, the -1 with one of the
    # four 1s: 6 patterns) and their mirrors: 12 of 64.
    assert sign_flip_p([3.0, 1.0, 1.0, 1.0, 1.0, -1.0]) == pytest.approx(12 / 64)
    tied = np.full(6, 1e-12)
    assert sign_flip_p(tied) == 1.0
    assert not compare(tied, np.zeros(6), task="t", budget=1, a="x", b="y", metric="kl", higher_is_better=True).decided
    assert 0 < sign_flip_p(np.ones(30)) < 1e-4
    # A difference that is not finite makes no verdict (an infinite one gave p = 0 and "A beats B by inf").
    assert np.isnan(sign_flip_p([np.inf] + [1.0] * 7)) and np.isnan(sign_flip_p([np.nan] + [1.0] * 7))
    assert not compare([np.inf] + [1.0] * 7, [0.0] * 8, task="t", budget=1, a="x", b="y", metric="m", higher_is_better=True).decided
    d = np.random.default_rng(2).normal(0.4, 1.0, size=18)
    assert sign_flip_p(d) == pytest.approx(float(sign_flip_p(d[None]).squeeze()))


def test_mcnemar_matches_a_hand_computed_case():
    # 8 pairs where A alone is right, 2 where B alone is right, 5 concordant: discordant n = 10,
    # p = 2 * P[Binomial(10, 1/2) <= 2] = 2 * (1 + 10 + 45) / 1024 = 0.109375.
    a = np.array([1] * 8 + [0] * 2 + [1] * 3 + [0] * 2)
    b = np.array([0] * 8 + [1] * 2 + [1] * 3 + [0] * 2)
    assert mcnemar_exact(a, b) == pytest.approx(112 / 1024)
    assert mcnemar_exact(b, a) == pytest.approx(112 / 1024)
    assert mcnemar_exact(a, a) == 1.0  # no discordant pair
    assert mcnemar_exact([1] * 6, [0] * 6) == pytest.approx(2 / 64)
    assert mcnemar_exact([1, 0], [0, 1]) == 1.0  # capped at 1


def test_win_tie_loss_and_the_verdict_sentence():
    assert win_tie_loss(np.array([0.5, 0.0, -1.0, 2.0])) == (2, 1, 1)
    rng = np.random.default_rng(1)
    kl_b = rng.uniform(0.5, 1.0, 20)
    kl_a = kl_b - 0.3 + rng.normal(0, 0.05, 20)  # a has lower KL: better
    c = compare(kl_a, kl_b, task="fidelity", budget=256, a="trimkv", b="snapkv", metric="KL", higher_is_better=False)
    assert c.improvement == pytest.approx(0.3, abs=0.05) and c.decided and c.wins == 20
    assert c.sentence().startswith("trimkv beats snapkv at 256 on fidelity by 0.")
    assert "20 wins 0 losses" in c.sentence()
    flipped = compare(kl_b, kl_a, task="fidelity", budget=256, a="snapkv", b="trimkv", metric="KL", higher_is_better=False)
    assert flipped.sentence().startswith("trimkv beats snapkv") and "20 wins 0 losses" in flipped.sentence()
    exact_a, exact_b = np.array([1, 1, 0, 1, 1, 0]), np.array([1, 0, 0, 1, 1, 0])
    tie = compare(exact_a, exact_b, task="needle", budget=128, a="x", b="y", metric="exact", higher_is_better=True,
                  binary_a=exact_a, binary_b=exact_b)
    assert tie.mcnemar_p == 1.0 and (tie.wins, tie.ties, tie.losses) == (1, 5, 0)
    assert tie.sentence().startswith("no clear difference between x and y at 128 on needle")
    assert tie.sentence().endswith("1 wins 0 losses 5 ties, sign-flip p = 1; exact answers 4 vs 3 of 6, McNemar p = 1.")
    few = compare([1.0] * 5, [0.0] * 5, task="t", budget=1, a="x", b="y", metric="recall", higher_is_better=True)
    assert not few.decided and few.sentence().startswith("too few examples (5 < 6) to decide between x and y at 1 on t (x ahead by 1 recall)")
    # A metric where lower is better: the undecided sentence said "(x -0.0005 KL)" of an x whose KL was 0.0005 higher.
    behind = compare([0.0015] * 4, [0.001] * 4, task="t", budget=1, a="x", b="y", metric="KL", higher_is_better=False)
    assert "(x behind by 0.0005 KL)" in behind.sentence()


def test_a_score_that_is_not_finite_is_no_tie_and_its_comparison_says_so():
    """An arm whose run gave NaN scores (a float16 overflow) was compared as "no clear difference ... (x behind by nan
    recall), 95% CI nan to nan, 0 wins 0 losses 6 ties": every NaN difference counted as a tie."""
    assert win_tie_loss(np.array([0.5, np.nan, 0.0, -np.inf, np.inf])) == (1, 1, 0)
    recall_a = np.array([1.0, 1.0, np.nan, 0.5, 1.0, 0.0])
    recall_b = np.array([0.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    c = compare(recall_a, recall_b, task="needle", budget=64, a="x", b="y", metric="recall", higher_is_better=True,
                binary_a=recall_a == 1, binary_b=recall_b == 1, kv_a=1.0, kv_b=2.0)
    assert not c.decided and (c.wins, c.ties, c.losses) == (3, 2, 0)
    assert c.sentence() == (
        "no verdict between x and y at 64 on needle: 1 of 6 examples have a recall difference that is not finite (a score "
        "that is NaN or infinite); the others: 3 wins 0 losses 2 ties; exact answers 3 vs 1 of 6, McNemar p = 0.5; y held 2.00x the KV."
    )
