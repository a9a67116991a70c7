"""Layer group: which consecutive ops run together from local memory, how they are sliced, where tiles live.

A group is a run of consecutive ops (in the module's topological order) that
the chip executes slice by slice without touching DDR in between: per slice it
loads the group's inputs, computes every op on local tiles and stores the
group's outputs; weights are loaded once. Slices split N first, then H; an
output's rows are split evenly and every op's needed input rows — with the
halo of a conv or pool window — are propagated backwards through the group
(``slicing.Rule``), a tensor read by several ops holding the union. The
schedule is software-pipelined (load slice i+1 and store slice i-1 while
computing slice i), so group inputs and outputs get two buffers each.

The grouping is chosen by dynamic programming over the op order: best[j] =
min over i of best[i] + cycles(group ops[i:j]), where a group's cycles come
from the cost model (``cost.py``, shared with the simulator) at its best slicing
(the fewest slices that fit, or a few more when pipelining pays). Ops without a
slice rule (or whose single-op group cannot fit) run as global ops, reading and
writing DDR directly; a Reshape is an alias of its input's DDR buffer.

Local memory is allocated per group by lifetime (position in the group's op
order): weights, inputs and outputs live across the whole step, intermediate
tensors from their producer to their last reader; offsets are EU-aligned, an
op's output avoids its inputs' banks where possible, and a group that does not
fit is re-sliced — the final check raises, never overlaps.

lg.mlir is tpu.mlir plus group info (as TPU-MLIR's): each op gets a ``ginfo``
dictionary (group, id, kind; for local ops the output's local addresses and
size per lane, scratch buffer, and per slice n_idx/n_slice/h_idx/h_slice of
the rows it computes); the module's ``lg.groups`` lists every group with its
slicing, estimated cycles and DDR bytes, and its loads, stores and weights
with their local addresses and per-slice ranges.

The parts, one file each:

- ``groups``: op kinds and layouts, the planned ``Group``, the facts the search reuses, slice arithmetic
- ``copies``: layout ops as one strided DDR-to-DDR copy (``as_copy``)
- ``packs``: weight packs, an op's weights interleaved and loaded by one GDMA (``packs_of``)
- ``folds``: the alternate layouts, lane spread and folded input channels (``Fold``)
- ``redirects``: channel redirects, pieces of a tensor read in another layout (``channel_redirects``)
- ``schedule``: the GDMA/BDC step order of a local group and its replay (``schedule``)
- ``planner_facts``, ``estimate``, ``finalize``, ``search``: the ``Planner``, layer by layer, from the facts
  to the search over the op order
- ``lg_mlir``: the groups written onto the module and read back (``layer_group``, ``read_groups``)
"""

from tpubuild.codegen.layergroup.copies import Block, CopyDims, as_copy, copy_for
from tpubuild.codegen.layergroup.folds import Fold, find_folds, fold_graph, spread_graph
from tpubuild.codegen.layergroup.groups import (
    ALIAS,
    ALIAS_OPS,
    CHANNEL,
    COPY,
    FOLD,
    GLOBAL,
    LOCAL,
    MAX_GROUP_OPS,
    SPREAD,
    Estimate,
    Group,
    OpFacts,
    Range,
    TensorFacts,
    logical_shape,
    split,
    with_h_pads,
)
from tpubuild.codegen.layergroup.lg_mlir import annotate, layer_group, read_groups
from tpubuild.codegen.layergroup.packs import Pack, pack_of, packs_of, weight_block
from tpubuild.codegen.layergroup.redirects import Piece, channel_redirects
from tpubuild.codegen.layergroup.schedule import NONE, START, Step, pipelined_after_first, replay_steps, schedule
from tpubuild.codegen.layergroup.search import Planner

__all__ = [
    "ALIAS",
    "ALIAS_OPS",
    "Block",
    "CHANNEL",
    "COPY",
    "CopyDims",
    "Estimate",
    "FOLD",
    "Fold",
    "GLOBAL",
    "Group",
    "LOCAL",
    "MAX_GROUP_OPS",
    "NONE",
    "OpFacts",
    "Pack",
    "Piece",
    "Planner",
    "Range",
    "SPREAD",
    "START",
    "Step",
    "TensorFacts",
    "annotate",
    "as_copy",
    "channel_redirects",
    "copy_for",
    "find_folds",
    "fold_graph",
    "layer_group",
    "logical_shape",
    "pack_of",
    "packs_of",
    "pipelined_after_first",
    "read_groups",
    "replay_steps",
    "schedule",
    "split",
    "spread_graph",
    "weight_block",
    "with_h_pads",
]
