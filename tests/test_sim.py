"""The chip simulator on hand-assembled model files, against the TPU kernels on whole tensors."""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np
import pytest

from tpubuild.codegen import commands as cmd
from tpubuild.codegen.asm import Assembler
from tpubuild.codegen.commands import Tensor
from tpubuild.codegen.model_file import ChipParams, ModelFileError, decode_model, encode_model
from tpubuild.ir import tpu
from tpubuild.kernels import get_kernel
from tpubuild.sim.chip import simulate

# 4 lanes: 8 and 16 channels take several slots per lane, and lane_start wraps
CHIP = ChipParams(
    name="toy",
    lanes=4,
    lane_bytes=64 * 1024,
    banks=4,
    eu_bytes=16,
    ddr_bandwidth=16e9,
    clock_hz=1e9,
    macs_per_lane_per_cycle={"INT8": 64, "F32": 8, "BF16": 32, "F16": 32},
    gdma_latency_cycles=50,
    bdc_overhead_cycles=10,
)

H = W = 16
CIN, COUT = 8, 16


def _conv_relu_add(dtype: str, int8: bool, rng, slices=((0, 8), (8, 16)), *, drop_wait: bool = False):
    """y = relu(conv3x3(x, w, b)) + z, computed in H slices with per-slice pads and double-buffered loads."""
    asm = Assembler(CHIP, model="conv_relu_add")
    np_dtype = np.int8 if int8 else np.dtype(getattr(ml_dtypes, dtype, dtype))
    if int8:
        x = rng.integers(-128, 128, (1, CIN, H, W), dtype=np.int8)
        z = rng.integers(-128, 128, (1, COUT, H, W), dtype=np.int8)
        w = rng.integers(-128, 128, (COUT, CIN, 3, 3), dtype=np.int8)
        b = rng.integers(-2000, 2000, (COUT,), dtype=np.int32)
        conv_p = tpu.ConvOp.PARAMS(
            kernel_shape=(3, 3),
            strides=(1, 1),
            pads=(1, 1, 1, 1),
            dilations=(1, 1),
            multiplier=tuple(int(m) for m in rng.integers(1 << 14, 1 << 15, COUT)),
            rshift=(26,) * COUT,
            in_zp=(3,),
            out_zp=-2,
        )
        add_p = tpu.AddOp.PARAMS(multiplier=(19000, 23000), rshift=(15,), in_zp=(-2, 5), out_zp=1)
        bias_dtype = "int32"
    else:
        x = rng.standard_normal((1, CIN, H, W)).astype(np_dtype)
        z = rng.standard_normal((1, COUT, H, W)).astype(np_dtype)
        w = (rng.standard_normal((COUT, CIN, 3, 3)) * 0.2).astype(np_dtype)
        b = rng.standard_normal((COUT,)).astype(np_dtype)
        conv_p = tpu.ConvOp.PARAMS(kernel_shape=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1))
        add_p = tpu.AddOp.PARAMS()
        bias_dtype = dtype
    relu_p = tpu.ReluOp.PARAMS()
    xin = asm.input("x", x.shape, dtype)
    zin = asm.input("z", z.shape, dtype)
    yout = asm.output("y", (1, COUT, H, W), dtype)
    w_addr, b_addr = asm.weight(w), asm.weight(b)
    xs, zs = cmd.contiguous_strides(x.shape), cmd.contiguous_strides(z.shape)

    w_blk, b_blk = (1, COUT, CIN, 9), (1, COUT, 1, 1)
    w_loc, b_loc = asm.local(w_blk, dtype), asm.local(b_blk, bias_dtype)
    asm.load(w_addr, cmd.contiguous_strides(w_blk), w_loc, w_blk, dtype)
    last_weight = asm.load(b_addr, (COUT, 1, 1, 1), b_loc, b_blk, bias_dtype)
    w_t = Tensor.local(w_loc, 0, w_blk, dtype, view=w.shape)
    b_t = Tensor.local(b_loc, 0, b_blk, bias_dtype, view=(COUT,))

    rows = max(h1 - h0 for h0, h1 in slices)
    # two buffers of each per-slice tensor: loads of slice i+1 overlap compute of slice i
    bufs = [
        {
            "x": asm.local((1, CIN, rows + 2, W), dtype),
            "z": asm.local((1, COUT, rows, W), dtype, lane_start=2),
            "c": asm.local((1, COUT, rows, W), dtype),
            "r": asm.local((1, COUT, rows, W), dtype),
            "y": asm.local((1, COUT, rows, W), dtype, lane_start=1),
        }
        for _ in range(2)
    ]
    last_use = [0, 0]  # per buffer set: the last BDC reading it (its loads must wait for it)

    def geometry(s):
        h0, h1 = slices[s]
        i0, i1 = max(h0 - 1, 0), min(h1 + 1, H)
        return h0, h1, i0, (1, CIN, i1 - i0, W), (1, COUT, h1 - h0, W)

    def emit_loads(s):
        buf, (h0, _, i0, xb, zb) = bufs[s % 2], geometry(s)
        wait = last_use[s % 2]
        gx = asm.load(xin.ddr_addr + i0 * W * cmd.itemsize(dtype), xs, buf["x"], xb, dtype, wait_bdc=wait)
        gz = asm.load(zin.ddr_addr + h0 * W * cmd.itemsize(dtype), zs, buf["z"], zb, dtype, lane_start=2, wait_bdc=wait)
        return gx, gz

    loads = {0: emit_loads(0)}
    for s in range(len(slices)):
        buf, (h0, h1, _, xb, yb) = bufs[s % 2], geometry(s)
        zb = yb
        gx, gz = loads[s]
        pads = (1 if h0 == 0 else 0, 1, 1 if h1 == H else 0, 1)
        c_t = Tensor.local(buf["c"], 0, yb, dtype)
        r_t = Tensor.local(buf["r"], 0, yb, dtype)
        y_t = Tensor.local(buf["y"], 1, yb, dtype)
        asm.compute(
            tpu.ConvOp,
            dataclasses.replace(conv_p, pads=pads),
            [Tensor.local(buf["x"], 0, xb, dtype), w_t, b_t],
            [c_t],
            wait_gdma=max(gx, last_weight),
        )
        asm.compute(tpu.ReluOp, relu_p, [c_t], [r_t])
        add = asm.compute(
            tpu.AddOp, add_p, [r_t, Tensor.local(buf["z"], 2, zb, dtype)], [y_t], wait_gdma=0 if drop_wait else gz
        )
        last_use[s % 2] = add
        if s + 1 < len(slices):  # software pipelining: the next slice loads while this one computes
            loads[s + 1] = emit_loads(s + 1)
        asm.store(buf["y"], yout.ddr_addr + h0 * W * cmd.itemsize(dtype), zs, yb, dtype, lane_start=1, wait_bdc=add)
    conv_k, relu_k, add_k = get_kernel(tpu.ConvOp), get_kernel(tpu.ReluOp), get_kernel(tpu.AddOp)
    c = np.asarray(conv_k(conv_p, x, w, b)).astype(np_dtype)
    r = np.asarray(relu_k(relu_p, c)).astype(np_dtype)
    expect = np.asarray(add_k(add_p, r, z)).astype(np_dtype)
    return asm.build(), {"x": x, "z": z}, expect


