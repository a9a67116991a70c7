"""Layer group: halo math, group slicing executed tile by tile against whole-tensor inference, local
memory never overlapping, memory assign's reuse, upstream parse, determinism, a generated 500-op model."""

from __future__ import annotations

import dataclasses
import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tpubuild.build.chips import load_chip
from tpubuild.codegen import alloc
from tpubuild.codegen.assign import assign, ddr_lifetimes, memory_assign
from tpubuild.codegen.cost import nchw
from tpubuild.codegen.graph import build_graph
from tpubuild.codegen.layergroup import FOLD, LOCAL, Planner, layer_group, logical_shape, packs_of, read_groups
from tpubuild.codegen.slicing import Window, exact_f32, local_rule
from tpubuild.codegen.synthetic import residual_net
from tpubuild.ir import mlir, top, tpu
from tpubuild.ir.top import InputOp
from tpubuild.ir.types import tensor_type
from tpubuild.ir.weights import WeightStore
from tpubuild.kernels import Operand, get_kernel, prepare
from tpubuild.testing import upstream_check
from tpubuild.top.inference import run

BM1684X = load_chip("bm1684x")


def small_chip(lmem: int = 16 * 1024, lanes: int = 4):
    """bm1684x with a small local memory and few lanes: groups must slice."""
    return dataclasses.replace(BM1684X, lmem_bytes=lmem, lanes=lanes, lmem_banks=4)


# ---- halo math ----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 5),
    s=st.integers(1, 3),
    d=st.integers(1, 2),
    pb=st.integers(0, 3),
    pe=st.integers(0, 3),
    h=st.integers(1, 20),
    data=st.data(),
)
def test_window_need_covers_the_rows_the_windows_touch(k, s, d, pb, pe, h, data):
    span = (k - 1) * d + 1
    out_h = (h + pb + pe - span) // s + 1
    if out_h < 1 or max(pb, pe) >= span:
        return  # windows lying wholly in the padding: such ops keep H whole (slicing.Rule)
    lo = data.draw(st.integers(0, out_h - 1))
    hi = data.draw(st.integers(lo + 1, out_h))
    first, end, top, bottom = Window(k, s, d, pb, pe).need(lo, hi, h)
    touched = {r * s - pb + j * d for r in range(lo, hi) for j in range(k)}
    inside = [x for x in touched if 0 <= x < h]
    # a contiguous run over every row touched (a dilated window may skip rows inside it)
    assert 0 <= first <= end <= h
    if inside:  # (dilated windows near the border may touch only padding)
        assert first <= min(inside) and max(inside) < end
    assert top == max(pb - lo * s, 0)
    # the tile plus the slice's pads yields exactly hi - lo rows
    assert (end - first + top + bottom - span) // s + 1 == hi - lo


@settings(max_examples=40, deadline=None)
@given(
    k=st.sampled_from([1, 3, 5]),
    s=st.integers(1, 2),
    pad=st.integers(0, 2),
    h=st.integers(10, 16),
    pieces=st.integers(1, 4),
    d=st.integers(1, 2),
)
def test_conv_on_trimmed_tiles_equals_the_whole_conv(k, s, pad, h, pieces, d):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, h, 12)).astype(np.float32)
    w = rng.standard_normal((4, 3, k, k)).astype(np.float32)
    if pad >= (k - 1) * d + 1:
        return
    p = tpu.ConvOp.PARAMS(kernel_shape=(k, k), strides=(s, s), pads=(pad, pad, pad, pad), dilations=(d, d))
    kernel = get_kernel(tpu.ConvOp)
    full = kernel(p, x, w, None)
    out_h = full.shape[2]
    win = Window(k, s, d, pad, pad)
    pieces = min(pieces, out_h)
    for i in range(pieces):
        lo, hi = i * out_h // pieces, (i + 1) * out_h // pieces
        first, end, top, bottom = win.need(lo, hi, h)
        tile = kernel(dataclasses.replace(p, pads=(top, pad, bottom, pad)), x[:, :, first:end], w, None)
        np.testing.assert_allclose(tile, full[:, :, lo:hi], rtol=1e-5, atol=1e-5)


def _const(a: np.ndarray) -> Operand:
    return Operand(a.shape, a.dtype, a)


def _one_op_graph(op_cls, params, x_shape, w_shape, dtype=np.float32):
    b = mlir.GraphBuilder([tensor_type(x_shape, dtype)])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    w = b.weight("w", tensor_type(w_shape, dtype))
    bias = b.weight("b", tensor_type((w_shape[0],)))
    y = b.add(op_cls.make([x, w, bias], params, name="y")).results[0]
    graph = build_graph(b.finish([y], name="one", weight_file="w.npz", state="TPU_LOWERED"))
    return graph, next(n for n in graph.ops if n.name == "y")


