"""The planner's search: dynamic programming over the op order for the grouping, then the exact plan of each
group (merging or halving where the estimate and the exact plan disagree)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tpubuild.codegen.layergroup.finalize import PlannerExact
from tpubuild.codegen.layergroup.groups import (
    ALIAS,
    CHANNEL,
    COPY,
    GLOBAL,
    LOCAL,
    MAX_GROUP_OPS,
    SPREAD,
    Estimate,
    Group,
)


class Planner(PlannerExact):
    """The layer group planner: facts (``PlannerFacts``), estimates (``PlannerEstimates``), exact plans
    (``PlannerExact``) and the search over the op order that uses them (this class)."""

    def best_local(self, i: int, j: int, hint: int = 0) -> Estimate | None:
        """The cheapest slicing of ops[i:j] among the fewest slices that fit and about 2x and 4x as many
        (more slices overlap more DMA with compute but add halo rows and command overheads), in the
        channel layout or, for layout-free ops, the lane-spread one; None: none fits."""
        best = self._best_local(i, j, hint)
        alts = [self.spread] if self.spread is not None and self.spreads(i, j) else []
        if i in self.folds and j > self.folds[i].conv:  # X' never leaves the group
            alts.append(self.fold[i])
        for planner in alts:
            alt = planner._best_local(i, j, hint)
            if alt is not None and (best is None or alt.cycles < best.cycles):
                best = alt
        return best

    def _best_local(self, i: int, j: int, hint: int = 0) -> Estimate | None:
        seq = self.sequence(i, j)
        first = self._first_fit(i, j, seq, min(hint, len(seq) - 1))
        if first is None:
            return None
        k0 = seq[first][0] * seq[first][1]
        tried = [first]
        for factor in (2, 4):
            idx = next((x for x in range(first, len(seq)) if seq[x][0] * seq[x][1] >= factor * k0), None)
            if idx is not None and idx not in tried:
                tried.append(idx)
        best: Estimate | None = None
        for idx in tried:
            fits, cycles = self.estimate(i, j, *seq[idx])
            if fits and (best is None or cycles < best.cycles):
                best = Estimate(cycles, seq[idx][0], seq[idx][1], first, self.layout_name)
        return best

    def _first_fit(self, i: int, j: int, seq: list[tuple[int, int]], hint: int) -> int | None:
        """The first slicing in ``seq`` that fits, searching from ``hint`` (fit only improves along seq)."""
        if self.estimate(i, j, *seq[hint])[0]:
            lo = hint
            while lo > 0 and self.estimate(i, j, *seq[lo - 1])[0]:
                lo -= 1
            return lo
        # gallop forward, then bisect
        step, lo, hi = 1, hint, None
        while True:
            idx = lo + step
            if idx >= len(seq):
                idx = len(seq) - 1
                if idx == lo or not self.estimate(i, j, *seq[idx])[0]:
                    return None
                hi = idx
                break
            if self.estimate(i, j, *seq[idx])[0]:
                hi = idx
                break
            lo, step = idx, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.estimate(i, j, *seq[mid])[0]:
                hi = mid
            else:
                lo = mid
        return hi

    # ---- the search -----------------------------------------------------------------------------

    def alone_cycles(self, p: int) -> tuple[int, str, Estimate | None]:
        """(cycles, kind, local estimate) of op p in a group of its own (or as a global op)."""
        f = self.ops[p]
        if f.kind == ALIAS:
            return 0, ALIAS, None
        if f.kind == LOCAL:
            e = self.best_local(p, p + 1)
            if e is not None and e.cycles <= f.global_cycles:
                return e.cycles, LOCAL, e
        return f.global_cycles, (COPY if f.kind == COPY else GLOBAL), None

    def search(self) -> list[tuple[int, int, str, Estimate | None]]:
        """Dynamic programming over the op order: [(first op, end, kind, estimate)] covering every op."""
        n = len(self.ops)
        best = [0] + [math.inf] * n
        choice: list[tuple[int, str, Estimate | None]] = [(0, GLOBAL, None)] * (n + 1)  # [0]: never read
        for j in range(1, n + 1):
            cycles, kind, est = self.alone_cycles(j - 1)
            best[j], choice[j] = best[j - 1] + cycles, (j - 1, kind, est)
            if self.ops[j - 1].kind != LOCAL:
                continue
            hint = est.index if est else 0
            for i in range(j - 2, max(-1, j - 1 - MAX_GROUP_OPS), -1):
                if self.ops[i].kind != LOCAL or (i, j) in self.unfit:
                    break
                e = self.best_local(i, j, hint)
                if e is None:
                    break
                hint = e.index
                if best[i] + e.cycles < best[j]:
                    best[j], choice[j] = best[i] + e.cycles, (i, LOCAL, e)
        groups = []
        j = n
        while j > 0:
            i, kind, est = choice[j]
            groups.append((i, j, kind, est))
            j = i
        return groups[::-1]

    # ---- the final plan -------------------------------------------------------------------------

    def plan(self) -> list[Group]:
        groups = self._plan_once()
        while groups is None:  # a run the search chose has no exact plan: search again without it
            groups = self._plan_once()
        self._alternate(groups)
        return groups

    def _plan_once(self) -> list[Group] | None:
        """The search's choice settled into exact groups; None when a run it chose as one group has no exact
        plan as one (the search sizes groups by a middle slice): that run is then ``unfit``, and the next
        search picks the best grouping without it instead of the run falling apart in _settle's halves."""
        groups: list[Group] = []
        chosen = self.search()
        k = 0
        while k < len(chosen):
            i, j, kind, est = chosen[k]
            if kind != LOCAL:
                groups.append(self._single(len(groups), i, kind))
                k += 1
                continue
            assert est is not None, "the search's local groups carry their estimate"
            placed = self._place(len(groups), i, j, est)
            if j - i > 1 and not (len(placed) == 1 and placed[0].kind == LOCAL):
                self.unfit.add((i, j))
                return None
            # the search sizes groups by a middle slice: where it split a run of ops that also fits as
            # one group, the exact plans decide (a near tie in the estimate can hide a real difference)
            while k + 1 < len(chosen) and chosen[k + 1][2] == LOCAL and chosen[k + 1][1] - i <= MAX_GROUP_OPS:
                j2, est2 = chosen[k + 1][1], chosen[k + 1][3]
                merged = self.best_local(i, j2)
                if merged is None or est2 is None:
                    break
                whole = self._place(len(groups), i, j2, merged)
                split = placed + self._place(len(groups) + len(placed), j, j2, est2)
                if sum(g.cycles for g in whole) >= sum(g.cycles for g in split):
                    break
                placed, j, k = whole, j2, k + 1
            groups.extend(placed)
            k += 1
        return groups

    def _place(self, gid: int, i: int, j: int, est: Estimate) -> list[Group]:
        """The exact groups of the search's choice ops[i:j] at ``est``."""
        if est.layout == CHANNEL:
            return self._settle(gid, i, j, est)
        settled = self.layout(Group(0, LOCAL, [i], layout=est.layout))._settle(gid, i, j, est)
        whole = len(settled) == 1 and settled[0].kind == LOCAL
        # the search's estimate sizes a middle slice: keep the other layout only if its exact
        # plan beats the channel layout's too
        base = self._best_local(i, j)
        channel = self._settle(gid, i, j, base) if base is not None else None
        if whole and (channel is None or settled[0].cycles < sum(g.cycles for g in channel)):
            return settled
        if est.layout == SPREAD and channel is None:
            return settled
        # (a fold group split up would store X' to DDR: the ops run in the channel layout)
        return channel if channel is not None else self._settle(gid, i, j, Estimate(0, 1, 1, 0))

    def _alternate(self, groups: Sequence[Group]) -> None:
        """Every other local group is mirrored to the top of local memory
        (``capacity - addr - size``: the same buffers, overlaps and banks, upside down), so two
        neighbours that fit together use disjoint bytes and codegen can load the next one's
        weights and first tiles while the current one still computes (``Emitter.prefetch``)."""
        cap = self.chip.lmem_bytes
        flip = False
        for group in groups:
            if group.kind != LOCAL:  # global ops and copies between use no local memory
                continue
            if flip and all(
                group.addrs[k] % self.chip.eu_bytes == 0 == (cap - group.sizes[k]) % self.chip.eu_bytes
                for k in group.addrs
            ):
                group.addrs = {k: cap - a - group.sizes[k] for k, a in group.addrs.items()}
                self.layout(group).check(group)
            flip = not flip

    def _settle(self, gid: int, i: int, j: int, est: Estimate) -> list[Group]:
        """The group at its estimated slicing, re-sliced until the exact plan fits; split if it never does."""
        seq = self.sequence(i, j)
        start = seq.index((est.n_secs, est.h_secs)) if (est.n_secs, est.h_secs) in seq else 0
        for ns, hs in seq[start:]:
            group = self.finalize(gid, i, j, ns, hs)
            if group is not None:
                return [group]
        if j - i == 1:
            return [self._single(gid, i, GLOBAL)]
        # it never fits as one group: its two halves, each settled the same way (and halved again if need be),
        # not every op alone (a run of 48 ops the search sized by a middle slice fell apart into 48 groups)
        return self._halves(gid, i, j)

    def _halves(self, gid: int, i: int, j: int) -> list[Group]:
        """ops[i:mid] and ops[mid:j], each one local group at its best estimate if it fits, else halved again."""
        out: list[Group] = []
        for a, b in ((i, (i + j) // 2), ((i + j) // 2, j)):
            e, at = self.best_local(a, b), gid + len(out)
            if e is not None:
                out += self._settle(at, a, b, e)
            else:
                out += [self._single(at, a, GLOBAL)] if b - a == 1 else self._halves(at, a, b)
        return out

    def _single(self, gid: int, p: int, kind: str) -> Group:
        f = self.ops[p]
        node = self.g.ops[p]
        inputs = list(dict.fromkeys(t for _, t, _ in f.operands))
        outputs = [o for o in node.outputs if o in self.g.tensors]
        return Group(
            gid,
            kind,
            [p],
            inputs=inputs,
            outputs=outputs,
            weights=f.weights,
            cycles=f.global_cycles if kind in (GLOBAL, COPY) else 0,
            ddr_bytes=f.global_bytes if kind in (GLOBAL, COPY) else 0,
        )


# readers that take a result's channels in runs (a channel shuffle's Reshape, a channel Split): codegen
# stores those runs to their places directly (``channel_redirects``), which needs the channel layout