@pytest.mark.parametrize("dtype,int8", [("float32", False), ("bfloat16", False), ("float16", False), ("int8", True)])
def test_conv_relu_add_in_two_h_slices_matches_the_kernels_on_whole_tensors(dtype, int8):
    model, inputs, expect = _conv_relu_add(dtype, int8, np.random.default_rng(0))
    model = decode_model(encode_model(model))  # through the file format
    run = simulate(model, inputs)
    y = run.outputs["y"]
    assert y.dtype == expect.dtype and y.shape == expect.shape
    # each op rounds once to the stored type, sliced or not: bit-exact in every mode
    np.testing.assert_array_equal(y.view(np.uint8), expect.view(np.uint8))
    if int8:
        assert len(np.unique(y)) > 50  # requantization gives a spread, not a saturated constant


def test_three_uneven_slices_are_bit_exact_too():
    model, inputs, expect = _conv_relu_add("int8", True, np.random.default_rng(1), slices=((0, 5), (5, 11), (11, 16)))
    np.testing.assert_array_equal(simulate(model, inputs).outputs["y"], expect)


def test_a_missing_wait_is_reported_as_a_race():
    model, inputs, _ = _conv_relu_add("float32", False, np.random.default_rng(0), drop_wait=True)
    with pytest.raises(ModelFileError, match=r"race: GDMA \d+ .* BDC \d+ \(tpu.Add operand 1"):
        simulate(model, inputs)


