"""Codegen end to end: ONNX -> TPU -> layer group -> assign -> .model -> simulator, against TPU inference.

The chip runs the TPU kernels on the tiles codegen describes, so INT8 results must be bit-exact, and so
are float results here (a dot product's order does not depend on how many rows a tile has).
Small chips (few lanes, little local memory) force H slices with halos, views into tiles, double buffering
and several groups.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tpubuild.build.chips import load_chip
from tpubuild.calib.calibrate import calibrate
from tpubuild.codegen.assign import memory_assign
from tpubuild.codegen.codegen import codegen
from tpubuild.codegen.layergroup import LOCAL, layer_group
from tpubuild.codegen.model_file import decode_model, encode_model
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir
from tpubuild.ir.weights import WeightStore
from tpubuild.lower.lowering import lower_module
from tpubuild.sim.chip import simulate
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import run

BM1684X = load_chip("bm1684x")


def node(op, inputs, output, **attrs):
    return helper.make_node(op, list(inputs), [output], name=output, **attrs)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def cnn(make_model, size: int = 24):
    """Convs (3x3 s1, 3x3 s2, depthwise, 1x1), a residual add, max pool, concat, SiLU, resize, GAP, gemm."""
    rng = np.random.default_rng(5)
    nodes = [
        node("Conv", ["x", "w1", "b1"], "c1", pads=[1, 1, 1, 1]),
        node("Relu", ["c1"], "r1"),
        node("Conv", ["r1", "wd", "bd"], "dw", pads=[1, 1, 1, 1], group=8),
        node("Add", ["r1", "dw"], "res"),
        node("MaxPool", ["res"], "p1", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        node("Conv", ["p1", "w2", "b2"], "c2", pads=[1, 1, 1, 1], strides=[1, 1]),
        node("Sigmoid", ["c2"], "gate"),
        node("Mul", ["c2", "gate"], "silu"),
        node("Conv", ["silu", "w3", "b3"], "c3"),
        node("Concat", ["p1", "c3"], "cat", axis=1),
        node("Resize", ["cat", "", "scales"], "up", mode="nearest"),
        node("Conv", ["up", "w4", "b4"], "c4", pads=[1, 1, 1, 1], strides=[2, 2]),
        node("GlobalAveragePool", ["c4"], "gap"),
        node("Flatten", ["gap"], "flat"),
        node("Gemm", ["flat", "wf", "bf"], "logits", transB=1),
    ]
    inits = {
        "w1": randn(rng, 8, 3, 3, 3, scale=0.4),
        "b1": randn(rng, 8, scale=0.1),
        "wd": randn(rng, 8, 1, 3, 3, scale=0.4),
        "bd": randn(rng, 8, scale=0.1),
        "w2": randn(rng, 8, 8, 3, 3, scale=0.15),
        "b2": randn(rng, 8, scale=0.1),
        "w3": randn(rng, 4, 8, 1, 1, scale=0.4),
        "b3": randn(rng, 4, scale=0.1),
        "w4": randn(rng, 6, 12, 3, 3, scale=0.2),
        "b4": randn(rng, 6, scale=0.1),
        "wf": randn(rng, 5, 6, scale=0.8),
        "bf": randn(rng, 5, scale=0.1),
        "scales": np.array([1, 1, 2, 2], np.float32),
    }
    return make_model(nodes, {"x": np.zeros((2, 3, size, size), np.float32)}, initializers=inits)


def lowered(model: onnx.ModelProto, shapes: dict, tmp_path: Path, mode: str):
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    module, weights = convert_onnx(path, shapes, "test", "origin_weights.npz")
    module, weights = canonicalize(module, weights, "canonical_weights.npz")
    rng = np.random.default_rng(0)
    samples = [{k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in shapes.items()} for _ in range(4)]
    cali = calibrate(module, weights, samples, "max")[0] if mode == "INT8" else None
    tm, tw = lower_module(module, weights, chip=BM1684X, mode=mode, cali=cali)
    tw.save(tmp_path / "tpu_weights.npz")
    inputs = {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in shapes.items()}
    return mlir.parse_module(mlir.print_module(tm)), WeightStore.load(tmp_path / "tpu_weights.npz"), inputs


def compile_and_run(tm, tw, inputs, chip, *, prefetch: bool = True):
    """tpu.mlir -> lg -> addr -> .model bytes -> simulator; each stage file printed and parsed back."""
    lg, groups = layer_group(mlir.parse_module(mlir.print_module(tm)), chip)
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), chip)
    model = decode_model(encode_model(codegen(mlir.parse_module(mlir.print_module(addr)), tw, chip, prefetch=prefetch)))
    return simulate(model, inputs), groups


def small(lmem: int, lanes: int):
    return dataclasses.replace(BM1684X, lmem_bytes=lmem, lanes=lanes, lmem_banks=4, eu_bytes=16)


CHIPS = {"bm1684x": BM1684X, "4 lanes 12K": small(12 * 1024, 4), "8 lanes 3K": small(3 * 1024, 8)}


@pytest.mark.parametrize("chip", list(CHIPS))
@pytest.mark.parametrize("mode", ["INT8", "F32", "BF16"])
def test_cnn_on_the_chip_matches_tpu_inference(make_model, tmp_path, mode, chip):
    tm, tw, inputs = lowered(cnn(make_model), {"x": (2, 3, 24, 24)}, tmp_path, mode)
    ref = run(tm, tw, inputs)
    result, groups = compile_and_run(tm, tw, inputs, CHIPS[chip])
    for name, out in result.outputs.items():
        # every mode: the chip runs TPU inference's kernels on C-ordered tiles, as inference holds them
        np.testing.assert_array_equal(out, ref[name], err_msg=name)
    if chip == "8 lanes 3K":
        assert any(g.kind == LOCAL and g.h_secs > 1 for g in groups)
    assert any(g.kind == LOCAL and len(g.ops) > 2 for g in groups)


@pytest.mark.parametrize("mode", ["INT8", "F32"])
def test_an_output_descriptor_names_the_onnx_output(make_model, tmp_path, monkeypatch, mode):
    """Lowering returns an output it computed in another type cast back to f32 (``<name>_f32``): the .model's
    output descriptor keeps the ONNX name as ``source``; an F32 output keeps its name and needs none. (With
    int8.output_tail the INT8 model's head computes in F32 like an F32 output; switched off here, the head is F16
    and its output a cast.)"""
    from tpubuild.lower import int8

    monkeypatch.setattr(int8, "output_tail", lambda lw: set())
    tm, tw, _ = lowered(cnn(make_model), {"x": (2, 3, 24, 24)}, tmp_path, mode)
    lg, _ = layer_group(mlir.parse_module(mlir.print_module(tm)), BM1684X)
    addr, _ = memory_assign(lg, BM1684X)
    (out,) = decode_model(encode_model(codegen(addr, tw, BM1684X))).header.outputs
    onnx_name = cnn(make_model).graph.output[0].name
    assert out.source_name == onnx_name
    assert (out.source != "") == (mode == "INT8")
    assert out.name == (f"{onnx_name}_f32" if mode == "INT8" else onnx_name)


@pytest.mark.parametrize("mode", ["INT8", "BF16"])
def test_attention_on_the_chip_matches_tpu_inference(attention_model, tmp_path, mode):
    tm, tw, inputs = lowered(attention_model(2), {"x": (2, 6, 16)}, tmp_path, mode)
    ref = run(tm, tw, inputs)
    for chip in (BM1684X, small(2 * 1024, 4)):
        result, groups = compile_and_run(tm, tw, inputs, chip)
        for name, out in result.outputs.items():
            np.testing.assert_array_equal(out, ref[name], err_msg=name)


def test_estimated_cycles_are_the_replayed_cycles(make_model, tmp_path):
    """Layer group's plan and the simulator's replay use the same cost formulas and the same schedule."""
    tm, tw, inputs = lowered(cnn(make_model), {"x": (2, 3, 24, 24)}, tmp_path, "INT8")
    result, groups = compile_and_run(tm, tw, inputs, CHIPS["4 lanes 12K"], prefetch=False)
    estimate = sum(g.cycles for g in groups)
    assert result.profile["total_cycles"] == estimate
    # loading a group's weights and first tiles while the previous group computes only saves time,
    # and the race check (simulate) has accepted the earlier transfers
    early, _ = compile_and_run(tm, tw, inputs, CHIPS["4 lanes 12K"])
    assert early.profile["total_cycles"] < estimate
    for name, out in early.outputs.items():
        np.testing.assert_array_equal(out, result.outputs[name], err_msg=name)


def test_model_file_is_deterministic(make_model, tmp_path):
    tm, tw, _ = lowered(cnn(make_model), {"x": (2, 3, 24, 24)}, tmp_path, "INT8")
    blobs = []
    for _ in range(2):
        lg, _ = layer_group(mlir.parse_module(mlir.print_module(tm)), CHIPS["8 lanes 3K"])
        addr, _ = memory_assign(lg, CHIPS["8 lanes 3K"])
        blobs.append(encode_model(codegen(addr, tw, CHIPS["8 lanes 3K"])))
    assert blobs[0] == blobs[1]


def channel_shuffle(make_model):
    """ShuffleNet's channel shuffle: conv, reshape to 5-D, transpose the group dims, reshape back, conv."""
    rng = np.random.default_rng(7)
    nodes = [
        node("Conv", ["x", "w1", "b1"], "c1", pads=[1, 1, 1, 1]),
        node("Reshape", ["c1", "s5"], "r5"),
        node("Transpose", ["r5"], "t5", perm=[0, 2, 1, 3, 4]),
        node("Reshape", ["t5", "s4"], "r4"),
        node("Conv", ["r4", "w2", "b2"], "c2", pads=[1, 1, 1, 1]),
    ]
    inits = {
        "w1": randn(rng, 8, 3, 3, 3, scale=0.4),
        "b1": randn(rng, 8, scale=0.1),
        "s5": np.array([1, 2, 4, 10, 10], np.int64),
        "s4": np.array([1, 8, 10, 10], np.int64),
        "w2": randn(rng, 4, 8, 3, 3, scale=0.3),
        "b2": randn(rng, 4, scale=0.1),
    }
    return make_model(nodes, {"x": np.zeros((1, 3, 10, 10), np.float32)}, initializers=inits)


