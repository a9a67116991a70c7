"""ONNX backend node tests through frontend + canonicalize + TOP inference.

Every case whose op types are all supported (a converter is registered, or the
node is constant-folded: Constant, Shape, Size, or inputs that are all
constants) is converted with its input shapes taken from the test data, run
through canonicalize and TOP inference, and compared with the expected outputs
(np.allclose rtol 1e-4, atol 1e-5; integers and booleans exactly).

Suites:
  node               the generated node test cases. The onnx 1.23 wheel ships only their
                     generators, so they are regenerated deterministically (numpy seeded, as
                     `onnx/backend/test/cmd_tools.py generate-data` writes them) into
                     build/onnx-node-cases/onnx-<version>/ on first use.
  pytorch-converted  and pytorch-operator: the data folders the wheel does ship.

Graph inputs that the compiler needs at compile time (Resize scales, TopK's K, Slice
starts, ...) are test inputs in many node cases; such an input is frozen to its
test value as an initializer (what a user's model has, or a manifest gives), and the
case is counted as such. A case whose non-tensor types (sequences, optionals, maps)
the compiler cannot express is counted as unsupported.

Usage: PYTHONPATH=. python bench/onnx_node_tests.py [--suite node] [--filter REGEX] [--limit N] [-v]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
# bench/iree.py would shadow the `iree` package (the IREE column) were this folder first on the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
CACHE = ROOT / "build" / "onnx-node-cases"
WHEEL_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
SUITES = ("node", "pytorch-converted", "pytorch-operator")
SEED = 0
RTOL, ATOL = 1e-4, 1e-5
FOLDED = {"Constant", "Shape", "Size"}  # evaluated at compile time whatever their inputs
FROZEN_RE = re.compile(r"tensor '([^']*)'\) must be known at compile time")


# ---- the node cases, regenerated ------------------------------------------------


def _write_tensor(path: Path, value, name: str) -> None:
    proto = value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(np.asarray(value), name)
    path.write_bytes(proto.SerializeToString())


def _write_case(case, out: Path) -> None:
    """One case as cmd_tools writes it: model.onnx and test_data_set_*/{input,output}_*.pb (tensors only)."""
    out.mkdir(parents=True)
    (out / "model.onnx").write_bytes(case.model.SerializeToString())
    graph = case.model.graph
    tensor_io = all(v.type.HasField("tensor_type") for v in list(graph.input) + list(graph.output))
    (out / "meta.json").write_text(json.dumps({"tensor_io": tensor_io}, sort_keys=True))
    if not tensor_io:
        return  # sequence/optional/map data: the compiler has no such types; no data written
    for i, (inputs, outputs) in enumerate(case.data_sets):
        data_dir = out / f"test_data_set_{i}"
        data_dir.mkdir()
        for j, value in enumerate(inputs):
            _write_tensor(data_dir / f"input_{j}.pb", value, graph.input[j].name)
        for j, value in enumerate(outputs):
            _write_tensor(data_dir / f"output_{j}.pb", value, graph.output[j].name)


def node_cases_dir() -> Path:
    """The regenerated node cases, written once per onnx version (atomically: a temp dir renamed)."""
    target = CACHE / f"onnx-{onnx.__version__}-seed{SEED}"
    if (target / "COMPLETE").exists():
        return target
    import warnings

    from onnx.backend.test.case import node as node_cases

    np.random.seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow casts on purpose
        cases = node_cases.collect_testcases()
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=CACHE))
    for case in cases:
        _write_case(case, tmp / case.name)
    (tmp / "COMPLETE").write_text(f"{len(cases)} cases, onnx {onnx.__version__}, numpy seed {SEED}\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


# ---- cases ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    suite: str
    name: str
    path: Path

    @property
    def model(self) -> onnx.ModelProto:
        return onnx.load(os.fspath(self.path / "model.onnx"))

    @property
    def meta(self) -> dict:
        meta = self.path / "meta.json"
        return json.loads(meta.read_text()) if meta.exists() else {}

    def data_sets(self) -> Iterator[tuple[list[onnx.TensorProto], list[np.ndarray]]]:
        for d in sorted(self.path.glob("test_data_set_*")):
            ins = [_load_tensor(p) for p in sorted(d.glob("input_*.pb"), key=_index)]
            outs = [numpy_helper.to_array(_load_tensor(p)) for p in sorted(d.glob("output_*.pb"), key=_index)]
            yield ins, outs


def _index(p: Path) -> int:
    return int(p.stem.rsplit("_", 1)[1])


def _load_tensor(path: Path) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return t


def _op_key(model: onnx.ModelProto) -> str:
    ops = list(dict.fromkeys(n.op_type for n in model.graph.node if n.op_type != "Constant"))
    return "+".join(ops) or "Constant"


def op_key(case: Case, model: onnx.ModelProto) -> str:
    """What the report groups a case under: its op type; a function's expansion under the function's op."""
    if "_expanded" in case.name:
        base = case.path.parent / case.name.split("_expanded")[0]
        if (base / "model.onnx").exists():
            return f"{_op_key(onnx.load(os.fspath(base / 'model.onnx')))} (expanded)"
    return _op_key(model)


def suite_dir(suite: str) -> Path:
    return node_cases_dir() if suite == "node" else WHEEL_DATA / suite


def list_cases(suite: str, pattern: str | None = None) -> list[Case]:
    root = suite_dir(suite)
    rx = re.compile(pattern) if pattern else None
    return [
        Case(suite, d.name, d)
        for d in sorted(root.iterdir())
        if d.is_dir() and (d / "model.onnx").exists() and (rx is None or rx.search(d.name))
    ]


def unsupported_reason(case: Case, model: onnx.ModelProto) -> str | None:
    """Why the case is outside what the frontend claims to support (None: it is in scope)."""
    from tpubuild.frontend import registry
    from tpubuild.frontend.onnx_graph import CONTROL_FLOW

    table = registry.supported()
    if not case.meta.get("tensor_io", True):
        return "non-tensor inputs/outputs (sequence/optional/map)"
    known = {t.name for t in model.graph.initializer}
    missing = []
    for node in model.graph.node:
        if node.op_type in CONTROL_FLOW and ("", node.op_type) not in table:  # refused whatever its inputs
            missing.append(node.op_type)
            continue
        static = all(i in known for i in node.input if i)
        if node.op_type in FOLDED or static or (node.domain in ("", "ai.onnx") and ("", node.op_type) in table):
            if static or node.op_type in FOLDED:
                known.update(node.output)
            continue
        missing.append(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}")
    return f"ops without a converter: {', '.join(sorted(set(missing)))}" if missing else None


# ---- running one case -----------------------------------------------------------------


@dataclasses.dataclass
class Result:
    case: Case
    op: str
    status: str  # pass, fail, unsupported
    reason: str = ""
    frozen: tuple[str, ...] = ()
    # the converted graphs and their data, kept for the IREE column: (module, weights, feeds, expected) per data set
    graphs: list = dataclasses.field(default_factory=list, repr=False)
    iree: str = ""  # through TOSA/IREE: pass, fail ("" not run)
    iree_reason: str = ""


def _freeze(model: onnx.ModelProto, name: str, value: onnx.TensorProto) -> None:
    """Make graph input ``name`` an initializer holding its test value."""
    init = onnx.TensorProto()
    init.CopyFrom(value)
    init.name = name
    model.graph.initializer.append(init)
    keep = [i for i in model.graph.input if i.name != name]
    del model.graph.input[:]
    model.graph.input.extend(keep)


def _shape_inputs(model: onnx.ModelProto, tensor: str, feeds: dict) -> list[str]:
    """The graph inputs to freeze so ``tensor`` is known at compile time: itself if it is one, else the
    integer inputs it is computed from (a target shape, say)."""
    if tensor in feeds:
        return [tensor]
    producer = {o: n for n in model.graph.node for o in n.output}
    seen, todo, found = set(), [tensor], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in feeds and feeds[name].data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            found.append(name)
        elif name in producer:
            todo.extend(i for i in producer[name].input if i)
    return sorted(found)


def _compare(got: np.ndarray, want: np.ndarray) -> str | None:
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    if want.dtype.kind in "biuUSO":
        if got.dtype.kind != want.dtype.kind:
            return f"dtype {got.dtype} != expected {want.dtype}"
        if not np.array_equal(got, want):
            return f"{int(np.sum(got != want))} of {want.size} values differ"
        return None
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != expected {want.dtype}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    if not np.allclose(g, w, rtol=RTOL, atol=ATOL, equal_nan=True):
        with np.errstate(invalid="ignore"):
            err = np.nanmax(np.abs(g - w)) if g.size else 0.0
        return f"values differ (max abs err {err:.3g})"
    return None


def _canonicalize():
    """tpubuild.top.canonicalize.canonicalize, or None while it does not exist."""
    try:
        from tpubuild.top.canonicalize import canonicalize
    except ImportError:
        return None
    return canonicalize


class _CaseFailed(Exception):
    """A case's failure (its reason), raised by run_case's steps."""


def run_case(case: Case) -> Result:
    model = case.model
    op = op_key(case, model)
    reason = unsupported_reason(case, model)
    if reason:
        return Result(case, op, "unsupported", reason)
    frozen: list[str] = []
    graphs: list = []  # for the IREE column: each data set's canonical graph, weights, inputs and expected outputs
    try:
        for ins, expected in case.data_sets():
            feeds = _feeds(model, ins)
            module, weights = _convert(case, feeds, frozen)
            module, weights, names, outs = _infer(case, module, weights, feeds)
            graphs.append((module, weights, {n: numpy_helper.to_array(t) for n, t in feeds.items()}, expected))
            _check_outputs(names, outs, expected)
    except _CaseFailed as e:
        return Result(case, op, "fail", str(e), tuple(frozen), graphs)
    return Result(case, op, "pass", frozen=tuple(frozen), graphs=graphs)


def _feeds(model, ins) -> dict:
    """The data set's input tensors by the model's (non-initializer) input names."""
    inits = {t.name for t in model.graph.initializer}
    real = [i.name for i in model.graph.input if i.name not in inits]
    feeds = {}
    for j, tensor in enumerate(ins):
        name = tensor.name if tensor.name in real else real[j]
        feeds[name] = tensor
    return feeds


def _convert(case: Case, feeds: dict, frozen: list[str]):
    """The case's model through the frontend; inputs the frontend needs as constants (shapes) are frozen into
    the model (taken out of ``feeds``, named in ``frozen``) and the conversion retried."""
    from tpubuild.errors import TpuBuildError
    from tpubuild.frontend.onnx_graph import OnnxConverter

    model = case.model
    for _ in range(len(feeds) + 1):
        shapes = {n: list(t.dims) for n, t in feeds.items()}
        try:
            converter = OnnxConverter(model, shapes, file=f"{case.name}/model.onnx")
            return converter.convert(case.name, f"{case.name}_weights.npz")
        except TpuBuildError as e:
            m = FROZEN_RE.search(str(e))
            names = _shape_inputs(model, m.group(1), feeds) if m else []
            if not names:
                raise _CaseFailed(f"frontend: {e.problem}") from None
            for name in names:
                frozen.append(name)
                _freeze(model, name, feeds.pop(name))
        except Exception as e:  # e.g. an element type the IR lacks; this case's failure, not the bench's
            raise _CaseFailed(f"frontend: {type(e).__name__}: {e}") from None
    raise _CaseFailed("frontend: every input frozen, and the conversion still fails")


def _infer(case: Case, module, weights, feeds: dict):
    """Canonicalized (when the pass exists), printed, parsed and run: the module, its weights, the output names
    and every output."""
    from tpubuild.errors import TpuBuildError
    from tpubuild.ir import mlir
    from tpubuild.top.inference import run

    canonicalize = _canonicalize()
    try:
        if canonicalize is not None:
            module, weights = canonicalize(module, weights, f"{case.name}_canonical_weights.npz")
        module = mlir.parse_module(mlir.print_module(module))
        outs = run(module, weights, {n: numpy_helper.to_array(t) for n, t in feeds.items()}, all_tensors=False)
    except TpuBuildError as e:
        raise _CaseFailed(f"canonicalize/inference: {e.problem}") from None
    except Exception as e:  # a kernel bug must not stop the bench; it is this case's failure
        raise _CaseFailed(f"{type(e).__name__}: {e}") from None
    return module, weights, mlir.output_names(module), outs


def _check_outputs(names, outs, expected) -> None:
    if len(names) != len(expected):
        raise _CaseFailed(f"{len(names)} outputs, expected {len(expected)}")
    for j, (name, want) in enumerate(zip(names, expected, strict=True)):
        problem = _compare(np.asarray(outs[name]), want)
        if problem:
            raise _CaseFailed(f"output {j} ({name}): {problem}")


# ---- the same cases through TOSA and IREE ----------------------------------------------------------------

# functions per iree-compile: one compile of many small cases instead of one each (a compile failure splits the
# batch in halves until the failing case is alone)
IREE_BATCH = 64


def run_iree(results: Sequence[Result], work: Path) -> None:
    """Each supported case's graphs exported to TOSA, compiled by IREE (llvm-cpu) and run on the case's inputs,
    against the expected outputs as TOP's are; sets ``r.iree`` and ``r.iree_reason``."""
    from tpubuild.errors import TpuBuildError
    from tpubuild.export.tosa import translate

    functions = []  # (name, result, exported, feeds, expected)
    for i, r in enumerate(results):
        if r.status == "unsupported" or not r.graphs:
            if r.status != "unsupported":
                r.iree, r.iree_reason = "fail", f"not converted: {r.reason}"
            continue
        r.iree = "pass"
        for j, (module, weights, feeds, expected) in enumerate(r.graphs):
            name = f"c{i}_{j}"
            try:
                exported = translate(module, weights, r.case.name, key_prefix=f"{name}_")
            except (TpuBuildError, NotImplementedError) as e:
                r.iree, r.iree_reason = "fail", f"export: {getattr(e, 'problem', e)}"
                break
            functions.append((name, r, exported, feeds, expected))
    functions = [f for f in functions if f[1].iree == "pass"]
    for at in range(0, len(functions), IREE_BATCH):
        _iree_batch(functions[at : at + IREE_BATCH], work)