def test_wrong_slice_pads_give_a_different_result():
    """The check is sensitive: forgetting to trim the pads of the second slice breaks exactness."""
    model, inputs, expect = _conv_relu_add("float32", False, np.random.default_rng(0))
    bdc = list(model.bdc)
    conv = bdc[3]
    assert conv.op == "tpu.Conv" and '"pads":[0,1,1,1]' in conv.params
    bdc[3] = dataclasses.replace(conv, params=conv.params.replace('"pads":[0,1,1,1]', '"pads":[1,1,0,1]'))
    bad = dataclasses.replace(model, bdc=tuple(bdc))
    out = simulate(bad, inputs).outputs["y"]
    assert not np.array_equal(out, expect)
    np.testing.assert_array_equal(out[:, :, :8], expect[:, :, :8])


def _matmul(dtype: str, int8: bool, rng):
    """(1, 24, 40) @ (40, 12) + bias: rows over the lanes, the right matrix loaded whole."""
    asm = Assembler(CHIP, model="matmul")
    M, K, N = 24, 40, 12
    if int8:
        a = rng.integers(-128, 128, (1, M, K), dtype=np.int8)
        bm = rng.integers(-128, 128, (K, N), dtype=np.int8)
        bias = rng.integers(-5000, 5000, (N,), dtype=np.int32)
        p = tpu.MatMulOp.PARAMS(
            multiplier=tuple(int(v) for v in rng.integers(1 << 14, 1 << 15, N)),
            rshift=(24,) * N,
            in_zp=(-1, 0),
            out_zp=4,
            do_relu=True,
            qmin=4,
        )
        bias_dtype = "int32"
    else:
        a = rng.standard_normal((1, M, K)).astype(np.float32)
        bm = rng.standard_normal((K, N)).astype(np.float32)
        bias = rng.standard_normal((N,)).astype(np.float32)
        p = tpu.MatMulOp.PARAMS()
        bias_dtype = dtype
    ain = asm.input("a", a.shape, dtype)
    out = asm.output("out", (1, M, N), dtype)
    b_addr, bias_addr = asm.weight(bm), asm.weight(bias)
    a_blk, b_blk, o_blk = (1, M, 1, K), (1, K, 1, N), (1, M, 1, N)
    a_loc, b_loc = asm.local(a_blk, dtype), asm.local(b_blk, dtype)
    bias_loc, o_loc = asm.local((1, 1, 1, N), bias_dtype), asm.local(o_blk, dtype)
    asm.load(ain.ddr_addr, cmd.contiguous_strides(a_blk), a_loc, a_blk, dtype)
    asm.load(b_addr, cmd.contiguous_strides(b_blk), b_loc, b_blk, dtype)
    g = asm.load(bias_addr, (N, N, N, 1), bias_loc, (1, 1, 1, N), bias_dtype)
    m = asm.compute(
        tpu.MatMulOp,
        p,
        [
            Tensor.local(a_loc, 0, a_blk, dtype, view=a.shape),
            Tensor.local(b_loc, 0, b_blk, dtype, view=bm.shape),
            Tensor.local(bias_loc, 0, (1, 1, 1, N), bias_dtype, view=(N,)),
        ],
        [Tensor.local(o_loc, 0, o_blk, dtype, view=(1, M, N))],
        wait_gdma=g,
    )
    asm.store(o_loc, out.ddr_addr, cmd.contiguous_strides(o_blk), o_blk, dtype, wait_bdc=m)
    expect = np.asarray(get_kernel(tpu.MatMulOp)(p, a, bm, bias)).astype(a.dtype)
    return asm.build(), {"a": a}, expect


@pytest.mark.parametrize("int8", [False, True])
def test_matmul_matches_the_kernel(int8):
    model, inputs, expect = _matmul("int8" if int8 else "float32", int8, np.random.default_rng(2))
    run = simulate(decode_model(encode_model(model)), inputs)
    np.testing.assert_array_equal(run.outputs["out"], expect)
    if not int8:  # and the float result is the real product, not only the kernel's
        a = inputs["a"].astype(np.float64)
        np.testing.assert_allclose(run.outputs["out"], expect, rtol=1e-6)
        assert run.outputs["out"].shape == (1, 24, 12) and a.shape == (1, 24, 40)