# long sums over slices of a few rows: on numpy's OpenBLAS (Haswell kernels) one GEMM over a slice's pixels
# summed some outputs in another order than the whole tensor's (kernels.nn.pixel_gemm runs one per row)
@pytest.mark.parametrize(
    "ic,oc,k,s,h,pieces",
    [(32, 8, 5, 1, 20, 3), (64, 8, 3, 1, 20, 2), (64, 8, 3, 2, 40, 3), (32, 96, 5, 2, 8, 2), (64, 16, 3, 1, 40, 5)],
)
def test_f32_conv_slices_as_exact_f32_allows_give_the_whole_tensors_bits(ic, oc, k, s, h, pieces):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, ic, h, h)).astype(np.float32)
    w = rng.standard_normal((oc, ic, k, k)).astype(np.float32)
    bias = rng.standard_normal(oc).astype(np.float32)
    pad = k // 2
    p = tpu.ConvOp.PARAMS(kernel_shape=(k, k), strides=(s, s), pads=(pad,) * 4, dilations=(1, 1))
    graph, node = _one_op_graph(tpu.ConvOp, p, x.shape, w.shape)
    rule = exact_f32(graph, node, local_rule(graph, node))
    kernel = get_kernel(tpu.ConvOp)
    full = kernel(p, x, w, bias)
    # TPU inference computes the whole tensor with the prepared kernel: the same bits
    whole = prepare(tpu.ConvOp, p, [Operand(x.shape, x.dtype, None), _const(w), _const(bias)])
    np.testing.assert_array_equal(whole(x, w, bias), full)
    out_h = full.shape[2]
    for i in range(pieces):
        lo, hi = i * out_h // pieces, (i + 1) * out_h // pieces
        assert hi - lo >= rule.min_rows
        first, end, top_pad, bottom = rule.window.need(lo, hi, h)
        tile = kernel(dataclasses.replace(p, pads=(top_pad, pad, bottom, pad)), x[:, :, first:end], w, bias)
        np.testing.assert_array_equal(tile, full[:, :, lo:hi], err_msg=f"rows {lo}..{hi}")


