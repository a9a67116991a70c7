"""tpubuild vs TPU-MLIR (tpu-mlir==1.30.2): compile time of the INT8 flow and of the whole target matrix, INT8 accuracy.

    python bench/vs_tpumlir.py [--models demo_cnn,ppocr_mobile_v2_cls,ppocrv4_rec,mini_yolo] [--no-matrix]
                               [--venv .anchors/tpumlir-venv] [--jobs N] [--work DIR] [--keep]
                               [--save-theirs FIGURES.json | --theirs-from FIGURES.json]

TPU-MLIR runs from its own venv (../shared/anchors/tpumlir-setup.sh installs it
into .anchors/tpumlir-venv; without it this script says so and exits 0). For each
model, on the same ONNX file, test input and calibration samples:

- TPU-MLIR: ``model_transform`` (with --test_input: onnxruntime vs its TOP
  inference), ``run_calibration`` (its defaults: KL thresholds plus its auto-tune
  on 5 samples) and ``model_deploy --quantize INT8 --chip bm1684x`` (with
  --test_input/--test_reference: TPU inference vs TOP on the graph outputs, layer
  group, codegen to a .bmodel, model_runner on the bm1684x cmodel, bmodel vs TPU);
  each a process, in a fresh folder;
- tpubuild: one ``doit -n N report:<model>/bm1684x-INT8`` (N: --jobs, default
  the machine's cores, as TPU-MLIR's tools use them) in a fresh build folder with
  the artifact cache off (TPUBUILD_ARTIFACT_CACHE=off): fetch, transform,
  onnxruntime reference, canonicalize, TOP verification (origin and canonical vs
  onnxruntime, every tensor), calibration (the manifest's method), the
  mixed-precision search where the manifest asks for one (ppocrv4_rec), lowering,
  TPU verification (every tensor), layer group, memory assign, codegen, the chip
  simulator and its cycle model, the chip-vs-TPU check (bit-exact for INT8), and
  report.html with its charts.

So each side verifies its own flow at every level it has; ours compares every
tensor at each level and draws a report, theirs compares the graph outputs of
TPU inference and of the bmodel (plus every tensor at transform). Calibration
data: the samples our calibration reads (the manifest's, never the test input),
preprocessed by tpubuild (tpubuild.calib.data) and
given to TPU-MLIR as one .npz per sample, so both read identical tensors (the
preprocessing is not in TPU-MLIR's time; TPU-MLIR reads the .npz files as they
are). TPU-MLIR's pinned onnx 1.14 refuses ONNX IR versions above 9, so it gets a
copy with ``ir_version = 9``, and pools without a ``strides`` attribute get
ONNX's default (1) written out: TPU-MLIR 1.30.2 takes a missing stride as the
kernel size (mini_yolo's SPPF pools). The same model either way.

Prints per model:

1. wall time of the whole INT8 flow, each side, and ours/theirs (goal <= 0.25x);
   CPU time (the processes and their children) beside it: the machine is shared,
   CPU time is the steadier figure. When model_deploy's own check refuses its
   INT8 outputs (TPU inference vs TOP below 0.90/0.80: PP-OCRv4 rec with its
   default KL table), it stops before the bmodel; the script says so and deploys
   again with a tolerance nothing fails, and times that complete run;
2. INT8 output cosine against the float model run by onnxruntime on the test
   input: ours from TPU inference (the simulated chip reproduces it bit for bit,
   which verify_chip checks), theirs from model_runner on the .bmodel (the bm1684x
   cmodel; model_deploy runs it on the same input, then deletes its outputs, so
   this script runs it again, untimed) and on its final tpu.mlir (the addressed
   one; model_deploy deletes the first tpu.mlir's weights); the lowest cosine
   over the graph outputs, paired by position (goal: ours >= theirs);
3. the whole chip x mode matrix of the manifest: theirs one transform, one
   calibration (when an INT8 target exists) and one model_deploy per target;
   ours ``doit -n N compile:<model>`` (every target, the shared stages built once).
   Theirs continues from the INT8 flow of (1) (its transform, calibration and
   deploy are matrix work as they are) with a deploy per other target; ours is
   one more doit run, in another fresh build folder (artifact cache still off).
   Total wall time and ours/theirs (goal <= 0.15x).

Ratios are measured in this run, one side right after the other (each timed
command starts after os.sync(): the files of the one before are on disk). Run it alone
on the machine if you can (it takes minutes per model: TPU-MLIR's tools start
slowly, and ppocrv4_rec's INT8 target runs the search).

While working on our side only, ``--save-theirs FILE`` keeps TPU-MLIR's figures of
a run and ``--theirs-from FILE`` takes them from there instead of running its
tools again (its times are steady run to run); the ratios then compare this run
of ours with that earlier run of theirs, and the output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402  (after sys.path: the repo before an installed copy)

FLOW_GOAL, MATRIX_GOAL = 0.25, 0.15
DEFAULT_MODELS = "demo_cnn,ppocr_mobile_v2_cls,ppocrv4_rec,mini_yolo"
CHIP, MODE = "bm1684x", "INT8"
POOLS = ("MaxPool", "AveragePool", "LpPool")
NO_TOLERANCE = "0,-1e9"  # cos, euc bounds that pass anything above cos 0 (a leading "-" would read as an option)


@dataclass
class Timing:
    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: Timing) -> Timing:
        return Timing(self.wall + other.wall, self.cpu + other.cpu)


@dataclass
class Side:
    """One tool's figures for one model."""

    flow: Timing = field(default_factory=Timing)
    steps: dict[str, Timing] = field(default_factory=dict)
    matrix: Timing = field(default_factory=Timing)
    failed: list[str] = field(default_factory=list)
    done: bool = False  # the INT8 flow ran to its end
    cos: float | None = None
    cos_tpu: float | None = None  # theirs: tpu.mlir


