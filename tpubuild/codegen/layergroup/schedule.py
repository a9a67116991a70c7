"""The GDMA/BDC schedule of a local group: the steps' order and waits, their replay, and the pipelined estimate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def pipelined_after_first(k: int, load: int, compute: int, store: int, gdma_t: int, bdc_t: int) -> int:
    """Cycles of k equal slices in ``schedule``'s order, slice 0's compute having ended at ``bdc_t`` and
    the GDMA queue (its loads and the weights) at ``gdma_t``: then slice t+1 loads and slice t-1 stores
    (one GDMA engine) while slice t computes."""
    if k == 1:
        return bdc_t + store
    return max(bdc_t, gdma_t + load) + (k - 2) * max(load + store, compute) + max(store, compute) + store


@dataclass(frozen=True)
class Step:
    """One step of a local group's command streams: ``queue`` "gdma" (a load of slice ``slice``'s
    inputs, the weights of op ``op``, a store of a slice's outputs) or "bdc" (op ``op`` of a slice).
    ``wait``: the index of the step of the other queue this one waits for (START: the previous group's
    last compute; NONE: only its own queue's order); ``after``: every step of the other queue it needs
    (``wait`` is the last of them in this order; codegen may emit a group's first transfers early,
    before the previous group's last store, so their command ids no longer follow this order)."""

    queue: str
    kind: str
    slice: int
    op: int = -1
    wait: int = -1
    after: tuple[int, ...] = ()


START, NONE = -2, -1


def schedule(n_ops: int, slices: int, copies: int, weighted: Sequence[bool]) -> list[Step]:
    """The order codegen emits a local group's steps in, and their waits (one list for both queues).

    GDMA: slice 0's loads, the weights op by op, slice 1's loads, then slice t's loads and slice t-2's
    stores; BDC: every op of slice 0 (each waiting for its weights, so later weights load while earlier
    ops compute), then slice by slice. A load into buffer s % 2 waits for the compute of slice s - 2
    that read it; a slice's first op waits for its loads and for the store of slice s - 2 that read its
    output buffer; a store waits for its slice's last op.
    """
    order = _StepOrder(n_ops, copies)
    order.load(0)
    order.weight_loads(weighted)
    if slices == 1:
        order.compute(0)
        order.store(0)
        return order.steps
    order.load(1)
    order.compute(0)
    for t in range(2, slices + 2):
        if t < slices:
            order.load(t)
        order.store(t - 2)
        if 1 <= t - 1 < slices:
            order.compute(t - 1)
    return order.steps


class _StepOrder:
    """``schedule``'s steps as they are appended, with the indices later steps wait for."""

    def __init__(self, n_ops: int, copies: int):
        self.n_ops, self.copies = n_ops, copies
        self.steps: list[Step] = []
        self.loads: dict[int, int] = {}
        self.stores: dict[int, int] = {}
        self.last_op: dict[int, int] = {}
        self.weights: dict[int, int] = {}

    def load(self, s: int) -> None:
        self.loads[s] = len(self.steps)
        reuse = s >= self.copies  # the buffer held slice s - copies: its compute must be done
        self.steps.append(
            Step(
                "gdma",
                "load",
                s,
                wait=self.last_op[s - self.copies] if reuse else START,
                after=(self.last_op[s - self.copies],) if reuse else (),
            )
        )

    def weight_loads(self, weighted: Sequence[bool]) -> None:
        for p in range(self.n_ops):
            if weighted[p]:
                self.weights[p] = len(self.steps)
                self.steps.append(Step("gdma", "weights", 0, p, wait=NONE))

    def store(self, s: int) -> None:
        self.stores[s] = len(self.steps)
        self.steps.append(Step("gdma", "store", s, wait=self.last_op[s], after=(self.last_op[s],)))

    def compute(self, s: int) -> None:
        for p in range(self.n_ops):
            waits = [self.loads[s]] if p == 0 else []
            if p == 0 and s >= self.copies:
                waits.append(self.stores[s - self.copies])
            if s == 0 and p in self.weights:
                waits.append(self.weights[p])
            self.steps.append(Step("bdc", "compute", s, p, wait=max(waits) if waits else NONE, after=tuple(waits)))
        self.last_op[s] = len(self.steps) - 1


def replay_steps(steps: Sequence[Step], durations: Sequence[int]) -> int:
    """Makespan of ``steps`` on two in-order queues with their waits (START: time 0)."""
    end = [0] * len(steps)
    free = {"gdma": 0, "bdc": 0}
    for i, (step, d) in enumerate(zip(steps, durations, strict=True)):
        start = max(free[step.queue], end[step.wait] if step.wait >= 0 else 0)
        end[i] = free[step.queue] = start + d
    return max(free.values())
