"""How ops run on local tiles: the 4-D layout, tile sizes per lane, and each op's slice rule.

Local layout (DESIGN.md "The chip model"): a tensor is seen as (n, c, h, w);
channel c lives in lane c % lanes and each lane holds n x ceil(c / lanes)
planes of h x w elements, every plane starting on an EU boundary. Lower ranks
map as [w] -> (1, 1, 1, w), [c, w] -> (1, c, 1, w), [n, c, w] -> (n, c, 1, w).
Weights keep their first non-unit dim on lanes (a conv filter's output
channels) and the rest contiguous.

An op's rule says which of its tensors can be sliced along N and H, and for a
windowed operand (conv, pool) which input rows an output row range needs — the
halo — and the padding that is left at that slice's borders. An op without a
rule runs on whole tensors (``WHOLE``); ops with several results or a rank
above 4 run as global ops.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tpubuild.build.chips import Chip
from tpubuild.codegen.cost import nchw
from tpubuild.codegen.graph import Graph, Node
from tpubuild.ir import top, tpu

Shape4 = tuple[int, int, int, int]


def align(x: int, a: int) -> int:
    return -(-x // a) * a


def tile_lane_bytes(chip: Chip, shape4: Shape4, esize: int) -> int:
    """Bytes one lane needs for an (n, c, h, w) tile: n x ceil(c / lanes) EU-aligned h x w planes."""
    n, c, h, w = shape4
    return n * math.ceil(c / chip.lanes) * align(h * w * esize, chip.eu_bytes)


def weight_lane_bytes(chip: Chip, shape: tuple[int, ...], esize: int) -> int:
    """Bytes one lane needs for a weight: its first non-unit dim on lanes, the rest one aligned row."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    if not dims:
        dims = [1]
    rest = math.prod(dims[1:])
    return math.ceil(dims[0] / chip.lanes) * align(rest * esize, chip.eu_bytes)


@dataclass(frozen=True)
class Window:
    """A sliding window over H: output row r reads input rows r*stride - pad_begin + j*dilation, j < kernel."""

    kernel: int
    stride: int
    dilation: int
    pad_begin: int
    pad_end: int

    def need(self, lo: int, hi: int, in_h: int) -> tuple[int, int, int, int]:
        """(first, end) input rows for output rows [lo, hi), clipped to the input, and the (top, bottom)
        padding the kernel must add to that tile to produce exactly hi - lo rows."""
        first = lo * self.stride - self.pad_begin
        end = (hi - 1) * self.stride - self.pad_begin + (self.kernel - 1) * self.dilation + 1
        return max(first, 0), min(end, in_h), max(-first, 0), max(end - in_h, 0)


