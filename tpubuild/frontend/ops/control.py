"""If: a condition known at compile time (a shape test, once the input shapes are fixed) takes its branch; one
decided by the data runs both branches and picks each output with a Where (ONNX branches have no side effects)."""

from __future__ import annotations

import numpy as np

from xdsl.ir import Operation, SSAValue

from tpubuild.errors import TpuBuildError
from tpubuild.frontend.onnx_graph import Const, Ctx, Node, dtype_of_value, shape_of
from tpubuild.frontend.registry import converter
from tpubuild.ir import top

_FIX_THE_INPUT = (
    "where the input is a setting (a sample rate, a mode), give it its value in the manifest, e.g. "
    "`inputs: [{name: sr, value: 16000}]`: the If is then taken at compile time"
)


@converter("If", since=1)
def _(node: Node, ctx: Ctx):
    cond = node.input(0)
    if isinstance(cond, Const):
        taken = ctx.inline(node.attrs["then_branch" if bool(np.asarray(cond.array).reshape(-1)[0]) else "else_branch"])
        # the If's results carry its own output names: verification pairs tensors by name
        return [
            value if isinstance(value, Const) else ctx.emit(top.IdentityOp, [value], name=name)
            for value, name in zip(taken, node.outputs, strict=True)
        ]
    try:
        then, other = ctx.inline(node.attrs["then_branch"]), ctx.inline(node.attrs["else_branch"])
    except TpuBuildError as e:
        behind = _inputs_behind(cond)
        e.problem = (
            f"If node {node.label!r} is decided at run time (its condition is computed from "
            f"{behind or 'the graph inputs'}), so both branches are converted, and one fails: " + e.problem
        )
        e.hint = _FIX_THE_INPUT if behind else e.hint
        raise
    # a one-element tensor: as a scalar it broadcasts to any output's shape
    cond = ctx.reshape(cond, (), f"{node.outputs[0]}_cond")
    outs = []
    for a, b, name in zip(then, other, node.outputs, strict=True):
        if (shape_of(a), dtype_of_value(a)) != (shape_of(b), dtype_of_value(b)):
            raise NotImplementedError(
                f"its condition is computed from the graph inputs, and its branches give output {name!r} different "
                f"types ({dtype_of_value(a)}{list(shape_of(a))} and {dtype_of_value(b)}{list(shape_of(b))}): both "
                "branches run and a Where picks, which needs one type"
            )
        outs.append(ctx.emit(top.WhereOp, [cond, a, b], name=name))
    return outs


def _inputs_behind(value) -> list[str]:
    """The graph inputs a TOP value is computed from, by name."""
    found, seen, todo = [], set(), [value]
    while todo:
        v = todo.pop()
        if not isinstance(v, SSAValue) or v in seen:
            continue
        seen.add(v)
        if isinstance(v.owner, top.InputOp):
            found.append(v.owner.loc_name)
        elif isinstance(v.owner, Operation):
            todo.extend(v.owner.operands)
    return sorted(found)
