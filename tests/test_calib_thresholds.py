"""Streaming statistics and threshold methods on distributions whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpubuild.calib.stats import BINS, TensorStats, batch_stats
from tpubuild.calib.thresholds import METHODS, MIN_THRESHOLD, PERCENTILE, levels_for, threshold


def streamed(samples) -> TensorStats:
    stats = TensorStats()
    for s in samples:
        stats.update(s)
    return stats


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---- streaming statistics ----------------------------------------------------


def test_streaming_equals_batch_with_growing_range(rng):
    """Later samples exceed the range (re-binning by 2^k): still bit-equal to the all-at-once histogram."""
    samples = [rng.standard_normal((2, 3, 17)).astype(np.float32) * scale for scale in (0.01, 1.0, 0.3, 250.0, 7.0)]
    samples[2][0, 0, 0] = 0.0
    s, b = streamed(samples), batch_stats(samples)
    assert s.range == b.range and s.range == 2.0 ** math.ceil(math.log2(b.absmax + 1e-30))
    np.testing.assert_array_equal(s.hist, b.hist)
    assert (s.min, s.max, s.zeros, s.count, s.samples) == (b.min, b.max, b.zeros, b.count, b.samples)
    assert s.hist.sum() + s.zeros == s.count


def test_streaming_is_order_independent(rng):
    samples = [rng.laplace(size=500).astype(np.float32) * k for k in (1, 10, 100)]
    a, b = streamed(samples), streamed(samples[::-1])
    np.testing.assert_array_equal(a.hist, b.hist)
    assert a.range == b.range


@pytest.mark.parametrize("split", [[0, 1, 2], [3, 4], [2, 0, 4, 1], []])
def test_merged_halves_equal_one_stream(rng, split):
    """Statistics of two sets of samples merged (calibration's two processes) equal the histogram of all the
    samples at once, whichever half saw the larger range, or the all-zero sample, or none."""
    samples = [rng.standard_normal(300).astype(np.float32) * k for k in (0.02, 1.0, 300.0, 5.0)]
    samples.append(np.zeros(40, np.float32))
    mine = streamed([samples[i] for i in split])
    mine.merge(streamed([x for i, x in enumerate(samples) if i not in split]))
    whole = batch_stats(samples)
    np.testing.assert_array_equal(mine.hist, whole.hist)
    assert (mine.min, mine.max, mine.range, mine.zeros, mine.count, mine.samples) == (
        whole.min,
        whole.max,
        whole.range,
        whole.zeros,
        whole.count,
        whole.samples,
    )


def test_range_is_the_power_of_two_above_the_max():
    stats = streamed([np.array([0.5, -3.0, 4.0], np.float32)])
    assert stats.range == 8.0  # 4.0 is not inside [0, 4)
    assert stats.hist[int(4.0 / (8.0 / BINS))] == 1 and stats.hist.sum() == 3


def test_zeros_are_counted_apart():
    stats = streamed([np.zeros(10, np.float32), np.array([0.0, 1.0], np.float32)])
    assert stats.zeros == 11 and stats.hist.sum() == 1 and stats.count == 12


def test_nan_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        streamed([np.array([1.0, np.nan], np.float32)])


def test_infinities_are_counted_apart():
    """A causal mask's -inf (scores + mask before a softmax) lies beyond any threshold: the statistics and so
    every method's threshold are those of the finite values."""
    stats = streamed([np.array([-np.inf, 1.0, -2.0], np.float32), np.full(3, -np.inf, np.float32)])
    assert stats.infinite == 4 and stats.count == 2 and (stats.min, stats.max) == (-2.0, 1.0)
    assert all(math.isfinite(threshold(stats, m)) for m in METHODS)


def test_memory_does_not_depend_on_sample_count(rng):
    a = streamed(rng.standard_normal((5, 64)).astype(np.float32))
    b = streamed(rng.standard_normal((500, 64)).astype(np.float32))
    assert a.hist.nbytes == b.hist.nbytes == BINS * 8


# ---- threshold methods -------------------------------------------------------


def test_methods_are_registered():
    assert set(METHODS) == {"max", "percentile", "kl", "mse"}


def test_max_on_uniform_is_the_max(rng):
    x = rng.uniform(-3.0, 2.0, 100_000).astype(np.float32)
    assert threshold(streamed([x]), "max") == pytest.approx(float(np.abs(x).max()), rel=0, abs=0)


def test_percentile_matches_numpy(rng):
    x = rng.standard_normal(400_000).astype(np.float32)
    got = threshold(streamed([x]), "percentile")
    expect = np.percentile(np.abs(x), PERCENTILE)
    assert got == pytest.approx(expect, rel=2e-3)


def test_percentile_of_mostly_zeros_keeps_the_range():
    x = np.zeros(1_000_000, np.float32)
    x[:10] = np.linspace(1, 5, 10)
    assert threshold(streamed([x]), "percentile") == 5.0


def test_kl_clips_gaussian_outliers(rng):
    """A Gaussian with a few huge outliers: KL keeps the bulk (a few sigma), far below the max."""
    x = np.concatenate([rng.standard_normal(200_000), [60.0, -55.0, 48.0]]).astype(np.float32)
    t = threshold(streamed([x]), "kl")
    assert 2.5 < t < 8.0


def test_kl_keeps_uniform_range(rng):
    """Nothing to gain by clipping a uniform distribution: KL stays near the max."""
    x = rng.uniform(-1.0, 1.0, 200_000).astype(np.float32)
    assert threshold(streamed([x]), "kl") > 0.95


def test_mse_is_the_best_of_a_brute_force_search(rng):
    """MSE's threshold gives (nearly) the least squared fake-quant error over a fine grid, on the raw values."""
    x = rng.laplace(size=100_000).astype(np.float32)
    stats = streamed([x])
    levels = levels_for(stats)

    def err(t):
        step = t / levels
        return float(np.mean((x - np.clip(np.round(x / step), -levels, levels) * step) ** 2))

    grid = np.linspace(0.5, np.abs(x).max(), 400)
    best = min(err(t) for t in grid)
    got = threshold(stats, "mse")
    assert err(got) <= best * 1.02
    assert got < 0.8 * np.abs(x).max()  # a heavy tail is worth clipping


def test_unsigned_tensors_use_255_levels(rng):
    x = np.maximum(rng.standard_normal(10_000), 0).astype(np.float32)
    assert levels_for(streamed([x])) == 255
    assert levels_for(streamed([x - 0.1])) == 127


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_stays_within_the_max(rng, name):
    for x in (rng.standard_normal(5000), rng.exponential(size=5000), np.full(100, 3.0), np.array([0.0, 1e-20])):
        stats = streamed([x.astype(np.float32)])
        t = threshold(stats, name)
        assert 0 < t <= stats.absmax


@pytest.mark.parametrize("name", sorted(METHODS))
def test_all_zero_tensor_gets_the_floor(name):
    assert threshold(streamed([np.zeros(8, np.float32)]), name) == MIN_THRESHOLD


@pytest.mark.parametrize("name", sorted(METHODS))
def test_methods_are_deterministic(rng, name):
    samples = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    assert threshold(streamed(samples), name) == threshold(streamed(samples), name)
