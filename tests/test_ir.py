"""IR: quant types, module attributes, params, .mlir read/write, weight store, frontend refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from xdsl.dialects.builtin import TensorType, f16, f32
from xdsl.utils.exceptions import VerifyException

from tpubuild.errors import TpuBuildError
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir, params, top, tpu
from tpubuild.ir.quant import CalibratedType, UniformType
from tpubuild.ir.types import dtype_of, tensor_type
from tpubuild.ir.weights import WeightStore
from tpubuild.testing import upstream_check

ROOT = Path(__file__).resolve().parent.parent


def upstream(path: Path, *extra: str) -> str:
    """Parse and verify ``path`` with upstream MLIR; returns what it prints."""
    return upstream_check(path, *extra)


# ---- quant element types ------------------------------------------------------

QUANT_TYPES = {
    "calibrated": (CalibratedType.get(f32, -1.5, 2.0), "!quant.calibrated<f32<-1.5:2.0>>"),
    "calibrated_tiny": (CalibratedType.get(f32, -3e-7, 1e-12), "!quant.calibrated<f32<-3.0e-07:1.0e-12>>"),
    "calibrated_f16": (CalibratedType.get(f16, 0.0, 6.0), "!quant.calibrated<f16<0.0:6.0>>"),
    "uniform_i8": (UniformType.get("i8", f32, [0.0125], [-3]), "!quant.uniform<i8:f32, 0.0125:-3>"),
    "uniform_u8": (UniformType.get("u8", f32, [0.5], [128]), "!quant.uniform<u8:f32, 0.5:128>"),
    "uniform_i16": (UniformType.get("i16", f32, [1e-4], [0]), "!quant.uniform<i16:f32, 0.0001:0>"),
    "per_axis_i8": (
        UniformType.get("i8", f32, [0.1, 0.2, 1e-5, 3.0], [0, 0, 0, 0], axis=1),
        "!quant.uniform<i8:f32:1, {0.1:0,0.2:0,1.0e-05:0,3.0:0}>",
    ),
    "per_axis_u8": (
        UniformType.get("u8", f32, [0.25, 0.125, 2.0, 1.0], [1, 128, 255, 0], axis=1),
        "!quant.uniform<u8:f32:1, {0.25:1,0.125:128,2.0:255,1.0:0}>",
    ),
}


def quant_module(elem_types) -> mlir.ModuleOp:
    """x (f32) -> tpu.Cast to each element type in turn -> return."""
    builder = mlir.GraphBuilder([tensor_type([1, 4, 2, 2])])
    v = builder.add(top.InputOp.make([builder.args[0]], name="x")).results[0]
    for i, elem in enumerate(elem_types):
        v = builder.add(tpu.CastOp.make([v], name=f"cast{i}", result_types=[TensorType(elem, [1, 4, 2, 2])])).results[0]
    return builder.finish([v], name="quant", weight_file="quant_weights.npz", state="TPU_LOWERED")


@pytest.mark.parametrize("case", QUANT_TYPES)
def test_quant_type_prints_as_mlir_spells_it(case):
    elem, text = QUANT_TYPES[case]
    printed = mlir.print_module(quant_module([elem]))
    assert f"tensor<1x4x2x2x{text}>" in printed


@pytest.mark.parametrize("case", QUANT_TYPES)
def test_quant_type_round_trips_through_xdsl(case):
    elem, _ = QUANT_TYPES[case]
    text = mlir.print_module(quant_module([elem]))
    parsed = mlir.parse_module(text)
    (cast,) = [op for op in mlir.body_ops(parsed) if isinstance(op, tpu.CastOp)]
    assert cast.results[0].type == TensorType(elem, [1, 4, 2, 2])
    assert mlir.print_module(parsed) == text


def test_quant_storage_dtypes():
    assert dtype_of(TensorType(QUANT_TYPES["uniform_u8"][0], [2])) == np.uint8
    assert dtype_of(TensorType(QUANT_TYPES["per_axis_i8"][0], [2])) == np.int8
    assert dtype_of(TensorType(QUANT_TYPES["calibrated"][0], [2])) == np.float32


def test_quant_types_parse_upstream(tmp_path):
    """Upstream MLIR's own quant dialect parses and verifies every spelling; its generic reprint reads back."""
    elems = [e for e, _ in QUANT_TYPES.values()]
    path = tmp_path / "quant.mlir"
    mlir.save_module(quant_module(elems), path)
    generic = upstream(path, "--mlir-print-op-generic")
    reparsed = mlir.parse_module(generic, file="upstream")
    casts = [op for op in mlir.body_ops(reparsed) if isinstance(op, tpu.CastOp)]
    assert [c.results[0].type.element_type for c in casts] == elems


def test_unknown_quant_storage_refused():
    with pytest.raises(ValueError, match="i4"):
        UniformType.get("i4", f32, [1.0], [0])


ELEMENT_DTYPES = [
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.float64,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint8,
    np.bool_,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.int4,
    ml_dtypes.uint4,
    ml_dtypes.int2,
    ml_dtypes.uint2,
    ml_dtypes.float4_e2m1fn,
]