def test_f32_pointwise_conv_slices_of_any_rows_give_the_whole_tensors_bits():
    """Each output row is its own GEMM (kernels.nn.pixel_gemm), so a 1x1 conv's slices need no minimum: one
    row, or any run of rows at any offset, gives the whole tensor's bits, as TPU inference (the prepared
    kernel) computes the whole tensor."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 96, 13, 5)).astype(np.float32)
    w = rng.standard_normal((24, 96, 1, 1)).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    p = tpu.ConvOp.PARAMS(kernel_shape=(1, 1), strides=(1, 1), pads=(0,) * 4, dilations=(1, 1))
    graph, node = _one_op_graph(tpu.ConvOp, p, x.shape, w.shape)
    assert exact_f32(graph, node, local_rule(graph, node)).min_rows == 1
    kernel = get_kernel(tpu.ConvOp)
    full = kernel(p, x, w, bias)
    whole = prepare(tpu.ConvOp, p, [Operand(x.shape, x.dtype, None), _const(w), _const(bias)])
    np.testing.assert_array_equal(whole(x, w, bias), full)
    for lo in range(13):
        for hi in range(lo + 1, min(lo + 5, 13) + 1):
            tile = kernel(p, x[1:, :, lo:hi], w, bias)
            np.testing.assert_array_equal(tile, full[1:, :, lo:hi], err_msg=f"rows {lo}..{hi}")


def test_f32_conv_slices_keep_every_tap_live():
    """A top slice of one row under a 5x5 window with pads 2 would leave the first two kernel rows in the
    padding (the kernel drops such taps, which changes the GEMM's sums): F32 slices keep three rows."""
    p = tpu.ConvOp.PARAMS(kernel_shape=(5, 5), strides=(1, 1), pads=(2,) * 4, dilations=(1, 1))
    graph, node = _one_op_graph(tpu.ConvOp, p, (1, 8, 16, 16), (8, 8, 5, 5))
    assert exact_f32(graph, node, local_rule(graph, node)).min_rows == 3
    stride2 = dataclasses.replace(p, strides=(2, 2))
    graph, node = _one_op_graph(tpu.ConvOp, stride2, (1, 8, 16, 16), (8, 8, 5, 5))
    assert exact_f32(graph, node, local_rule(graph, node)).min_rows == 2


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_conv_slices_keep_every_tap_live_too(dtype):
    """The 16-bit modes' convs are float32 GEMMs on widened operands, rounded after. A top slice of one row
    under a stride-2 3x3 window drops the kernel's top row of taps: most of its float32 sums change, and a
    few of them cross a 16-bit rounding boundary (YOLO11s-seg's BF16 conv on cv183x: one pixel of 51200 one
    step off). exact_f32 keeps two rows, whose slices give the whole tensor's bits."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 8, 400)).astype(dtype)
    w = (rng.standard_normal((128, 64, 3, 3)) * 0.05).astype(dtype)
    bias = rng.standard_normal(128).astype(np.float32)
    p = tpu.ConvOp.PARAMS(kernel_shape=(3, 3), strides=(2, 2), pads=(1,) * 4, dilations=(1, 1))
    graph, node = _one_op_graph(tpu.ConvOp, p, x.shape, w.shape, dtype)
    rule = exact_f32(graph, node, local_rule(graph, node))
    assert rule.min_rows == 2
    kernel = get_kernel(tpu.ConvOp)

    def bits(a: np.ndarray) -> np.ndarray:
        return a.astype(dtype).view(np.uint16)  # rounded to the mode's type, as the chip stores the result

    full = bits(kernel(p, x, w, bias))

    def tile(lo: int, hi: int) -> np.ndarray:
        first, end, top_pad, bottom = rule.window.need(lo, hi, x.shape[2])
        return bits(kernel(dataclasses.replace(p, pads=(top_pad, 1, bottom, 1)), x[:, :, first:end], w, bias))

    assert not np.array_equal(tile(0, 1), full[:, :, :1])  # one row: some values a step off
    for lo in (0, 2):
        np.testing.assert_array_equal(tile(lo, lo + 2), full[:, :, lo : lo + 2], err_msg=f"rows {lo}..{lo + 2}")


def test_f32_deconv_slices_give_the_whole_tensors_bits():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 256, 10, 12)).astype(np.float32)
    w = rng.standard_normal((256, 16, 2, 2)).astype(np.float32)
    deconv = tpu.MIRROR[top.DeconvOp]
    p = deconv.PARAMS(kernel_shape=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0), dilations=(1, 1))
    kernel = get_kernel(deconv)
    full = kernel(p, x, w, None)
    for lo, hi in [(0, 3), (3, 4), (4, 10)]:  # input rows r make output rows 2r, 2r + 1
        np.testing.assert_array_equal(kernel(p, x[:1, :, lo:hi], w, None), full[:1, :, 2 * lo : 2 * hi])


def test_f32_1d_conv_n_slices_give_the_whole_batchs_bits():
    """A 1-D conv's GEMM row is a whole block of its columns, so its blocks are sized by one sample's bytes:
    a slice of one sample runs the whole batch's blocks (sized by the batch, they differed)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 64, 3000)).astype(np.float32)  # several 2 MB column blocks
    w = rng.standard_normal((16, 64, 5)).astype(np.float32)
    p = tpu.ConvOp.PARAMS(kernel_shape=(5,), strides=(1,), pads=(2, 2), dilations=(1,))
    kernel = get_kernel(tpu.ConvOp)
    full = kernel(p, x, w, None)
    whole = prepare(tpu.ConvOp, p, [Operand(x.shape, x.dtype, None), _const(w), Operand(None, None, None)])
    np.testing.assert_array_equal(whole(x, w, None), full)
    for i in range(3):
        np.testing.assert_array_equal(kernel(p, x[i : i + 1], w, None), full[i : i + 1], err_msg=f"sample {i}")


# ---- executing a plan tile by tile ----------------------------------------------------------------


def execute(module, weights: WeightStore, inputs: dict, chip=BM1684X) -> dict[str, np.ndarray]:
    """Run an lg.mlir as the chip would: each local group slice by slice on tiles holding only the planned
    rows (reading a tile outside them fails), in its layout (a spread group's tensors in their lane-spread
    shapes), global ops on whole tensors."""
    graph = build_graph(module)
    groups = read_groups(module, graph)
    channel = Planner(graph, chip, exact_f32=False)
    ddr = {name: np.asarray(a) for name, a in inputs.items()}
    arrays = {name: weights[name] for name, t in graph.tensors.items() if t.weight}
    for group in groups:
        if group.kind != LOCAL:
            node = graph.ops[group.ops[0]]
            args = [None if t is None else (arrays[t] if graph.tensors[t].weight else ddr[t]) for t in node.inputs]
            result = get_kernel(type(node.op))(node.op.params, *args)
            for name, r in zip(node.outputs, result if isinstance(result, tuple) else (result,), strict=True):
                ddr[name] = np.asarray(r).astype(graph.tensors[name].dtype)
            continue
        planner = channel.layout(group)
        stored = {o: np.full(graph.tensors[o].shape, np.nan).astype(graph.tensors[o].dtype) for o in group.outputs}
        sources = {
            t: _folded(planner.folded[t], ddr[t], planner.t[t].shape4) if t in planner.folded else ddr[t]
            for t in group.inputs
        }
        folded_weights = {f.weight: f.weight_data(arrays[f.weight]) for f in planner.folded.values()}
        for s in range(group.slices):
            tiles = {}
            for t in group.inputs:
                tiles[t] = (group.ranges[t][s], _tile(sources[t], group.ranges[t][s], planner.t[t].shape4))
            for p in group.ops:
                node = graph.ops[p]
                out_r = group.ranges[node.name][s]
                params, operands = planner.op_tiles(group, p, s)  # what codegen emits for this op and slice
                args = []
                for operand in operands:
                    if operand is None:
                        args.append(None)
                    elif operand[1] is None:
                        args.append(folded_weights.get(operand[0], arrays[operand[0]]))
                    else:
                        t, (n_lo, n_hi, h_lo, h_hi) = operand
                        have, tile = tiles[t]
                        assert have[0] <= n_lo and n_hi <= have[1] and have[2] <= h_lo and h_hi <= have[3], (
                            f"{node.name} reads {t} rows outside its tile"
                        )
                        view = tile[n_lo - have[0] : n_hi - have[0], :, h_lo - have[2] : h_hi - have[2]]
                        args.append(view.reshape(logical_shape(planner.g.tensors[t].shape, operand[1])))
                result = np.asarray(get_kernel(type(node.op))(params, *args)).astype(graph.tensors[node.name].dtype)
                tiles[node.name] = (out_r, result.reshape(nchw(result.shape)))
            for o in group.outputs:
                own = group.own[o][s]
                have, tile = tiles[o]
                view = stored[o].reshape(planner.t[o].shape4)
                view[own[0] : own[1], :, own[2] : own[3]] = tile[
                    own[0] - have[0] : own[1] - have[0], :, own[2] - have[2] : own[3] - have[2]
                ]
        ddr.update(stored)
    return ddr


def _folded(fold, x, shape4):
    """A fold group's input X' (``layergroup.Fold``) made from X: the rows its pieces name, the zero point
    where they fall in the padding."""
    x = np.asarray(x)
    folded = np.full(shape4, fold.zp, x.dtype)
    for dy, first, rows, source in fold.pieces(0, shape4[2]):
        if source is not None:
            folded[:, dy * fold.ic : (dy + 1) * fold.ic, first : first + rows] = x[
                :, :, source : source + (rows - 1) * fold.sh + 1 : fold.sh
            ]
    return folded


def _tile(array, r, shape4):
    a = np.asarray(array).reshape(shape4)
    return a[r[0] : r[1], :, r[2] : r[3]].copy()


def conv_chain(h: int = 24, c: int = 4) -> tuple:
    """input -> conv3x3 s1 -> relu -> conv3x3 s2 -> maxpool 3x3 s1 p1 -> conv1x1 -> add(pool) -> conv 5x5 p2."""
    rng = np.random.default_rng(1)
    b = mlir.GraphBuilder([tensor_type((2, c, h, h))])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    weights = WeightStore()

    def conv(v, name, k, s, p, cin):
        weights.add(f"{name}.w", rng.standard_normal((c, cin, k, k)).astype(np.float32) * 0.3)
        weights.add(f"{name}.b", rng.standard_normal((c,)).astype(np.float32) * 0.1)
        w = b.weight(f"{name}.w", tensor_type((c, cin, k, k)))
        bias = b.weight(f"{name}.b", tensor_type((c,)))
        params = tpu.ConvOp.PARAMS(kernel_shape=(k, k), strides=(s, s), pads=(p, p, p, p), dilations=(1, 1))
        return b.add(tpu.ConvOp.make([v, w, bias], params, name=name)).results[0]

    y = conv(x, "c1", 3, 1, 1, c)
    y = b.add(tpu.ReluOp.make([y], name="r1")).results[0]
    y = conv(y, "c2", 3, 2, 1, c)
    pool = b.add(
        tpu.MaxPoolOp.make(
            [y], tpu.MaxPoolOp.PARAMS(kernel_shape=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1)), name="pool"
        )
    ).results[0]
    z = conv(pool, "c3", 1, 1, 0, c)
    z = b.add(tpu.AddOp.make([z, pool], name="add")).results[0]
    z = conv(z, "c4", 5, 1, 2, c)
    module = b.finish([z, pool], name="chain", weight_file="w.npz", state="TPU_LOWERED")
    return module, weights, {"x": rng.standard_normal((2, c, h, h)).astype(np.float32)}