@pytest.mark.parametrize("mode", ["INT8", "F32"])
def test_a_permute_runs_as_one_ddr_to_ddr_copy(make_model, tmp_path, mode):
    tm, tw, inputs = lowered(channel_shuffle(make_model), {"x": (1, 3, 10, 10)}, tmp_path, mode)
    ref = run(tm, tw, inputs)
    result, groups = compile_and_run(tm, tw, inputs, BM1684X)
    assert [g.kind for g in groups].count("copy") == 1
    assert [g.kind for g in groups].count("alias") == 2
    for name, out in result.outputs.items():
        np.testing.assert_array_equal(out, ref[name], err_msg=name)


@pytest.mark.parametrize("mode", ["INT8", "BF16"])
def test_a_convs_weights_load_as_one_pack(make_model, tmp_path, mode):
    """A local conv's filter and bias (INT8: int8 and int32) are one pack: one GDMA of its byte rows,
    the bias never loaded on its own, each a view into the pack; the chip equals inference bit for bit."""
    from tpubuild.codegen.commands import Direction
    from tpubuild.codegen.graph import build_graph
    from tpubuild.codegen.layergroup import packs_of, read_groups

    tm, tw, inputs = lowered(cnn(make_model), {"x": (2, 3, 24, 24)}, tmp_path, mode)
    ref = run(tm, tw, inputs)
    lg, _ = layer_group(mlir.parse_module(mlir.print_module(tm)), BM1684X)
    addr, a = memory_assign(mlir.parse_module(mlir.print_module(lg)), BM1684X)
    model = codegen(mlir.parse_module(mlir.print_module(addr)), tw, BM1684X)
    graph = build_graph(addr)
    packs = packs_of(graph, read_groups(addr, graph), BM1684X)
    keys = {pack.key for pack in packs.values()}
    assert len(keys) >= 3 and all(len(pack.weights) == 2 for pack in packs.values())
    loads = [g for g in model.gdma if g.direction == Direction.LOAD and g.ddr_addr < a.weight_bytes]
    for key in keys:
        pack = packs[key]
        hits = [g for g in loads if g.ddr_addr == a.weights[key]]
        assert [(g.dtype, g.shape) for g in hits] == [("uint8", (1, pack.channels, 1, pack.row))]
        assert not any(g.ddr_addr == a.weights[pack.weights[1]] for g in loads)
    out = simulate(decode_model(encode_model(model)), inputs).outputs
    for name, value in out.items():
        np.testing.assert_array_equal(value, ref[name], err_msg=name)