def test_global_bdc_softmax_reads_and_writes_ddr_directly():
    rng = np.random.default_rng(3)
    asm = Assembler(CHIP, model="softmax")
    x = rng.standard_normal((2, 3, 50)).astype(np.float32)
    xin = asm.input("x", x.shape, "float32")
    yout = asm.output("y", x.shape, "float32")
    blk = (1, 6, 1, 50)
    asm.compute(
        tpu.SoftmaxOp,
        tpu.SoftmaxOp.PARAMS(axis=-1),
        [Tensor.ddr(xin.ddr_addr, blk, "float32", view=x.shape)],
        [Tensor.ddr(yout.ddr_addr, blk, "float32", view=x.shape)],
    )
    model = decode_model(encode_model(asm.build()))
    assert model.bdc[0].is_global
    run = simulate(model, {"x": x})
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(run.outputs["y"], e / e.sum(-1, keepdims=True), rtol=1e-6)
    assert run.profile["ddr_read_bytes"] == x.nbytes and run.profile["ddr_write_bytes"] == x.nbytes
    assert run.profile["bdc"]["global_commands"] == 1


def test_ddr_to_ddr_strided_copy_transposes():
    asm = Assembler(CHIP, model="copy")
    x = np.arange(2 * 3 * 4 * 5, dtype=np.int16).reshape(2, 3, 4, 5)
    xin = asm.input("x", x.shape, "int16")
    yout = asm.output("y", (2, 3, 5, 4), "int16")
    # read x with h and w strides swapped, write contiguous: a transpose of the last two dims
    asm.copy(xin.ddr_addr, (60, 20, 1, 5), yout.ddr_addr, cmd.contiguous_strides((2, 3, 5, 4)), (2, 3, 5, 4), "int16")
    run = simulate(decode_model(encode_model(asm.build())), {"x": x})
    np.testing.assert_array_equal(run.outputs["y"], x.transpose(0, 1, 3, 2))


def test_local_layout_puts_channel_c_in_lane_lane_start_plus_c():
    from tpubuild.sim.memory import Memories, Where, gather, scatter

    mem = Memories(CHIP, 1024)
    data = np.arange(1 * 6 * 2 * 3, dtype=np.float32).reshape(1, 6, 2, 3)
    scatter(mem.local_pieces(32, 3, data.shape, "float32", Where("gdma", 0)), data)
    lanes = mem.local.view(np.uint8)
    # channel 0 -> lane 3 slot 0; channel 1 -> lane 0 slot 1; plane = align_up(6 * 4, 16) = 32 bytes
    first = lanes[3, 32 : 32 + 24].view(np.float32)
    np.testing.assert_array_equal(first, data[0, 0].ravel())
    second = lanes[0, 32 + 32 : 32 + 32 + 24].view(np.float32)
    np.testing.assert_array_equal(second, data[0, 1].ravel())
    np.testing.assert_array_equal(
        gather(mem.local_pieces(32, 3, data.shape, "float32", Where("bdc", 0)), data.shape, data.dtype), data
    )


def test_a_command_outside_local_memory_stops_with_its_index_and_range():
    model, inputs, _ = _conv_relu_add("float32", False, np.random.default_rng(0))
    gdma = list(model.gdma)
    gdma[4] = dataclasses.replace(gdma[4], local_addr=CHIP.lane_bytes - 64)
    bad = dataclasses.replace(model, gdma=tuple(gdma))
    with pytest.raises(ModelFileError, match=r"section 'gdma', command 4: local range \[65472, \d+\) is outside"):
        simulate(bad, inputs, races=False)  # the simulator's own check (the reader would refuse it first)
    with pytest.raises(ModelFileError, match=r"section 'gdma', command 4: local side: local range"):
        decode_model(encode_model(bad, validate=False))


# ---- the cycle model ----------------------------------------------------------------------------


def test_cycles_of_one_load_are_latency_plus_bytes_over_bandwidth():
    asm = Assembler(CHIP)
    xin = asm.input("x", (1, 4, 8, 8), "float32")
    asm.output("y", (1,), "float32")
    asm.load(xin.ddr_addr, cmd.contiguous_strides((1, 4, 8, 8)), 0, (1, 4, 8, 8), "float32")
    run = simulate(asm.build(), {"x": np.zeros((1, 4, 8, 8), np.float32)})
    # 1024 bytes at 16 bytes per cycle (16 GB/s at 1 GHz) + 50 cycles latency
    assert run.profile["total_cycles"] == 50 + 64
    assert run.profile["ddr_read_bytes"] == 1024 and run.profile["ddr_write_bytes"] == 0
    assert run.profile["gdma"]["utilisation"] == 1.0 and run.profile["bdc"]["utilisation"] == 0.0


