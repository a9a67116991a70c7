"""Export rules of data movement: reshape, permute, concat, split, slice, pad, tile, expand, gather, resize."""

from __future__ import annotations

import itertools
import math

import numpy as np

from tpubuild.export.tosa import Emitter, Val, element, rule
from tpubuild.ir import top
from tpubuild.kernels.resize import axis_taps, resampled


@rule(top.IdentityOp, narrow=True)
def _(e: Emitter, op, p, args):
    return args[0]


@rule(top.ReshapeOp, narrow=True)
def _(e: Emitter, op, p: top.ShapeParams, args):
    return e.reshape(args[0], p.shape)


@rule(top.PermuteOp, narrow=True)
def _(e: Emitter, op, p: top.PermuteParams, args):
    return e.transpose(args[0], p.order)


@rule(top.ConcatOp)
def _(e: Emitter, op, p: top.AxisParams, args):
    axis = p.axis % args[0].rank
    return e.concat([v for v in args if v.shape[axis] > 0] or args[:1], axis)


@rule(top.SplitOp)
def _(e: Emitter, op, p: top.SplitParams, args):
    (x,) = args
    axis = p.axis % x.rank
    outs, start = [], 0
    for size in p.split_size:
        begin = [0] * x.rank
        begin[axis] = start
        shape = list(x.shape)
        shape[axis] = size
        outs.append(e.slice(x, begin, shape))
        start += size
    return tuple(outs)


def _step(e: Emitter, x: Val, axis: int, step: int, count: int) -> Val:
    """Every ``step``-th element along ``axis`` from the first, ``count`` of them: the axis padded to count x step,
    split into [count, step], the first of each step kept."""
    shape = list(x.shape)
    total = count * step
    if total > shape[axis]:
        ends = [0] * x.rank
        ends[axis] = total - shape[axis]
        x = e.pad(x, [0] * x.rank, ends)
    else:
        size = list(shape)
        size[axis] = total
        x = e.slice(x, [0] * x.rank, size)
    split = [*shape[:axis], count, step, *shape[axis + 1 :]]
    x = e.reshape(x, split)
    size = list(split)
    size[axis + 1] = 1
    x = e.slice(x, [0] * x.rank, size)
    out = list(shape)
    out[axis] = count
    return e.reshape(x, out)


@rule(top.SliceOp)
def _(e: Emitter, op, p: top.SliceParams, args):
    (x,) = args
    for axis, (start, stop, step) in enumerate(zip(p.offset, p.ends, p.steps, strict=False)):
        n = x.shape[axis]
        count = len(range(start, stop, step))
        if count == n and step == 1:
            continue
        if step < 0:
            # reversed: the slice of the reversed axis from n - 1 - start, stepping -step
            x = e.unary("tosa.reverse", x, f"axis = {axis} : i32")
            start, step = n - 1 - start, -step
        begin = [0] * x.rank
        begin[axis] = start
        size = list(x.shape)
        size[axis] = min(n - start, (count - 1) * step + 1) if count else 0
        x = e.slice(x, begin, size)
        if step > 1 and count:
            x = _step(e, x, axis, step, count)
    return x


@rule(top.PadOp)
def _(e: Emitter, op, p: top.PadParams, args):
    (x,) = args
    rank = x.rank
    begins, ends = list(p.paddings[:rank]), list(p.paddings[rank:])
    # negative pads crop first
    start = [max(0, -b) for b in begins]
    size = [d - max(0, -b) - max(0, -a) for d, b, a in zip(x.shape, begins, ends, strict=False)]
    x = e.slice(x, start, size)
    begins, ends = [max(0, b) for b in begins], [max(0, a) for a in ends]
    if p.mode == "constant":
        return e.pad(x, begins, ends, p.val)
    for axis in range(rank):
        b, a = begins[axis], ends[axis]
        if not b and not a:
            continue
        n = x.shape[axis]
        parts = [_edge_run(e, x, axis, p.mode, n, b, True), x, _edge_run(e, x, axis, p.mode, n, a, False)]
        x = e.concat([v for v in parts if v is not None], axis)
    return x


def _take(e: Emitter, x: Val, axis: int, index: int) -> Val:
    begin = [0] * x.rank
    begin[axis] = index
    size = list(x.shape)
    size[axis] = 1
    return e.slice(x, begin, size)