def test_a_view_reads_rows_of_a_taller_tile_through_its_plane_stride():
    """Rows 2..5 of a (1, 8, 6, 5) tile on 4 lanes (two planes per lane): the tile's address plus two
    rows, the tile's plane stride; the view spans only up to its last row (no race with a neighbour)."""
    from tpubuild.codegen import commands as cmd
    from tpubuild.codegen.asm import Assembler
    from tpubuild.codegen.commands import Tensor
    from tpubuild.codegen.model_file import ChipParams
    from tpubuild.ir import tpu

    chip = ChipParams(
        name="toy",
        lanes=4,
        lane_bytes=4096,
        banks=4,
        eu_bytes=16,
        ddr_bandwidth=16e9,
        clock_hz=1e9,
        macs_per_lane_per_cycle={"F32": 8},
        gdma_latency_cycles=10,
        bdc_overhead_cycles=5,
    )
    x = np.arange(8 * 6 * 5, dtype=np.float32).reshape(1, 8, 6, 5) - 100
    asm = Assembler(chip)
    xin, yout = asm.input("x", x.shape, "float32"), asm.output("y", (1, 8, 4, 5), "float32")
    tile = asm.local(x.shape, "float32")
    plane = cmd.plane_bytes(6, 5, "float32", chip.eu_bytes)
    out = asm.local((1, 8, 4, 5), "float32")
    loaded = asm.load(xin.ddr_addr, cmd.contiguous_strides(x.shape), tile, x.shape, "float32")
    view = Tensor.local(tile + 2 * 5 * 4, 0, (1, 8, 4, 5), "float32", plane=plane)
    done = asm.compute(
        tpu.ReluOp, tpu.ReluOp.PARAMS(), [view], [Tensor.local(out, 0, (1, 8, 4, 5), "float32")], wait_gdma=loaded
    )
    asm.store(out, yout.ddr_addr, cmd.contiguous_strides((1, 8, 4, 5)), (1, 8, 4, 5), "float32", wait_bdc=done)
    model = decode_model(encode_model(asm.build()))
    assert cmd.local_bytes((1, 8, 4, 5), "float32", 0, 4, 16, plane) == plane + 4 * 5 * 4
    np.testing.assert_array_equal(simulate(model, {"x": x}).outputs["y"], np.maximum(x[:, :, 2:6], 0))