def test_double_buffered_loads_overlap_compute():
    model, inputs, _ = _conv_relu_add(
        "int8", True, np.random.default_rng(0), slices=((0, 4), (4, 8), (8, 12), (12, 16))
    )
    p = simulate(model, inputs).profile
    busy = p["gdma"]["busy_cycles"] + p["bdc"]["busy_cycles"]
    assert p["total_cycles"] < busy  # the engines ran concurrently part of the time
    assert p["total_cycles"] >= max(p["gdma"]["busy_cycles"], p["bdc"]["busy_cycles"])
    # conv MACs: 16 x 16 x 16 outputs x 8 x 9
    assert p["ops"]["tpu.Conv"]["macs"] == COUT * H * W * CIN * 9
    assert p["time_ms"] == pytest.approx(p["total_cycles"] / 1e9 * 1e3)


def test_conv_cycles_scale_with_channel_rounds_over_lanes():
    from tpubuild.sim.chip import decoded_params
    from tpubuild.sim.cycles import bdc_cycles

    model, _, _ = _conv_relu_add("int8", True, np.random.default_rng(0))
    conv = model.bdc[0]
    p = decoded_params(model)[0]
    # 16 output channels on 4 lanes: 4 rounds of 8 x 16 positions x 9 taps, the 8 input channels padded to
    # one 16-byte EU of int8; 64 MACs per lane per cycle; plus requantising the int32 result (3 vector passes
    # at 4 int32 per 16-byte EU per cycle) and the 10-cycle command overhead
    assert bdc_cycles(CHIP.to_chip(), conv, p) == 10 + 4 * 8 * 16 * 9 * 16 // 64 + 4 * 8 * 16 * 3 // 4
    wide = dataclasses.replace(CHIP, lanes=16).to_chip()  # one round when every channel has its lane
    assert bdc_cycles(wide, conv, p) == 10 + 8 * 16 * 9 * 16 // 64 + 8 * 16 * 3 // 4


# ---- a prepared program, run several times ---------------------------------------------------


def test_a_program_runs_again_from_a_fresh_chip():
    """Each run starts from zeros and the weights: a run that reads a buffer before writing it, or
    that overwrites the weights, gives the next run the same result, as a fresh simulate does."""
    from tpubuild.sim.chip import Program

    asm = Assembler(CHIP, model="reruns")
    shape = (1, 6, 2, 3)  # 6 channels on 4 lanes from lane 3: three runs of channels
    w = np.arange(36, dtype=np.float32).reshape(shape) - 10
    w_addr = asm.weight(w)
    xin = asm.input("x", shape, "float32")
    stale, fresh = asm.output("stale", shape, "float32"), asm.output("weights", shape, "float32")
    strides = cmd.contiguous_strides(shape)
    buf, w_loc, out_a, out_b = (asm.local(shape, "float32", lane_start=3) for _ in range(4))
    asm.load(w_addr, strides, w_loc, shape, "float32", lane_start=3)
    relu = tpu.ReluOp.PARAMS()
    # BDC 1 reads buf before anything wrote it in this run (zeros on a fresh chip)
    asm.compute(tpu.ReluOp, relu, [Tensor.local(buf, 3, shape, "float32")], [Tensor.local(out_a, 3, shape, "float32")])
    b2 = asm.compute(
        tpu.ReluOp,
        relu,
        [Tensor.local(w_loc, 3, shape, "float32")],
        [Tensor.local(out_b, 3, shape, "float32")],
        wait_gdma=1,
    )
    asm.load(xin.ddr_addr, strides, buf, shape, "float32", lane_start=3, wait_bdc=b2)
    asm.store(buf, w_addr, strides, shape, "float32", lane_start=3)  # x over the weights in DDR
    asm.store(out_a, stale.ddr_addr, strides, shape, "float32", lane_start=3)
    asm.store(out_b, fresh.ddr_addr, strides, shape, "float32", lane_start=3)
    model = decode_model(encode_model(asm.build()))
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(shape).astype(np.float32) + 1 for _ in range(3)]
    program = Program(model)
    for x in xs:
        run, once = program.run({"x": x}), simulate(model, {"x": x})
        np.testing.assert_array_equal(run.outputs["stale"], np.zeros(shape, np.float32))
        np.testing.assert_array_equal(run.outputs["weights"], np.maximum(w, 0))
        assert run.profile == once.profile
    run.profile["total_cycles"] = -1  # a caller's edit of one run's profile is not the next run's
    assert program.run({"x": xs[0]}).profile == once.profile