def _edge_run(e: Emitter, x: Val, axis: int, mode: str, n: int, count: int, before: bool) -> Val | None:
    """The ``count`` elements a reflect/edge/wrap pad adds before (or after) ``x`` along ``axis``, in order."""
    if not count:
        return None
    if mode == "edge":
        idx = [0] * count if before else [n - 1] * count
    elif mode == "reflect":
        idx = [count - i for i in range(count)] if before else [n - 2 - i for i in range(count)]
    elif mode == "wrap":
        idx = [(i - count) % n for i in range(count)] if before else [i % n for i in range(count)]
    else:
        raise NotImplementedError(f"pad mode {mode}")
    return e.concat([_take(e, x, axis, i) for i in idx], axis)


@rule(top.TileOp)
def _(e: Emitter, op, p: top.TileParams, args):
    return e.tile(args[0], p.tile)


@rule(top.ExpandOp)
def _(e: Emitter, op, p: top.ShapeParams, args):
    return e.broadcast_to(args[0], op.results[0].type.get_shape())


def gather_axis(e: Emitter, x: Val, axis: int, idx: Val, index_shape) -> Val:
    """x taken at ``idx`` (int32, non-negative, flat [W]) along ``axis``: tosa.gather on x as [N, K, C]."""
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1 :])
    k = x.shape[axis]
    w = idx.shape[0]
    values = e.reshape(x, [outer, k, inner])
    indices = e.tile(e.reshape(idx, [1, w]), [outer, 1])
    y = e.op1("tosa.gather", [values, indices], [outer, w, inner], x.dtype)
    return e.reshape(y, [*x.shape[:axis], *index_shape, *x.shape[axis + 1 :]])


def _indices(e: Emitter, idx: Val, k: int) -> Val:
    """Indices as int32, negatives counted from the end: numpy when constant, a select otherwise."""
    if idx.array is not None:
        a = np.asarray(idx.array).astype(np.int64)
        return e.const((np.where(a < 0, a + k, a)).reshape(-1).astype(np.int32))
    flat = e.cast(e.reshape(idx, [math.prod(idx.shape)]), np.int32)
    neg = e.binary("tosa.greater", e.scalar(0, np.int32, 1), flat, np.bool_)
    wrapped = e.binary("tosa.add", flat, e.scalar(k, np.int32, 1))
    return e.op1("tosa.select", [neg, wrapped, flat], flat.shape, np.int32)


# constant indices of at most this many take slices (concatenated) rather than a tosa.gather: IREE lowers a gather
# to an element-wise extract, where slices stay copies (mini_vit's q/k/v picks: 54 -> 1 ms)
_SLICED_GATHER = 16


@rule(top.GatherOp)
def _(e: Emitter, op, p: top.AxisParams, args):
    x, idx = args
    axis = p.axis % x.rank
    k = x.shape[axis]
    if idx.array is not None and 0 < idx.array.size <= _SLICED_GATHER:
        flat = [int(i) % k for i in np.asarray(idx.array).reshape(-1)]
        out = [*x.shape[:axis], *idx.shape, *x.shape[axis + 1 :]]
        runs: list[list[int]] = []  # consecutive ascending indices as one slice
        for i in flat:
            if runs and i == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        parts = []
        for start, count in runs:
            begin = [0] * x.rank
            begin[axis] = start
            size = list(x.shape)
            size[axis] = count
            parts.append(e.slice(x, begin, size))
        return e.reshape(e.concat(parts, axis), out)
    return gather_axis(e, x, axis, _indices(e, idx, k), idx.shape)