def run(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[Timing, bool]:
    """``cmd`` with its output appended to ``log``: wall and CPU seconds (this child and its own children)."""
    # the previous command's files go to disk first: the kernel would write them back during this one, on the
    # same two cores (either side's, after the other's builds of hundreds of MB)
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(wall, cpu), proc.returncode == 0


def tail(log: Path, lines: int = 12) -> str:
    return "\n".join("    " + line for line in log.read_text(errors="replace").splitlines()[-lines:])


# ---- tpubuild -----------------------------------------------------------------------------------


def ours_env(manifest: Path, build_dir: Path) -> dict:
    return {
        **os.environ,
        "TPUBUILD_MANIFESTS": str(manifest),
        "TPUBUILD_BUILD_DIR": str(build_dir),
        "TPUBUILD_ARTIFACT_CACHE": "off",
        "TPUBUILD_PROGRESS": "off",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


JOBS = os.cpu_count() or 1  # doit's -n for our builds; --jobs


def doit(tasks: list[str], manifest: Path, build_dir: Path, log: Path) -> tuple[Timing, bool]:
    cmd = [sys.executable, "-m", "doit", "-n", str(JOBS), "-f", str(REPO / "dodo.py"), *tasks]
    return run(cmd, REPO, ours_env(manifest, build_dir), log)


def ours_outputs(paths, target_id: str) -> list[np.ndarray]:
    """TPU inference's real-valued graph outputs of the target, in graph order."""
    from tpubuild.build.files import read_npz
    from tpubuild.ir.mlir import load_module
    from tpubuild.top.inference import output_names

    tp = paths.target(target_id)
    values = read_npz(tp.tpu_outs)
    return [values[name] for name in output_names(load_module(tp.tpu_mlir))]


# ---- TPU-MLIR -----------------------------------------------------------------------------------


class TpuMlir:
    """TPU-MLIR's tools in its venv, run in one folder per model."""

    def __init__(self, venv: Path, work: Path, name: str, log: Path):
        self.venv, self.work, self.name, self.log = venv, work, name, log
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["VIRTUAL_ENV"] = str(venv)

    def tool(self, name: str, *args: str) -> tuple[Timing, bool]:
        return run([str(self.venv / "bin" / name), *args], self.work, self.env, self.log)

    def transform(self, shapes: list[list[int]]) -> tuple[Timing, bool]:
        return self.tool(
            "model_transform",
            "--model_name",
            self.name,
            "--model_def",
            f"{self.name}.onnx",
            "--input_shapes",
            str(shapes).replace(" ", ""),
            "--test_input",
            "input.npz",
            "--test_result",
            f"{self.name}_top_outputs.npz",
            "--mlir",
            f"{self.name}.mlir",
        )

    def calibrate(self, samples: int) -> tuple[Timing, bool]:
        return self.tool(
            "run_calibration",
            f"{self.name}.mlir",
            "--dataset",
            "cali",
            "--input_num",
            str(samples),
            "-o",
            f"{self.name}_cali_table",
        )

    def deploy(self, chip: str, mode: str, asymmetric: bool, tolerance: str | None = None) -> tuple[Timing, bool]:
        args = ([f"--tolerance={tolerance}"] if tolerance else []) + [
            "--mlir",
            f"{self.name}.mlir",
            "--quantize",
            mode,
            "--chip",
            chip,
            "--test_input",
            f"{self.name}_in_f32.npz",
            "--test_reference",
            f"{self.name}_top_outputs.npz",
            "--model",
            f"{self.name}_{chip}_{mode.lower()}{'_asym' if asymmetric else ''}.{model_suffix(chip)}",
        ]
        if mode == "INT8":
            args += ["--calibration_table", f"{self.name}_cali_table"] + (["--asymmetric"] if asymmetric else [])
        return self.tool("model_deploy", *args)

    def outputs(self, chip: str, kind: str) -> list[np.ndarray] | None:
        """The INT8 symmetric target's graph outputs on the test input by model_runner (not timed: model_deploy
        ran it too, then removed its files): kind "model" runs the .bmodel on the cmodel, "tpu" TPU inference of its
        final (addressed) tpu.mlir, whose weights model_deploy keeps."""
        model = (
            self.work / f"{self.name}_{chip}_int8.bmodel"
            if kind == "model"
            else self.work / f"{self.name}_{chip}_int8_sym_final.mlir"
        )
        if not model.is_file():
            return None
        out = self.work / f"bench_{kind}_outputs.npz"
        _, ok = self.tool(
            "model_runner", "--input", f"{self.name}_in_f32.npz", "--model", model.name, "--output", out.name
        )
        if not ok or not out.is_file():
            return None
        with np.load(out) as data:
            return [data[k] for k in data.files]


def model_suffix(chip: str) -> str:
    """model_deploy writes a cvimodel for the cv18xx chips, and its runner picks the format by this suffix."""
    return "cvimodel" if chip.startswith("cv18") else "bmodel"


def input_specs(m, paths) -> list[dict]:
    """The manifest's inputs as the build's stages complete them from the source model."""
    from tpubuild.build.inputs import of_source
    from tpubuild.build.tasks import source_file

    return of_source(m, source_file(m, paths))


def prepare_tpumlir(m, paths, work: Path) -> int:
    """The ONNX copy (IR version <= 9), the test input and one .npz per sample our calibration reads; the
    sample count (0 for a manifest without calibration data)."""
    import onnx

    from tpubuild.build.tasks import calibration_files, source_file
    from tpubuild.calib.data import Samples, split_test_sample

    model = onnx.load(str(source_file(m, paths)))
    model.ir_version = min(model.ir_version, 9)  # onnx 1.14 refuses newer IR versions; the graph is untouched
    for node in model.graph.node:
        # ONNX's default strides (1 per spatial axis) written out: TPU-MLIR's converter takes a pool's missing
        # strides as its kernel shape (mini_yolo's SPPF: 5x5 pools of stride 1 became stride 5, 4x4 -> 1x1,
        # and its own TOP inference then refuses the Concat); the same model
        if node.op_type in POOLS and not any(a.name == "strides" for a in node.attribute):
            kernel = next(a.ints for a in node.attribute if a.name == "kernel_shape")
            node.attribute.append(onnx.helper.make_attribute("strides", [1] * len(kernel)))
    onnx.save(model, str(work / f"{m.name}.onnx"))
    shutil.copyfile(paths.input_npz, work / "input.npz")
    cal = m.calibration
    cali = work / "cali"
    cali.mkdir()
    if cal is None:  # a float-only manifest: nothing to calibrate
        return 0
    from tpubuild.build.inputs import of_source

    specs = of_source(m, source_file(m, paths), model)
    count = 0
    # the samples our calibration reads: never the test input (tasks.calibration_files, calib/data.py)
    samples = Samples.of(calibration_files(m)[0], specs, cal.get("count"))
    for i, sample in enumerate(split_test_sample(samples)[0] if m.holds_back_test_sample else samples):
        np.savez(cali / f"{i:04d}.npz", **sample)
        count += 1
    return count


# ---- comparison ---------------------------------------------------------------------------------


def float_outputs(onnx_path: Path, input_npz: Path) -> list[np.ndarray]:
    import onnxruntime as ort

    from tpubuild.build.files import read_npz

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    inputs = read_npz(input_npz)
    return session.run(None, {a.name: inputs[a.name] for a in session.get_inputs()})


def lowest_cos(test: list[np.ndarray] | None, ref: list[np.ndarray]) -> float | None:
    """The lowest cosine over graph outputs paired by position (sizes must agree)."""
    from tpubuild.verify.similarity import cosine

    if test is None or len(test) != len(ref) or any(np.size(t) != np.size(r) for t, r in zip(test, ref, strict=True)):
        return None
    return min(cosine(np.ravel(t), np.ravel(r)) for t, r in zip(test, ref, strict=True))


def largest_error(test: list[np.ndarray] | None, ref: list[np.ndarray]) -> float | None:
    """The largest absolute error over the outputs, relative to the largest |float output| (where cosine
    saturates, as on a two-class softmax, this still tells the two apart)."""
    if lowest_cos(test, ref) is None:
        return None
    return max(
        float(np.max(np.abs(np.ravel(t).astype(np.float64) - np.ravel(r)))) / max(float(np.max(np.abs(r))), 1e-30)
        for t, r in zip(test, ref, strict=True)
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


# ---- one model ----------------------------------------------------------------------------------


def side_json(side: Side) -> dict:
    return dataclasses.asdict(side)


def side_of(doc: dict) -> Side:
    return Side(
        **{
            **doc,
            "flow": Timing(**doc["flow"]),
            "matrix": Timing(**doc["matrix"]),
            "steps": {k: Timing(**v) for k, v in doc["steps"].items()},
        }
    )


def bench_model(
    name: str, venv: Path, work: Path, matrix: bool, cached: Side | None = None
) -> tuple[Side, Side, list[str]]:
    """Both sides on one model; ``cached``: TPU-MLIR's figures of an earlier run, its tools not run."""
    from tpubuild.build.manifest import load_manifest
    from tpubuild.build.paths import ModelPaths
    from tpubuild.build.tasks import source_file

    manifest = REPO / "configs" / "models" / f"{name}.yaml"
    m = load_manifest(manifest)
    target = next(t for t in m.targets if t.chip == CHIP and t.mode == MODE and not t.asymmetric)
    build = work / "ours"
    paths = ModelPaths.of(build, m.name)
    log = work / "ours.log"
    ours, theirs = Side(), Side()
    print(f"== {m.name}: {len(m.targets)} targets ({', '.join(t.id for t in m.targets)})", flush=True)

    ours.flow, ok = doit([f"report:{m.name}/{target.id}"], manifest, build, log)
    print(
        f"  tpubuild  INT8 flow (doit report:{m.name}/{target.id})  {ours.flow.wall:7.1f} s wall "
        f"{ours.flow.cpu:7.1f} s CPU" + ("" if ok else "  FAILED:\n" + tail(log)),
        flush=True,
    )
    if not ok:
        ours.failed.append(target.id)
        return ours, theirs, []
    ours.done = True
    if cached is not None:
        return _ours_against(cached, m, paths, target, ours, manifest, work, log, matrix)

    tm_dir = work / "tpumlir"
    tm_dir.mkdir()
    samples = prepare_tpumlir(m, paths, tm_dir)
    tm = TpuMlir(venv, tm_dir, m.name, work / "tpumlir.log")
    steps = [("transform", lambda: tm.transform([spec["shape"] for spec in input_specs(m, paths)]))]
    if any(t.mode == "INT8" for t in m.targets):
        steps.append(("calibration", lambda: tm.calibrate(samples)))
    steps.append(("deploy", lambda: tm.deploy(CHIP, MODE, False)))
    for step, call in steps:
        logged = tm.log.stat().st_size if tm.log.exists() else 0
        theirs.steps[step], ok = call()
        if not ok and step == "deploy" and b"npz compare FAILED" in tm.log.read_bytes()[logged:]:
            # its own check refused its INT8 outputs (PP-OCRv4 rec with KL: cos 0.63 vs TOP): deploy again with
            # a tolerance nothing fails, to time the whole flow and measure what it would ship; the first,
            # stopped run is not counted
            theirs.failed.append(f"{target.id} (its own TPU-vs-TOP check failed)")
            print(
                f"  TPU-MLIR deploy stopped at its own check ({theirs.steps[step].wall:.1f} s); again with "
                f"--tolerance {NO_TOLERANCE}",
                flush=True,
            )
            theirs.steps[step], ok = tm.deploy(CHIP, MODE, False, NO_TOLERANCE)
        theirs.flow += theirs.steps[step]
        if not ok:
            print(f"  TPU-MLIR {step} FAILED:\n" + tail(tm.log), flush=True)
            theirs.failed.append(target.id)
            return ours, theirs, []
    theirs.done = True
    print(
        f"  TPU-MLIR  INT8 flow ({', '.join(f'{s} {t.wall:.1f}' for s, t in theirs.steps.items())})  "
        f"{theirs.flow.wall:7.1f} s wall {theirs.flow.cpu:7.1f} s CPU   ours/theirs "
        f"{ours.flow.wall / theirs.flow.wall:.3f}x wall, {ours.flow.cpu / theirs.flow.cpu:.3f}x CPU",
        flush=True,
    )

    ref = float_outputs(source_file(m, paths), paths.input_npz)
    ours_out, theirs_out = ours_outputs(paths, target.id), tm.outputs(CHIP, "model")
    ours.cos, theirs.cos = lowest_cos(ours_out, ref), lowest_cos(theirs_out, ref)
    theirs.cos_tpu = lowest_cos(tm.outputs(CHIP, "tpu"), ref)
    print(
        f"  INT8 output cosine vs onnxruntime float: ours {_cos(ours.cos)}, theirs {_cos(theirs.cos)} "
        f"(bmodel), {_cos(theirs.cos_tpu)} (final.mlir); largest |error| / largest |float output|: "
        f"ours {_num(largest_error(ours_out, ref))}, theirs {_num(largest_error(theirs_out, ref))}",
        flush=True,
    )

    others = [t for t in m.targets if t is not target]
    if not matrix:
        return ours, theirs, [target.id]
    ours.matrix, failed = _our_matrix(m, manifest, work, log)
    ours.failed += failed
    theirs.matrix = theirs.flow
    for t in others:
        spent, ok = tm.deploy(t.chip, t.mode, t.asymmetric)
        theirs.matrix += spent
        if not ok:
            theirs.failed.append(t.id)
    print(
        f"  matrix ({len(m.targets)} targets)  tpubuild {ours.matrix.wall:7.1f} s wall {ours.matrix.cpu:7.1f} s CPU"
        f"   TPU-MLIR {theirs.matrix.wall:7.1f} s wall {theirs.matrix.cpu:7.1f} s CPU   ours/theirs "
        f"{ours.matrix.wall / theirs.matrix.wall:.3f}x wall, {ours.matrix.cpu / theirs.matrix.cpu:.3f}x CPU"
        + (
            f"\n  failed targets: tpubuild {ours.failed or 'none'}, TPU-MLIR {theirs.failed or 'none'}"
            if ours.failed or theirs.failed
            else ""
        ),
        flush=True,
    )
    return ours, theirs, [t.id for t in m.targets]


def _our_matrix(m, manifest: Path, work: Path, log: Path):
    """One `doit compile:<model>` in a fresh folder: its time and the targets left without a verify.json."""
    from tpubuild.build.paths import ModelPaths

    build = work / "ours-matrix"
    spent, ok = doit([f"compile:{m.name}"], manifest, build, log)
    built = ModelPaths.of(build, m.name)
    return spent, [] if ok else [t.id for t in m.targets if not built.target(t.id).verify.is_file()]


def _ours_against(
    theirs: Side, m, paths, target, ours: Side, manifest: Path, work: Path, log: Path, matrix: bool
) -> tuple[Side, Side, list[str]]:
    """The rest of bench_model with TPU-MLIR's figures taken from an earlier run."""
    from tpubuild.build.tasks import source_file

    print(
        f"  TPU-MLIR  INT8 flow (an earlier run: {', '.join(f'{s} {t.wall:.1f}' for s, t in theirs.steps.items())})"
        f"  {theirs.flow.wall:7.1f} s wall {theirs.flow.cpu:7.1f} s CPU   ours/theirs "
        f"{ours.flow.wall / theirs.flow.wall:.3f}x wall, {ours.flow.cpu / theirs.flow.cpu:.3f}x CPU",
        flush=True,
    )
    ref = float_outputs(source_file(m, paths), paths.input_npz)
    ours.cos = lowest_cos(ours_outputs(paths, target.id), ref)
    print(
        f"  INT8 output cosine vs onnxruntime float: ours {_cos(ours.cos)}, theirs {_cos(theirs.cos)} "
        f"(bmodel, earlier run)",
        flush=True,
    )
    if not matrix or not theirs.matrix.wall:
        if matrix:
            print("  matrix: the earlier run of TPU-MLIR has none (it was run with --no-matrix)", flush=True)
        return ours, theirs, [target.id]
    ours.matrix, failed = _our_matrix(m, manifest, work, log)
    ours.failed += failed
    print(
        f"  matrix ({len(m.targets)} targets)  tpubuild {ours.matrix.wall:7.1f} s wall {ours.matrix.cpu:7.1f} s CPU"
        f"   TPU-MLIR (earlier run) {theirs.matrix.wall:7.1f} s wall {theirs.matrix.cpu:7.1f} s CPU   ours/theirs "
        f"{ours.matrix.wall / theirs.matrix.wall:.3f}x wall, {ours.matrix.cpu / theirs.matrix.cpu:.3f}x CPU"
        + (f"\n  failed targets: tpubuild {ours.failed}" if ours.failed else ""),
        flush=True,
    )
    return ours, theirs, [t.id for t in m.targets]


def _cos(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f} (1-cos {1 - value:.1e})"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{1 - value:.1e}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b > 0 else "-"


def print_table(rows: list[tuple[str, Side, Side, list[str]]], matrix: bool) -> None:
    print(
        f"\n{'model':<21}{'INT8 flow s: ours':>18}{'theirs':>8}{'ratio':>8}{'CPU ratio':>10}"
        f"{'1-cos ours':>11}{'theirs':>9}{'':>3}"
        + (f"{'matrix s: ours':>16}{'theirs':>8}{'ratio':>8}{'CPU ratio':>10}" if matrix else "")
    )
    for name, ours, theirs, _ in rows:
        if not (ours.done and theirs.done):
            print(f"{name:<21}  {'tpubuild' if not ours.done else 'TPU-MLIR'} failed (see above)")
            continue
        better = "" if ours.cos is None or theirs.cos is None else ">=" if ours.cos >= theirs.cos else "<"
        line = (
            f"{name:<21}{ours.flow.wall:>18.1f}{theirs.flow.wall:>8.1f}{_ratio(ours.flow.wall, theirs.flow.wall):>8}"
            f"{_ratio(ours.flow.cpu, theirs.flow.cpu):>10}{_loss(ours.cos):>11}{_loss(theirs.cos):>9}{better:>3}"
        )
        if matrix and ours.matrix.wall:
            line += (
                f"{ours.matrix.wall:>16.1f}{theirs.matrix.wall:>8.1f}{_ratio(ours.matrix.wall, theirs.matrix.wall):>8}"
                f"{_ratio(ours.matrix.cpu, theirs.matrix.cpu):>10}"
            )
        print(line)
    done = [r for r in rows if r[1].done and r[2].done]
    if not done:
        return
    ow, tw = sum(r[1].flow.wall for r in done), sum(r[2].flow.wall for r in done)
    oc, tc = sum(r[1].flow.cpu for r in done), sum(r[2].flow.cpu for r in done)
    line = f"{'total':<21}{ow:>18.1f}{tw:>8.1f}{_ratio(ow, tw):>8}{_ratio(oc, tc):>10}{'':>23}"
    if matrix:
        mo, mt = sum(r[1].matrix.wall for r in done), sum(r[2].matrix.wall for r in done)
        mco, mct = sum(r[1].matrix.cpu for r in done), sum(r[2].matrix.cpu for r in done)
        line += f"{mo:>16.1f}{mt:>8.1f}{_ratio(mo, mt):>8}{_ratio(mco, mct):>10}"
    print(line)
    flow_ok = [r[0] for r in done if r[1].flow.wall / r[2].flow.wall <= FLOW_GOAL]
    cos_ok = [r[0] for r in done if r[1].cos is not None and r[2].cos is not None and r[1].cos >= r[2].cos]
    print(
        f"\nINT8 flow within {FLOW_GOAL}x of TPU-MLIR's wall time: {len(flow_ok)} of {len(done)} models; "
        f"INT8 cosine at least TPU-MLIR's: {len(cos_ok)} of {len(done)}"
    )
    if matrix:
        matrix_ok = [r[0] for r in done if r[1].matrix.wall and r[1].matrix.wall / r[2].matrix.wall <= MATRIX_GOAL]
        print(f"matrix within {MATRIX_GOAL}x: {len(matrix_ok)} of {len(done)} models")


def main() -> int:
    global JOBS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated manifests (default {DEFAULT_MODELS}; ppocrv4_det works too, slowly)",
    )
    parser.add_argument(
        "--venv",
        default=os.environ.get("TPUMLIR_VENV", str(REPO / ".anchors" / "tpumlir-venv")),
        help="TPU-MLIR's venv (default .anchors/tpumlir-venv, or $TPUMLIR_VENV)",
    )
    parser.add_argument("--no-matrix", action="store_true", help="only the bm1684x INT8 flow")
    parser.add_argument(
        "--jobs",
        type=int,
        default=JOBS,
        help=f"doit -n for our builds (default {JOBS}, the cores: TPU-MLIR's tools thread too)",
    )
    parser.add_argument("--work", help="folder for both sides' builds (default: a temporary one, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    figures = parser.add_mutually_exclusive_group()
    figures.add_argument("--save-theirs", metavar="JSON", help="write TPU-MLIR's figures of this run to JSON")
    figures.add_argument(
        "--theirs-from",
        metavar="JSON",
        help="take TPU-MLIR's figures from JSON (written by --save-theirs) instead of running it: "
        "the ratios are then against that earlier run",
    )
    args = parser.parse_args()
    JOBS = args.jobs
    earlier = json.loads(Path(args.theirs_from).read_text()) if args.theirs_from else {}
    if args.theirs_from:
        print(
            f"TPU-MLIR's figures: the run of {earlier.get('measured', '?')} kept in {args.theirs_from} "
            "(its tools are not run)"
        )
    venv = Path(args.venv).resolve()
    if not args.theirs_from and not (venv / "bin" / "model_deploy").is_file():
        print(
            f"vs_tpumlir: skipped: no TPU-MLIR in {venv} (install it with ../shared/anchors/tpumlir-setup.sh "
            f"{venv}, or name another venv with --venv)"
        )
        return 0
    root = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="vs_tpumlir-"))
    rows = []
    try:
        for name in filter(None, args.models.split(",")):
            work = root / name
            if work.exists():
                shutil.rmtree(work)
            work.mkdir(parents=True)
            if args.theirs_from and name not in earlier.get("models", {}):
                print(f"== {name}: no TPU-MLIR figures for it in {args.theirs_from}; skipped")
                continue
            cached = side_of(earlier["models"][name]) if args.theirs_from else None
            rows.append((name, *bench_model(name, venv, work, not args.no_matrix, cached)))
        print_table(rows, not args.no_matrix)
        if args.save_theirs:
            saved = {
                "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "matrix": not args.no_matrix,
                "models": {name: side_json(theirs) for name, _, theirs, _ in rows if theirs.done},
            }
            Path(args.save_theirs).write_text(json.dumps(saved, indent=1) + "\n")
            print(f"TPU-MLIR's figures kept in {args.save_theirs}")
    finally:
        if args.keep or args.work:
            print(f"\nbuilds and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r[1].done and r[2].done for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