@pytest.mark.parametrize("mode", ["F32", "INT8"])
def test_a_weight_two_ops_share_is_loaded_once(make_model, tmp_path, mode):
    """YOLO's box decode: one anchors constant read by a Sub and an Add in one group. Loading it again for
    the second op would race with the first op reading it (the simulator refuses unordered access)."""
    rng = np.random.default_rng(3)
    nodes = [
        node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1]),
        node("Sub", ["anchors", "c"], "lt"),
        node("Add", ["anchors", "c"], "rb"),
        node("Mul", ["lt", "rb"], "y"),
    ]
    inits = {"w": randn(rng, 4, 3, 3, 3, scale=0.4), "b": randn(rng, 4, scale=0.1), "anchors": randn(rng, 1, 4, 8, 8)}
    model = make_model(nodes, {"x": np.zeros((1, 3, 8, 8), np.float32)}, initializers=inits)
    tm, tw, inputs = lowered(model, {"x": (1, 3, 8, 8)}, tmp_path, mode)
    ref = run(tm, tw, inputs)
    result, groups = compile_and_run(tm, tw, inputs, BM1684X)
    assert any(g.kind == LOCAL and len(g.ops) >= 3 for g in groups)
    for name, out in result.outputs.items():
        np.testing.assert_array_equal(out, ref[name], err_msg=name)


def test_an_activation_named_weight_is_read_as_an_activation(make_model, tmp_path):
    """Tensor names are the user's: a conv output called "weight" is a sliced activation, not a weight."""
    rng = np.random.default_rng(4)
    nodes = [
        node("Conv", ["x", "w1", "b1"], "c", pads=[1, 1, 1, 1]),
        node("Relu", ["c"], "weight"),
        node("Conv", ["weight", "w2", "b2"], "y", pads=[1, 1, 1, 1]),
    ]
    inits = {
        "w1": randn(rng, 4, 3, 3, 3, scale=0.4),
        "b1": randn(rng, 4, scale=0.1),
        "w2": randn(rng, 4, 4, 3, 3, scale=0.4),
        "b2": randn(rng, 4, scale=0.1),
    }
    model = make_model(nodes, {"x": np.zeros((1, 3, 16, 16), np.float32)}, initializers=inits)
    tm, tw, inputs = lowered(model, {"x": (1, 3, 16, 16)}, tmp_path, "INT8")
    ref = run(tm, tw, inputs)
    result, groups = compile_and_run(tm, tw, inputs, CHIPS["8 lanes 3K"])
    assert any(g.kind == LOCAL and len(g.ops) >= 2 for g in groups), [(g.kind, g.ops, g.h_secs) for g in groups]
    for name, out in result.outputs.items():
        np.testing.assert_array_equal(out, ref[name], err_msg=name)


