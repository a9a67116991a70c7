"""LSTM, GRU and RNN, ONNX semantics: gate order LSTM i,o,f,c and GRU z,r,h; layout [seq, batch, ...].

Arithmetic is float64 then cast back, so long sequences do not drift from the reference.
"""

from __future__ import annotations

import numpy as np

from tpubuild.ir import top
from tpubuild.kernels.registry import KernelError, kernel


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


# name -> (fn(x, alpha, beta), default alpha, default beta); alpha/beta as the ONNX activation ops
_ACTIVATIONS = {
    "sigmoid": (lambda x, a, b: _sigmoid(x), None, None),
    "tanh": (lambda x, a, b: np.tanh(x), None, None),
    "relu": (lambda x, a, b: np.maximum(x, 0), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: np.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: np.where(x > a, x, 0.0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: np.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: np.where(x >= 0, x, a * (np.exp(x) - 1)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + np.abs(x)), None, None),
    "softplus": (lambda x, a, b: np.logaddexp(x, 0), None, None),
}


def activation_specs(p: top.RnnParams, defaults: tuple[str, ...], dirs: int) -> list[tuple[str, float, float]]:
    """(lower-case name, alpha, beta) per activation slot (per direction), alphas/betas consumed in order."""
    names = list(p.activations) or list(defaults) * dirs
    if len(names) != len(defaults) * dirs:
        raise KernelError(f"{len(names)} activations given, expected {len(defaults) * dirs}")
    alphas, betas = list(p.activation_alpha), list(p.activation_beta)
    specs = []
    for name in names:
        if name.lower() not in _ACTIVATIONS:
            raise KernelError(f"unsupported RNN activation {name!r}")
        _, da, db = _ACTIVATIONS[name.lower()]
        a = alphas.pop(0) if da is not None and alphas else da
        b = betas.pop(0) if db is not None and betas else db
        specs.append((name.lower(), a, b))
    return specs


def activations(p: top.RnnParams, defaults: tuple[str, ...], dirs: int) -> list:
    """One callable per activation slot (per direction), alphas/betas consumed in order."""
    return [
        lambda x, fn=_ACTIVATIONS[name][0], a=a, b=b: fn(x, a, b) for name, a, b in activation_specs(p, defaults, dirs)
    ]


def _directions(p: top.RnnParams) -> list[bool]:
    """Per direction slot: does it run backwards in time?"""
    return {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[p.direction]


def _clip(x, p: top.RnnParams):
    return np.clip(x, -p.clip, p.clip) if p.clip > 0 else x


def _initial(state, dirs, batch, hidden):
    return np.zeros((dirs, batch, hidden)) if state is None else state.astype(np.float64)


@kernel(top.LSTMOp)
def _(p: top.RnnParams, x, w, r, b, h0, c0, peep):
    seq, batch, _ = x.shape
    hs = p.hidden_size
    backwards = _directions(p)
    acts = activations(p, ("Sigmoid", "Tanh", "Tanh"), len(backwards))
    x64 = x.astype(np.float64)
    h_all, c_all = _initial(h0, len(backwards), batch, hs), _initial(c0, len(backwards), batch, hs)
    y = np.zeros((seq, len(backwards), batch, hs))
    for d, back in enumerate(backwards):
        f, g, h = acts[3 * d : 3 * d + 3]
        wd, rd = w[d].astype(np.float64), r[d].astype(np.float64)
        bias = np.zeros(4 * hs) if b is None else b[d, : 4 * hs].astype(np.float64) + b[d, 4 * hs :]
        pi, po, pf = (np.zeros(hs),) * 3 if peep is None else np.split(peep[d].astype(np.float64), 3)
        ht, ct = h_all[d], c_all[d]
        for t in reversed(range(seq)) if back else range(seq):
            gates = x64[t] @ wd.T + ht @ rd.T + bias
            gi, go, gf, gc = np.split(gates, 4, axis=-1)
            i = f(_clip(gi + pi * ct, p))
            forget = 1 - i if p.input_forget else f(_clip(gf + pf * ct, p))
            ct = forget * ct + i * g(_clip(gc, p))
            o = f(_clip(go + po * ct, p))
            ht = o * h(ct)
            y[t, d] = ht
        h_all[d], c_all[d] = ht, ct
    return y.astype(x.dtype), h_all.astype(x.dtype), c_all.astype(x.dtype)


@kernel(top.GRUOp)
def _(p: top.RnnParams, x, w, r, b, h0):
    seq, batch, _ = x.shape
    hs = p.hidden_size
    backwards = _directions(p)
    acts = activations(p, ("Sigmoid", "Tanh"), len(backwards))
    x64 = x.astype(np.float64)
    h_all = _initial(h0, len(backwards), batch, hs)
    y = np.zeros((seq, len(backwards), batch, hs))
    for d, back in enumerate(backwards):
        f, g = acts[2 * d : 2 * d + 2]
        wd, rd = w[d].astype(np.float64), r[d].astype(np.float64)
        wb, rb = (np.zeros(3 * hs),) * 2 if b is None else np.split(b[d].astype(np.float64), 2)
        rz, rr, rh = np.split(rd, 3)
        ht = h_all[d]
        for t in reversed(range(seq)) if back else range(seq):
            xz, xr, xh = np.split(x64[t] @ wd.T + wb, 3, axis=-1)
            z = f(_clip(xz + ht @ rz.T + rb[:hs], p))
            reset = f(_clip(xr + ht @ rr.T + rb[hs : 2 * hs], p))
            if p.linear_before_reset:
                cand = g(_clip(xh + reset * (ht @ rh.T + rb[2 * hs :]), p))
            else:
                cand = g(_clip(xh + (reset * ht) @ rh.T + rb[2 * hs :], p))
            ht = (1 - z) * cand + z * ht
            y[t, d] = ht
        h_all[d] = ht
    return y.astype(x.dtype), h_all.astype(x.dtype)


@kernel(top.RNNOp)
def _(p: top.RnnParams, x, w, r, b, h0):
    seq, batch, _ = x.shape
    hs = p.hidden_size
    backwards = _directions(p)
    acts = activations(p, ("Tanh",), len(backwards))
    x64 = x.astype(np.float64)
    h_all = _initial(h0, len(backwards), batch, hs)
    y = np.zeros((seq, len(backwards), batch, hs))
    for d, back in enumerate(backwards):
        wd, rd = w[d].astype(np.float64), r[d].astype(np.float64)
        bias = np.zeros(hs) if b is None else b[d, :hs].astype(np.float64) + b[d, hs:]
        ht = h_all[d]
        for t in reversed(range(seq)) if back else range(seq):
            ht = acts[d](_clip(x64[t] @ wd.T + ht @ rd.T + bias, p))
            y[t, d] = ht
        h_all[d] = ht
    return y.astype(x.dtype), h_all.astype(x.dtype)
