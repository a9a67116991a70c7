"""The build tree: where each stage's artifacts live (DESIGN.md "The flow").

Model-level stages write to build/<model>/; per-target stages (later issues)
write to build/<model>/<chip>-<mode>[-asym]/.
"""

from __future__ import annotations

from dataclasses import dataclass

# paths are cached per object: task generation (every doit run) reads each several times
from functools import cached_property
from pathlib import Path


def failed_json(verify_json: str | Path) -> Path:
    """Where a failing verify stage keeps its comparison (verify_tpu.json -> verify_tpu.failed.json).

    Not a doit target: it exists only while the stage's last run failed, for the reports.
    """
    path = Path(verify_json)
    return path.with_name(f"{path.stem}.failed.json")


def zoo_index(build_dir: str | Path) -> Path:
    """The zoo's index page: every model and target with its status, linking the reports."""
    return Path(build_dir) / "index.html"


def zoo_status(build_dir: str | Path) -> Path:
    """Each stage task's last outcome (failures with their message), kept by the console reporter."""
    return Path(build_dir) / ".status.json"


@dataclass(frozen=True)
class ModelPaths:
    root: Path  # build/<model>

    @classmethod
    def of(cls, build_dir: str | Path, model: str) -> ModelPaths:
        return cls(Path(build_dir).resolve() / model)

    # fetch / export (non-path sources only)
    @cached_property
    def fetched_source(self) -> Path:
        return self.root / "source.onnx"

    # transform
    @cached_property
    def origin_mlir(self) -> Path:
        return self.root / "origin.mlir"

    @cached_property
    def origin_weights(self) -> Path:
        return self.root / "origin_weights.npz"

    @cached_property
    def input_npz(self) -> Path:
        return self.root / "input.npz"

    @cached_property
    def input_source(self) -> Path:
        """Where input.npz came from: {"source": "..."} (test_input, a held-back calibration sample, noise)."""
        return self.root / "input.json"

    # reference
    @cached_property
    def onnx_outs(self) -> Path:
        return self.root / "onnx_outs.npz"

    # canonicalize
    @cached_property
    def canonical_mlir(self) -> Path:
        return self.root / "canonical.mlir"

    @cached_property
    def canonical_weights(self) -> Path:
        return self.root / "canonical_weights.npz"

    # calibrate (models with an INT8 target); cali.mlir names canonical_weights.npz
    @cached_property
    def cali_mlir(self) -> Path:
        return self.root / "cali.mlir"

    @cached_property
    def cali_table(self) -> Path:
        return self.root / "cali_table"

    # verify_top
    @cached_property
    def origin_outs(self) -> Path:
        return self.root / "origin_outs.npz"

    @cached_property
    def top_outs(self) -> Path:
        return self.root / "top_outs.npz"

    @cached_property
    def verify_top(self) -> Path:
        return self.root / "verify_top.json"

    # compile
    @cached_property
    def summary(self) -> Path:
        return self.root / "summary.txt"

    # the model's failure page (a failed model-level stage), written with the zoo index
    @cached_property
    def failed_page(self) -> Path:
        return self.root / "failed.html"

    def target(self, target_id: str) -> TargetPaths:
        found = self._targets.get(target_id)
        if found is None:
            found = self._targets[target_id] = TargetPaths(self.root / target_id)
        return found

    @cached_property
    def _targets(self) -> dict[str, TargetPaths]:
        return {}  # one TargetPaths per target, so that its cached paths are reused


@dataclass(frozen=True)
class TargetPaths:
    """One deploy target's stages: build/<model>/<chip>-<mode>[-asym]/."""

    root: Path

    # search (INT8 targets whose manifest asks for it): the quantize table and the bias corrections lowering reads
    @cached_property
    def qtable(self) -> Path:
        return self.root / "qtable.txt"

    @cached_property
    def bias_correction(self) -> Path:
        return self.root / "bias_correction.npz"

    # lower
    @cached_property
    def tpu_mlir(self) -> Path:
        return self.root / "tpu.mlir"

    @cached_property
    def tpu_weights(self) -> Path:
        return self.root / "tpu_weights.npz"

    # verify_tpu: real values (compare with TOP by name) and stored bits (what the chip must reproduce)
    @cached_property
    def tpu_outs(self) -> Path:
        return self.root / "tpu_outs.npz"

    @cached_property
    def tpu_raw(self) -> Path:
        return self.root / "tpu_raw.npz"

    @cached_property
    def verify_tpu(self) -> Path:
        return self.root / "verify_tpu.json"

    # layergroup, assign (the backend)
    @cached_property
    def lg_mlir(self) -> Path:
        return self.root / "lg.mlir"

    @cached_property
    def addr_mlir(self) -> Path:
        return self.root / "addr.mlir"

    # codegen: the chip model, named after the model (build/<model>/<target>/<model>.model)
    @cached_property
    def model_file(self) -> Path:
        return self.root / f"{self.root.parent.name}.model"

    # run: the simulated chip's outputs (stored types) and its cycle estimate
    @cached_property
    def chip_outs(self) -> Path:
        return self.root / "chip_outs.npz"

    @cached_property
    def profile(self) -> Path:
        return self.root / "profile.json"

    # the cpu target (IREE, tpubuild/build/cpu.py): the export, its compiled module, its outputs
    @cached_property
    def tosa_mlir(self) -> Path:
        return self.root / "tosa.mlir"

    @cached_property
    def vmfb(self) -> Path:
        return self.root / f"{self.root.parent.name}.vmfb"

    @cached_property
    def iree_outs(self) -> Path:
        return self.root / "iree_outs.npz"

    # verify_chip: Chip vs Tpu, with the ONNX/Top/Tpu comparisons, as one report (verify_iree for a cpu target)
    @cached_property
    def verify(self) -> Path:
        return self.root / "verify.json"

    # report: the target's page (similarity charts, layer groups, timeline)
    @cached_property
    def report(self) -> Path:
        return self.root / "report.html"

    # a target whose build stopped: its failure page, written with the zoo index (not a doit target)
    @cached_property
    def failed_page(self) -> Path:
        return self.root / "failed.html"
