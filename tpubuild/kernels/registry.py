"""The kernel registry: one numpy function per op class.

A kernel takes the op's parsed parameters and its operand arrays (``None`` for
an absent optional operand) and returns an array, or a tuple for several
results. Registering one op class twice is a programming error.

An op class may also register a prepared kernel: a maker that, given the
parameters and what is known of the operands before a run (shapes, dtypes,
weight arrays), returns a function of the operand arrays computing the same
bits as the kernel, with the work that depends only on those done once (weights
reshaped, windows' offsets, divisors). Reference inference runs one module on
many inputs through them; the simulator prepares each command's kernel for its
tiles (their shapes are the command's, weight tiles fixed). A TPU op whose float
path is its TOP op's kernel serves float32 operands with that op's prepared kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from tpubuild.registry import Registry

_KERNELS = Registry("a kernel")
_PREPARED = Registry("a prepared kernel")


class KernelError(Exception):
    """A kernel met inputs it cannot compute (raised with the op's location by the interpreter)."""


class Operand(NamedTuple):
    """An operand as a plan sees it: shape and dtype of its type (None: absent), its array when a weight."""

    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    const: np.ndarray | None

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape of a present operand; ValueError for an absent one."""
        if self.shape is None:
            raise ValueError("an absent operand has no shape")
        return self.shape


def kernel(*op_classes: type) -> Callable[[Callable], Callable]:
    return _KERNELS.register(*op_classes)


def prepared(*op_classes: type) -> Callable[[Callable], Callable]:
    """Register ``make(params, operands: list[Operand])`` -> a function of the operand arrays, or None
    (nothing to prepare for these operands: the kernel serves)."""
    return _PREPARED.register(*op_classes)


def get_kernel(op_class: type) -> Callable:
    from tpubuild.kernels import load_all

    load_all()
    try:
        return _KERNELS[op_class]
    except KeyError:
        raise NotImplementedError(f"no reference kernel for {op_class.name}") from None


def prepare(op_class: type, params, operands: list[Operand]) -> Callable:
    """The op's kernel for operands of these shapes and dtypes (and these weights), bound to ``params``."""
    run = get_kernel(op_class)
    make = _PREPARED.get(op_class)
    return (make(params, operands) if make is not None else None) or functools.partial(run, params)