@pytest.mark.parametrize("lmem,lanes", [(256 * 1024, 64), (6 * 1024, 4), (2 * 1024, 4), (3 * 1024, 8)])
def test_group_slices_reproduce_whole_tensor_inference(lmem, lanes):
    module, weights, inputs = conv_chain()
    chip = small_chip(lmem, lanes)
    ref = run(module, weights, inputs)
    lg, groups = layer_group(module, chip, exact_f32=False)  # slice the F32 convs too: the halo math
    lg = mlir.parse_module(mlir.print_module(lg))
    got = execute(lg, weights, inputs, chip)
    if lanes == 64:  # the 4-channel 3x3 conv on the input folds its kernel rows into 12 channels
        assert [g.layout for g in groups if g.kind == LOCAL][0] == FOLD
    for name in ("pool", "c4"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=name)
    if lmem <= 6 * 1024:
        assert any(g.kind == LOCAL and g.h_secs > 1 for g in groups), "a small local memory must force H slices"
    assert any(g.kind == LOCAL and len(g.ops) > 1 for g in groups), "ops must be grouped"


def test_weights_that_vary_along_n_or_h_keep_their_op_whole_along_that_axis():
    """A weight operand is loaded whole: an Add of a [1, c, h, w] bias (a Swin window attention's relative
    position bias) is not sliced along H, a Mul by an [n, 1, 1, 1] weight not along N; the groups still slice
    what they can, and the tiles give the whole tensors' values."""
    rng = np.random.default_rng(2)
    n, c, h = 4, 4, 16
    b = mlir.GraphBuilder([tensor_type((n, c, h, h))])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    weights = WeightStore()
    for name, shape in {"bias": (1, c, h, h), "gain": (n, 1, 1, 1), "per_channel": (1, c, 1, 1)}.items():
        weights.add(name, rng.standard_normal(shape).astype(np.float32))
    y = b.add(tpu.ReluOp.make([x], name="relu")).results[0]
    y = b.add(tpu.AddOp.make([y, b.weight("bias", tensor_type((1, c, h, h)))], name="add")).results[0]
    y = b.add(tpu.ReluOp.make([y], name="relu2")).results[0]
    y = b.add(tpu.MulOp.make([y, b.weight("gain", tensor_type((n, 1, 1, 1)))], name="mul")).results[0]
    y = b.add(tpu.AddOp.make([y, b.weight("per_channel", tensor_type((1, c, 1, 1)))], name="shift")).results[0]
    module = b.finish([y], name="biases", weight_file="w.npz", state="TPU_LOWERED")
    graph = build_graph(module)
    rules = {node.name: local_rule(graph, node) for node in graph.ops}
    assert (rules["add"].n_split, rules["add"].h_split) == (True, False)
    assert (rules["mul"].n_split, rules["mul"].h_split) == (False, True)
    assert (rules["shift"].n_split, rules["shift"].h_split) == (True, True)
    inputs = {"x": rng.standard_normal((n, c, h, h)).astype(np.float32)}
    chip = small_chip(8 * 1024, 4)
    lg, groups = layer_group(module, chip, exact_f32=False)
    got = execute(mlir.parse_module(mlir.print_module(lg)), weights, inputs, chip)
    np.testing.assert_array_equal(got["shift"], run(module, weights, inputs)["shift"])
    local = [g for g in groups if g.kind == LOCAL]
    assert any(g.n_secs > 1 for g in local) and any(g.h_secs > 1 for g in local), "both axes must be sliced"