def _iree_batch(batch: list, work: Path) -> None:
    import subprocess

    from tpubuild.build.cpu import COMPILE_FLAGS, Vmfb, iree_tool
    from tpubuild.export.tosa import carried, write_functions

    if not batch:
        return
    src, vmfb = work / "batch.mlir", work / "batch.vmfb"
    with open(src, "wb") as fh:
        write_functions(fh, [(name, exported) for name, _, exported, _, _ in batch], "onnx-node-tests")
    done = subprocess.run([iree_tool("iree-compile"), *COMPILE_FLAGS, str(src), "-o", str(vmfb)], capture_output=True)
    if done.returncode != 0:
        if len(batch) == 1:
            errors = [ln for ln in done.stderr.decode(errors="replace").splitlines() if "error" in ln]
            batch[0][1].iree, batch[0][1].iree_reason = "fail", f"iree-compile: {(errors or ['?'])[0][:200]}"
            return
        half = len(batch) // 2
        _iree_batch(batch[:half], work)
        _iree_batch(batch[half:], work)
        return
    module = Vmfb(str(vmfb), function=batch[0][0])
    for name, r, exported, feeds, expected in batch:
        if r.iree != "pass":
            continue
        try:
            fn = module.context.modules.module[name]
            names = json.loads(exported.reflection["tpubuild.inputs"])
            # IREE computes f64 in f32 (its default demotion): inputs given so, outputs compared as such
            # unsigned integers as the signed ones of the same bits (the export's integers are signless)
            args = [
                np.asarray(feeds[n], np.float32 if feeds[n].dtype == np.float64 else None, order="C") for n in names
            ]
            # 2/4-bit types as their bytes (the export carries them so: tosa.CARRIED)
            args = [carried(a) for a in args]
            outs = fn(*[a.view(a.dtype.str.replace("u", "i")) if a.dtype.kind == "u" else a for a in args])
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            got = [np.asarray(o.to_host() if hasattr(o, "to_host") else o) for o in outs]
        except Exception as e:  # a runtime error is this case's failure, not the bench's
            r.iree, r.iree_reason = "fail", f"run: {type(e).__name__}: {str(e)[:200]}"
            continue
        if len(got) != len(expected):
            r.iree, r.iree_reason = "fail", f"{len(got)} outputs, expected {len(expected)}"
            continue
        for j, (g, want) in enumerate(zip(got, expected, strict=True)):
            g = _as_returned(g, want)
            problem = _compare(g.astype(want.dtype) if g.dtype == np.float32 and want.dtype == np.float64 else g, want)
            if problem:
                r.iree, r.iree_reason = "fail", f"output {j}: {problem}{_beyond_float32(feeds, want)}"
                break


