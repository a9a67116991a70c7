"""Data-movement kernels: reshape, permute, concat, identity, graph plumbing."""

from __future__ import annotations

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.registry import kernel


@kernel(top.IdentityOp, top.InputOp)
def _(p, x):
    return x


@kernel(top.ReshapeOp)
def _(p, x):
    return np.reshape(x, p.shape)


@kernel(top.PermuteOp)
def _(p, x):
    return np.transpose(x, p.order)


@kernel(top.ConcatOp)
def _(p, *xs):
    return np.concatenate(xs, axis=p.axis)
