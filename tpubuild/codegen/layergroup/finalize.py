"""The planner's exact plans: a group's ranges per slice, local addresses, checked buffers and replayed cycles."""

from __future__ import annotations

import dataclasses

from tpubuild.codegen import alloc, cost
from tpubuild.codegen.layergroup.estimate import PlannerEstimates
from tpubuild.codegen.layergroup.groups import LOCAL, Group, logical_shape, with_h_pads
from tpubuild.codegen.layergroup.schedule import Step, replay_steps, schedule


class PlannerExact(PlannerEstimates):
    """Exact plans of a group (``Planner``'s third layer)."""

    def finalize(self, gid: int, i: int, j: int, ns: int, hs: int) -> Group | None:
        """Exact ranges for every slice, local addresses, cycles; None if it does not fit at this slicing."""
        inputs, outputs, weights, _ = self.structure(i, j)
        needs, owns = [], []
        for ni in range(ns):
            for hi in range(hs):
                needs.append(self.ranges(i, j, ns, hs, ni, hi))
                owns.append({o: self.own_range(o, ns, hs, ni, hi) for o in outputs})
        if hs > 1 and any(
            need[self.ops[p].name][3] - need[self.ops[p].name][2] < self.ops[p].slice_rule.min_rows
            for p in range(i, j)
            for need in needs
        ):
            return None  # (``limits`` keeps H slices this tall; a guard for the exact F32 bits)
        sizes = self.sizes_of(i, j, needs)
        copies = 2 if ns * hs > 1 else 1
        bufs, avoid = self.buffers(i, j, sizes, copies)
        try:
            addrs = alloc.place(
                bufs,
                align=self.chip.eu_bytes,
                bank_bytes=self.chip.lmem_bank_bytes,
                avoid=avoid,
                capacity=self.chip.lmem_bytes,
                what="local memory",
            )
        except alloc.AllocError:
            return None
        per_slice = [self.slice_costs(i, j, need, own) for need, own in zip(needs, owns, strict=True)]
        wbytes = sum(self.weight_nbytes(w) for w in weights)
        keyed = {b.key: b.size for b in bufs}
        group = Group(
            gid,
            LOCAL,
            list(range(i, j)),
            ns,
            hs,
            inputs,
            outputs,
            weights,
            ranges={t: [need[t] for need in needs] for t in needs[0]},
            own={o: [own[o] for own in owns] for o in outputs},
            sizes=keyed,
            addrs=addrs,
            copies=copies,
            ddr_bytes=wbytes + sum(c[3] for c in per_slice),
            lmem_bytes=alloc.peak(bufs, addrs),
            layout=self.layout_name,
        )
        group.cycles = self.replay(group)
        return group

    # ---- one op on one slice (codegen emits exactly this) -----------------------------------------

    def op_tiles(self, group: Group, p: int, s: int) -> tuple[object, list]:
        """(params as executed, per operand: None, (weight, None) or (tensor, rows needed)) of op p in
        slice s: a windowed op's H pads trimmed to the slice, a sized op's output shape the slice's, each
        activation's rows from its rule."""
        node = self.g.ops[p]
        f = self.ops[p]
        out_r = group.ranges[node.name][s]
        out4 = self.t[node.name].shape4
        out_rank = len(self.g.tensors[node.name].shape)
        params = node.op.params
        operands: list = []
        for k, t in enumerate(node.inputs):
            if t is None:
                operands.append(None)
                continue
            if self.g.tensors[t].weight:
                operands.append((t, None))
                continue
            s4 = self.t[t].shape4
            if len(self.g.tensors[t].shape) == out_rank:
                n_lo, n_hi = (out_r[0], out_r[1]) if s4[0] == out4[0] else (0, s4[0])
                h_lo, h_hi, top, bottom = f.slice_rule.in_h_range(k, out_r[2], out_r[3], s4[2], out4[2])
                if k == 0 and f.slice_rule.window is not None:
                    params = with_h_pads(params, top, bottom)
            else:
                n_lo, n_hi, h_lo, h_hi = 0, s4[0], 0, s4[2]
            operands.append((t, (n_lo, n_hi, h_lo, h_hi)))
        if f.slice_rule.sized:
            params = dataclasses.replace(params, shape=logical_shape(self.g.tensors[node.name].shape, out_r))
        return params, operands

    def check(self, group: Group) -> None:
        """Raise AllocError unless the group's local buffers (as recorded) fit and never overlap while alive."""
        sizes = {k.rsplit("#", 1)[0] if not k.endswith("#buf") else k: v for k, v in group.sizes.items()}
        i, j = group.ops[0], group.ops[-1] + 1
        bufs, _ = self.buffers(i, j, sizes, group.copies)
        missing = [b.key for b in bufs if b.key not in group.addrs]
        if missing:
            raise alloc.AllocError(f"group {group.id}: no local address for {', '.join(missing[:3])}")
        alloc.check(bufs, group.addrs, capacity=self.chip.lmem_bytes, what=f"group {group.id} local memory")

    def replay(self, group: Group) -> int:
        """Cycles of the group's commands (``schedule`` with the cost model's cycles of each): what the
        simulator's cycle model replays for this group."""
        steps, durations = self.timed_steps(group)
        return replay_steps(steps, durations)

    def timed_steps(self, group: Group) -> tuple[list[Step], list[int]]:
        """The group's ``schedule`` and the cost model's cycles of each step."""
        chip, g = self.chip, self.g
        loads = group.weight_loads(g, self.packs)
        steps = schedule(len(group.ops), group.slices, group.copies, [bool(w) for w in loads])
        durations = []
        for step in steps:
            if step.kind == "load":
                d = sum(self.load_cycles(t, group.ranges[t][step.slice]) for t in group.inputs)
            elif step.kind == "store":
                d = sum(
                    self.t[o].gdma_cycles(chip, r[1] - r[0], r[3] - r[2], store=True)
                    for o in group.outputs
                    for r in [group.own[o][step.slice]]
                )
            elif step.kind == "weights":
                d = sum(cost.gdma_cycles(chip, self.weight_nbytes(w)) for w in loads[step.op])
            else:
                p = group.ops[step.op]
                node = g.ops[p]
                params, operands = self.op_tiles(group, p, step.slice)
                ins = [
                    ()
                    if o is None
                    else g.tensors[o[0]].shape
                    if o[1] is None
                    else logical_shape(g.tensors[o[0]].shape, o[1])
                    for o in operands
                ]
                out = logical_shape(g.tensors[node.name].shape, group.ranges[node.name][step.slice])
                d = max(1, cost.bdc_cycles(chip, node.kind, params, ins, [out], self._compute_dtype(node)))
            durations.append(d)
        return steps, durations
