"""One module per ONNX op family; importing them registers their converters."""

from tpubuild.frontend.ops import conv, elementwise, matmul, norm, pool, shape  # noqa: F401  (imported for their converter registrations)
from tpubuild.frontend.ops import conv_transpose, einsum, resize, rnn, tensor  # noqa: F401  (imported for their converter registrations)
from tpubuild.frontend.ops import activation, arith, logic, normalization, reduce  # noqa: F401  (imported for their converter registrations)
from tpubuild.frontend.ops import control, quantize  # noqa: F401  (imported for their converter registrations)
