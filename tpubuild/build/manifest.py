"""Model manifests: YAML validated against configs/schema/manifest.schema.json.

dodo.py loads every manifest on every run, so this module stays cheap: only
yaml and jsonschema are imported (no numpy, onnx or xdsl), and the validator is
compiled once per process. Validation problems become one TpuBuildError that
names the file, the JSON path of each bad field and the expected form.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpubuild.errors import TpuBuildError

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "configs" / "schema" / "manifest.schema.json"

# What every INT8 target's outputs (and their parts) must reach against TOP inference unless the manifest
# says otherwise. cos 0.97 is below what the default INT8 path reaches on the zoo's test inputs (lowest
# 0.987); euc is DESIGN.md's 0.80 (for outputs of equal norm, about cos 0.98). A part INT8 destroyed (class
# scores at cos 0.87 beside boxes at 0.999) fails both.
INT8_OUTPUT_TOLERANCE: dict[str, float] = {"cos": 0.97, "euc": 0.80}

# Defaults the schema leaves open. DESIGN.md "Numerics" gives the TPU and chip
# figures; TOP inference is float32 against onnxruntime, so it must be near-exact.
DEFAULT_TOLERANCE: dict[str, Any] = {
    "top": {"cos": 0.99999, "euc": 0.999},
    "tpu": {
        "F32": {"cos": 0.99, "euc": 0.99},
        "BF16": {"cos": 0.99, "euc": 0.90},
        "F16": {"cos": 0.99, "euc": 0.90},
        "INT8": dict(INT8_OUTPUT_TOLERANCE),
    },
    "chip": {"cos": 0.99, "euc": 0.90},
    # IREE's outputs vs TOP's (the cpu target): F32 is two float32 compilers of one graph
    "iree": {"F32": {"cos": 0.99999, "euc": 0.999}, "F16": {"cos": 0.99, "euc": 0.90}},
}

# calibration.method when the manifest names none: KL alone, TPU-MLIR's default, clipped a document model's white
# paper (255) at 243 and its first SiLU at 2.0 of 26.1, and lost a classifier's decisive logits; ``auto`` judges
# every method's threshold by the error it causes in the tensor's consumers (tpubuild/calib/tune.py)
DEFAULT_METHOD = "auto"

_MAX_ERRORS = 5  # more than this is noise: the user fixes the first ones and reruns


@dataclass(frozen=True)
class InputSpec:
    """One entry of `inputs`. What it leaves out (None) the stages take from the model (build/inputs.py):
    no name, the graph input at its position; no shape, the model's fixed dims; no dtype, the model's."""

    name: str | None
    shape: tuple[int, ...] | None
    dtype: str | None = None
    range: tuple[float, float] | None = None
    preprocess: dict[str, Any] | None = None
    value: Any = None  # a fixed value (JSON: a number or nested lists): the input becomes a constant

    def config(self) -> dict[str, Any]:
        """The JSON form, as stage options for config_changed (preprocess makes an image test_input)."""
        config = {
            "name": self.name,
            "shape": list(self.shape) if self.shape else None,
            "dtype": self.dtype,
            "range": list(self.range) if self.range else None,
            "preprocess": self.preprocess,
        }
        return config if self.value is None else {**config, "value": self.value}


@dataclass(frozen=True)
class Target:
    chip: str
    mode: str
    asymmetric: bool = False

    @property
    def id(self) -> str:
        """The build-tree folder and task-id suffix, e.g. bm1684x-INT8-asym."""
        return f"{self.chip}-{self.mode}" + ("-asym" if self.asymmetric else "")


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. Paths in it are resolved against the manifest's folder."""

    name: str
    file: Path
    source: str | dict[str, Any]
    inputs: tuple[InputSpec, ...] = ()
    calibration: dict[str, Any] | None = None
    quantize_table: Path | None = None
    mixed_precision: dict[str, Any] | None = None  # {search, target_cos, ...}: INT8 targets' quantize table search
    test_input: Path | None = None
    outputs: dict[str, Any] | None = None  # {output: {parts: {part: {axis, range}}}}: parts verification judges
    targets: tuple[Target, ...] = ()
    tolerance: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_TOLERANCE)))

    @property
    def source_kind(self) -> str:
        """'path' (a string or {path: ...}), 'pypi' or 'torch'."""
        if isinstance(self.source, str) or "path" in self.source:
            return "path"
        return "torch" if "torch" in self.source else "pypi"

    @property
    def calibration_spec(self) -> dict[str, Any]:
        """``calibration`` of a manifest that has it (an INT8 target's, one holding back a test sample)."""
        if self.calibration is None:
            raise ValueError(f"{self.name}: the manifest has no calibration data")
        return self.calibration

    @property
    def source_spec(self) -> dict[str, Any]:
        """The source as a mapping (a string source is {path: ...})."""
        return {"path": self.source} if isinstance(self.source, str) else self.source

    @property
    def source_file(self) -> Path:
        """The resolved model file of a path source; a PyPI or PyTorch source raises ValueError."""
        path = self.source_path
        if path is None:
            raise ValueError(f"{self.name}: a {self.source_kind} source has no model file in place")
        return path

    @property
    def source_path(self) -> Path | None:
        """The resolved model file of a path source; None for PyPI and PyTorch sources."""
        if isinstance(self.source, str):
            return self.resolve(self.source)
        return self.resolve(self.source["path"]) if "path" in self.source else None

    @property
    def prepare(self) -> tuple[str, ...]:
        """The names of the preparation steps applied to the source model, in order."""
        return () if isinstance(self.source, str) else tuple(self.source.get("prepare", ()))

    @property
    def needs_fetch(self) -> bool:
        """True when build/<model>/source.onnx is made (fetched, exported or prepared) rather than used in place."""
        return self.source_kind != "path" or bool(self.prepare)

    @property
    def holds_back_test_sample(self) -> bool:
        """True when the test input is a calibration sample that calibration holds back: no `test_input`, and
        calibration data to take one from (calib/data.py, split_test_sample)."""
        return self.test_input is None and self.calibration is not None and "data" in self.calibration

    def resolve(self, rel: str) -> Path:
        return (self.file.parent / rel).resolve()

    @property
    def searched(self) -> bool:
        """Do INT8 targets get the mixed-precision search? By default yes, when there is calibration data: it
        keeps in float what validation shows INT8 cannot hold (``mixed_precision: {search: false}`` turns it off)."""
        return self.calibration is not None and bool((self.mixed_precision or {}).get("search", True))