@dataclass(frozen=True)
class Rule:
    """How one op's tiles relate: may the group slice it along N / H, and which operands are special."""

    n_split: bool = True
    h_split: bool = True
    window: Window | None = None  # on operand 0
    whole: frozenset[int] = frozenset()  # operand indices needed in full along H (e.g. a matmul's right side)
    buffer_factor: float = 0.0  # scratch per lane, as a multiple of the output tile (f32 working copies)
    # computes any output rows from its operands' matching rows (plus a window); False: the kernel
    # only maps whole tensors to whole tensors (an output row may depend on every input row), so its
    # result and operands are always whole, even when its readers need fewer rows
    rows: bool = True
    # operand 0's row r makes output rows [r * upsample, (r + 1) * upsample) and nothing else (a
    # transposed conv whose kernel equals its stride, a nearest resize by an integer factor): the op
    # computes whole runs of them
    upsample: int = 1
    # the op's parameters name its output shape (Interp): a slice runs with its own
    sized: bool = False
    # every result element depends only on the same element of each operand (element-wise, no
    # broadcasting but of single values, no per-channel weights): any row-major reshape of its
    # operands and result computes the same elements, so it may run in the lane-spread layout
    layout_free: bool = False
    # the fewest output rows an H slice of the op may compute (``exact_f32``)
    min_rows: int = 1

    def computed(self, lo: int, hi: int, out_h: int) -> tuple[int, int]:
        """The output rows the op computes when [lo, hi) are needed."""
        u = self.upsample
        return (lo // u * u, min(-(-hi // u) * u, out_h)) if u > 1 else (lo, hi)

    def in_h_range(self, k: int, lo: int, hi: int, in_h: int, out_h: int) -> tuple[int, int, int, int]:
        """Operand k's rows for output rows [lo, hi): (first, end, pad_top, pad_bottom)."""
        if not self.rows:
            return 0, in_h, 0, 0
        if k == 0 and self.window is not None:
            return self.window.need(lo, hi, in_h)
        if k == 0 and self.upsample > 1:
            return lo // self.upsample, -(-hi // self.upsample), 0, 0
        if k in self.whole or in_h != out_h:
            return 0, in_h, 0, 0  # whole operand, or broadcast along H (in_h == 1)
        return lo, hi, 0, 0

    @staticmethod
    def in_n_range(lo: int, hi: int, in_n: int, out_n: int) -> tuple[int, int]:
        return (lo, hi) if in_n == out_n else (0, in_n)


RuleFn = Callable[[Graph, Node], "Rule | None"]
_RULES: dict[type, RuleFn] = {}


def rule_for(*classes: type) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        for cls in classes:
            if cls in _RULES:
                raise ValueError(f"a slice rule for {cls.name} is already registered")
            _RULES[cls] = fn
        return fn

    return register


# An op without a rule of its own still runs locally on whole tensors (its parameters may name full
# shapes or offsets, e.g. Interp's output shape or Slice's ends): one slice, if it fits.
WHOLE = Rule(n_split=False, h_split=False, rows=False)


def local_rule(graph: Graph, node: Node) -> Rule | None:
    """The op's slice rule, or None when it must run as a global op (rank > 4, several results)."""
    if len(node.outputs) != 1:
        return None
    shapes = [graph.tensors[t].shape for t in node.inputs if t is not None] + [graph.tensors[node.name].shape]
    if any(len(s) > 4 for s in shapes):
        return None
    fn = _RULES.get(type(node.op))
    return fn(graph, node) if fn else WHOLE


def _mirrors(*top_classes: type) -> list[type]:
    return [tpu.MIRROR[c] for c in top_classes if c in tpu.MIRROR]


# elementwise ops (numpy broadcasting): every TOP unary/binary/variadic op and the activations
_ELEMENTWISE_TOP = [
    c
    for c in top.TOP_OPS
    if isinstance(c, type) and issubclass(c, (top.UnaryOp, top.BinaryOp, top.VariadicOp, top.PredicateOp))
] + [top.ReluOp, top.SigmoidOp, top.TanhOp, top.ClipOp, top.PReluOp, top.WhereOp, top.CompareOp, top.BatchNormOp]


# operands an element-wise op reads whole, whatever the layout of the others: a lookup table
_TABLES: dict[type, frozenset[int]] = {tpu.LutOp: frozenset({1})}


@rule_for(*_mirrors(*_ELEMENTWISE_TOP), tpu.CastOp, tpu.LutOp)
def _elementwise(graph: Graph, node: Node) -> Rule:
    n_split, h_split = _weight_splits(graph, node)
    return Rule(n_split=n_split, h_split=h_split, layout_free=_layout_free(graph, node))


def _weight_splits(graph: Graph, node: Node) -> tuple[bool, bool]:
    """May the op be sliced along N, along H? A weight operand is loaded whole, once for the group, so
    one that varies along N or H keeps the op whole along that axis (a Swin window attention adds a
    [1, heads, 64, 64] relative position bias to its scores: sliced along H, the scores' tile met the
    whole bias)."""
    rank = len(graph.tensors[node.name].shape)
    tables = _TABLES.get(type(node.op), frozenset())
    weights = [
        nchw(graph.tensors[t].shape, rank)
        for k, t in enumerate(node.inputs)
        if t is not None and k not in tables and graph.tensors[t].weight
    ]
    return all(w[0] == 1 for w in weights), all(w[2] == 1 for w in weights)


def _layout_free(graph: Graph, node: Node) -> bool:
    """Are the op's activation operands all of its result's shape, and its weights single values (or
    a table it indexes)?"""
    out = graph.tensors[node.name].shape
    tables = _TABLES.get(type(node.op), frozenset())
    for k, t in enumerate(node.inputs):
        if t is None or k in tables:
            continue
        x = graph.tensors[t]
        if (math.prod(x.shape) != 1) if x.weight else (x.shape != out):
            return False
    return True


MIN_RUN = 64  # elements of one lane's run in the lane-spread layout, at least


def spread_shape(shape: tuple[int, ...], lanes: int) -> Shape4:
    """The lane-spread layout of a tensor: the same elements row-major as (n, c * k, p / k / w', w'),
    p = h * w the channel plane, k the divisor of p (up to ``lanes``, p / k >= ``MIN_RUN``) that
    leaves each lane the fewest elements, ``ceil(c * k / lanes) * p / k`` (the smallest such k);
    w' = w when k divides h (else the largest divisor of p / k dividing w). ``nchw`` puts channel c in
    lane c % lanes, so a 1-channel map sits in one lane and 96 channels fill 64 lanes and then 32; spread,
    1 x 640 x 640 becomes 64 x 10 x 640 and 96 x 80 x 80 becomes 192 x 40 x 80 (3 slots of 3200 per lane,
    not 2 of 6400).
    TPU-MLIR reshapes its global element-wise ops over the lanes alike. ``nchw(shape)`` when no k helps."""
    n, c, h, w = nchw(shape)
    plane = h * w
    # a lane's run stays at least one EU of int8 (64 elements; or the whole plane if shorter): the
    # vector unit works EU by EU, so finer runs would save no cycles
    k = min(
        (d for d in range(1, min(lanes, plane) + 1) if plane % d == 0 and plane // d >= min(plane, MIN_RUN)),
        key=lambda d: (math.ceil(c * d / lanes) * (plane // d), d),
    )
    if k == 1:
        return n, c, h, w
    if h % k == 0:
        return n, c * k, h // k, w
    run = plane // k
    row = math.gcd(run, w)
    return n, c * k, run // row, row


def _spatial_rule(p, nd: int) -> Rule:
    """A 2-D window slides over H; a pad as large as the window would leave windows wholly in the
    padding, whose slices hold no input row: such an op keeps H whole."""
    dil = p.dilations or (1,) * nd
    window = Window(p.kernel_shape[0], p.strides[0], dil[0], p.pads[0], p.pads[nd])
    span = (window.kernel - 1) * window.dilation + 1
    if max(window.pad_begin, window.pad_end) >= span:
        return WHOLE
    return Rule(window=window)


# the result types of ops whose float path sums through float32 BLAS GEMMs (16-bit operands widened)
_FLOAT32_GEMM = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def exact_f32(graph: Graph, node: Node, rule: Rule) -> Rule:
    """``rule`` limited so that the op's F32 slices give the whole tensor's bits.

    An F32 conv (not depthwise: that one sums tap by tap) or Deconv sums through BLAS GEMMs,
    pixel-major, one per row, each of one shape and layout, so a row's bits depend only on its
    own columns, K (channels x live taps) and N (``kernels.nn.pixel_gemm``): a conv slice matches
    the whole tensor as long as it keeps every tap live, i.e. each H slice has rows past the pads
    (``Rule.min_rows``); a Deconv's slices (whole runs of one tap's rows) always do. A MatMul's
    GEMM runs on whole tensors. Integer GEMMs are exact. The 16-bit float modes' GEMMs are the same
    float32 ones on widened operands (kernels.tpu), rounded after: rounding hides most float32
    differences but not one that crosses a rounding boundary (YOLO11s-seg on cv183x: a BF16 stride-2
    conv in 1-row slices dropped its top taps for row 0, and one pixel of its 51200 came out one bf16
    step off, which a later INT8 conv carried to the output), so they keep the same limits.
    """
    if graph.tensors[node.name].dtype not in _FLOAT32_GEMM:
        return rule
    if isinstance(node.op, tpu.ConvOp):
        group, channels = node.op.params.group, graph.tensors[node.input(0)].shape[1]
        if group > 1 and group == channels:
            return rule
        w = rule.window
        # a slice of R rows at the top sees an input row through its first tap iff (R - 1) * stride >= pad
        past_pads = 1 if w is None else -(-max(w.pad_begin, w.pad_end) // w.stride) + 1
        return dataclasses.replace(rule, min_rows=past_pads)
    if isinstance(node.op, tpu.MatMulOp):
        return WHOLE
    return rule


@rule_for(tpu.ConvOp)
def _conv(graph: Graph, node: Node) -> Rule | None:
    p = node.op.params
    nd = len(p.kernel_shape)
    if nd == 1:
        return Rule(h_split=False)  # (n, c, 1, w): H is 1, the window runs along W, which is never sliced
    if nd != 2:
        return WHOLE
    return _spatial_rule(p, nd)


@rule_for(tpu.MaxPoolOp, tpu.AvgPoolOp)
def _pool(graph: Graph, node: Node) -> Rule | None:
    p = node.op.params
    nd = len(p.kernel_shape)
    if nd == 1:
        return Rule(h_split=False)
    if nd != 2:
        return WHOLE
    if p.ceil_mode or p.count_include_pad:
        # ceil mode's extra window and counted padding depend on where the true border is: keep H whole
        return Rule(h_split=False, rows=False)
    return _spatial_rule(p, nd)


@rule_for(tpu.MatMulOp)
def _matmul(graph: Graph, node: Node) -> Rule:
    right = node.inputs[1]
    out_rank = len(graph.tensors[node.name].shape)
    n_split = True
    if right is not None and not graph.tensors[right].weight:
        rn = nchw(graph.tensors[right].shape, out_rank)[0]
        n_split = rn in (1, nchw(graph.tensors[node.name].shape)[0])
    return Rule(n_split=n_split, whole=frozenset({1}))


def _axes_rule(graph: Graph, node: Node, axes: list[int], buffer_factor: float) -> Rule:
    """An op normalising or reducing over ``axes`` of its (rank-4-mapped) input: those dims stay whole."""
    rank = len(graph.tensors[node.name].shape)
    mapped = {_mapped_dim(a % max(rank, 1), rank) for a in axes}
    # reducing or joining along N or H: an output row depends on every input row
    whole = "n" in mapped or "h" in mapped
    return Rule(n_split="n" not in mapped, h_split="h" not in mapped, buffer_factor=buffer_factor, rows=not whole)


def _mapped_dim(axis: int, rank: int) -> str:
    """Which of n, c, h, w a tensor dim lands on in ``nchw``."""
    if rank == 0:
        return "w"
    table = {1: "w", 2: "cw", 3: "ncw", 4: "nchw"}.get(rank, "nc" + "h" * (rank - 3) + "w")
    return table[axis]


@rule_for(tpu.SoftmaxOp)
def _softmax(graph: Graph, node: Node) -> Rule:
    return _axes_rule(graph, node, [node.op.params.axis], 1.0)


@rule_for(tpu.LayerNormOp)
def _layernorm(graph: Graph, node: Node) -> Rule:
    rank = len(graph.tensors[node.name].shape)
    axis = node.op.params.axis % max(rank, 1)
    return _axes_rule(graph, node, list(range(axis, rank)), 1.0)


@rule_for(tpu.ConcatOp)
def _concat(graph: Graph, node: Node) -> Rule:
    return _axes_rule(graph, node, [node.op.params.axis], 0.0)


# coordinate transforms of a resize that depend on the output index alone (not on the lengths), so a
# run of whole upsampled rows maps like the whole tensor shifted
_SHIFTABLE = ("asymmetric", "half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn")


@rule_for(tpu.MIRROR[top.InterpOp])
def _interp(graph: Graph, node: Node) -> Rule:
    """A nearest resize that repeats every input row exactly s times along H (N and C unchanged)
    slices N and H; any other resize runs on whole tensors."""
    from tpubuild.kernels.resize import _resample_axis

    p = node.op.params
    shape_in = graph.tensors[node.input(0)].shape
    if (
        len(shape_in) != 4
        or p.mode != "nearest"
        or p.coord_mode not in _SHIFTABLE
        or p.antialias
        or p.roi
        or tuple(p.shape[:2]) != tuple(shape_in[:2])
    ):
        return WHOLE
    in_h, out_h = shape_in[2], p.shape[2]
    u = out_h // in_h
    if u < 2 or out_h != u * in_h:
        return WHOLE
    # the kernel's own row map must be o -> o // u
    rows = _resample_axis(
        np.arange(in_h, dtype=np.float64), 0, out_h, dataclasses.replace(p, scales=(p.scales[2],), shape=(out_h,))
    )
    if not np.array_equal(rows, np.arange(out_h) // u):
        return WHOLE
    return Rule(upsample=u, sized=True)


@rule_for(tpu.MIRROR[top.DeconvOp])
def _deconv(graph: Graph, node: Node) -> Rule:
    # a transposed conv scatters each input row into several output rows: H stays whole, N slices;
    # unless its kernel equals its stride along H (no pads, dilation or output padding there): then
    # input row r makes exactly output rows [r * stride, (r + 1) * stride), each from one tap
    p = node.op.params
    nd = len(p.kernel_shape)
    extra = p.output_padding or (0,) * nd
    if (
        nd == 2
        and p.kernel_shape[0] == p.strides[0] > 1
        and (p.dilations or (1,))[0] == 1
        and p.pads[0] == p.pads[nd] == 0
        and extra[0] == 0
    ):
        return Rule(upsample=p.strides[0])
    return Rule(h_split=False, rows=False)
