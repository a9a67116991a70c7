"""torchvision's architectures through every target, as a user exports a PyTorch model.

    python bench/torchvision_sweep.py [MODEL ...] [--build-dir DIR] [-j N] [--list]

Each model is a `torch` source (`fetch` exports it with the TorchScript exporter, opset 17, as
`torch.onnx.export` users do) from this file's factories: torchvision's own initialisation under
seed 0, then `prepare: [normalize_activations]`, which makes random weights behave like trained ones
(trained weights would be a download). The manifest is what a user writes: the input's shape and
ImageNet `preprocess`, `calibration: {data: <the zoo's photos>}` and nothing else (the test input is
the sample calibration holds back); targets bm1684x F32/F16/BF16/INT8, cv183x INT8 and cpu F32
(IREE). r3d_18 (video) has no calibration data, so no INT8 targets.

Prints `tpubuild compile`'s summary (every target's verdict and cosines); exit status 1 if any target
fails. Needs torch and torchvision (`pip install -e '.[torch]' torchvision==0.28.0`); a full sweep is
about an hour on 2 cores and takes some 40 GB of build folder (default: a temp folder, removed).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHOTOS = REPO / "models" / "calib" / "photos" / "*.jpg"
# model -> input size (square images; r3d_18 takes 16 frames of 112 x 112)
MODELS = {
    "mobilenet_v3_small": 224,
    "mobilenet_v3_large": 224,
    "efficientnet_b0": 224,
    "efficientnet_v2_s": 224,
    "mnasnet0_5": 224,
    "regnet_x_400mf": 224,
    "regnet_y_400mf": 224,
    "shufflenet_v2_x0_5": 224,
    "squeezenet1_1": 224,
    "googlenet": 224,
    "inception_v3": 299,
    "resnext50_32x4d": 224,
    "convnext_tiny": 224,
    "swin_t": 224,
    "swin_v2_t": 224,
    "maxvit_t": 224,
    "vit_b_32": 224,
    "deeplabv3_mobilenet_v3_large": 256,
    "lraspp_mobilenet_v3_large": 256,
    "r3d_18": 112,
}
VIDEO = {"r3d_18"}
# their default backbone weights are a download
SEGMENTERS = {"deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"}
IMAGENET = "{mean: [123.675, 116.28, 103.53], scale: [0.017125, 0.017507, 0.017429], pixel_format: rgb"


def _torchvision():
    """torchvision, imported beside a CPU build of torch: PyPI's torchvision wheel is built against CUDA
    torch, its C ops (nms, roi_align) do not load, and registering their fake kernels would fail the
    import. The classification and segmentation models need none of them."""
    import torch

    register = torch.library.register_fake

    def tolerant(*args, **kwargs):
        def apply(fn):
            try:
                return register(*args, **kwargs)(fn)
            except RuntimeError:
                return fn

        return apply

    torch.library.register_fake = tolerant
    try:
        import torchvision
    finally:
        torch.library.register_fake = register
    return torchvision


def __getattr__(name: str):
    """The factory of each model: ``bench/torchvision_sweep.py:<model>`` in a manifest's `torch` source."""
    if name not in MODELS:
        raise AttributeError(name)

    def make():
        kwargs: dict = {"weights": None}
        if name in SEGMENTERS:
            kwargs["weights_backbone"] = None
        if name in ("googlenet", "inception_v3"):
            kwargs.update(aux_logits=False, init_weights=True)
        return _torchvision().models.get_model(name, **kwargs)

    return make


def manifest(name: str) -> str:
    size = MODELS[name]
    shape = [1, 3, 16, size, size] if name in VIDEO else [1, 3, size, size]
    source = f"{{torch: '{Path(__file__).resolve()}:{name}', example_shape: {shape}, prepare: [normalize_activations]}}"
    if name in VIDEO:
        inputs = f"inputs:\n  - {{name: input, shape: {shape}, range: [-2.0, 2.0]}}\n"
        int8 = ""
    else:
        inputs = (
            f"inputs:\n  - name: input\n    shape: {shape}\n"
            f"    preprocess: {IMAGENET}, resize: [{size}, {size}]}}\n"
            f"calibration:\n  data: {PHOTOS}\n"
        )
        int8 = "  - {chip: bm1684x, mode: INT8}\n  - {chip: cv183x, mode: INT8}\n"
    return (
        f"name: tv_{name}\nsource: {source}\n{inputs}targets:\n"
        "  - {chip: bm1684x, mode: F32}\n  - {chip: bm1684x, mode: F16}\n  - {chip: bm1684x, mode: BF16}\n"
        f"{int8}  - {{chip: cpu, mode: F32}}\n"
    )


def main(argv: list[str] | None = None) -> int:
    from sweep import main as sweep  # bench/, the folder this script runs from

    return sweep(argv, __doc__, list(MODELS), manifest)


if __name__ == "__main__":
    sys.exit(main())