@pytest.mark.parametrize("coord_mode,nearest_mode", [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor")])
def test_nearest_upsample_slices_along_h_on_the_chip(coord_mode, nearest_mode):
    """A nearest resize by 2 repeats each input row twice, so its group slices H, each slice running the
    kernel with its own output shape; the chip reproduces whole-tensor inference bit for bit."""
    from tpubuild.ir import top, tpu
    from tpubuild.ir.top import InputOp
    from tpubuild.ir.types import tensor_type

    rng = np.random.default_rng(5)
    b = mlir.GraphBuilder([tensor_type((2, 8, 24, 32)), tensor_type((2, 8, 48, 64))])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    skip = b.add(InputOp.make([b.args[1]], name="skip")).results[0]
    interp = tpu.MIRROR[top.InterpOp]
    p = interp.PARAMS(
        shape=(2, 8, 48, 64),
        scales=(1.0, 1.0, 2.0, 2.0),
        mode="nearest",
        coord_mode=coord_mode,
        nearest_mode=nearest_mode,
    )
    y = b.add(interp.make([x], p, name="up")).results[0]
    y = b.add(tpu.AddOp.make([y, skip], name="add")).results[0]
    y = b.add(tpu.ReluOp.make([y], name="relu")).results[0]
    module = b.finish([y], name="up", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {
        "x": rng.standard_normal((2, 8, 24, 32)).astype(np.float32),
        "skip": rng.standard_normal((2, 8, 48, 64)).astype(np.float32),
    }
    ref = run(module, WeightStore(), inputs)
    chip = small(24 * 1024, 4)
    lg, groups = layer_group(mlir.parse_module(mlir.print_module(module)), chip)
    assert any(g.kind == LOCAL and g.h_secs > 1 and len(g.ops) == 3 for g in groups), [
        (g.kind, g.ops, g.n_secs, g.h_secs) for g in groups
    ]
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), chip)
    model = decode_model(encode_model(codegen(mlir.parse_module(mlir.print_module(addr)), WeightStore(), chip)))
    np.testing.assert_array_equal(simulate(model, inputs).outputs["relu"], ref["relu"])


@pytest.mark.parametrize("c,groups", [(12, 3), (160, 2)])
def test_channel_shuffle_is_stored_shuffled(c, groups):
    """ShuffleNet's channel shuffle (Reshape, Permute (0, 2, 1, 3, 4), Reshape) after a local group: the group
    stores each run of C/g channels straight to channels j, j + g, ... of the shuffled tensor (views from
    lane j*C/g, past one lane-width of channels too) and no DDR-to-DDR copy runs; bit-exact with inference."""
    from tpubuild.codegen.commands import Direction
    from tpubuild.ir import top, tpu
    from tpubuild.ir.top import InputOp
    from tpubuild.ir.types import tensor_type

    rng = np.random.default_rng(7)
    shape = (1, c, 6, 10)
    b = mlir.GraphBuilder([tensor_type(shape)])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    y = b.add(tpu.ReluOp.make([x], name="relu")).results[0]
    reshape = tpu.MIRROR[top.ReshapeOp]
    y = b.add(reshape.make([y], reshape.PARAMS(shape=(1, groups, c // groups, 6, 10)), name="split")).results[0]
    permute = tpu.MIRROR[top.PermuteOp]
    y = b.add(permute.make([y], permute.PARAMS(order=(0, 2, 1, 3, 4)), name="shuffle")).results[0]
    y = b.add(reshape.make([y], reshape.PARAMS(shape=shape), name="join")).results[0]
    y = b.add(tpu.MIRROR[top.SigmoidOp].make([y], name="out")).results[0]
    module = b.finish([y], name="shuffle", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {"x": rng.standard_normal(shape).astype(np.float32)}
    ref = run(module, WeightStore(), inputs)
    lg, _ = layer_group(mlir.parse_module(mlir.print_module(module)), BM1684X)
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), BM1684X)
    model = codegen(mlir.parse_module(mlir.print_module(addr)), WeightStore(), BM1684X)
    assert not any(g.direction == Direction.DDR2DDR for g in model.gdma)
    assert sum(g.direction == Direction.STORE for g in model.gdma) == groups + 1
    np.testing.assert_array_equal(simulate(decode_model(encode_model(model)), inputs).outputs["out"], ref["out"])


def test_a_sliced_group_stores_its_channel_shuffle_shuffled():
    """The group before a channel shuffle runs in H slices, so its loads and stores interleave: memory
    assign keeps the shuffled tensor's bytes apart from the group's input (it lives from the group's
    step, when the stores write it), the group stores it shuffled and no DDR-to-DDR copy runs."""
    from tpubuild.codegen.commands import Direction
    from tpubuild.ir import top, tpu
    from tpubuild.ir.top import InputOp
    from tpubuild.ir.types import tensor_type

    rng = np.random.default_rng(5)
    shape, groups = (1, 8, 32, 16), 2
    b = mlir.GraphBuilder([tensor_type(shape)])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    y = b.add(tpu.ReluOp.make([x], name="relu")).results[0]
    reshape = tpu.MIRROR[top.ReshapeOp]
    y = b.add(reshape.make([y], reshape.PARAMS(shape=(1, groups, 8 // groups, 32, 16)), name="split")).results[0]
    permute = tpu.MIRROR[top.PermuteOp]
    y = b.add(permute.make([y], permute.PARAMS(order=(0, 2, 1, 3, 4)), name="shuffle")).results[0]
    y = b.add(reshape.make([y], reshape.PARAMS(shape=shape), name="join")).results[0]
    y = b.add(tpu.MIRROR[top.SigmoidOp].make([y], name="out")).results[0]
    module = b.finish([y], name="shuffle", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {"x": rng.standard_normal(shape).astype(np.float32)}
    ref = run(module, WeightStore(), inputs)
    chip = dataclasses.replace(small(6 * 1024, 4), gdma_latency=0)  # slices cost no more than one global op
    lg, planned = layer_group(mlir.parse_module(mlir.print_module(module)), chip)
    assert planned[0].kind == LOCAL and planned[0].slices > 1
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), chip)
    model = codegen(mlir.parse_module(mlir.print_module(addr)), WeightStore(), chip)
    assert not any(g.direction == Direction.DDR2DDR for g in model.gdma)
    np.testing.assert_array_equal(simulate(decode_model(encode_model(model)), inputs).outputs["out"], ref["out"])


def test_slice_and_constant_gather_of_rank_5_run_as_copies():
    """A rank-5 Slice and a Gather of a constant (negative) index, which would run as global ops, are one
    strided DDR-to-DDR copy each from the right offset; the chip reproduces inference bit for bit."""
    from tpubuild.codegen.commands import Direction
    from tpubuild.ir import top, tpu
    from tpubuild.ir.top import InputOp
    from tpubuild.ir.types import tensor_type

    rng = np.random.default_rng(9)
    shape = (3, 1, 2, 5, 4)
    b = mlir.GraphBuilder([tensor_type(shape)])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    weights = WeightStore()
    weights.add("idx", np.array(-2, np.int64))
    idx = b.weight("idx", tensor_type((), np.int64))
    gather = tpu.MIRROR[top.GatherOp]
    g = b.add(gather.make([x, idx], gather.PARAMS(axis=0), name="g")).results[0]
    slice_ = tpu.MIRROR[top.SliceOp]
    s = b.add(
        slice_.make([x], slice_.PARAMS(offset=(2, 0, 1, 0, 0), ends=(3, 1, 2, 5, 4), steps=(1, 1, 1, 2, 1)), name="s")
    ).results[0]
    module = b.finish([g, s], name="copies", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {"x": rng.standard_normal(shape).astype(np.float32)}
    ref = run(module, weights, inputs)
    lg, groups = layer_group(mlir.parse_module(mlir.print_module(module)), BM1684X)
    assert [grp.kind for grp in groups] == ["copy", "copy"]
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), BM1684X)
    model = codegen(mlir.parse_module(mlir.print_module(addr)), weights, BM1684X)
    assert not model.bdc and all(c.direction == Direction.DDR2DDR for c in model.gdma)
    out = simulate(decode_model(encode_model(model)), inputs).outputs
    for name in ("g", "s"):
        np.testing.assert_array_equal(out[name], ref[name], err_msg=name)


def test_channel_split_is_stored_split():
    """A channel Split (a global op) reading a local group's output alone: the group stores each result's
    run of channels straight to it (the run from lane 30 crosses into the second slot) and no Split runs."""
    from tpubuild.ir import top, tpu
    from tpubuild.ir.top import InputOp
    from tpubuild.ir.types import tensor_type

    rng = np.random.default_rng(11)
    shape = (1, 80, 6, 10)
    b = mlir.GraphBuilder([tensor_type(shape)])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    y = b.add(tpu.ReluOp.make([x], name="relu")).results[0]
    split = tpu.MIRROR[top.SplitOp]
    left, right = b.add(split.make([y], split.PARAMS(axis=1, split_size=(30, 50)), name=["left", "right"])).results
    out0 = b.add(tpu.MIRROR[top.SigmoidOp].make([left], name="out0")).results[0]
    out1 = b.add(tpu.MIRROR[top.SigmoidOp].make([right], name="out1")).results[0]
    module = b.finish([out0, out1], name="split", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {"x": rng.standard_normal(shape).astype(np.float32)}
    ref = run(module, WeightStore(), inputs)
    lg, groups = layer_group(mlir.parse_module(mlir.print_module(module)), BM1684X)
    assert "global" in [g.kind for g in groups]
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), BM1684X)
    model = codegen(mlir.parse_module(mlir.print_module(addr)), WeightStore(), BM1684X)
    assert not any(c.op == "tpu.Split" for c in model.bdc)
    out = simulate(decode_model(encode_model(model)), inputs).outputs
    for name in ("out0", "out1"):
        np.testing.assert_array_equal(out[name], ref[name], err_msg=name)


def one_channel_head(make_model, size: int):
    """A conv to one channel and a sigmoid on it: PP-OCR det's probability map."""
    rng = np.random.default_rng(3)
    nodes = [node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1]), node("Sigmoid", ["c"], "prob")]
    inits = {"w": randn(rng, 1, 4, 3, 3, scale=0.4), "b": randn(rng, 1, scale=0.1)}
    return make_model(nodes, {"x": np.zeros((1, 4, size, size), np.float32)}, initializers=inits)


@pytest.mark.parametrize("mode", ["INT8", "F32", "BF16"])
def test_a_one_channel_map_runs_spread_over_the_lanes(make_model, tmp_path, mode, monkeypatch):
    """The sigmoid (a lookup in INT8) on a 1-channel map runs in a group of its own in the lane-spread
    layout: bit-exact with inference, and its commands take a fraction of the cycles they take in one lane."""
    from tpubuild.codegen import layergroup
    from tpubuild.lower import int8

    # the 4-channel conv would fold (find_folds as the planner and the weight packs call it)
    monkeypatch.setattr(layergroup.planner_facts, "find_folds", lambda graph, chip: [])
    monkeypatch.setattr(layergroup.packs, "find_folds", lambda graph, chip: [])
    # the lookup, as a sigmoid before another conv is: the one after the last conv would stay float
    monkeypatch.setattr(int8, "output_tail", lambda lw: set())
    tm, tw, inputs = lowered(one_channel_head(make_model, 128), {"x": (1, 4, 128, 128)}, tmp_path, mode)
    ref = run(tm, tw, inputs)
    result, groups = compile_and_run(tm, tw, inputs, BM1684X)
    for name, out in result.outputs.items():
        np.testing.assert_array_equal(out, ref[name], err_msg=name)
    assert any(g.layout == layergroup.SPREAD for g in groups)
    # every op in its channel layout
    monkeypatch.setattr(layergroup.planner_facts, "_layout_free", lambda graph, node: False)
    channel, groups = compile_and_run(tm, tw, inputs, BM1684X)
    assert not any(g.layout == layergroup.SPREAD for g in groups)

    sigmoid = "tpu.Lut" if mode == "INT8" else "tpu.Sigmoid"
    # 16384 elements in one lane against 256 in each of 64
    assert result.profile["ops"][sigmoid]["cycles"] * 16 < channel.profile["ops"][sigmoid]["cycles"]
    assert result.profile["total_cycles"] < channel.profile["total_cycles"]


def test_a_global_elementwise_op_sees_its_tensors_spread():
    """An element-wise op too large for local memory runs as a global op; its kernel sees the tensors in
    their lane-spread shapes (the cycle model spreads its work over those lanes); bit-exact with inference."""
    from tpubuild.codegen.slicing import spread_shape
    from tpubuild.ir import top, tpu
    from tpubuild.ir.top import InputOp
    from tpubuild.ir.types import tensor_type

    rng = np.random.default_rng(13)
    shape = (1, 1, 64, 64)
    b = mlir.GraphBuilder([tensor_type(shape)])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    y = b.add(tpu.MIRROR[top.SigmoidOp].make([x], name="out")).results[0]
    module = b.finish([y], name="head", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {"x": rng.standard_normal(shape).astype(np.float32)}
    ref = run(module, WeightStore(), inputs)
    chip = small(512, 8)  # a spread row (64 elements of 4 bytes) per lane, in and out, twice: does not fit
    lg, groups = layer_group(mlir.parse_module(mlir.print_module(module)), chip)
    assert [g.kind for g in groups] == ["global"]
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), chip)
    model = decode_model(encode_model(codegen(mlir.parse_module(mlir.print_module(addr)), WeightStore(), chip)))
    (sigmoid,) = model.bdc
    assert sigmoid.is_global and sigmoid.results[0].view == spread_shape(shape, 8) == (1, 8, 8, 64)
    np.testing.assert_array_equal(simulate(model, inputs).outputs["out"], ref["out"])


def stem(make_model, size: int):
    """A 3-channel 3x3 stride-2 conv to 128 channels on the input and a ReLU: a CNN's first layer."""
    rng = np.random.default_rng(17)
    nodes = [node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1], strides=[2, 2]), node("Relu", ["c"], "r")]
    inits = {"w": randn(rng, 128, 3, 3, 3, scale=0.4), "b": randn(rng, 128, scale=0.1)}
    return make_model(nodes, {"x": np.zeros((1, 3, size, size), np.float32)}, initializers=inits)


