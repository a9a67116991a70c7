"""Similarity metrics and labels, checked against values worked out by hand."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tpubuild.verify.similarity import (
    CLOSE,
    EQUAL,
    NOT_MATCH,
    NOT_SIMILAR,
    SIMILAR,
    Tolerance,
    cosine,
    euclidean,
    max_abs_error,
    similarity,
    sqnr_db,
)

TOL = Tolerance(0.99, 0.9)


def test_cosine_by_hand():
    assert cosine(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(0.0)
    assert cosine(np.array([1.0, 2.0]), np.array([2.0, 4.0])) == pytest.approx(1.0)
    assert cosine(np.array([1.0, 2.0]), np.array([-1.0, -2.0])) == pytest.approx(-1.0)
    # (3*4 + 4*3) / (5 * 5)
    assert cosine(np.array([3.0, 4.0]), np.array([4.0, 3.0])) == pytest.approx(24 / 25)


def test_cosine_of_zero_tensors():
    zero = np.zeros(4, np.float32)
    assert cosine(zero, zero) == 1.0
    assert cosine(zero, np.ones(4)) == 0.0


def test_euclidean_by_hand():
    # ||a-b|| = sqrt(2), ||(a+b)/2|| = sqrt(0.5): 1 - sqrt(2)/sqrt(0.5) = -1
    assert euclidean(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(-1.0)
    # a = [2], b = [1]: 1 - 1 / 1.5
    assert euclidean(np.array([2.0]), np.array([1.0])) == pytest.approx(1 - 1 / 1.5)
    assert euclidean(np.zeros(3), np.zeros(3)) == 1.0
    assert euclidean(np.ones(3), -np.ones(3)) == -math.inf


def test_sqnr_by_hand():
    ref = np.array([1.0, -1.0, 1.0, -1.0])
    noise = np.array([0.1, -0.1, 0.1, -0.1])
    # zero-mean signal power 4, zero-mean noise power 0.04: 10 log10(100) = 20 dB
    assert sqnr_db(ref + noise, ref) == pytest.approx(20.0)
    assert sqnr_db(ref, ref) == math.inf
    # a constant offset is zero-mean noise 0: SQNR ignores DC, as TPU-MLIR's does
    assert sqnr_db(ref + 5.0, ref) == math.inf


def test_empty_tensors_are_equal_without_warnings():
    """A zero-length slice (RivaGAN's encoder makes a [1, 0, 1, 256, 256] tensor) has no mean to take."""
    empty = np.zeros((1, 0, 3), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = similarity(empty, empty, TOL)
    assert s.label == EQUAL and s.passed and s.sqnr == math.inf


def test_max_abs_error():
    assert max_abs_error(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.5, 2.0])) == pytest.approx(1.0)


def test_labels():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(1000).astype(np.float32)
    assert similarity(a, a.copy(), TOL).label == EQUAL
    assert similarity(a * np.float32(1 + 1e-7), a, TOL).label in (EQUAL, CLOSE)
    assert similarity(a + np.float32(1e-3) * rng.standard_normal(1000).astype(np.float32), a, TOL).label == SIMILAR
    bad = similarity(rng.standard_normal(1000), a, TOL)
    assert bad.label == NOT_SIMILAR and not bad.passed
    mismatch = similarity(a[:10], a, TOL)
    assert mismatch.label == NOT_MATCH and not mismatch.passed


def test_nan_is_never_similar():
    a = np.array([1.0, 2.0, 3.0])
    b = np.array([1.0, np.nan, 3.0])
    result = similarity(b, a, Tolerance(0.0, -10.0))
    assert not result.passed


