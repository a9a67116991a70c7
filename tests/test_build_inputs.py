"""A manifest's inputs completed from the model: what an entry leaves out, the ONNX graph (or the TOP module
made from it) says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tpubuild.build import stages
from tpubuild.build.files import read_npz
from tpubuild.build.inputs import complete, module_inputs, of_module, onnx_inputs
from tpubuild.errors import TpuBuildError
from tpubuild.ir.mlir import load_module


def two_input_model(path: Path, ids_dims: list, image_dims: list) -> onnx.ModelProto:
    """Token ids (int64) into an embedding, and an image; the embedding table is also listed as an input, as
    old exporters write initializers."""
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"]),
        helper.make_node("ReduceMean", ["image"], ["pooled"], axes=[2, 3], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "m",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ids_dims),
            helper.make_tensor_value_info("image", TensorProto.FLOAT, image_dims),
            helper.make_tensor_value_info("table", TensorProto.FLOAT, [10, 4]),
        ],
        [
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, None),
        ],
        initializer=[table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return model


def test_entries_left_out_take_the_models_shape_and_dtype(tmp_path):
    model = two_input_model(tmp_path / "m.onnx", [1, 6], ["batch", 3, 8, 8])
    declared = onnx_inputs(model)
    assert [d.name for d in declared] == ["ids", "image"]  # the initializer listed as an input is a weight
    specs = complete([], declared, file="m.onnx")
    assert [(s["name"], s["shape"], s["dtype"]) for s in specs] == [
        ("ids", [1, 6], "int64"),
        ("image", [1, 3, 8, 8], "float32"),  # a dynamic batch alone is 1
    ]
    # an entry without a name stands for the input at its position; a named one is matched by name
    pre = {"mean": [127.5], "scale": [0.5]}
    specs = complete(
        [{"range": [0, 10]}, {"name": "image", "shape": [2, 3, 8, 8], "preprocess": pre}], declared, file="m"
    )
    assert specs[0]["range"] == [0, 10] and specs[1]["shape"] == [2, 3, 8, 8] and specs[1]["preprocess"] == pre
    specs = complete([{"name": "image", "preprocess": pre}], declared, file="m")
    assert specs[1]["preprocess"] == pre and specs[0]["preprocess"] is None


@pytest.mark.parametrize(
    ("given", "image_dims", "expected"),
    [
        ([], [1, 3, "h", "w"], "input 'image' has dynamic shape [1, 3, 'h', 'w']"),
        ([{"name": "pixels"}], [1, 3, 8, 8], "'pixels' (model inputs: ['ids', 'image'])"),
        ([{"name": "ids", "dtype": "float32"}], [1, 3, 8, 8], "'ids' is int64 in the model, the manifest says float32"),
        ([{}, {}, {"range": [0, 1]}], [1, 3, 8, 8], "inputs[2] (no name, and the model has 2 inputs)"),
    ],
)
def test_what_the_model_cannot_say_is_asked_for(tmp_path, given, image_dims, expected):
    declared = onnx_inputs(two_input_model(tmp_path / "m.onnx", [1, 6], image_dims))
    with pytest.raises(TpuBuildError) as err:
        complete(given, declared, file=str(tmp_path / "m.onnx"))
    assert expected in str(err.value) and str(tmp_path / "m.onnx") in str(err.value)


def test_transform_without_inputs_feeds_the_models_types(tmp_path):
    """Without `inputs`, the test input has the model's dtypes: token ids are integers, not floats in [0, 1)
    that Gather would read as index 0 everywhere; calibrate and search read the same specs off the module."""
    two_input_model(tmp_path / "m.onnx", ["n", 6], ["n", 3, 8, 8])
    out = {
        "out_mlir": str(tmp_path / "o.mlir"),
        "out_weights": str(tmp_path / "w.npz"),
        "out_input": str(tmp_path / "i.npz"),
    }
    stages.transform(str(tmp_path / "m.onnx"), [], "m", None, **out)
    test = read_npz(tmp_path / "i.npz")
    assert test["ids"].dtype == np.int64 and test["ids"].shape == (1, 6) and test["ids"].max() > 0
    assert test["image"].dtype == np.float32 and test["image"].shape == (1, 3, 8, 8)
    from_module = complete([], module_inputs(load_module(tmp_path / "o.mlir")), file="o.mlir")
    assert from_module == complete([], onnx_inputs(onnx.load(str(tmp_path / "m.onnx"))), file="m.onnx")


def rate_model(path: Path) -> onnx.ModelProto:
    """silero VAD's pattern: an If on a sample-rate input picks the network for that rate; the other branch is
    not valid at this input size (here: a different output shape), so both cannot run and be picked between."""
    then = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t"])],
        "at16k",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.array(2, np.float32), "two")],
    )
    other = helper.make_graph(
        [helper.make_node("Reshape", ["x", "square"], ["e"])],
        "at8k",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 2])],
        initializer=[numpy_helper.from_array(np.array([2, 2], np.int64), "square")],
    )
    nodes = [
        helper.make_node("Equal", ["sr", "rate16k"], ["is16k"]),
        helper.make_node("If", ["is16k"], ["y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "vad",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array(16000, np.int64), "rate16k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return model


@pytest.mark.parametrize(("rate", "expected_shape"), [(16000, (1, 4)), (8000, (2, 2))])
def test_a_fixed_input_value_becomes_a_constant(tmp_path, rate, expected_shape):
    """`inputs: [{name: sr, value: 16000}]`: the compiled model has no `sr` input and its If is taken at compile
    time; onnxruntime, the reference, is fed the value, and TOP matches it."""
    from tpubuild.top.inference import run, weights_for

    rate_model(tmp_path / "m.onnx")
    given = [{"name": "sr", "value": rate}]
    specs = complete(given, onnx_inputs(onnx.load(str(tmp_path / "m.onnx"))), file="m.onnx")
    assert specs[1] == {"name": "sr", "shape": [], "dtype": "int64", "range": None, "preprocess": None, "value": rate}
    out = {
        "out_mlir": str(tmp_path / "o.mlir"),
        "out_weights": str(tmp_path / "w.npz"),
        "out_input": str(tmp_path / "i.npz"),
    }
    stages.transform(str(tmp_path / "m.onnx"), given, "m", None, **out)
    module = load_module(tmp_path / "o.mlir")
    assert [d.name for d in module_inputs(module)] == ["x"] and set(read_npz(tmp_path / "i.npz")) == {"x"}
    stages.reference(str(tmp_path / "m.onnx"), str(tmp_path / "i.npz"), str(tmp_path / "ref.npz"), given)
    want = read_npz(tmp_path / "ref.npz")["y"]
    got = run(module, weights_for(module, tmp_path / "o.mlir"), read_npz(tmp_path / "i.npz"))["y"]
    assert want.shape == expected_shape and np.array_equal(got, want)
    # the TOP module's inputs complete the same entries (calibrate and search read them there)
    assert of_module(given, module, file="o.mlir") == specs[:1]


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("sr", 16000.5, "does not fit int64"),
        ("sr", [1, 2], "does not fit the shape"),
        ("rate", 16000, "names an input the model does not have: 'rate'"),
    ],
)
def test_a_fixed_value_must_fit_the_input(tmp_path, name, value, expected):
    declared = onnx_inputs(rate_model(tmp_path / "m.onnx"))
    with pytest.raises(TpuBuildError, match=expected):
        complete([{"name": name, "value": value}], declared, file="m.onnx")
