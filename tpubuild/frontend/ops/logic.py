"""Comparisons and logic: Equal, Less, Greater (and OrEqual), Not, And, Or, Xor -> top.Compare."""

from __future__ import annotations

from tpubuild.frontend.onnx_graph import Ctx, Node
from tpubuild.frontend.registry import converter
from tpubuild.ir import top

# ONNX op -> (top.Compare mode, first opset with numpy broadcasting)
_MODES = {
    "Equal": ("Equal", 7),
    "Greater": ("Greater", 7),
    "Less": ("Less", 7),
    "GreaterOrEqual": ("GreaterOrEqual", 12),
    "LessOrEqual": ("LessOrEqual", 12),
    "And": ("And", 7),
    "Or": ("Or", 7),
    "Xor": ("Xor", 7),
    "Not": ("Not", 1),
}


def _compare(node: Node, ctx: Ctx):
    mode = _MODES[node.op_type][0]
    return [ctx.emit(top.CompareOp, list(node.inputs), top.CompareParams(mode), name=node.outputs[0])]


for _op, (_mode, _since) in _MODES.items():
    converter(_op, since=_since)(_compare)