def test_infinities_in_the_same_places_agree():
    """A causal mask's -inf in both tensors agrees, and the metrics are those of the rest; an infinity in one
    alone fails."""
    rng = np.random.default_rng(1)
    ref = np.triu(np.full((8, 8), -np.inf), 1) + rng.standard_normal((8, 8))
    test = ref + 1e-3 * rng.standard_normal((8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = similarity(test, ref, TOL)
    assert s.label == SIMILAR and s.cos > 0.999 and math.isfinite(s.sqnr) and s.max_abs < 0.01
    test[0, 0] = -np.inf
    assert not similarity(test, ref, TOL).passed


def test_integer_tensors_compare():
    a = np.arange(10, dtype=np.int8)
    assert similarity(a, a.copy(), TOL).label == EQUAL
    assert similarity(a, a[::-1].copy(), TOL).label == NOT_SIMILAR


def test_tolerance_parse():
    assert Tolerance.parse("0.99,0.9") == Tolerance(0.99, 0.9)
    with pytest.raises(ValueError, match="COS,EUC"):
        Tolerance.parse("0.99")
    with pytest.raises(ValueError, match="COS,EUC"):
        Tolerance.parse("a,b")


finite = arrays(np.float64, st.integers(1, 50), elements=st.floats(-1e3, 1e3, allow_nan=False))


@settings(max_examples=60, deadline=None)
@given(finite, finite)
@example(np.array([1.0]), np.array([3.83644105e-160]))  # subnormal squares: cos 1.000002 before scaling
def test_metric_ranges_and_symmetry(a, b):
    n = min(a.size, b.size)
    a, b = a[:n], b[:n]
    c = cosine(a, b)
    assert -1.0 - 1e-9 <= c <= 1.0 + 1e-9
    assert c == pytest.approx(cosine(b, a))
    assert euclidean(a, b) <= 1.0
    assert euclidean(a, b) == pytest.approx(euclidean(b, a)) or math.isinf(euclidean(a, b))


@settings(max_examples=40, deadline=None)
@given(finite, st.floats(0.01, 100.0))
def test_cosine_is_scale_invariant(a, k):
    if np.linalg.norm(a) == 0:
        return
    assert cosine(a * k, a) == pytest.approx(1.0)


@settings(max_examples=300, deadline=None)
@given(
    arrays(np.float32, st.integers(1, 40), elements=st.floats(-1e6, 1e6, width=32)),
    st.lists(
        st.sampled_from([0.0, 1e-9, 1e-7, 1e-5, 1e-3, float("nan"), float("inf"), -float("inf")]),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([0.0, 1e-6, 1e-5, 2e-5]),
)
def test_close_label_is_numpys_allclose(ref, nudges, rel):
    """CLOSE exactly when np.allclose(rtol=1e-5, atol=1e-8, equal_nan=True) and not bitwise equal: relative
    and absolute nudges around the bounds, NaNs and infinities on either side."""
    from tpubuild.verify.similarity import CLOSE_ATOL, CLOSE_RTOL

    test = ref.astype(np.float64).copy()
    for i, d in enumerate(nudges[: test.size]):
        test[i] = test[i] * (1 + rel) + d if math.isfinite(d) else d
    test = test.astype(np.float32)
    if nudges[0] != 0.0 and not math.isfinite(nudges[0]) and ref.size > 1:
        ref = ref.copy()
        ref[1] = nudges[0]  # a NaN or infinity in the reference too
    label = similarity(test, ref, TOL).label
    close = np.allclose(
        test.astype(np.float64), ref.astype(np.float64), rtol=CLOSE_RTOL, atol=CLOSE_ATOL, equal_nan=True
    )
    if np.array_equal(test, ref, equal_nan=True):
        assert label == EQUAL
    else:
        assert (label == CLOSE) == close


def test_close_bounds_by_hand():
    zero, big = np.zeros(3), np.full(3, 1000.0)
    assert similarity(zero + 5e-9, zero, TOL).label == CLOSE  # within atol 1e-8
    assert similarity(zero + 2e-8, zero, TOL).label != CLOSE
    assert similarity(big + 0.009, big, TOL).label == CLOSE  # within rtol 1e-5 of 1000 (+ atol)
    assert similarity(big + 0.011, big, TOL).label != CLOSE