def test_a_weight_tile_is_read_once_and_a_tile_written_over_is_not():
    """Operands made of bytes every run finds the same (weights as GDMA loads them) are read when the
    program is prepared; a buffer the weights were loaded into and a command then wrote is read each run."""
    from tpubuild.sim.chip import Program

    asm = Assembler(CHIP, model="fixed")
    shape = (1, 6, 2, 3)
    w = np.arange(36, dtype=np.float32).reshape(shape) - 10
    w_addr = asm.weight(w)
    xin = asm.input("x", shape, "float32")
    y_w, y_x = asm.output("relu_w", shape, "float32"), asm.output("relu_x", shape, "float32")
    strides = cmd.contiguous_strides(shape)
    w_loc, buf, x_loc, out_w, out_x = (asm.local(shape, "float32", lane_start=3) for _ in range(5))
    local = functools.partial(Tensor.local, lane_start=3, shape=shape, dtype="float32")
    asm.load(w_addr, strides, w_loc, shape, "float32", lane_start=3)
    asm.load(w_addr, strides, buf, shape, "float32", lane_start=3)
    g = asm.load(xin.ddr_addr, strides, x_loc, shape, "float32", lane_start=3)
    relu = tpu.ReluOp.PARAMS()
    asm.compute(tpu.ReluOp, relu, [local(w_loc)], [local(out_w)], wait_gdma=g)
    asm.compute(tpu.ReluOp, relu, [local(x_loc)], [local(buf)])  # buf held the weights: now x
    b = asm.compute(tpu.ReluOp, relu, [local(buf)], [local(out_x)])
    asm.store(out_w, y_w.ddr_addr, strides, shape, "float32", lane_start=3, wait_bdc=b)
    asm.store(out_x, y_x.ddr_addr, strides, shape, "float32", lane_start=3)
    program = Program(decode_model(encode_model(asm.build())))
    weight_read_once = [type(o).__name__ for o in program.steps[3].operands]
    assert weight_read_once == ["_Value"] and type(program.steps[-3].operands[0]).__name__ != "_Value"
    for seed in range(2):
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        out = program.run({"x": x}).outputs
        np.testing.assert_array_equal(out["relu_w"], np.maximum(w, 0))
        np.testing.assert_array_equal(out["relu_x"], np.maximum(x, 0))


def test_a_result_goes_to_the_commands_reading_it_and_to_memory_only_when_read_there():
    """relu -> add: the relu tile is handed to the add (not written: nothing reads it in local memory),
    the add tile is written (a GDMA store reads it); a one-shot simulate writes both, same outputs."""
    from tpubuild.sim.chip import Program

    asm = Assembler(CHIP, model="forward")
    shape = (1, 6, 2, 3)
    xin, yout = asm.input("x", shape, "float32"), asm.output("y", shape, "float32")
    strides = cmd.contiguous_strides(shape)
    x_loc, r_loc, y_loc = (asm.local(shape, "float32", lane_start=3) for _ in range(3))
    local = functools.partial(Tensor.local, lane_start=3, shape=shape, dtype="float32")
    g = asm.load(xin.ddr_addr, strides, x_loc, shape, "float32", lane_start=3)
    asm.compute(tpu.ReluOp, tpu.ReluOp.PARAMS(), [local(x_loc)], [local(r_loc)], wait_gdma=g)
    b = asm.compute(tpu.AddOp, tpu.AddOp.PARAMS(), [local(r_loc), local(x_loc)], [local(y_loc)])
    asm.store(y_loc, yout.ddr_addr, strides, shape, "float32", lane_start=3, wait_bdc=b)
    model = decode_model(encode_model(asm.build()))
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    program = Program(model)
    run = program.run({"x": x})
    np.testing.assert_array_equal(run.outputs["y"], np.maximum(x, 0) + x)
    np.testing.assert_array_equal(run.outputs["y"], simulate(model, {"x": x}).outputs["y"])
    lanes = program.mem.local  # channel 0 of each tile: lane 3, the tile's first bytes
    assert (
        not lanes[3, r_loc : r_loc + 24].any()
        and lanes[3, y_loc : y_loc + 24].view(np.float32)[0] == run.outputs["y"].flat[0]
    )