def test_slices_cover_outputs_and_halos_grow_backwards():
    module, _, _ = conv_chain(h=32)
    _, groups = layer_group(module, small_chip(3 * 1024, 8), exact_f32=False)
    graph = build_graph(module)
    sliced = [g for g in groups if g.kind == LOCAL and g.h_secs > 1]
    assert sliced
    for g in sliced:
        for o in g.outputs:
            n, _, h, _ = nchw(graph.tensors[o].shape)
            covered = np.zeros((n, h), int)
            for r in g.own[o]:
                covered[r[0] : r[1], r[2] : r[3]] += 1
            assert covered.min() >= 1, f"{o}: some rows are never stored"
        # every conv 3x3 (stride 1, pad 1) input tile holds one more row than the output tile on each
        # inner border, and conv 5x5 two
        for p in g.ops:
            node = graph.ops[p]
            if node.kind != "tpu.Conv" or node.inputs[0] not in g.ranges:
                continue
            k = node.op.params.kernel_shape[0]
            s_ = node.op.params.strides[0]
            h_in = nchw(graph.tensors[node.inputs[0]].shape)[2]
            for r_in, r_out in zip(g.ranges[node.inputs[0]], g.ranges[node.name], strict=True):
                if s_ == 1 and r_out[2] > 0:
                    assert r_in[2] <= r_out[2] - (k - 1) // 2
                if s_ == 1 and r_out[3] < h_in:
                    assert r_in[3] >= r_out[3] + (k - 1) // 2


# ---- local memory --------------------------------------------------------------------------------

buffers_strategy = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 6), st.integers(0, 5000)), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(specs=buffers_strategy, align=st.sampled_from([1, 16, 64]), banks=st.sampled_from([0, 1024]))
def test_placement_never_overlaps_live_buffers(specs, align, banks):
    bufs = [alloc.Buffer(f"b{i}", s, s + d, size) for i, (s, d, size) in enumerate(specs)]
    avoid = {f"b{i}": [f"b{i + 1}"] for i in range(len(bufs) - 1)}
    offsets = alloc.place(bufs, align=align, bank_bytes=banks, avoid=avoid)
    for a in bufs:
        assert offsets[a.key] % align == 0
        for b in bufs:
            if a.key < b.key and a.meets(b) and a.size and b.size:
                lo_a, lo_b = offsets[a.key], offsets[b.key]
                assert lo_a + a.size <= lo_b or lo_b + b.size <= lo_a, (a, b, lo_a, lo_b)
    assert alloc.peak(bufs, offsets) >= alloc.live_bound(bufs)
    with pytest.raises(alloc.AllocError):
        alloc.place(bufs + [alloc.Buffer("huge", 0, 20, 10**6)], align=align, capacity=10**6 - 1)


def test_group_local_buffers_fit_and_never_overlap_in_lg_mlir():
    module, _ = residual_net(60, size=56)
    chip = small_chip(64 * 1024, 16)
    lg, groups = layer_group(module, chip, exact_f32=False)
    lg = mlir.parse_module(mlir.print_module(lg))
    graph = build_graph(lg)
    planner = Planner(graph, chip)
    local = [g for g in read_groups(lg, graph) if g.kind == LOCAL]
    assert local
    for g in local:
        planner.check(g)  # as recorded in the file
        assert g.lmem_bytes <= chip.lmem_bytes
    # a plan whose buffers collide is refused, never emitted
    g = max(local, key=lambda g: len(g.addrs))
    keys = sorted(g.addrs)
    tampered = dataclasses.replace(g, addrs={**g.addrs, keys[1]: g.addrs[keys[0]]})
    with pytest.raises(alloc.AllocError):
        planner.check(tampered)
    too_big = dataclasses.replace(g, addrs={**g.addrs, keys[0]: chip.lmem_bytes})
    with pytest.raises(alloc.AllocError, match="do not fit"):
        planner.check(too_big)


