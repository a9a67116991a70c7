"""Reading .mlir files fast: the i64-array and per-axis quant fast paths give what xDSL's generic parser gives,
and the per-process parse cache hands out independent copies."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from xdsl.dialects.builtin import StringAttr
from xdsl.parser import Parser

from tpubuild.ir import mlir
from tpubuild.ir.quant import UniformType

# a lowered-module-like op: i64 scalars (negative, past i64's signed range, in a dictionary) and arrays (negative,
# single, empty), other integer and float widths, a per-axis type with negative zero points and exponents, a
# per-tensor type
TEXT = """"builtin.module"() ({
  "func.func"() <{sym_name = "main", function_type = (tensor<1x3xf32>) -> tensor<1x3xf32>}> ({
  ^bb0(%0: tensor<1x3xf32> loc(unknown)):
    %1 = "top.Input"(%0) : (tensor<1x3xf32>) -> tensor<1x3xf32> loc("x")
    %2 = "top.Weight"() {a = [7 : i64], b = [-3 : i64, 0 : i64, 2147483647 : i64], c = [], d = [1.5, 2.0], e = [1 : i32, 2 : i32], f = -5 : i64, g = 9223372036854775808 : i64, h = 3 : i32, i = {j = 12 : i64, k = 0.5 : f64}, l = 7} : () -> tensor<3x1x!quant.uniform<i8:f32:0, {0.5:0,1.25e-07:-3,3.0:12}>> loc("w")
    %3 = "top.Weight"() : () -> tensor<3x!quant.uniform<u8:f32, 0.0078125:128>> loc("v")
    "func.return"(%1) : (tensor<1x3xf32>) -> () loc(unknown)
  }) : () -> () loc(unknown)
}) {module.name = "m"} : () -> () loc(unknown)
"""  # noqa: E501 (MLIR generic form prints an op on one line, and the parser is tested on such lines)


def described(module) -> list:
    """Everything of each op that a stage can read, with the Python types of the values."""

    def attr(a):
        return (type(a).__name__, repr(a))

    return [
        (
            type(op).__name__,
            sorted((k, attr(v)) for k, v in op.attributes.items()),
            sorted((k, attr(v)) for k, v in op.properties.items()),
            [attr(r.type) for r in op.results],
            repr(op.location),
        )
        for op in module.walk()
    ]


def test_fast_paths_give_the_generic_parsers_attributes():
    fast = mlir._parse(TEXT, "t.mlir")
    generic = Parser(mlir.context(), TEXT, name="t.mlir").parse_module()
    assert described(fast) == described(generic)
    weight = list(mlir.body_ops(fast))[1]
    assert [a.value.data for a in weight.attributes["b"].data] == [-3, 0, 2147483647]
    qtype = weight.results[0].type.element_type
    assert isinstance(qtype, UniformType)
    assert qtype.scale_list == [0.5, 1.25e-07, 3.0] and qtype.zero_point_list == [0, -3, 12]
    assert mlir.print_module(fast) == mlir.print_module(generic)


def test_tensor_types_read_once_per_text_stay_distinct():
    # the same text twice shares its type; a per-axis type differing in one scale does not
    text = TEXT.replace(
        '%3 = "top.Weight"() : () -> tensor<3x!quant.uniform<u8:f32, 0.0078125:128>>',
        '%3 = "top.Weight"() : () -> tensor<3x1x!quant.uniform<i8:f32:0, {0.5:0,1.25e-07:-3,3.5:12}>>',
    )
    for _ in range(2):
        fast = mlir._parse(text, "t.mlir")
        generic = Parser(mlir.context(), text, name="t.mlir").parse_module()
        assert described(fast) == described(generic)
    w, v = list(mlir.body_ops(fast))[1:3]
    assert w.results[0].type != v.results[0].type
    assert v.results[0].type.element_type.scale_list == [0.5, 1.25e-07, 3.5]


def test_fast_path_leaves_malformed_lists_to_the_parser():
    bad = TEXT.replace("{0.5:0,1.25e-07:-3,3.0:12}", "{0.5:0,,3.0:12}")
    with pytest.raises(mlir.TpuBuildError, match="not valid MLIR"):
        mlir.parse_module(bad, file="bad.mlir")


def test_parse_cache_hands_out_independent_copies():
    first = mlir.parse_module(TEXT)
    first.attributes["module.name"] = StringAttr("changed")
    list(mlir.body_ops(first))[1].detach()
    second = mlir.parse_module(TEXT)
    assert mlir.module_attr(second, "name") == "m"
    assert len(list(mlir.body_ops(second))) == 4
    assert mlir.print_module(second) == mlir.print_module(mlir._parse(TEXT, "t.mlir"))


def test_a_saved_module_is_read_back_without_parsing_as_parsing_would_give_it(make_model, tmp_path, monkeypatch):
    """save_module keeps a copy for the next load of the same text in this process: an INT8 lowering
    (per-channel types, multiplier arrays, f64 params, module flags) and its layer-grouped and addressed
    modules read back as what parsing their files gives."""
    from tpubuild.build.chips import load_chip
    from tpubuild.calib.calibrate import apply_table, calibrate
    from tpubuild.codegen.assign import memory_assign
    from tpubuild.codegen.layergroup import layer_group
    from tpubuild.frontend import convert_onnx
    from tpubuild.lower.lowering import lower_module

    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Sigmoid", ["r"], ["y"]),
    ]
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    model = tmp_path / "m.onnx"
    onnx.save(make_model(nodes, {"x": np.zeros((1, 3, 8, 8), np.float32)}, initializers=inits), model)
    module, weights = convert_onnx(model, {"x": (1, 3, 8, 8)}, "m", "w.npz")
    cali, _ = calibrate(module, weights, [{"x": rng.uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32)}], "max")
    lowered, _ = lower_module(apply_table(module, cali), weights, chip=load_chip("bm1684x"), mode="INT8", cali=cali)
    grouped, _ = layer_group(lowered.clone(), load_chip("bm1684x"))
    addressed, _ = memory_assign(grouped.clone(), load_chip("bm1684x"))
    for name, saved in (("tpu.mlir", lowered), ("lg.mlir", grouped), ("addr.mlir", addressed)):
        path = tmp_path / name
        mlir.save_module(saved, path)
        text = path.read_text()
        parsed = mlir._parse(text, str(path))
        saved.attributes["module.name"] = StringAttr("changed after saving")
        with monkeypatch.context() as patch:
            patch.setattr(mlir, "_parse", no_parse)
            loaded = mlir.load_module(path)
        assert described(loaded) == described(parsed) and mlir.print_module(loaded) == text
    # an edited file is read from its text
    path.write_text(text.replace('"m"', '"m2"', 1))
    with monkeypatch.context() as patch:
        patch.setattr(mlir, "_parse", no_parse)
        with pytest.raises(AssertionError, match="parsed again"):
            mlir.load_module(path)


def no_parse(*args):
    raise AssertionError("parsed again")


def test_fast_printing_writes_what_the_generic_printer_writes():
    """mlir.print_module's i64 fast path: the same text as xDSL's printer, for scalars (negative, past i64's signed
    range), arrays (single, empty, mixed with i32, inside a dictionary) and a module parsed either way."""
    import io

    from xdsl.printer import Printer

    text = TEXT.replace("l = 7}", "l = 7, m = [3 : i64, 4 : i32], n = {o = [-1 : i64, 2 : i64]}}")
    for module in (mlir._parse(text, "t.mlir"), Parser(mlir.context(), text, name="t.mlir").parse_module()):
        out = io.StringIO()
        Printer(stream=out, print_generic_format=True, print_debuginfo=True).print_op(module)
        assert mlir.print_module(module) == out.getvalue() + "\n"
        assert "f = -5 : i64" in out.getvalue() and "n = {o = [-1 : i64, 2 : i64]}" in out.getvalue()
