"""Reference inference through a Plan: every op's tensors are its kernel's, bit for bit, on every input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tpubuild.build import stages
from tpubuild.ir import mlir
from tpubuild.ir.base import TensorOp
from tpubuild.ir.top import InputOp, NoneOp, WeightOp
from tpubuild.kernels import get_kernel
from tpubuild.top.inference import Plan, run, weights_for

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """canonical.mlir of the shipped demo CNN (fused conv activations, pools, matmul, softmax)."""
    root = tmp_path_factory.mktemp("demo")
    stages.transform(
        str(REPO / "models" / "demo_cnn.onnx"),
        [{"name": "input", "shape": [1, 3, 32, 32], "dtype": "float32"}],
        "demo_cnn",
        None,
        str(root / "origin.mlir"),
        str(root / "origin_weights.npz"),
        str(root / "input.npz"),
    )
    stages.canonicalize(
        str(root / "origin.mlir"),
        str(root / "origin_weights.npz"),
        str(root / "canonical.mlir"),
        str(root / "canonical_weights.npz"),
    )
    return root / "canonical.mlir"


def kernels_one_by_one(module, weights, inputs) -> dict[str, np.ndarray]:
    """Each op's registered kernel on its operands, in order: what a plan must reproduce."""
    values, named = {}, {}
    for op in mlir.body_ops(module):
        if not isinstance(op, TensorOp):
            continue
        if isinstance(op, NoneOp):
            values[op.results[0]] = None
            continue
        if isinstance(op, WeightOp):
            values[op.results[0]] = weights[op.loc_name]
            continue
        if isinstance(op, InputOp):
            results = (np.asarray(inputs[op.loc_name], np.float32),)
        else:
            out = get_kernel(type(op))(op.params, *[values[v] for v in op.operands])
            results = out if isinstance(out, tuple) else (out,)
        for value, name, array in zip(op.results, op.names, results, strict=True):
            values[value] = named[name] = np.ascontiguousarray(array)
    return named


def test_plan_is_its_kernels_on_every_input(demo):
    module = mlir.load_module(demo)
    weights = weights_for(module, demo)
    plan = Plan(module, weights)
    rng = np.random.default_rng(5)
    for _ in range(3):  # one plan, several inputs: nothing of one run leaks into the next
        inputs = {"input": rng.normal(size=(1, 3, 32, 32)).astype(np.float32)}
        expect = kernels_one_by_one(module, weights, inputs)
        got = plan.run(inputs)
        assert sorted(got) == sorted(expect)
        for name, array in expect.items():
            assert got[name].dtype == array.dtype and np.array_equal(got[name], array), name
        live = plan.run(inputs, all_tensors=False)
        assert sorted(live) == mlir.output_names(module)
        for name, array in live.items():
            assert np.array_equal(array, expect[name]), name
        again = run(module, weights, inputs)  # a plan of its own
        assert all(np.array_equal(again[n], a) for n, a in expect.items())


def test_plan_observer_sees_every_computed_op(demo):
    module = mlir.load_module(demo)
    plan = Plan(module, weights_for(module, demo))
    seen = []
    plan.run(
        {"input": np.zeros((1, 3, 32, 32), np.float32)},
        all_tensors=False,
        observer=lambda op, args, results: seen.append((op.loc_name, len(args), len(results))),
    )
    computed = [
        op for op in mlir.body_ops(module) if isinstance(op, TensorOp) and not isinstance(op, (WeightOp, NoneOp))
    ]
    assert [s[0] for s in seen] == [op.loc_name for op in computed]
    assert seen[0][1] == 0  # top.Input: no operands
    assert all(n == len(op.operands) for (_, n, _), op in zip(seen[1:], computed[1:], strict=True))