@functools.cache
def _validator():
    from jsonschema.validators import validator_for  # ~0.1 s: paid once per process, only when a manifest is loaded

    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    cls = validator_for(schema)
    return cls(schema)


def json_path(parts) -> str:
    """['inputs', 0, 'shape', 1] -> 'inputs[0].shape[1]'."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _describe(error) -> str:
    where = json_path(error.absolute_path)
    expected = error.schema.get("description") if isinstance(error.schema, dict) else None
    text = f"{where}: {error.message}"
    return text + (f"; expected {expected}" if expected else "")


def schema_errors(data: Any) -> list[str]:
    """One line per bad field: its JSON path, what is wrong and the expected form.

    When several schema branches complain about the same field (e.g. `source`,
    which may be a string or one of two mappings) only the outermost complaint
    is kept: it carries the description listing every accepted form.
    """
    best: dict[tuple, Any] = {}
    for err in _validator().iter_errors(data):
        key = tuple(err.absolute_path)
        if key not in best or len(err.schema_path) < len(best[key].schema_path):
            best[key] = err
    ordered = sorted(best.values(), key=lambda e: [str(p) for p in e.absolute_path])
    return [_describe(e) for e in ordered]


def _semantic_errors(data: dict[str, Any]) -> list[str]:
    """Rules JSON Schema cannot say simply."""
    errors = []
    seen: set[str] = set()
    for i, spec in enumerate(data.get("inputs", ())):
        if spec.get("name") in seen:
            errors.append(f"inputs[{i}].name: {spec['name']!r} is listed twice; expected unique input names")
        if "name" in spec:
            seen.add(spec["name"])
        rng = spec.get("range")
        if rng and not rng[0] < rng[1]:
            errors.append(f"inputs[{i}].range: {rng} is empty; expected [lo, hi] with lo < hi")
        pre = spec.get("preprocess") or {}
        mean, scale = pre.get("mean"), pre.get("scale")
        if mean and scale and len(mean) != len(scale) and 1 not in (len(mean), len(scale)):
            errors.append(
                f"inputs[{i}].preprocess: mean has {len(mean)} values and scale {len(scale)}; "
                "expected the same count (or one value for all channels)"
            )
    for output, spec in (data.get("outputs") or {}).items():
        for part, p in spec["parts"].items():
            start, stop = p["range"]
            if not start < stop:
                errors.append(f"outputs.{output}.parts.{part}.range: {[start, stop]} is empty; expected start < stop")
    errors += _fixed_value_errors(data) + _torch_input_errors(data)
    ids = [Target(t["chip"], t["mode"], t.get("asymmetric", False)).id for t in data.get("targets", [])]
    for i, tid in enumerate(ids):
        if tid in ids[:i]:
            errors.append(f"targets[{i}]: {tid} is listed twice; expected each target once")
    return errors


def _fixed_value_errors(data: dict[str, Any]) -> list[str]:
    """An input with a fixed `value` is no test input, and leaves the compiled model: positions would count
    differently before and after it, so every entry beside it needs its name."""
    inputs = data.get("inputs", ())
    if not any("value" in spec for spec in inputs):
        return []
    errors = []
    for i, spec in enumerate(inputs):
        if "value" in spec and ({"range", "preprocess"} & set(spec)):
            errors.append(f"inputs[{i}]: a fixed value is no test input; expected value without range and preprocess")
        if "name" not in spec:
            errors.append(f"inputs[{i}]: no name, beside an input with a fixed value; expected every input named")
    return errors


def _torch_input_errors(data: dict[str, Any]) -> list[str]:
    """A PyTorch source has no model file to complete `inputs` from: its export's example inputs are them."""
    source = data["source"]
    if not (isinstance(source, dict) and "torch" in source):
        return []
    if not data.get("inputs"):
        return ["inputs: a `torch` source needs them; expected one {name, shape} per forward() argument"]
    errors = []
    for i, spec in enumerate(data["inputs"]):
        missing = [k for k in ("name", "shape") if k not in spec]
        if missing:
            errors.append(f"inputs[{i}]: a `torch` source needs {' and '.join(missing)} of each input")
    return errors