@rule(top.InterpOp)
def _(e: Emitter, op, p: top.InterpParams, args):
    """Resize one axis at a time, as the kernel: nearest as a gather of the source indices (a broadcast when
    each row is repeated a whole number of times), linear and cubic as a product with the [in, out] matrix of the
    kernel's taps and weights (clamped taps summed)."""
    (x,) = args
    if not x.is_float:
        raise NotImplementedError(f"resize of {x.dtype}")
    for axis in resampled(p, x.shape):
        idx, weights, outside = axis_taps(x.shape[axis], axis, p.shape[axis], p)
        out_len = idx.shape[0]
        k = x.shape[axis]
        if p.mode == "nearest" and out_len % k == 0 and np.array_equal(idx[:, 0], np.arange(out_len) // (out_len // k)):
            # each row repeated: a broadcast, which IREE fuses into the consumer where a gather is a dispatch
            rows = e.reshape(x, [*x.shape[: axis + 1], 1, *x.shape[axis + 1 :]])
            y = e.reshape(
                e.tile(rows, [1] * (axis + 1) + [out_len // k] + [1] * (x.rank - axis - 1)),
                [*x.shape[:axis], out_len, *x.shape[axis + 1 :]],
            )
        elif p.mode == "nearest":
            y = gather_axis(e, x, axis, e.const(idx[:, 0].astype(np.int32)), [out_len])
        else:
            matrix = np.zeros((x.shape[axis], out_len), np.float64)
            for j in range(idx.shape[1]):
                np.add.at(matrix, (idx[:, j], np.arange(out_len)), weights[:, j])
            perm = [i for i in range(x.rank) if i != axis] + [axis]
            moved = e.transpose(x, perm)
            rows = math.prod(moved.shape[:-1])
            a3 = e.reshape(moved, [1, rows, x.shape[axis]])
            b3 = e.const(matrix.astype(x.dtype).reshape(1, x.shape[axis], out_len))
            zp = e.zero_point(x.dtype)
            prod = e.op1("tosa.matmul", [a3, b3, zp, zp], [1, rows, out_len], x.dtype)
            prod = e.reshape(prod, [*moved.shape[:-1], out_len])
            y = e.transpose(prod, [int(i) for i in np.argsort(perm)])
        if outside is not None and outside.any():
            mask = e.const(outside.reshape((1,) * axis + (out_len,) + (1,) * (x.rank - axis - 1)))
            y = e.op1("tosa.select", [mask, e.scalar(p.extrapolation_value, x.dtype, x.rank), y], y.shape, y.dtype)
        x = y
    return x


@rule(top.Depth2SpaceOp)
def _(e: Emitter, op, p: top.Depth2SpaceParams, args):
    (x,) = args
    n, c, h, w = x.shape
    bh, bw = p.block_h, p.block_w
    out = op.results[0].type.get_shape()
    if p.is_inversed:
        t = e.reshape(x, [n, c, h // bh, bh, w // bw, bw])
        t = e.transpose(t, [0, 3, 5, 1, 2, 4] if not p.is_CRD else [0, 1, 3, 5, 2, 4])
        return e.reshape(t, out)
    if p.is_CRD:
        t = e.reshape(x, [n, c // (bh * bw), bh, bw, h, w])
        t = e.transpose(t, [0, 1, 4, 2, 5, 3])
    else:
        t = e.reshape(x, [n, bh, bw, c // (bh * bw), h, w])
        t = e.transpose(t, [0, 3, 4, 1, 5, 2])
    return e.reshape(t, out)


@rule(top.TriluOp)
def _(e: Emitter, op, p: top.TriluParams, args):
    (x,) = args
    rows, cols = x.shape[-2:]
    i, j = np.indices((rows, cols))
    keep = (j - i >= p.diagonal) if p.upper else (j - i <= p.diagonal)
    mask = e.const(keep.reshape((1,) * (x.rank - 2) + (rows, cols)))
    zero = e.scalar(0, x.dtype, x.rank)
    element(x.dtype)
    return e.op1("tosa.select", [mask, x, zero], x.shape, x.dtype)


@rule(top.GatherElementsOp)
def _(e: Emitter, op, p: top.AxisParams, args):
    """A linalg.generic over the indices: each element extracted from the input at its own position, the axis
    replaced by its index (negatives counted from the end)."""
    x, idx = args
    axis = p.axis % x.rank
    x = e.use(x)
    el_idx = element(idx.dtype)

    def body(bd, v):
        raw = bd.typed("arith.index_cast", [(v[0], el_idx)], "index")
        dim = bd.typed("arith.constant", [], "index", f"value = {x.shape[axis]} : index")
        zero = bd.typed("arith.constant", [], "index", "value = 0 : index")
        neg = bd.typed("arith.cmpi", [(raw, "index"), (zero, "index")], "i1", "predicate = 2 : i64")
        wrapped = bd.typed("arith.addi", [(raw, "index"), (dim, "index")], "index")
        k = bd.typed("arith.select", [(neg, "i1"), (wrapped, "index"), (raw, "index")], "index")
        at = [k if d == axis else bd.typed("linalg.index", [], "index", f"dim = {d} : i64") for d in range(x.rank)]
        return bd.typed("tensor.extract", [(x.name, x.type)] + [(i, "index") for i in at], element(x.dtype))

    return e.generic([idx], idx.shape, x.dtype, body)


def _flat_index(e: Emitter, idx: Val, dims, strides) -> Val:
    """Index tuples (the last axis of ``idx``, len(dims) long; negatives counted from the end of their dim) as
    flat int32 offsets sum(i_k * strides[k]), of shape idx.shape[:-1]."""
    depth = len(dims)
    i = e.cast(idx, np.int32)
    size = e.const(np.array(dims, np.int32).reshape((1,) * (i.rank - 1) + (depth,)))
    neg = e.binary("tosa.greater", e.scalar(0, np.int32, i.rank), i, np.bool_)
    i = e.op1("tosa.select", [neg, e.binary("tosa.add", i, size), i], i.shape, np.int32)
    stride = e.const(np.array(strides, np.int32).reshape((1,) * (i.rank - 1) + (depth,)))
    flat = e.op1(
        "tosa.reduce_sum", [e.binary("tosa.mul", i, stride)], [*i.shape[:-1], 1], np.int32, f"axis = {i.rank - 1} : i32"
    )
    return e.reshape(flat, i.shape[:-1])


def _strides(shape) -> list[int]:
    return [math.prod(shape[k + 1 :]) for k in range(len(shape))]


@rule(top.GatherNDOp)
def _(e: Emitter, op, p: top.GatherNDParams, args):
    """tosa.gather of the input as [batch, K, C]: the index tuples as flat offsets into its K leading dims."""
    x, idx = args
    b, depth = p.batch_dims, idx.shape[-1]
    batch = math.prod(x.shape[:b])
    lead, rest = x.shape[b : b + depth], x.shape[b + depth :]
    flat = _flat_index(e, idx, lead, _strides(lead))
    w = math.prod(idx.shape[b:-1])
    values = e.reshape(x, [batch, math.prod(lead), math.prod(rest)])
    y = e.op1("tosa.gather", [values, e.reshape(flat, [batch, w])], [batch, w, math.prod(rest)], x.dtype)
    return e.reshape(y, op.results[0].type.get_shape())


_COMBINE = {  # ScatterND/Elements reductions: (float op, signed int op, unsigned int op)
    "add": ("arith.addf", "arith.addi", "arith.addi"),
    "mul": ("arith.mulf", "arith.muli", "arith.muli"),
    "max": ("arith.maximumf", "arith.maxsi", "arith.maxui"),
    "min": ("arith.minimumf", "arith.minsi", "arith.minui"),
}


def _scatter(e: Emitter, x: Val, flat: Val, updates: Val, reduction: str) -> Val:
    """``x`` [K, C] with rows ``flat`` [W] (int32) replaced by (or combined with) ``updates`` [W, C]. Replaced:
    tosa.scatter (ONNX leaves duplicate indices undefined there). Combined, which TOSA has no op for: a
    linalg.generic over (k, c, w), each update folded into the rows it names, in order (duplicates all count)."""
    k, c = x.shape
    w = flat.shape[0]
    if reduction == "none":
        y = e.op1(
            "tosa.scatter",
            [e.reshape(x, [1, k, c]), e.reshape(flat, [1, w]), e.reshape(updates, [1, w, c])],
            [1, k, c],
            x.dtype,
        )
        return e.reshape(y, [k, c])
    if reduction not in _COMBINE or x.dtype == np.bool_:
        raise NotImplementedError(f"scatter reduction {reduction} of {x.dtype}")
    el = element(x.dtype)
    combine = _COMBINE[reduction][0 if x.is_float else 2 if x.dtype.kind == "u" else 1]

    def body(bd, v, acc):
        row = bd.typed("arith.index_cast", [(v[0], "i32")], "index")
        here = bd.typed(
            "arith.cmpi",
            [(row, "index"), (bd.typed("linalg.index", [], "index", "dim = 0 : i64"), "index")],
            "i1",
            "predicate = 0 : i64",
        )
        return bd.select(here, bd.op(combine, acc, v[1], type=el), acc, el)

    return e.loops([(flat, ["d2"]), (updates, ["d2", "d1"])], x, ["d0", "d1"], 1, body)


@rule(top.ScatterNDOp)
def _(e: Emitter, op, p: top.ScatterParams, args):
    x, idx, updates = args
    depth = idx.shape[-1]
    lead, rest = x.shape[:depth], x.shape[depth:]
    flat = _flat_index(e, idx, lead, _strides(lead))
    w, c = math.prod(flat.shape), math.prod(rest)
    y = _scatter(e, e.reshape(x, [math.prod(lead), c]), e.reshape(flat, [w]), e.reshape(updates, [w, c]), p.reduction)
    return e.reshape(y, x.shape)


@rule(top.ScatterElementsOp)
def _(e: Emitter, op, p: top.ScatterParams, args):
    """Each update element's flat offset in the input: its own position's on the other axes (a constant) plus its
    index times the axis' stride; then a scatter of single elements."""
    x, idx, updates = args
    axis = p.axis % x.rank
    strides = _strides(x.shape)
    own = np.indices(idx.shape)
    base = sum(own[d] * strides[d] for d in range(x.rank) if d != axis)
    i = e.cast(idx, np.int32)
    neg = e.binary("tosa.greater", e.scalar(0, np.int32, i.rank), i, np.bool_)
    i = e.op1(
        "tosa.select", [neg, e.binary("tosa.add", i, e.scalar(x.shape[axis], np.int32, i.rank)), i], i.shape, np.int32
    )
    at = e.binary(
        "tosa.add",
        e.binary("tosa.mul", i, e.scalar(strides[axis], np.int32, i.rank)),
        e.const(np.asarray(base, np.int32)),
    )
    w = math.prod(idx.shape)
    y = _scatter(e, e.reshape(x, [math.prod(x.shape), 1]), e.reshape(at, [w]), e.reshape(updates, [w, 1]), p.reduction)
    return e.reshape(y, x.shape)


def _better(bd, a: str, b: str, el: str, dtype: np.dtype, largest: bool) -> tuple[str, str]:
    """(a sorts strictly before b, a ties b) as the kernel's stable sort orders them: NaN first when largest,
    last when smallest; NaNs tie."""
    if dtype.kind in "iu":
        predicate = {(True, "i"): 4, (True, "u"): 8, (False, "i"): 2, (False, "u"): 6}[(largest, dtype.kind)]
        cmp = lambda pr: bd.op("arith.cmpi", a, b, type=el, result="i1", props=f"predicate = {pr} : i64")  # noqa: E731
        return cmp(predicate), cmp(0)
    nan_a, nan_b = bd.cmpf("uno", a, a, el), bd.cmpf("uno", b, b, el)
    ordered = bd.cmpf("ogt" if largest else "olt", a, b, el)
    true = bd.typed("arith.constant", [], "i1", "value = true")
    if largest:  # a NaN before every number
        nan_first = bd.op("arith.andi", nan_a, bd.op("arith.xori", nan_b, true, type="i1"), type="i1")
    else:  # every number before a NaN
        nan_first = bd.op("arith.andi", nan_b, bd.op("arith.xori", nan_a, true, type="i1"), type="i1")
    tie = bd.op("arith.ori", bd.cmpf("oeq", a, b, el), bd.op("arith.andi", nan_a, nan_b, type="i1"), type="i1")
    return bd.op("arith.ori", ordered, nan_first, type="i1"), tie


@rule(top.TopKOp)
def _(e: Emitter, op, p: top.TopKParams, args):
    """Each element's rank in the kernel's stable order (how many sort before it: better, or tied at a smaller
    index), a linalg reduction over the axis; then output slot r takes the element ranked r. No sort in TOSA;
    n * (n + K) comparisons per row."""
    (x,) = args
    if x.dtype == np.bool_:
        raise NotImplementedError("TopK of bool")
    axis, r = p.axis % x.rank, x.rank
    el = element(x.dtype)
    own = [f"d{d}" for d in range(r)]
    other = [f"d{r}" if d == axis else f"d{d}" for d in range(r)]

    def rank_body(bd, v, acc):
        before, tie = _better(bd, v[0], v[1], el, x.dtype, p.largest)
        j, i = (bd.typed("linalg.index", [], "index", f"dim = {d} : i64") for d in (r, axis))
        earlier = bd.typed("arith.cmpi", [(j, "index"), (i, "index")], "i1", "predicate = 2 : i64")
        counts = bd.op("arith.ori", before, bd.op("arith.andi", tie, earlier, type="i1"), type="i1")
        return bd.op("arith.addi", acc, bd.typed("arith.extui", [(counts, "i1")], "i32"), type="i32")

    ranks = e.loops([(x, other), (x, own)], e.const(np.zeros(x.shape, np.int32)), own, 1, rank_body)
    shape = list(x.shape)
    shape[axis] = p.K

    def pick(source: Val | None, dtype) -> Val:
        """Output slot d{axis} takes, over positions d{r} along the axis, the one whose rank is the slot."""
        out_el = element(dtype)

        def body(bd, v, acc):
            slot = bd.typed(
                "arith.index_cast", [(bd.typed("linalg.index", [], "index", f"dim = {axis} : i64"), "index")], "i32"
            )
            here = bd.op("arith.cmpi", v[0], slot, type="i32", result="i1", props="predicate = 0 : i64")
            if source is None:  # the position itself: the index output
                at = bd.typed(
                    "arith.index_cast", [(bd.typed("linalg.index", [], "index", f"dim = {r} : i64"), "index")], out_el
                )
            else:
                at = v[1]
            return bd.select(here, at, acc, out_el)

        inputs = [(ranks, other)] + ([(source, other)] if source is not None else [])
        return e.loops(inputs, e.const(np.zeros(shape, dtype)), own, 1, body)

    return pick(x, x.dtype), pick(None, np.int64)


def strided_slice(e: Emitter, x: Val, starts, counts, steps) -> Val:
    """x[..., start:start + (count - 1) * step + 1:step, ...] per axis (non-negative starts and steps)."""
    for axis, (start, count, step) in enumerate(zip(starts, counts, steps, strict=True)):
        if start == 0 and count == x.shape[axis] and step == 1:
            continue
        begin = [0] * x.rank
        begin[axis] = start
        size = list(x.shape)
        size[axis] = (count - 1) * step + 1
        x = e.slice(x, begin, size)
        if step > 1:
            x = _step(e, x, axis, step, count)
    return x


@rule(top.GridSampleOp)
def _(e: Emitter, op, p: top.GridSampleParams, args):
    """A linalg.generic over the output: each point reads its grid coordinates, then its taps (2, 4 or 1 per
    axis) out of the input, as the kernel does, in float32."""
    x, grid = args
    if not (x.is_float and grid.is_float):
        raise NotImplementedError(f"GridSample of {x.dtype} by a {grid.dtype} grid")
    x, grid = e.use(x), e.use(grid)
    out_shape = op.results[0].type.get_shape()

    def body(bd, _):
        s = _F32(bd)
        n_ix, c_ix = s.index(0), s.index(1)
        out_ix = [s.index(d) for d in range(2, len(out_shape))]
        per_axis = []
        for axis, length in enumerate(x.shape[2:]):
            component = s.index_const(x.rank - 3 - axis)  # x first: the grid's last axis is reversed
            g = s.extract(grid, [n_ix, *out_ix, component])
            per_axis.append(_grid_axis_taps(s, g, length, p))
        acc = s.c(0.0)
        for combo in itertools.product(*per_axis):
            w = combo[0][1]
            for _, wk in combo[1:]:
                w = s.f("arith.mulf", w, wk)
            v = s.extract(x, [n_ix, c_ix, *(i for i, _ in combo)])
            acc = s.f("arith.addf", acc, s.f("arith.mulf", w, v))
        el = element(x.dtype)
        return acc if el == "f32" else bd.typed("arith.truncf", [(acc, "f32")], el)

    return e.generic([], out_shape, x.dtype, body)


class _F32:
    """float32 scalar arithmetic in a linalg.generic body."""

    def __init__(self, bd):
        self.bd = bd

    def c(self, value: float) -> str:
        return self.bd.const(value, np.float32)

    def f(self, name: str, *args: str) -> str:
        return self.bd.f(name, *args, el="f32")

    def index(self, d: int) -> str:
        return self.bd.typed("linalg.index", [], "index", f"dim = {d} : i64")

    def index_const(self, value: int) -> str:
        return self.bd.typed("arith.constant", [], "index", f"value = {value} : index")

    def extract(self, v: Val, at: list[str]) -> str:
        el = element(v.dtype)
        got = self.bd.typed("tensor.extract", [(v.name, v.type)] + [(i, "index") for i in at], el)
        return got if el == "f32" else self.bd.typed("arith.extf", [(got, el)], "f32")

    def clamp(self, v: str, lo: float, hi: float) -> str:
        return self.f("arith.minimumf", self.f("arith.maximumf", v, self.c(lo)), self.c(hi))

    def reflect(self, v: str, lo: float, hi: float) -> str:
        """kernels.resize._reflect."""
        if hi <= lo:
            return self.c(lo)
        bd, f, c = self.bd, self.f, self.c
        below, above = bd.cmpf("olt", v, c(lo)), bd.cmpf("ogt", v, c(hi))
        dx = bd.select(below, f("arith.subf", c(lo), v), f("arith.subf", v, c(hi)), "f32")
        n = f("math.trunc", f("arith.divf", dx, c(hi - lo)))
        r = f("arith.subf", dx, f("arith.mulf", n, c(hi - lo)))
        even = bd.cmpf("oeq", f("arith.remf", n, c(2.0)), c(0.0))
        from_lo = bd.select(even, f("arith.addf", c(lo), r), f("arith.subf", c(hi), r), "f32")
        from_hi = bd.select(even, f("arith.subf", c(hi), r), f("arith.addf", c(lo), r), "f32")
        return bd.select(below, from_lo, bd.select(above, from_hi, v, "f32"), "f32")

    def cubic_weights(self, t: str) -> list[str]:
        """kernels.resize._cubic_weights: Keys' a = -0.75 for the taps at -1, 0, 1, 2."""
        f, c, a = self.f, self.c, -0.75

        def near(d):
            return f(
                "arith.addf",
                f("arith.mulf", f("arith.mulf", f("arith.subf", f("arith.mulf", c(a + 2), d), c(a + 3)), d), d),
                c(1.0),
            )

        def far(d):
            inner = f("arith.addf", f("arith.mulf", f("arith.subf", f("arith.mulf", c(a), d), c(5 * a)), d), c(8 * a))
            return f("arith.subf", f("arith.mulf", inner, d), c(4 * a))

        return [
            far(f("arith.addf", t, c(1.0))),
            near(t),
            near(f("arith.subf", c(1.0), t)),
            far(f("arith.subf", c(2.0), t)),
        ]


def _grid_axis_taps(s: _F32, g: str, length: int, p: top.GridSampleParams) -> list[tuple[str, str]]:
    """(index, weight) of each tap along one axis from its normalised coordinate ``g`` (kernels.resize)."""
    f, c, bd = s.f, s.c, s.bd
    lo, hi = (0.0, length - 1.0) if p.align_corners else (-0.5, length - 0.5)
    plus1 = f("arith.addf", g, c(1.0))
    if p.align_corners:
        pos = f("arith.mulf", f("arith.mulf", plus1, c(0.5)), c(length - 1.0))
    else:
        pos = f("arith.mulf", f("arith.subf", f("arith.mulf", plus1, c(float(length))), c(1.0)), c(0.5))
    if p.mode == "nearest":
        pos = f("math.roundeven", pos)
    if p.padding_mode == "border" and p.mode != "cubic":
        outside = bd.op("arith.ori", bd.cmpf("olt", pos, c(lo)), bd.cmpf("ogt", pos, c(hi)), type="i1")
        pos = bd.select(outside, s.clamp(pos, 0.0, length - 1.0), pos, "f32")
    elif p.padding_mode == "reflection":
        pos = s.reflect(pos, lo, hi)
    if p.mode == "nearest":
        firsts, weights = [pos], [c(1.0)]
    else:
        first = f("math.floor", pos)
        t = f("arith.subf", pos, first)
        linear = p.mode == "linear"
        firsts = [f("arith.addf", first, c(float(k))) for k in ((0, 1) if linear else (-1, 0, 1, 2))]
        weights = [f("arith.subf", c(1.0), t), t] if linear else s.cubic_weights(t)
    taps = []
    for at, w in zip(firsts, weights, strict=True):
        if p.padding_mode == "zeros":
            inside = bd.op("arith.andi", bd.cmpf("oge", at, c(0.0)), bd.cmpf("olt", at, c(float(length))), type="i1")
            w = bd.select(inside, w, c(0.0), "f32")
        elif p.padding_mode == "reflection":
            at = f("math.trunc", s.reflect(at, lo, hi))
        as_int = bd.typed("arith.fptosi", [(s.clamp(at, 0.0, length - 1.0), "f32")], "i64")
        taps.append((bd.typed("arith.index_cast", [(as_int, "i64")], "index"), w))
    return taps
