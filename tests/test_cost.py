"""The cost formulas against TPU-MLIR's own cost model for bm1684x.

Each expected figure is the cycles TPU-MLIR 1.30.2 gives one command of the
same tile (``model_deploy --debug`` on PP-OCRv4 det, PP-OCR cls, light_inception_v2
and light_densenet121: the TIU commands in compiler_profile_0.txt, their tile shapes from the bmodel's
net_0.profile); the sum where TPU-MLIR splits the op into several commands
(conv + bias + requant). Our command overhead is left out (compute_cycles).
"""

from __future__ import annotations

import pytest

from tpubuild.build.chips import load_chip
from tpubuild.codegen import cost
from tpubuild.ir import top, tpu

BM1684X = load_chip("bm1684x")


def conv(k: int, group: int = 1) -> top.ConvParams:
    return top.ConvParams(kernel_shape=(k, k), strides=(1, 1), pads=(k // 2,) * 4, dilations=(1, 1), group=group)


@pytest.mark.parametrize(
    "op, params, ins, outs, dtype, tpumlir",
    [
        # INT8 1x1 conv 24 -> 24 on a 36 x 320 slice: CONV 2880 + AR 1440 + RQDQ 720
        ("tpu.Conv", conv(1), [(1, 24, 36, 320), (24, 24, 1, 1)], [(1, 24, 36, 320)], "int8", 2880 + 1440 + 720),
        # INT8 5x5 depthwise on 192 x 40 x 40: PorD 7500 + RQDQ 300
        ("tpu.Conv", conv(5, 192), [(1, 192, 40, 40), (192, 1, 5, 5)], [(1, 192, 40, 40)], "int8", 7500 + 300),
        # BF16 and F32 depthwise 5x5 on 192 x 40 x 40: PorD 3750 and 7500
        ("tpu.Conv", conv(5, 192), [(1, 192, 40, 40), (192, 1, 5, 5)], [(1, 192, 40, 40)], "bfloat16", 3750),
        ("tpu.Conv", conv(5, 192), [(1, 192, 40, 40), (192, 1, 5, 5)], [(1, 192, 40, 40)], "float32", 7500),
        # INT8 2x2 stride-2 transposed conv 24 -> 1 on a 36-row slice (72 output rows): CONV 46080, then its
        # RequantIntAxis RQDQ 2880
        (
            "tpu.Deconv",
            top.DeconvParams(kernel_shape=(2, 2), strides=(2, 2), pads=(0,) * 4, dilations=(1, 1)),
            [(1, 24, 36, 320), (24, 1, 2, 2)],
            [(1, 1, 72, 640)],
            "int8",
            46080 + 2880,
        ),
        # BF16 2x2 stride-2 transposed conv 24 -> 24 on a 20-row slice: CONV 12800
        (
            "tpu.Deconv",
            top.DeconvParams(kernel_shape=(2, 2), strides=(2, 2), pads=(0,) * 4, dilations=(1, 1)),
            [(1, 24, 20, 160), (24, 24, 2, 2)],
            [(1, 24, 40, 320)],
            "bfloat16",
            12800,
        ),
        # INT8 lookup table (HardSwish) on 192 x 40 x 40: SG 4800
        ("tpu.Lut", None, [(1, 192, 40, 40), (256,)], [(1, 192, 40, 40)], "int8", 4800),
        # nearest 2x upsample 96 x 40 x 40 -> 80 x 80, INT8 and BF16: SG 12800
        (
            "tpu.Interp",
            top.InterpParams(shape=(1, 96, 80, 80), scales=(1, 1, 2, 2)),
            [(1, 96, 40, 40)],
            [(1, 96, 80, 80)],
            "int8",
            12800,
        ),
        (
            "tpu.Interp",
            top.InterpParams(shape=(1, 96, 80, 80), scales=(1, 1, 2, 2)),
            [(1, 96, 40, 40)],
            [(1, 96, 80, 80)],
            "bfloat16",
            12800,
        ),
        # INT8 global average pool of 96 x 80 x 80: PorD 12800
        (
            "tpu.AvgPool",
            top.PoolParams(kernel_shape=(80, 80), strides=(1, 1), pads=(0,) * 4),
            [(1, 96, 80, 80)],
            [(1, 96, 1, 1)],
            "int8",
            12800,
        ),
        # INT8 3x3 stride-1 average pools of Inception v2 (light_inception_v2), padding not counted (windows of 4, 6
        # and 9): 192 x 28 x 28, PorD 351 + AR 2 x 156; 576 x 14 x 14, PorD 324 + AR 2 x 144 (the output planes in
        # whole 64-byte EUs: 13 and 4 of them)
        (
            "tpu.AvgPool",
            tpu.AvgPoolOp.PARAMS(kernel_shape=(3, 3), strides=(1, 1), pads=(1,) * 4, counts=(4, 6, 9)),
            [(1, 192, 28, 28)],
            [(1, 192, 28, 28)],
            "int8",
            351 + 2 * 156,
        ),
        (
            "tpu.AvgPool",
            tpu.AvgPoolOp.PARAMS(kernel_shape=(3, 3), strides=(1, 1), pads=(1,) * 4, counts=(4, 6, 9)),
            [(1, 576, 14, 14)],
            [(1, 576, 14, 14)],
            "int8",
            324 + 2 * 144,
        ),
        # INT8 2x2 stride-2 average pool of DenseNet-121's transitions, one window size: 256 x 28 x 28 -> 14 x 14,
        # PorD 192 (4 EUs a plane, 4 taps, strided)
        (
            "tpu.AvgPool",
            tpu.AvgPoolOp.PARAMS(kernel_shape=(2, 2), strides=(2, 2), pads=(0,) * 4, counts=(4,)),
            [(1, 256, 28, 28)],
            [(1, 256, 14, 14)],
            "int8",
            192,
        ),
        # 3x3 stride-2 max pools (light_inception_v2, light_densenet121): 192 x 56 x 56 -> 28 x 28, PorD 1053 in INT8,
        # 2025 in BF16, 3969 in F32 (13, 25, 49 EUs a plane); 64 x 112 x 112 -> 56 x 56, PorD 1323, 2646, 5292
        *[
            (
                "tpu.MaxPool",
                top.PoolParams(kernel_shape=(3, 3), strides=(2, 2), pads=(0, 0, 1, 1)),
                [(1, c, h, h)],
                [(1, c, h // 2, h // 2)],
                dtype,
                cycles,
            )
            for c, h, figures in ((192, 56, (1053, 2025, 3969)), (64, 112, (1323, 2646, 5292)))
            for dtype, cycles in zip(("int8", "bfloat16", "float32"), figures, strict=True)
        ],
        # a 3x3 stride-1 window over 192 x 28 x 28 in BF16 and F32: PorD 675, 1323 (the taps of Inception v2's
        # average pools; TPU-MLIR rescales their windows of several sizes in further AR commands)
        (
            "tpu.MaxPool",
            top.PoolParams(kernel_shape=(3, 3), strides=(1, 1), pads=(1,) * 4),
            [(1, 192, 28, 28)],
            [(1, 192, 28, 28)],
            "bfloat16",
            675,
        ),
        (
            "tpu.MaxPool",
            top.PoolParams(kernel_shape=(3, 3), strides=(1, 1), pads=(1,) * 4),
            [(1, 192, 28, 28)],
            [(1, 192, 28, 28)],
            "float32",
            1323,
        ),
    ],
)
def test_command_cycles_match_tpumlir_cost_model(op, params, ins, outs, dtype, tpumlir):
    assert cost.compute_cycles(BM1684X, op, params, ins, outs, dtype) == pytest.approx(tpumlir)


def test_deconv_costs_its_output_grid():
    """A transposed conv runs as a conv over the zero-inserted input: four times the work of its input grid
    for a 2x2 stride-2 kernel, as the same conv on the output grid."""
    p = top.DeconvParams(kernel_shape=(2, 2), strides=(2, 2), pads=(0,) * 4, dilations=(1, 1))
    deconv = cost.compute_cycles(
        BM1684X, "tpu.Deconv", p, [(1, 64, 20, 20), (64, 64, 2, 2)], [(1, 64, 40, 40)], "bfloat16"
    )
    same_conv = cost.compute_cycles(
        BM1684X, "tpu.Conv", conv(2), [(1, 64, 40, 40), (64, 64, 2, 2)], [(1, 64, 40, 40)], "bfloat16"
    )
    assert deconv == pytest.approx(same_conv)


def test_gdma_bandwidth_by_direction_matches_tpumlir():
    """A long transfer, past the fixed cost: TPU-MLIR's model loads 409600 bytes in 7582 cycles and stores
    1638400 in 39982 (PP-OCRv4 det INT8); the figures reach the simulator through the model file's header."""
    from tpubuild.codegen.model_file import ChipParams, _chip

    chip = BM1684X
    assert cost.gdma_cycles(chip, 409600) - chip.gdma_latency == pytest.approx(7582, rel=2e-3)
    assert cost.gdma_cycles(chip, 1638400, store=True) - chip.gdma_latency == pytest.approx(39982, rel=2e-3)
    header = _chip(ChipParams.from_chip(chip).to_json()).to_chip()
    assert header.ddr_store_bytes_per_cycle == chip.ddr_store_bytes_per_cycle < chip.ddr_bytes_per_cycle