def test_element_types_round_trip_and_parse_upstream(tmp_path):
    """Every dtype a tensor may hold maps to an MLIR element type that xDSL and upstream MLIR read back."""
    builder = mlir.GraphBuilder([tensor_type([2, 3], d) for d in ELEMENT_DTYPES])
    outs = [builder.add(top.InputOp.make([a], name=f"in{i}")).results[0] for i, a in enumerate(builder.args)]
    module = builder.finish(outs, name="types", weight_file="types_weights.npz")
    path = tmp_path / "types.mlir"
    mlir.save_module(module, path)
    parsed = mlir.load_module(path)
    assert [dtype_of(op.results[0].type) for op in mlir.input_ops(parsed)] == [np.dtype(d) for d in ELEMENT_DTYPES]
    upstream(path)


# ---- module attributes, printing, parsing ---------------------------------------


def test_module_attrs_round_trip():
    module = quant_module([])
    mlir.set_module_attrs(module, chip="bm1684x", mode="INT8", asymmetric=True)
    parsed = mlir.parse_module(mlir.print_module(module))
    got = {k: mlir.module_attr(parsed, k) for k in ("name", "weight_file", "state", "chip", "mode", "asymmetric")}
    assert got == {
        "name": "quant",
        "weight_file": "quant_weights.npz",
        "state": "TPU_LOWERED",
        "chip": "bm1684x",
        "mode": "INT8",
        "asymmetric": "true",
    }
    mlir.set_module_attrs(parsed, asymmetric=False)
    assert mlir.module_attr(mlir.parse_module(mlir.print_module(parsed)), "asymmetric") == "false"
    assert mlir.module_attr(parsed, "absent", "default") == "default"


@pytest.fixture(scope="module")
def demo_module(tmp_path_factory):
    path = ROOT / "models" / "demo_cnn.onnx"
    return convert_onnx(path, {"input": [2, 3, 32, 32]}, "demo_cnn", "demo_cnn_origin_weights.npz")


@pytest.fixture(scope="module")
def transformer_module():
    path = ROOT / "models" / "tiny_transformer.onnx"
    return convert_onnx(path, {}, "tiny_transformer", "tiny_transformer_origin_weights.npz")


def test_printing_is_deterministic(demo_module):
    """The same model converted twice prints to the same bytes, and a print/parse/print is stable."""
    module, _ = demo_module
    again, _ = convert_onnx(
        ROOT / "models" / "demo_cnn.onnx", {"input": [2, 3, 32, 32]}, "demo_cnn", "demo_cnn_origin_weights.npz"
    )
    text = mlir.print_module(module)
    assert mlir.print_module(again) == text
    assert mlir.print_module(mlir.parse_module(text)) == text


def test_save_module_is_byte_deterministic(demo_module, tmp_path):
    module, _ = demo_module
    mlir.save_module(module, tmp_path / "a.mlir")
    mlir.save_module(mlir.load_module(tmp_path / "a.mlir"), tmp_path / "b.mlir")
    assert (tmp_path / "a.mlir").read_bytes() == (tmp_path / "b.mlir").read_bytes()


@pytest.mark.parametrize("which", ["demo_module", "transformer_module"])
def test_converted_models_parse_upstream(which, request, tmp_path):
    module, _ = request.getfixturevalue(which)
    path = tmp_path / "origin.mlir"
    mlir.save_module(module, path)
    upstream(path)


def test_locations_name_tensors(demo_module):
    """Every op is located at the tensor it produces; the names survive the file."""
    module, weights = demo_module
    parsed = mlir.parse_module(mlir.print_module(module))
    names = [op.loc_name for op in mlir.body_ops(parsed) if isinstance(op, top.TopOp)]
    assert len(names) == len(set(names))
    assert set(mlir.weight_names(parsed)) == set(weights)
    assert mlir.output_names(parsed) == [o.name for o in onnx.load(ROOT / "models" / "demo_cnn.onnx").graph.output]


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.99])
def test_truncated_mlir_names_the_file(demo_module, tmp_path, cut):
    module, _ = demo_module
    text = mlir.print_module(module)
    path = tmp_path / "origin.mlir"
    path.write_text(text[: int(len(text) * cut)])
    with pytest.raises(TpuBuildError) as info:
        mlir.load_module(path)
    assert str(path) in str(info.value)
    assert "not valid MLIR" in str(info.value)


def test_infer_file_on_truncated_mlir_names_the_file(demo_module, tmp_path):
    from tpubuild.top.inference import infer_file

    module, _ = demo_module
    path = tmp_path / "origin.mlir"
    path.write_text(mlir.print_module(module)[:300])
    with pytest.raises(TpuBuildError, match="origin.mlir"):
        infer_file(path, {"input": np.zeros((2, 3, 32, 32), np.float32)})


def test_binary_file_is_not_mlir(tmp_path):
    path = tmp_path / "junk.mlir"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(TpuBuildError, match="junk.mlir"):
        mlir.load_module(path)


