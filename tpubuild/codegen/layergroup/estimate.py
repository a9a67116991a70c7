"""The planner's estimates: slicing sequences, the rows each slice needs, buffer sizes and a run's
estimated cycles at a slicing."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tpubuild.codegen import alloc
from tpubuild.codegen.layergroup.groups import Range, split
from tpubuild.codegen.layergroup.planner_facts import PlannerFacts
from tpubuild.codegen.layergroup.schedule import pipelined_after_first
from tpubuild.codegen.slicing import align, weight_lane_bytes


class PlannerEstimates(PlannerFacts):
    """Estimates of a run of ops at a slicing (``Planner``'s second layer)."""

    def sequence(self, i: int, j: int) -> list[tuple[int, int]]:
        """Slicings in the order they are tried: N first (each distinct slice size once), then H."""
        seq = self._sequences.get((i, j))
        if seq is None:
            if len(self._sequences) > 1 << 14:
                self._sequences.clear()
            seq = self._sequences[(i, j)] = self._sequence(i, j)
        return seq

    def _sequence(self, i: int, j: int) -> list[tuple[int, int]]:
        n_max, h_max = self.limits(i, j)
        seq, seen = [], set()
        for ns in range(1, n_max + 1):
            step = -(-n_max // ns)
            if step not in seen:
                seen.add(step)
                seq.append((ns, 1))
        ns = seq[-1][0]
        seen = set()
        for hs in range(2, h_max + 1):
            # only slice counts that change the tallest output slice (and so the working set)
            tallest = -(-h_max // hs)
            if tallest not in seen:
                seen.add(tallest)
                seq.append((ns, hs))
        return seq

    # ---- ranges ---------------------------------------------------------------------------------

    def ranges(self, i: int, j: int, ns: int, hs: int, ni: int, hi: int | None) -> dict[str, Range]:
        """Rows each tensor of ops[i:j] holds in slice (ni, hi); ``hi=None``: a middle slice of the
        tallest size (what the search sizes buffers by). A tensor read by several ops holds the union of
        their rows; each reader sees a view of its own rows (an address offset, the tile's plane stride)."""
        _, outputs, _, _ = self.structure(i, j)
        need: dict[str, Range] = {}
        for o in outputs:
            need[o] = self.own_range(o, ns, hs, ni, hi)
        for p in range(j - 1, i - 1, -1):
            f = self.ops[p]
            r = need.get(f.name)
            o4 = self.t[f.name].shape4
            if r is None:
                r = self.own_range(f.name, ns, hs, ni, hi)
            if not f.slice_rule.rows:  # whole rows in, whole rows out (and whole N unless it slices N)
                r = (r[0], r[1], 0, o4[2]) if f.slice_rule.n_split else (0, o4[0], 0, o4[2])
            r = (r[0], r[1], *f.slice_rule.computed(r[2], r[3], o4[2]))
            need[f.name] = r
            for k, t, same in f.operands:
                s4 = self.t[t].shape4
                if same:
                    n_lo, n_hi = (r[0], r[1]) if s4[0] == o4[0] else (0, s4[0])
                    h_lo, h_hi, _, _ = f.slice_rule.in_h_range(k, r[2], r[3], s4[2], o4[2])
                else:
                    n_lo, n_hi, h_lo, h_hi = 0, s4[0], 0, s4[2]
                old = need.get(t)
                if old is not None:
                    n_lo, n_hi = min(n_lo, old[0]), max(n_hi, old[1])
                    h_lo, h_hi = min(h_lo, old[2]), max(h_hi, old[3])
                need[t] = (n_lo, n_hi, h_lo, h_hi)
        return need

    def own_range(self, tensor: str, ns: int, hs: int, ni: int, hi: int | None) -> Range:
        n, _, h, _ = self.t[tensor].shape4
        if hi is None:
            n_len, h_len = -(-n // ns), -(-h // hs)
            h_lo = (h - h_len) // 2
            return 0, n_len, h_lo, h_lo + h_len
        return (*split(n, ns, ni), *split(h, hs, hi))

    # ---- one slicing's cost and fit -------------------------------------------------------------

    def slice_costs(self, i: int, j: int, need: dict[str, Range], own: dict[str, Range]) -> tuple[int, int, int, int]:
        """(load cycles, compute cycles, store cycles, DDR bytes) of one slice."""
        chip = self.chip
        inputs, outputs, _, _ = self.structure(i, j)
        load = store = nbytes = 0
        for t in inputs:
            r = need[t]
            load += self.load_cycles(t, r)
            nbytes += self.t[t].ddr_bytes(r[1] - r[0], r[3] - r[2])
        for o in outputs:
            r = own[o]
            store += self.t[o].gdma_cycles(chip, r[1] - r[0], r[3] - r[2], store=True)
            nbytes += self.t[o].ddr_bytes(r[1] - r[0], r[3] - r[2])
        compute = 0
        for p in range(i, j):
            f = self.ops[p]
            r = need[f.name]
            s4 = self.t[f.name].shape4
            frac = (r[1] - r[0]) * (r[3] - r[2]) / (s4[0] * s4[2])
            compute += chip.bdc_overhead + math.ceil(f.compute * frac)
        return load, compute, store, nbytes

    def buffers(self, i: int, j: int, sizes: dict[str, int], copies: int) -> tuple[list[alloc.Buffer], dict]:
        """Local buffers of ops[i:j] (per lane) with lifetimes in group positions, and bank conflicts."""
        inputs, outputs, weights, last = self.structure(i, j)
        m = j - i
        bufs: list[alloc.Buffer] = []
        for w in weights:
            bufs.append(alloc.Buffer(f"{w}#0", 0, m - 1, sizes[w]))
        whole = set(inputs) | set(outputs)
        for t in list(inputs) + list(outputs):
            bufs += [alloc.Buffer(f"{t}#{c}", 0, m - 1, sizes[t]) for c in range(copies)]
        avoid: dict[str, list[str]] = {}
        for p in range(i, j):
            f = self.ops[p]
            if f.name not in whole:
                bufs.append(alloc.Buffer(f"{f.name}#0", p - i, last.get(f.name, p) - i, sizes[f.name]))
            scratch = sizes.get(f"{f.name}#buf", 0)
            if scratch:
                bufs.append(alloc.Buffer(f"{f.name}#buf", p - i, p - i, scratch))
            outs = [f"{f.name}#{c}" for c in range(copies if f.name in whole else 1)]
            ins = [f"{t}#{c}" for _, t, _ in f.operands for c in range(copies if t in whole else 1)]
            for o in outs:
                avoid.setdefault(o, []).extend(ins)
                for x in ins:
                    avoid.setdefault(x, []).append(o)
        return bufs, avoid

    def sizes_of(self, i: int, j: int, needs: Sequence[dict[str, Range]]) -> dict[str, int]:
        chip = self.chip
        sizes: dict[str, int] = {}
        for need in needs:
            for t, r in need.items():
                b = self.t[t].lane_bytes(chip, r[1] - r[0], r[3] - r[2])
                if b > sizes.get(t, 0):
                    sizes[t] = b
        _, _, weights, _ = self.structure(i, j)
        for w in weights:
            t = self.g.tensors[w]
            sizes[w] = (
                self.packs[w].lane_bytes(chip)
                if w in self.packs
                else weight_lane_bytes(chip, t.shape, t.dtype.itemsize)
            )
        for p in range(i, j):
            f = self.ops[p]
            if f.slice_rule.buffer_factor:
                sizes[f"{f.name}#buf"] = align(
                    int(sizes[f.name] * f.slice_rule.buffer_factor * 4 / self.t[f.name].esize), chip.eu_bytes
                )
        return sizes

    def estimate(self, i: int, j: int, ns: int, hs: int) -> tuple[bool, int]:
        """(fits, cycles) of ops[i:j] at this slicing, sized by a middle slice of the tallest size.

        The search's inner loop: one pass, no allocation (the live-bytes bound decides the fit;
        ``finalize`` places the buffers for real and re-slices in the rare case that fails).
        """
        key = (i, j, ns, hs)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        chip, facts = self.chip, self.t
        inputs, outputs, _, last = self.structure(i, j)
        need = self.ranges(i, j, ns, hs, 0, None)
        copies = 2 if ns * hs > 1 else 1
        base = load = store = compute = 0
        for t in inputs:
            r = need[t]
            f = facts[t]
            base += copies * f.lane_bytes(chip, r[1] - r[0], r[3] - r[2])
            load += self.load_cycles(t, r)
        for o in outputs:
            r = need[o]
            f = facts[o]
            base += copies * f.lane_bytes(chip, r[1] - r[0], r[3] - r[2])
            own = self.own_range(o, ns, hs, 0, None)
            store += f.gdma_cycles(chip, own[1] - own[0], own[3] - own[2], store=True)
        whole = set(inputs) | set(outputs)
        m = j - i
        diff = [0] * (m + 1)
        gdma_t = bdc_t = load  # slice 0: weights load op by op behind its input tiles while ops compute
        for p in range(i, j):
            op = self.ops[p]
            r = need[op.name]
            f = facts[op.name]
            base += op.weight_lane
            c = chip.bdc_overhead + math.ceil(op.compute * (r[1] - r[0]) * (r[3] - r[2]) / op.rows)
            compute += c
            if op.weight_cycles:
                gdma_t += op.weight_cycles
                bdc_t = max(bdc_t, gdma_t)
            bdc_t += c
            size = f.lane_bytes(chip, r[1] - r[0], r[3] - r[2])
            if op.name not in whole:
                diff[p - i] += size
                diff[last.get(op.name, p) - i + 1] -= size
            if op.slice_rule.buffer_factor:
                scratch = int(size * op.slice_rule.buffer_factor * 4 / f.esize)
                diff[p - i] += scratch
                diff[p - i + 1] -= scratch
        live = top = 0
        for d in diff:
            live += d
            top = max(top, live)
        if base + top > chip.lmem_bytes:
            result = (False, 0)
        else:
            result = (True, pipelined_after_first(ns * hs, load, compute, store, gdma_t, bdc_t))
        self._memo[key] = result
        if len(self._memo) > 1 << 16:
            self._memo.clear()
        return result