def _merge(default: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(default)
    for key, value in override.items():
        out[key] = _merge(default[key], value) if isinstance(value, dict) and key in default else value
    return out


def read_yaml(path: Path) -> Any:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise TpuBuildError(f"cannot read manifest: {err.strerror}", file=str(path)) from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster to parse
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise TpuBuildError(
            f"{where}not valid YAML ({problem})", file=str(path), hint="check indentation and quoting"
        ) from None


def from_dict(data: Any, file: Path, *, validate: bool = True) -> Manifest:
    """Validate parsed YAML and build the Manifest (defaults applied).

    ``validate=False`` only for data that passed validation before (ManifestCache).
    """
    errors = schema_errors(data) if validate else []
    if not errors and validate:
        errors = _semantic_errors(data)
    if errors:
        more = len(errors) - _MAX_ERRORS
        lines = errors[:_MAX_ERRORS] + ([f"... and {more} more"] if more > 0 else [])
        raise TpuBuildError(
            "invalid manifest:\n  " + "\n  ".join(lines),
            file=str(file),
            hint="the manifest format is documented in docs/manifest.md",
        )
    inputs = tuple(
        InputSpec(
            name=s.get("name"),
            shape=tuple(int(d) for d in s["shape"]) if "shape" in s else None,
            dtype=s.get("dtype"),
            range=(float(s["range"][0]), float(s["range"][1])) if "range" in s else None,
            preprocess=s.get("preprocess"),
            value=s.get("value"),
        )
        for s in data.get("inputs", ())
    )
    base = file.parent
    return Manifest(
        name=data["name"],
        file=file,
        source=data["source"],
        inputs=inputs,
        calibration=data.get("calibration"),
        quantize_table=(base / data["quantize_table"]).resolve() if "quantize_table" in data else None,
        mixed_precision=data.get("mixed_precision"),
        test_input=(base / data["test_input"]).resolve() if "test_input" in data else None,
        outputs=data.get("outputs"),
        targets=tuple(Target(t["chip"], t["mode"], bool(t.get("asymmetric", False))) for t in data.get("targets", [])),
        tolerance=_merge(DEFAULT_TOLERANCE, data.get("tolerance", {})),
    )


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate one manifest; raises TpuBuildError naming the file."""
    file = Path(path).resolve()
    return from_dict(read_yaml(file), file)


class ManifestCache:
    """Validated manifests by file state, kept in the build tree (<build>/.manifests.json).

    YAML parsing and JSON Schema validation take ~5 ms a manifest, too much for a
    no-op build of a zoo of hundreds. An entry is used while the file's mtime, ctime,
    size and inode are unchanged and the schema and compiler are the same; anything
    else re-reads the file. Only valid manifests are kept, so errors are always fresh.
    """

    def __init__(self, file: Path | None, version: str):
        from tpubuild.build import chips

        self.file = file
        self.version = f"{version}|{file_stamp(SCHEMA_PATH)}|{file_stamp(chips.SCHEMA_PATH)}"
        self.entries: dict[str, Any] = {}
        self.chips: dict[str, list[int]] = {}  # chip files validated before (chips.trust)
        self.dirty = False
        if file is not None:
            try:
                doc = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return
            if isinstance(doc, dict) and doc.get("version") == self.version:
                self.entries = doc.get("entries", {})
                self.chips = doc.get("chips", {})
                chips.trust(self.chips)

    def load(self, path: str | Path) -> Manifest:
        """load_manifest(path), from the cache when the file is unchanged."""
        key = str(path)
        try:
            stamp = file_stamp(path)
        except OSError:
            return load_manifest(path)  # it reports the missing file
        hit = self.entries.get(key)
        if hit and hit[0] == stamp:
            return from_dict(hit[2], Path(hit[1]), validate=False)
        file = Path(path).resolve()
        data = read_yaml(file)
        manifest = from_dict(data, file)
        try:
            plain = json.loads(json.dumps(data)) == data  # YAML dates and the like do not round-trip
        except (TypeError, ValueError):
            plain = False
        # a file written within the clock tick of its stat could change again unseen (noop.RACY_NS)
        settled = time.time_ns() - stamp[0] > 2_000_000_000
        if plain and settled:
            self.entries[key] = [stamp, str(file), data]
            self.dirty = True
        return manifest

    def save(self) -> None:
        from tpubuild.build import chips

        seen = {**self.chips, **chips.validated()}
        if self.file is None or not (self.dirty or seen != self.chips):
            return
        from tpubuild.build.files import write_text

        with contextlib.suppress(OSError):  # only a speed-up
            write_text(self.file, json.dumps({"version": self.version, "entries": self.entries, "chips": seen}))
        self.dirty = False


def file_stamp(path: str | Path) -> list[int]:
    """What tells a file changed without reading it: mtime, ctime, size, inode."""
    st = os.stat(path)
    return [st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino]