def test_plan_merges_neighbours_whose_exact_plan_is_cheaper():
    """The search sizes groups by a middle slice; where it split a run of ops into neighbouring local
    groups that also fit as one, the plan keeps whichever exact plan replays in fewer cycles: here the
    merge saves cycles over the search's own split, and every op is still in exactly one group."""
    chip = dataclasses.replace(BM1684X, lmem_bytes=16 * 1024)
    module, _ = residual_net(40, size=32)
    graph = build_graph(module)
    planner = Planner(graph, chip, exact_f32=False)
    chosen = planner.search()
    split = sum(
        g.cycles
        for i, j, kind, est in chosen
        for g in (planner._place(0, i, j, est) if kind == LOCAL else [planner._single(0, i, kind)])
    )
    groups = planner.plan()
    assert sum(g.cycles for g in groups) < split
    assert sorted(p for g in groups for p in g.ops) == list(range(len(graph.ops)))
    assert sum(g.kind == LOCAL for g in groups) < sum(kind == LOCAL for _, _, kind, _ in chosen)


def test_a_run_with_no_exact_plan_is_searched_around_not_split_op_by_op(monkeypatch):
    """Where a run of ops the search chose as one group has no exact plan as one (the search sizes groups by a
    middle slice), the plan searches again without that run: here no run longer than 6 ops has an exact plan,
    and the plan is local groups of up to 6 ops, as few as the search's own groups of at most 6, not single ops."""
    module, _ = residual_net(40, size=32)
    graph = build_graph(module)
    assert max(j - i for i, j, _, _ in Planner(graph, BM1684X, exact_f32=False).search()) > 6
    finalize = Planner.finalize
    monkeypatch.setattr(
        Planner, "finalize", lambda self, gid, i, j, ns, hs: None if j - i > 6 else finalize(self, gid, i, j, ns, hs)
    )
    groups = Planner(graph, BM1684X, exact_f32=False).plan()
    assert sorted(p for g in groups for p in g.ops) == list(range(len(graph.ops)))
    local = [g for g in groups if g.kind == LOCAL]
    assert all(len(g.ops) <= 6 for g in local)
    monkeypatch.setattr("tpubuild.codegen.layergroup.search.MAX_GROUP_OPS", 6)
    capped = Planner(graph, BM1684X, exact_f32=False).search()
    assert len(local) <= sum(kind == LOCAL for _, _, kind, _ in capped)
    assert sum(len(g.ops) > 1 for g in local) * 2 > len(local)


# ---- memory assign -------------------------------------------------------------------------------


def test_assign_never_overlaps_live_tensors_and_reports_the_bound():
    module, _ = residual_net(120, size=64)
    lg, groups = layer_group(module, small_chip(32 * 1024, 16), exact_f32=False)
    graph = build_graph(lg)
    groups = read_groups(lg, graph)
    a = assign(graph, groups, BM1684X)
    life = ddr_lifetimes(graph, groups)
    names = sorted(life)
    for x in names:
        for y in names:
            if x < y and a.members[x] != a.members[y]:
                (s1, e1), (s2, e2) = life[x], life[y]
                if s1 <= e2 and s2 <= e1:
                    ax, ay = a.activations[x], a.activations[y]
                    assert ax + graph.tensors[x].nbytes <= ay or ay + graph.tensors[y].nbytes <= ax, (x, y)
    # each weight, or each pack of an op's weights (one region of interleaved rows), apart and aligned
    packs = packs_of(graph, groups, BM1684X)
    assert packs  # the convs' filters and biases
    regions = {
        (a.weights[packs[w].key], packs[w].nbytes) if w in packs else (addr, graph.tensors[w].nbytes)
        for w, addr in a.weights.items()
    }
    ws = sorted(regions)
    for (a1, n1), (a2, _) in itertools.pairwise(ws):
        assert a1 + n1 <= a2 and a2 % BM1684X.ddr_align == 0
    assert a.weight_bytes <= a.activation_base and min(a.activations.values()) >= a.activation_base
    assert a.lower_bound <= a.activation_bytes <= 1.05 * a.lower_bound
    # reuse happened: the region is far smaller than every DDR tensor side by side
    assert a.activation_bytes < sum(graph.tensors[t].nbytes for t in life) / 2


# ---- files ---------------------------------------------------------------------------------------


def test_lg_and_addr_mlir_parse_upstream_and_are_deterministic(tmp_path):
    texts = []
    for _ in range(2):
        module, _, _ = conv_chain()
        lg, _ = layer_group(module, small_chip(3 * 1024, 8))
        lg_text = mlir.print_module(lg)
        addr, _ = memory_assign(mlir.parse_module(lg_text), BM1684X)
        texts.append((lg_text, mlir.print_module(addr)))
    assert texts[0] == texts[1]
    for name, text in zip(("lg.mlir", "addr.mlir"), texts[0], strict=True):
        path = tmp_path / name
        path.write_text(text)
        upstream_check(path)
    assert 'module.state = "TPU_GROUPED"' in texts[0][0] and 'module.state = "TPU_ADDRESSED"' in texts[0][1]
    assert "ginfo = {" in texts[0][0] and "lg.groups = [" in texts[0][0]