@pytest.mark.parametrize("mode", ["INT8", "F32", "BF16"])
def test_a_small_ic_stem_conv_runs_folded(make_model, tmp_path, monkeypatch, mode):
    """The 3-channel stem conv (INT8: and the input's Cast) runs with the kernel rows folded into the
    channels (X' of 9 channels, a 1 x 3 conv): bit-exact with inference (a float GEMM sums the same
    products in the same order folded or not), a third of the cube's cycles, and layer group's estimate
    is still the replay of the commands."""
    from tpubuild.codegen import layergroup

    tm, tw, inputs = lowered(stem(make_model, 96), {"x": (1, 3, 96, 96)}, tmp_path, mode)
    ref = run(tm, tw, inputs)
    result, groups = compile_and_run(tm, tw, inputs, BM1684X)
    for name, out in result.outputs.items():
        np.testing.assert_array_equal(out, ref[name], err_msg=name)
    assert [g.layout for g in groups if g.kind == LOCAL][0] == layergroup.FOLD
    plain, _ = compile_and_run(tm, tw, inputs, BM1684X, prefetch=False)
    assert plain.profile["total_cycles"] == sum(g.cycles for g in groups)
    monkeypatch.setattr(layergroup.planner_facts, "find_folds", lambda graph, chip: [])
    monkeypatch.setattr(layergroup.packs, "find_folds", lambda graph, chip: [])
    channel, groups = compile_and_run(tm, tw, inputs, BM1684X)
    assert all(g.layout == layergroup.CHANNEL for g in groups)
    # the cube: ceil(9 / 64) EU chunks of input channels per position and kernel column instead of 3 x
    # ceil(3 / 64) (a third); the requantisation after it is the same
    assert result.profile["ops"]["tpu.Conv"]["cycles"] * 2 < channel.profile["ops"]["tpu.Conv"]["cycles"]
    assert result.profile["total_cycles"] < channel.profile["total_cycles"]


