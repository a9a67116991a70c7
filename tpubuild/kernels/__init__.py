"""numpy reference kernels, registered per op class; shared by inference and the simulator."""

import functools

from tpubuild.kernels.registry import KernelError, Operand, get_kernel, kernel, prepare, prepared  # noqa: F401  (the package API)


@functools.cache  # once: get_kernel calls it on every lookup, TPU kernels look up their TOP kernel on every call
def load_all() -> None:
    """Import every kernel module so their registrations run."""
    from tpubuild.kernels import elementwise, nn, tensor  # noqa: F401  (imported for their kernel registrations)
    from tpubuild.kernels import deconv, layout, resize, rnn  # noqa: F401  (imported for their kernel registrations)
    from tpubuild.kernels import norm, pointwise, reduce  # noqa: F401  (imported for their kernel registrations)
    from tpubuild.kernels import layout_prepared, nn_prepared  # noqa: F401  (imported for their kernel registrations)

    # TPU kernels last: TPU ops without a kernel of their own reuse their TOP op's
    from tpubuild.kernels import tpu

    tpu.register_mirrors()