def test_a_generated_500_op_model_plans_and_assigns():
    module, _ = residual_net(500, size=96)
    graph = build_graph(module)
    assert len(graph.ops) == 500
    lg, groups = layer_group(module, BM1684X, exact_f32=False)
    assert sum(len(g.ops) for g in groups) == 500
    assert sorted(p for g in groups for p in g.ops) == list(range(500))
    assert sum(g.kind == LOCAL and len(g.ops) > 1 for g in groups) >= 10
    _, a = memory_assign(mlir.parse_module(mlir.print_module(lg)), BM1684X)
    assert a.activation_bytes <= 1.05 * a.lower_bound


def test_every_lowered_op_kind_has_a_rule_or_runs_global():
    module, _, _ = conv_chain()
    graph = build_graph(module)
    assert all(local_rule(graph, node) is not None for node in graph.ops)


def test_assign_search_reaches_the_bound_where_greedy_fragments():
    """A ViT block's DDR tensors (from mini_vit): largest-first greedy leaves a hole one q/k/v wide; the
    order search closes it."""
    spec = [
        ("input", 0, 0, 49152),
        ("embed", 0, 2, 24576),
        ("tokens", 2, 3, 24576),
        ("qkv", 3, 5, 74880),
        ("pos", 3, 13, 24960),
        ("heads", 5, 8, 74880),
        ("q", 6, 10, 24960),
        ("k", 7, 9, 24960),
        ("v", 8, 10, 24960),
        ("kt", 9, 10, 24960),
        ("ctx", 10, 11, 24960),
        ("merge", 11, 13, 24960),
        ("res2", 13, 23, 24960),
        ("qkv1", 13, 15, 74880),
        ("heads1", 15, 18, 74880),
        ("q1", 16, 20, 24960),
        ("k1", 17, 19, 24960),
        ("v1", 18, 20, 24960),
        ("kt1", 19, 20, 24960),
        ("ctx1", 20, 21, 24960),
        ("merge1", 21, 23, 24960),
        ("logits", 23, 24, 64),
    ]
    bufs = [alloc.Buffer(*s) for s in spec]
    greedy = alloc.place(bufs, align=64)
    assert alloc.peak(bufs, greedy) > alloc.live_bound(bufs)
    best, offsets = alloc.improve(bufs, sorted(bufs, key=lambda b: (-b.size, b.start, b.key)), align=64)
    alloc.check(bufs, offsets)
    assert best == alloc.peak(bufs, offsets) == alloc.live_bound(bufs)


# ---- the chip roofline's per-op floor -----------------------------------------------------------


def test_attainable_cycles_spread_work_over_every_lane():
    """A conv's floor is its MACs over every lane at the dtype's cube rate plus requantising its int32 result
    (3 vector passes); a depthwise conv's taps run on the vector unit at int32 width, plus one requant pass;
    the cost of the emitted command with few channels is above the floor."""
    from tpubuild.codegen import cost

    chip = BM1684X
    p = tpu.ConvOp.PARAMS(kernel_shape=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1))
    ins, out = [(1, 96, 40, 40), (24, 96, 3, 3)], [(1, 24, 40, 40)]
    macs = 24 * 40 * 40 * 9 * 96
    floor = cost.attainable_cycles(chip, "tpu.Conv", p, ins, out, "int8")
    int32_per_cycle = 64 * 64 // 4  # lanes x int32 elements per 64-byte EU
    assert floor == pytest.approx(chip.bdc_overhead + macs / (64 * 256) + 3 * 24 * 40 * 40 / int32_per_cycle)
    # 24 output channels leave 40 of 64 lanes idle in the command as emitted
    assert cost.bdc_cycles(chip, "tpu.Conv", p, ins, out, "int8") > 2 * floor
    dw = dataclasses.replace(p, group=96)
    taps = 96 * 40 * 40 * 9
    floor_dw = cost.attainable_cycles(chip, "tpu.Conv", dw, [(1, 96, 40, 40), (96, 1, 3, 3)], [(1, 96, 40, 40)], "int8")
    assert floor_dw == pytest.approx(chip.bdc_overhead + (taps + 96 * 40 * 40) / int32_per_cycle)


