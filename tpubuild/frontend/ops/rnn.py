"""LSTM, GRU and RNN -> top.LSTM / top.GRU / top.RNN (single layer; layout 1 by permutes around the op)."""

from __future__ import annotations

import numpy as np

from tpubuild.frontend.onnx_graph import Ctx, Node, shape_of
from tpubuild.frontend.ops.common import result_names
from tpubuild.frontend.registry import converter
from tpubuild.ir import top


def _params(node: Node, gates: int) -> top.RnnParams:
    a = node.attrs
    hidden = a.get("hidden_size") or shape_of(node.input(1))[1] // gates
    # only activations the node names: RNN's schema default lists two (forward and backward) even for one
    given = any(attr.name == "activations" for attr in node.proto.attribute)
    return top.RnnParams(
        int(hidden),
        a.get("direction", "forward"),
        tuple(a["activations"]) if given else (),
        tuple(float(v) for v in a.get("activation_alpha") or ()),
        tuple(float(v) for v in a.get("activation_beta") or ()),
        float(a.get("clip") or 0.0),
        bool(a.get("input_forget", 0)),
        bool(a.get("linear_before_reset", 0)),
    )


def _check_sequence_lens(node: Node, ctx: Ctx, seq: int) -> None:
    lens = ctx.const(node, 4, "sequence_lens")
    if lens is not None and np.any(np.asarray(lens) != seq):
        raise NotImplementedError(
            f"sequence_lens {np.asarray(lens).tolist()} shorter than the sequence ({seq}) are not supported"
        )


def _rnn(node: Node, ctx: Ctx, cls: type[top.RnnOp], states: list[int]):
    """``states``: the input positions of the initial states (initial_h, [initial_c])."""
    p = _params(node, cls.GATES)
    batch_first = node.attrs.get("layout", 0) == 1
    names = result_names(node.outputs, cls.NUM_RESULTS)
    x = node.input(0)
    init = [node.input(i) for i in states]
    if batch_first:
        x = ctx.emit(top.PermuteOp, [x], top.PermuteParams((1, 0, 2)), name=f"{names[0]}_seq_major_x")
        init = [
            s
            if s is None
            else ctx.emit(top.PermuteOp, [s], top.PermuteParams((1, 0, 2)), name=f"{names[0]}_seq_major_state{i}")
            for i, s in enumerate(init)
        ]
    _check_sequence_lens(node, ctx, shape_of(x)[0])
    operands = [x, node.input(1), node.input(2), node.input(3), *init]
    if cls is top.LSTMOp:
        operands.append(node.input(7))
    inner = [f"{n}_seq_major" for n in names] if batch_first else names
    outs = ctx.emit_multi(cls, operands, p, names=inner)
    if batch_first:
        # Y [seq, dirs, batch, H] -> [batch, seq, dirs, H]; Y_h/Y_c [dirs, batch, H] -> [batch, dirs, H]
        orders = [(2, 0, 1, 3)] + [(1, 0, 2)] * (len(outs) - 1)
        outs = [
            ctx.emit(top.PermuteOp, [v], top.PermuteParams(o), name=n)
            for v, o, n in zip(outs, orders, names, strict=True)
        ]
    return outs


@converter("LSTM", since=7)
def _(node: Node, ctx: Ctx):
    return _rnn(node, ctx, top.LSTMOp, [5, 6])


@converter("GRU", since=7)
def _(node: Node, ctx: Ctx):
    return _rnn(node, ctx, top.GRUOp, [5])


@converter("RNN", since=7)
def _(node: Node, ctx: Ctx):
    return _rnn(node, ctx, top.RNNOp, [5])
