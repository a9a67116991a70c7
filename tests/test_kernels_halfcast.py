"""halfcast.astype (tpubuild/kernels/halfcast.py) gives numpy's float16 conversions bit for bit.

numpy's astype is the reference: TPU inference and the simulator round F16 results
with it. Checked on every float16, on float32 bit patterns drawn at random and
on the cases where rounding is decided (ties, overflow, subnormals, NaN payloads).
"""

from __future__ import annotations

import numpy as np
import pytest

from tpubuild.kernels import halfcast


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def numpy_cast(x: np.ndarray, dtype, order="K") -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(dtype, order=order)


def test_every_float16_widens_as_numpy_does():
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # NaN payloads included
    assert x.size >= halfcast.MIN_SIZE
    got = halfcast.astype(x, np.float32)
    assert got.dtype == np.float32 and np.array_equal(bits(got), bits(numpy_cast(x, np.float32)))


def edge_floats() -> np.ndarray:
    """float32 patterns around every float16 decision: ties to even at each exponent, the overflow
    threshold, the subnormal range and its lower end, signed zeros, infinities, quiet and signalling NaNs."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    wide = bits(numpy_cast(halves[np.isfinite(halves)], np.float32)).astype(np.int64)
    # each float16 value as float32 and its neighbours: +-1 ulp, the midpoint to the next and +-1 ulp of it
    near = np.concatenate([wide + d for d in (-1, 0, 1, 0x1000 - 1, 0x1000, 0x1000 + 1)])
    special = np.array(
        [
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0xFFC00000,
            0x7F800001,
            0x7FA00000,
            0x7FBFFFFF,
            0x7FFFFFFF,
            0x477FEFFF,
            0x477FF000,
            0x477FF001,
            0x33000000,
            0x33000001,
            0x32FFFFFF,
            0x00000001,
            0x80000001,
            0x00000000,
            0x80000000,
        ],
        np.int64,
    )
    return (np.concatenate([near, special]) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("which", ["edges", "random"])
def test_float32_rounds_to_float16_as_numpy_does(which):
    if which == "edges":
        x = edge_floats()
    else:
        x = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
        x = x.view(np.float32)
    got = halfcast.astype(x, np.float16)
    assert got.dtype == np.float16 and np.array_equal(bits(got), bits(numpy_cast(x, np.float16)))


def test_layout_and_small_arrays_follow_numpy():
    x = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32)
    view = x.T  # not C-contiguous: order K keeps numpy's layout, order C gives C order
    for order in ("K", "C"):
        got, want = halfcast.astype(view, np.float16, order), numpy_cast(view, np.float16, order)
        assert got.strides == want.strides and np.array_equal(bits(got), bits(want))
    small = x[:2, :3]
    assert np.array_equal(bits(halfcast.astype(small, np.float16)), bits(numpy_cast(small, np.float16)))
    same = halfcast.astype(x, np.float32)
    assert same is x  # nothing to convert: numpy's copy=False