def test_deconv_whose_kernel_is_its_stride_slices_along_h():
    """A 2x2 stride-2 transposed conv between two 3x3 convs: input row r makes output rows 2r and 2r+1 only,
    so its group slices H (the deconv computing whole row pairs, the next conv reading a view of them) and
    the tiles reproduce whole-tensor inference."""
    rng = np.random.default_rng(3)
    c, h = 4, 12
    b = mlir.GraphBuilder([tensor_type((2, c, h, h))])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    weights = WeightStore()

    def weight(name, shape):
        weights.add(name, rng.standard_normal(shape).astype(np.float32) * 0.3)
        return b.weight(name, tensor_type(shape))

    conv_p = tpu.ConvOp.PARAMS(kernel_shape=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1))
    y = b.add(tpu.ConvOp.make([x, weight("c1.w", (c, c, 3, 3)), weight("c1.b", (c,))], conv_p, name="c1")).results[0]
    deconv = tpu.MIRROR[top.DeconvOp]
    dp = deconv.PARAMS(kernel_shape=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0), dilations=(1, 1))
    y = b.add(deconv.make([y, weight("d.w", (c, c, 2, 2)), weight("d.b", (c,))], dp, name="up")).results[0]
    y = b.add(tpu.ConvOp.make([y, weight("c2.w", (c, c, 3, 3)), weight("c2.b", (c,))], conv_p, name="c2")).results[0]
    module = b.finish([y], name="up", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {"x": rng.standard_normal((2, c, h, h)).astype(np.float32)}
    ref = run(module, weights, inputs)
    graph = build_graph(module)
    rule = local_rule(graph, next(n for n in graph.ops if n.name == "up"))
    # rows 3..6 of the output need input rows 1..3, which make output rows 2..7
    assert rule.computed(3, 7, 2 * h) == (2, 8) and rule.in_h_range(0, 2, 8, h, 2 * h) == (1, 4, 0, 0)
    lg, groups = layer_group(module, small_chip(4 * 1024, 4), exact_f32=False)
    up = next(g for g in groups if any(graph.ops[p].name == "up" for p in g.ops))
    assert up.kind == LOCAL and up.h_secs > 1
    for r in up.ranges["up"]:
        assert r[2] % 2 == 0 and r[3] % 2 == 0, "the deconv computes whole row pairs"
    got = execute(mlir.parse_module(mlir.print_module(lg)), weights, inputs)
    np.testing.assert_allclose(got["c2"], ref["c2"], rtol=1e-4, atol=1e-4)


def test_each_backend_stage_refuses_a_module_of_another_state():
    from tpubuild.codegen.codegen import codegen
    from tpubuild.errors import TpuBuildError

    module, weights, _ = conv_chain()  # TPU_LOWERED
    with pytest.raises(
        TpuBuildError, match="memory assign reads a grouped module .state TPU_GROUPED., this one is TPU_LOWERED"
    ) as err:
        memory_assign(module, BM1684X)
    assert err.value.hint == "run the layergroup stage first"
    with pytest.raises(TpuBuildError, match="codegen reads an addressed module .state TPU_ADDRESSED."):
        codegen(module, weights, BM1684X)
    grouped, _ = layer_group(module, BM1684X)
    with pytest.raises(
        TpuBuildError, match="layer group reads a lowered module .state TPU_LOWERED., this one is TPU_GROUPED"
    ):
        layer_group(grouped, BM1684X)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 300), min_size=1, max_size=4), lanes=st.sampled_from([4, 8, 64]))
def test_spread_shape_holds_the_same_elements_in_no_more_per_lane(shape, lanes):
    """The lane-spread layout is a row-major reshape of the (n, c, h, w) view that leaves no lane more
    elements than the channel layout, in runs of at least 64 (or the whole plane)."""
    from tpubuild.codegen.slicing import MIN_RUN, spread_shape

    n, c, h, w = nchw(tuple(shape))
    s = spread_shape(tuple(shape), lanes)
    assert s[0] == n and np.prod(s) == n * c * h * w
    assert s[1] % c == 0  # each channel's plane is cut into s[1] // c consecutive runs
    per_lane = -(-s[1] // lanes) * s[2] * s[3]
    assert per_lane <= -(-c // lanes) * h * w
    assert s == (n, c, h, w) or s[2] * s[3] >= min(h * w, MIN_RUN)
    if c == 1 and h * w % lanes == 0 and h * w >= lanes * MIN_RUN:
        assert s[1] == lanes  # a one-channel map fills every lane


@settings(max_examples=300, deadline=None)
@given(
    h=st.integers(1, 40),
    kh=st.integers(2, 5),
    sh=st.integers(1, 3),
    dh=st.integers(1, 2),
    pt=st.integers(0, 3),
    data=st.data(),
)
def test_fold_pieces_make_every_row_of_the_folded_input_once(h, kh, sh, dh, pt, data):
    """Per kernel row dy, rows [lo, hi) of X' come from X's row r * sh + dy * dh - pt where that is
    inside X, and from the zero-point fill where it is padding; each row exactly once."""
    from tpubuild.codegen.layergroup import Fold

    out_h = data.draw(st.integers(1, 30))
    lo = data.draw(st.integers(0, out_h - 1))
    hi = data.draw(st.integers(lo + 1, out_h))
    fold = Fold(0, 0, "x", None, "w", 1, 3, h, 8, kh, sh, dh, pt, 0)
    made: dict[tuple[int, int], int | None] = {}
    for dy, first, rows, source in fold.pieces(lo, hi):
        assert rows > 0
        for k in range(rows):
            assert (dy, first + k) not in made
            made[(dy, first + k)] = None if source is None else source + k * sh
    for dy in range(kh):
        for r in range(lo, hi):
            y = r * sh + dy * dh - pt
            assert made[(dy, r)] == (y if 0 <= y < h else None)