def test_a_folded_conv_pads_with_the_input_zero_point():
    """A folded INT8 conv reading an int8 tensor with zero point 7 straight from DDR: its padding rows are
    a broadcast of 7 from the zero-point slot memory assign keeps after the weights; bit-exact."""
    from tpubuild.codegen.layergroup import FOLD
    from tpubuild.ir import tpu
    from tpubuild.ir.top import InputOp
    from tpubuild.ir.types import tensor_type

    rng = np.random.default_rng(19)
    b = mlir.GraphBuilder([tensor_type((1, 3, 128, 128), np.int8)])
    x = b.add(InputOp.make([b.args[0]], name="x")).results[0]
    weights = WeightStore()
    weights.add("w", rng.integers(-20, 20, (8, 3, 3, 3)).astype(np.int8))
    weights.add("b", rng.integers(-500, 500, (8,)).astype(np.int32))
    w = b.weight("w", tensor_type((8, 3, 3, 3), np.int8))
    bias = b.weight("b", tensor_type((8,), np.int32))
    params = tpu.ConvOp.PARAMS(
        kernel_shape=(3, 3),
        strides=(2, 2),
        pads=(1, 1, 1, 1),
        dilations=(1, 1),
        multiplier=(3,) * 8,
        rshift=(8,) * 8,
        in_zp=(7,),
    )
    y = b.add(
        tpu.ConvOp.make([x, w, bias], params, name="conv", result_types=[tensor_type((1, 8, 64, 64), np.int8)])
    ).results[0]
    module = b.finish([y], name="zp", weight_file="w.npz", state="TPU_LOWERED")
    inputs = {"x": rng.integers(-128, 128, (1, 3, 128, 128)).astype(np.int8)}
    ref = run(module, weights, inputs)
    lg, groups = layer_group(mlir.parse_module(mlir.print_module(module)), BM1684X)
    assert [g.layout for g in groups] == [FOLD]
    addr, _ = memory_assign(mlir.parse_module(mlir.print_module(lg)), BM1684X)
    model = decode_model(encode_model(codegen(mlir.parse_module(mlir.print_module(addr)), weights, BM1684X)))
    assert any(g.ddr_strides == (0, 0, 0, 0) for g in model.gdma)  # the padding rows
    np.testing.assert_array_equal(simulate(model, inputs).outputs["conv"], ref["conv"])