def _beyond_float32(feeds: dict, want: np.ndarray) -> str:
    """Why a float64 case cannot match through TOSA, which computes float64 in float32: its values overflow
    or underflow float32 (pytorch-operator's Add cases hold uninitialised memory: 1e199, 6.9e-310)."""
    tiny, big = np.finfo(np.float32).smallest_subnormal, np.finfo(np.float32).max
    for a in [*feeds.values(), want]:
        mag = np.abs(a[np.isfinite(a)]) if a.dtype == np.float64 else np.zeros(0)
        if mag.size and (mag.max() > big or ((mag > 0) & (mag < tiny)).any()):
            return " (float64 values beyond float32's range, in which TOSA computes float64)"
    return ""


def _as_returned(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """An IREE result as the export means it: a rank-0 result (the runtime hands it back as one element), an
    unsigned one (signless in the export), a 2/4-bit one (carried as its bytes) in the expected type."""
    from tpubuild.export.tosa import CARRIED

    if want.ndim == 0 and got.shape == (1,):
        got = got.reshape(())
    if want.dtype.kind == "u" and got.dtype.kind == "i" and got.dtype.itemsize == want.dtype.itemsize:
        got = got.view(want.dtype)
    if want.dtype in CARRIED and got.dtype == np.int8:
        got = got.view(want.dtype)
    return got


# ---- report ---------------------------------------------------------------------------


def report(suite: str, results: Sequence[Result], seconds: float, verbose: bool) -> None:
    by_op: dict[str, list[Result]] = collections.defaultdict(list)
    for r in results:
        by_op[r.op].append(r)
    print(f"\n=== {suite}: {len(results)} cases ({seconds:.1f} s) ===")
    iree = any(r.iree for r in results)
    print(f"{'op type':40s} {'pass':>5s} {'fail':>5s} {'unsup':>6s}" + (f" {'IREE pass':>9s}" if iree else ""))
    for op in sorted(by_op):
        rs = by_op[op]
        n = collections.Counter(r.status for r in rs)
        if n["pass"] + n["fail"] == 0 and not verbose:
            continue
        through = f" {sum(r.iree == 'pass' for r in rs):9d}" if iree else ""
        print(f"{op:40s} {n['pass']:5d} {n['fail']:5d} {n['unsupported']:6d}{through}")
    fails = [r for r in results if r.status == "fail"]
    if fails:
        print(f"\n--- {suite}: failures ---")
        for r in fails:
            print(f"FAIL {r.case.name} [{r.op}]: {r.reason}")
    iree_fails = [r for r in results if r.iree == "fail"]
    if iree_fails:
        print(f"\n--- {suite}: failures through TOSA/IREE ---")
        for r in iree_fails:
            print(f"IREE FAIL {r.case.name} [{r.op}]: {r.iree_reason}")
    if verbose:
        unsup = collections.Counter(r.reason for r in results if r.status == "unsupported")
        print(f"\n--- {suite}: unsupported, by reason ---")
        for reason, count in unsup.most_common():
            print(f"{count:5d}  {reason}")
    supported = [r for r in results if r.status != "unsupported"]
    passed = sum(r.status == "pass" for r in supported)
    frozen = sum(bool(r.frozen) for r in supported)
    rate = 100.0 * passed / len(supported) if supported else 0.0
    print(
        f"\n{suite}: {len(supported)} of {len(results)} cases supported; {passed} pass, "
        f"{len(supported) - passed} fail: pass rate {rate:.1f}% "
        f"({frozen} with graph inputs frozen to constants)"
    )
    if iree:
        through = sum(r.iree == "pass" for r in supported)
        print(
            f"{suite}: through TOSA/IREE: {through} pass of the {len(supported)} supported cases: pass rate "
            f"{100.0 * through / max(len(supported), 1):.1f}% (TOP: {rate:.1f}%)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", choices=SUITES, help="suite(s) to run (default: all)")
    ap.add_argument("--filter", help="regex on case names")
    ap.add_argument("--limit", type=int, help="at most N cases per suite")
    ap.add_argument("-v", "--verbose", action="store_true", help="also list unsupported op types and reasons")
    ap.add_argument("--iree", action="store_true", help="also export each case to TOSA and run it with IREE")
    args = ap.parse_args(argv)
    totals = []
    for suite in args.suite or SUITES:
        cases = list_cases(suite, args.filter)[: args.limit]
        start = time.perf_counter()
        results = [run_case(c) for c in cases]
        if args.iree:
            with tempfile.TemporaryDirectory(prefix="tpubuild-node-iree-") as tmp:
                run_iree(results, Path(tmp))
        report(suite, results, time.perf_counter() - start, args.verbose)
        supported = [r for r in results if r.status != "unsupported"]
        through = sum(r.iree == "pass" for r in supported)
        totals.append((suite, len(supported), sum(r.status == "pass" for r in supported), through))
    print("\n=== summary ===")
    for suite, n, passed, through in totals:
        line = f"{suite:20s} {passed:5d} / {n:5d} supported cases pass ({100.0 * passed / max(n, 1):.1f}%)"
        if args.iree:
            line += f"; through TOSA/IREE {through:5d} ({100.0 * through / max(n, 1):.1f}%)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
