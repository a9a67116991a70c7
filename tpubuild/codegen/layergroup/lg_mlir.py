"""lg.mlir: the groups written onto the module (``ginfo`` per op, ``lg.groups``), the stage, and reading them back."""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, ModuleOp, StringAttr
from xdsl.ir import Attribute

from tpubuild.build.chips import Chip
from tpubuild.codegen.graph import Graph, build_graph
from tpubuild.codegen.layergroup.groups import CHANNEL, LOCAL, Group, Range
from tpubuild.codegen.layergroup.search import Planner
from tpubuild.errors import TpuBuildError
from tpubuild.ir import mlir
from tpubuild.ir.params import int_array, int_attr

# ---- lg.mlir ------------------------------------------------------------------------------------


def _slices_attr(ranges: Sequence[Range]) -> dict[str, Attribute]:
    return {
        "n_idx": int_array([r[0] for r in ranges]),
        "n_slice": int_array([r[1] - r[0] for r in ranges]),
        "h_idx": int_array([r[2] for r in ranges]),
        "h_slice": int_array([r[3] - r[2] for r in ranges]),
    }


def _tensor_attr(group: Group, tensor: str, ranges: Sequence[Range]) -> DictionaryAttr:
    keys = group.buffer_keys(tensor)
    return DictionaryAttr(
        {
            "tensor": StringAttr(tensor),
            "addr": int_array([group.addrs[k] for k in keys]),
            "size": int_attr(group.sizes[keys[0]]),
            **_slices_attr(ranges),
        }
    )


def annotate(module: ModuleOp, graph: Graph, groups: Sequence[Group]) -> None:
    """Write the plan into the module: ``ginfo`` on every op, ``lg.groups`` on the module, state TPU_GROUPED."""
    for group in groups:
        for pos, p in enumerate(group.ops):
            node = graph.ops[p]
            info: dict[str, Attribute] = {
                "group": int_attr(group.id),
                "id": int_attr(pos),
                "kind": StringAttr(group.kind),
            }
            if group.kind == LOCAL:
                keys = group.buffer_keys(node.name)
                info.update(
                    {
                        "out_addr": int_array([group.addrs[k] for k in keys]),
                        "out_size": int_attr(group.sizes[keys[0]]),
                        "buffer_addr": int_attr(group.addrs.get(f"{node.name}#buf", 0)),
                        "buffer_size": int_attr(group.sizes.get(f"{node.name}#buf", 0)),
                        **_slices_attr(group.ranges[node.name]),
                    }
                )
            node.op.attributes["ginfo"] = DictionaryAttr(info)
    entries = []
    for group in groups:
        entry: dict[str, Attribute] = {
            "id": int_attr(group.id),
            "kind": StringAttr(group.kind),
            "ops": ArrayAttr([StringAttr(graph.ops[p].name) for p in group.ops]),
            "n_secs": int_attr(group.n_secs),
            "h_secs": int_attr(group.h_secs),
            "cycles": int_attr(group.cycles),
            "ddr_bytes": int_attr(group.ddr_bytes),
        }
        if group.kind == LOCAL:
            entry.update(
                {
                    "lmem_bytes": int_attr(group.lmem_bytes),
                    "layout": StringAttr(group.layout),
                    "loads": ArrayAttr([_tensor_attr(group, t, group.ranges[t]) for t in group.inputs]),
                    "stores": ArrayAttr([_tensor_attr(group, o, group.own[o]) for o in group.outputs]),
                    "weights": ArrayAttr(
                        [
                            DictionaryAttr(
                                {
                                    "tensor": StringAttr(w),
                                    "addr": int_attr(group.addrs[f"{w}#0"]),
                                    "size": int_attr(group.sizes[f"{w}#0"]),
                                }
                            )
                            for w in group.weights
                        ]
                    ),
                }
            )
        entries.append(DictionaryAttr(entry))
    module.attributes["lg.groups"] = ArrayAttr(entries)
    mlir.set_module_attrs(module, state="TPU_GROUPED")


def layer_group(module: ModuleOp, chip: Chip, *, exact_f32: bool = True) -> tuple[ModuleOp, list[Group]]:
    """Plan tpu.mlir's groups for ``chip`` and annotate the module in place (-> lg.mlir)."""
    mlir.require_state(module, "TPU_LOWERED", "layer group reads a lowered module", hint="run the lower stage first")
    graph = build_graph(module)
    groups = Planner(graph, chip, exact_f32=exact_f32).plan()
    annotate(module, graph, groups)
    return module, groups


# ---- reading lg.mlir back -----------------------------------------------------------------------


def _ranges(d: dict) -> list[Range]:
    return [
        (n, n + ns, h, h + hs) for n, ns, h, hs in zip(d["n_idx"], d["n_slice"], d["h_idx"], d["h_slice"], strict=True)
    ]


def read_groups(module: ModuleOp, graph: Graph | None = None) -> list[Group]:
    """The groups an lg.mlir (or addr.mlir) records, as ``Group`` objects."""
    graph = graph or build_graph(module)
    attr = module.attributes.get("lg.groups")
    if attr is None:
        raise TpuBuildError("the module has no lg.groups attribute", hint="run the layergroup stage first")
    index = {node.name: node.index for node in graph.ops}
    infos = {
        node.name: mlir.plain_value(node.op.attributes["ginfo"]) for node in graph.ops if "ginfo" in node.op.attributes
    }
    groups = []
    for d in mlir.plain_value(attr):
        g = Group(
            d["id"],
            d["kind"],
            [index[name] for name in d["ops"]],
            d["n_secs"],
            d["h_secs"],
            cycles=d["cycles"],
            ddr_bytes=d["ddr_bytes"],
        )
        if g.kind == LOCAL:
            g.copies = 2 if g.slices > 1 else 1
            g.lmem_bytes = d["lmem_bytes"]
            g.layout = d.get("layout", CHANNEL)
            for load in d["loads"]:
                g.inputs.append(load["tensor"])
                g.ranges[load["tensor"]] = _ranges(load)
                for c, a in enumerate(load["addr"]):
                    g.addrs[f"{load['tensor']}#{c}"], g.sizes[f"{load['tensor']}#{c}"] = a, load["size"]
            for store in d["stores"]:
                g.outputs.append(store["tensor"])
                g.own[store["tensor"]] = _ranges(store)
            for w in d["weights"]:
                g.weights.append(w["tensor"])
                g.addrs[f"{w['tensor']}#0"], g.sizes[f"{w['tensor']}#0"] = w["addr"], w["size"]
            for p in g.ops:
                name = graph.ops[p].name
                info = infos[name]
                g.ranges[name] = _ranges(info)
                for c, a in enumerate(info["out_addr"]):
                    g.addrs[f"{name}#{c}"], g.sizes[f"{name}#{c}"] = a, info["out_size"]
                if info["buffer_size"]:
                    g.addrs[f"{name}#buf"], g.sizes[f"{name}#buf"] = info["buffer_addr"], info["buffer_size"]
        else:
            node = graph.ops[g.ops[0]]
            g.inputs = list(dict.fromkeys(graph.data_inputs(node)))
            g.outputs = [o for o in node.outputs if o in graph.tensors]
            g.weights = list(dict.fromkeys(graph.weights_of(node)))
        groups.append(g)
    return groups