def test_missing_mlir_file(tmp_path):
    with pytest.raises(TpuBuildError, match="file not found"):
        mlir.load_module(tmp_path / "nope.mlir")


def test_broken_op_attribute_is_reported_with_its_location(demo_module):
    """A file whose op lacks a required parameter fails verification naming the op and attribute."""
    module, _ = demo_module
    text = mlir.print_module(module)
    conv = next(op for op in mlir.body_ops(module) if isinstance(op, top.ConvOp))
    broken = text.replace("kernel_shape = ", "kernel_shapx = ", 1)
    with pytest.raises(TpuBuildError) as info:
        mlir.parse_module(broken, file="broken.mlir")
    message = str(info.value)
    assert "broken.mlir" in message and "'kernel_shape'" in message and conv.loc_name in message


# ---- op parameters ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AllKinds:
    ints: tuple[int, ...]
    name: str
    scale: float = 1.0
    flag: bool = False
    count: int = 3
    floats: tuple[float, ...] = ()
    strs: tuple[str, ...] = ()
    maybe: int | None = None


def test_params_round_trip_every_kind():
    p = AllKinds((1, -2, 3), "x", scale=0.1, flag=True, count=-7, floats=(0.5, -1e-9), strs=("a", "b"), maybe=4)
    assert params.decode(AllKinds, params.encode(p)) == p


def test_params_defaults_are_not_stored():
    attrs = params.encode(AllKinds((1,), "x"))
    assert sorted(attrs) == ["ints", "name"]
    assert params.decode(AllKinds, attrs) == AllKinds((1,), "x")


def test_params_missing_required_attribute_is_named():
    attrs = params.encode(AllKinds((1,), "x"))
    del attrs["ints"]
    with pytest.raises(VerifyException, match="missing required attribute 'ints'"):
        params.decode(AllKinds, attrs)


@pytest.mark.parametrize("field,wrong", [("flag", "count"), ("scale", "name"), ("ints", "scale"), ("name", "count")])
def test_params_wrong_kind_names_the_attribute(field, wrong):
    p = AllKinds((1,), "x", scale=2.0, flag=True, count=5)
    attrs = params.encode(p)
    attrs[field] = attrs[wrong]
    with pytest.raises(VerifyException, match=f"attribute {field}"):
        params.decode(AllKinds, attrs)


def test_op_verify_names_missing_attribute_and_location():
    x = mlir.GraphBuilder([tensor_type([1, 2, 5, 5])])
    inp = x.add(top.InputOp.make([x.args[0]], name="x")).results[0]
    w = x.weight("w", tensor_type([3, 2, 3, 3]))
    conv = top.ConvOp.make([inp, w, x.none()], top.ConvParams((3, 3), (1, 1), (0,) * 4, (1, 1)), name="conv_out")
    del conv.attributes["strides"]
    with pytest.raises(VerifyException, match="conv_out.*missing required attribute 'strides'"):
        conv.verify()


# ---- weight store ------------------------------------------------------------------


def weight_arrays():
    rng = np.random.default_rng(3)
    return {
        "conv.w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "b": rng.integers(-128, 127, (4,)).astype(np.int8),
        "scalar": np.array(2.5, np.float32),
        "shape": np.array([1, -1], np.int64),
        "half": rng.standard_normal(5).astype(np.float16),
        "bf16": rng.standard_normal(6).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
        "i4": np.arange(-8, 8).astype(ml_dtypes.int4),
        "mask": np.array([True, False]),
    }


def test_weight_store_save_is_byte_deterministic(tmp_path):
    arrays = weight_arrays()
    WeightStore(arrays).save(tmp_path / "a.npz")
    WeightStore(dict(reversed(list(arrays.items())))).save(tmp_path / "b.npz")  # insertion order differs
    WeightStore.load(tmp_path / "a.npz").save(tmp_path / "c.npz")
    a = (tmp_path / "a.npz").read_bytes()
    assert a == (tmp_path / "b.npz").read_bytes() == (tmp_path / "c.npz").read_bytes()


def test_weight_store_round_trips_dtypes(tmp_path):
    arrays = weight_arrays()
    WeightStore(arrays).save(tmp_path / "w.npz")
    loaded = WeightStore.load(tmp_path / "w.npz")
    assert sorted(loaded) == sorted(arrays)
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype, name
        assert loaded[name].shape == a.shape, name
        assert loaded[name].tobytes() == a.tobytes(), name


def test_weight_store_errors(tmp_path):
    with pytest.raises(TpuBuildError, match="weight file not found"):
        WeightStore.load(tmp_path / "none.npz")
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(TpuBuildError, match="bad.npz"):
        WeightStore.load(tmp_path / "bad.npz")
    with pytest.raises(TpuBuildError, match="'missing'"):
        WeightStore()["missing"]


def test_weight_store_add_and_keep_only():
    store = WeightStore()
    assert store.add("w", np.zeros(2)) == "w"
    assert store.add("w", np.ones(2)) == "w_1"
    kept = store.keep_only(["w_1"])
    assert list(kept) == ["w_1"] and kept["w_1"].tolist() == [1.0, 1.0]
