"""The kernel registry: one numpy function per op class.

A kernel takes the op's parsed parameters and its operand arrays (``None`` for
an absent optional operand) and returns an array, or a tuple for several
results. Registering one op class twice is a programming error.
"""

from __future__ import annotations

from collections.abc import Callable

from tpubuild.registry import Registry

_KERNELS = Registry("a kernel")


class KernelError(Exception):
    """A kernel met inputs it cannot compute (raised with the op's location by the interpreter)."""


def kernel(*op_classes: type) -> Callable[[Callable], Callable]:
    return _KERNELS.register(*op_classes)


def get_kernel(op_class: type) -> Callable:
    from tpubuild.kernels import load_all
    load_all()
    try:
        return _KERNELS[op_class]
    except KeyError:
        raise NotImplementedError(f"no reference kernel for {op_class.name}") from None
