"""The shipped calibration images are exactly what models/make_calib.py makes from the pinned wheel."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "calib"


def test_regenerated_sets_are_byte_identical(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "models" / "make_calib.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    # models/calib also holds sets other scripts make (e.g. MiniLM's sentences): compare make_calib.py's own folders
    folders = {rel.parts[0] for rel in made}
    shipped = sorted(
        rel for rel in (p.relative_to(SHIPPED) for p in SHIPPED.rglob("*") if p.is_file()) if rel.parts[0] in folders
    )
    assert made == shipped
    for rel in made:
        assert (tmp_path / rel).read_bytes() == (SHIPPED / rel).read_bytes(), rel


def test_sets_are_real_varied_images():
    photos = sorted((SHIPPED / "photos").glob("*.jpg"))
    lines = sorted((SHIPPED / "text").glob("line_*.png"))
    pages = sorted((SHIPPED / "text").glob("page_*.png"))
    assert len(photos) >= 32 and len(lines) >= 16 and len(pages) >= 16
    means = []
    for path in photos:
        with Image.open(path) as img:
            assert img.size == (256, 256) and img.mode == "RGB"
            pixels = np.asarray(img, np.float32)
        assert pixels.std() > 10  # not a flat fill
        means.append(pixels.mean(axis=(0, 1)))
    assert np.std(means, axis=0).min() > 10  # different images, not one repeated
    for path in lines:
        with Image.open(path) as img:
            assert img.size == (320, 48)
            gray = np.asarray(img.convert("L"))
        dark = gray < 128
        assert 0.02 < dark.mean() < 0.5  # text drawn, background kept


def test_zoo_model_sets_have_their_sizes_and_held_back_tests():
    """docs/, faces/ and captcha/: the real zoo models' calibration images and test inputs no glob of theirs takes."""
    sizes = {"docs/rot_*.png": (320, 320), "faces/face_*.jpg": (320, 320), "captcha/cap_*.jpg": (416, 416)}
    for pattern, size in sizes.items():
        files = sorted(SHIPPED.glob(pattern))
        assert len(files) >= 12, pattern
        for path in files:
            with Image.open(path) as img:
                assert img.size == size and img.mode == "RGB", path
                assert np.asarray(img, np.float32).std() > 10, path
    tests = ["docs/test_rotated.png", "docs/test_page.png", "docs/test_line.png", "faces/test.jpg", "captcha/test.jpg"]
    for test in tests:
        assert (SHIPPED / test).is_file()
        assert not any(fnmatch.fnmatch(test, pattern) for pattern in sizes), f"{test} is in a calibration set"
    # the four orientations: a turned page's text lines run vertically (ink varies more along x than along y)
    for i in range(4):
        with Image.open(SHIPPED / "docs" / f"rot_{i:02d}.png") as img:
            ink = np.asarray(img.convert("L"), np.float32) < 128
        rows, cols = ink.mean(axis=1).std(), ink.mean(axis=0).std()
        assert (rows > cols) == (i % 2 == 0), (i, rows, cols)
