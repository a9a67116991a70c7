"""The `cpu` target's stages: TOP exported to TOSA, compiled by IREE for the local CPU, run and verified.

    canonical.mlir --export--> cpu-<mode>/tosa.mlir --iree_compile--> cpu-<mode>/<model>.vmfb
        --iree_run (test input)--> iree_outs.npz --verify_iree (vs TOP's outputs)--> verify.json --> report.html

IREE (PyPI wheels iree-base-compiler and iree-base-runtime, the `iree` extra) is an independent compiler: its
outputs matching TOP inference check our TOP graph's semantics, and the .vmfb is a CPU build of the same graph.
Each function is a stage: files in, files out (written atomically), imported lazily by the task graph.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tpubuild.errors import TpuBuildError

CPU = "cpu"  # the chip name of the IREE CPU target in manifests
CPU_MODES = ("F32", "F16")

# llvm-cpu for the local machine (the vmfb runs where it is built; the task config names the CPU, so an artifact
# cache shared between machines never hands one CPU's build to another)
COMPILE_FLAGS = (
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
)
# F16: IREE demotes every f32 op and value (the signature too) before its optimizations
MODE_FLAGS = {"F32": (), "F16": ("--iree-input-demote-f32-to-f16",)}

_MISSING = "pip install 'tpubuild[iree]' (the iree-base-compiler and iree-base-runtime wheels)"


@functools.cache
def host_cpu() -> str:
    """What the vmfb is compiled for: the machine and CPU model (part of the compile task's config)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{os.uname().machine} {model}".strip()


def check_mode(mode: str) -> None:
    if mode not in CPU_MODES:
        raise TpuBuildError(
            f"the cpu target (IREE) does not support mode {mode}; it supports {', '.join(CPU_MODES)}",
            hint="use {chip: cpu, mode: F32} or {chip: cpu, mode: F16}",
        )


def iree_tool(name: str) -> str:
    """The path of an IREE command-line tool from the installed wheel."""
    try:
        from iree.compiler.tools.binaries import find_tool
    except ImportError:
        raise TpuBuildError(f"IREE's compiler is not installed (needed for {name})", hint=_MISSING) from None
    return find_tool(name)


def export(model: str, in_mlir: str, out_mlir: str, mode: str = "F32") -> None:
    """canonical.mlir -> tosa.mlir (tosa + linalg/arith/math/tensor, weights inline). F16's weights are dense
    hex, not resource blobs: IREE's f32 -> f16 demotion rewrites only the former."""
    from tpubuild.export.tosa import export_file

    check_mode(mode)
    export_file(in_mlir, out_mlir, model, resources=mode == "F32")


def compile_vmfb(in_mlir: str, out_vmfb: str, mode: str = "F32", model: str | None = None) -> float:
    """iree-compile for the local CPU; the seconds it took. A failure names the model and IREE's first errors."""
    from tpubuild.build.files import all_or_nothing

    check_mode(mode)
    tool = iree_tool("iree-compile")
    with all_or_nothing(out_vmfb) as (tmp,):
        start = time.perf_counter()
        result = subprocess.run(
            [tool, *COMPILE_FLAGS, *MODE_FLAGS[mode], in_mlir, "-o", str(tmp)], capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            raise TpuBuildError(
                "iree-compile failed:\n" + "\n".join(result.stderr.strip().splitlines()[:20]),
                model=model,
                file=in_mlir,
                hint="the export should always compile: report the op named in the error (its loc)",
            )
    return seconds


def iree_compile(model: str, in_mlir: str, mode: str, out_vmfb: str) -> None:
    """tosa.mlir -> <model>.vmfb (llvm-cpu, this machine's CPU)."""
    seconds = compile_vmfb(in_mlir, out_vmfb, mode, model)
    print(f"{model}: iree-compile {seconds:.2f} s, {Path(out_vmfb).stat().st_size} bytes")


_FLOATS = {"f16": "float16", "f32": "float32"}


def _signless(a):
    """An unsigned array as the signed one of the same bits: the export's integers are signless (IREE's ABI
    checks the element type); 2/4-bit types as their bytes, as the export carries them."""
    from tpubuild.export.tosa import carried

    a = carried(a)
    return a.view(a.dtype.str.replace("u", "i")) if a.dtype.kind == "u" else a


class Vmfb:
    """A loaded .vmfb: ``run(inputs by name) -> outputs by name`` (names from the export's reflection)."""

    def __init__(self, path: str, driver: str = "local-sync", function: str = "main"):
        try:
            import iree.runtime as rt
        except ImportError:
            raise TpuBuildError("IREE's runtime is not installed", file=path, hint=_MISSING) from None
        config = rt.Config(driver)
        try:
            # copied, not mapped: a vmfb rewritten in place (a rebuild, a bench's next batch) under a mapping
            # is a bus error at the next access
            module = rt.VmModule.copy_buffer(config.vm_instance, Path(path).read_bytes())
        except (RuntimeError, ValueError, OSError) as err:
            raise TpuBuildError(f"not a loadable IREE module ({err})", file=path) from None
        self.context = rt.SystemContext(config=config, vm_modules=[module])
        found = module.lookup_function(function)
        if found is None:
            raise TpuBuildError(f"the module has no @{function}", file=path)
        reflection = found.reflection
        self.model = reflection.get("tpubuild.model", Path(path).stem)
        self.inputs: list[str] = json.loads(reflection.get("tpubuild.inputs", "[]"))
        self.outputs: list[str] = json.loads(reflection.get("tpubuild.outputs", "[]"))
        self.main = self.context.modules.module[function]
        self.path = path
        # each argument's element type as compiled (an F16 build takes f16 inputs)
        declaration = reflection.get("iree.abi.declaration", "")
        self.arg_types = re.findall(r"%input\d+: tensor<(?:[0-9?]+x)*(\w+)>", declaration)

    def arguments(self, inputs: Mapping) -> list:
        import numpy as np

        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise TpuBuildError(
                f"no data for inputs {missing} (given: {sorted(inputs)})",
                file=self.path,
                hint="the input npz must hold one array per model input, named as the input",
            )
        arrays = [inputs[n] for n in self.inputs] if self.inputs else list(inputs.values())
        # as compiled: IREE demotes f64 to f32 (and an F16 build takes f16)
        return [
            _signless(
                np.asarray(a, _FLOATS[t] if t in _FLOATS and np.asarray(a).dtype.kind == "f" else None, order="C")
            )
            for a, t in itertools.zip_longest(arrays, self.arg_types[: len(arrays)])
        ]

    def run(self, inputs: Mapping) -> dict:
        import numpy as np

        results = self.main(*self.arguments(inputs))
        results = results if isinstance(results, (list, tuple)) else [results]
        arrays = [np.asarray(r.to_host() if hasattr(r, "to_host") else r) for r in results]
        names = self.outputs if len(self.outputs) == len(arrays) else [f"output_{i}" for i in range(len(arrays))]
        return dict(zip(names, arrays, strict=False))


def iree_run(vmfb: str, input_npz: str, out_outs: str) -> None:
    """The vmfb on the test input -> its outputs by name."""
    from tpubuild.build.files import read_npz, write_npz

    write_npz(out_outs, Vmfb(vmfb).run(read_npz(input_npz)))


def verify_iree(
    model: str,
    target: str,
    mode: str,
    vmfb: str,
    iree_outs: str,
    top_outs: str,
    top_mlir: str,
    verify_top_json: str,
    tolerance: Mapping[str, float],
    out_json: str,
) -> None:
    """IREE's outputs vs TOP inference's -> verify.json with the levels ONNX vs Top and Top vs IREE.

    The graph outputs decide, each at ``tolerance`` (F32: near-exact, two float32 compilers of one graph).
    Fails (publishing nothing, keeping the comparison for the reports) otherwise.
    """
    import numpy as np

    from tpubuild.build.files import read_npz, write_text
    from tpubuild.build.stages import _forget_failure, _keep_failure, _tolerance, _top_outputs
    from tpubuild.verify.compare import compare_tensors, format_row, jsonable
    from tpubuild.verify.similarity import FLOAT32_ATOL

    got = {k: np.asarray(v, np.float32) if v.dtype == np.float16 else v for k, v in read_npz(iree_outs).items()}
    ref = read_npz(top_outs)
    names = _top_outputs(top_mlir)
    tol = _tolerance(tolerance, atol=FLOAT32_ATOL)
    report = compare_tensors(got, {n: ref[n] for n in names if n in ref}, tol, test_outputs=names, ref_outputs=names)
    level = {"level": "iree", "test": f"{target}/{Path(vmfb).name}", "ref": Path(top_outs).name, **report}
    if not report["passed"] or report["compared"] != len(names):
        _keep_failure(out_json, {"model": model, "stage": "verify_iree", "target": target, "comparisons": [level]})
        rows = "\n".join(f"  {format_row(row)}" for row in report["tensors"] if not row["passed"])
        raise TpuBuildError(
            f"IREE's outputs ({target}) do not match TOP inference "
            f"({report['compared']} of {len(names)} outputs compared):\n{rows}",
            model=model,
            stage="verify_iree",
            hint=f"to inspect: tpubuild run {vmfb} --input <input.npz> --output iree.npz && "
            f"tpubuild compare iree.npz {top_outs}",
        )
    _forget_failure(out_json)
    levels = json.loads(Path(verify_top_json).read_text(encoding="utf-8"))["comparisons"] + [level]
    doc = {
        "model": model,
        "stage": "verify_iree",
        "target": target,
        "mode": mode,
        "levels": ["onnx", "top", "iree"],
        "comparisons": levels,
        "passed": all(c["passed"] for c in levels),
    }
    write_text(out_json, json.dumps(jsonable(doc), indent=1, sort_keys=True) + "\n")


def write_report(model: str, target: str, verify_json: str, vmfb: str, graphs: Sequence[str], out_html: str) -> None:
    """The cpu target's report.html: its verification levels and the vmfb's size."""
    from tpubuild.verify import report

    report.write_cpu_report(model, target, verify_json, vmfb, graphs, out_html)
