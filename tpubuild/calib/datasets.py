"""The calibration image sets shipped in models/calib/, made deterministically from pinned sources.

- ``photos/``: photographs from scikit-image's sample data (public domain or
  CC0, as its ``skimage/data/_fetchers.py`` states), taken from the pinned
  wheel with each file's sha256 checked, as 4 square crops each (the center,
  two corners, and a mirrored center) at 256 x 256, JPEG quality 90.
- ``text/``: document-like images for OCR models. ``line_*.png``: one line
  of text on a 48 x 320 canvas (PP-OCR's recognizer input), rendered with
  Pillow's built-in font (Aileron) at several sizes, offsets and contrasts.
  ``page_*.png``: 640 x 640 pages of several such lines, plus scikit-image's
  scanned ``page.png`` and ``text.png``, whole and as a center crop.

Only the file bytes of the wheel members are used (no pooch download): the
same wheel and Pillow version give byte-identical files. ``models/make_calib.py``
writes them; a test regenerates them and compares.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
from collections.abc import Iterator
from pathlib import Path

SKIMAGE = "scikit-image==0.26.0"
PHOTOS = {
    "astronaut.png": "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
    "chelsea.png": "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb",
    "coffee.png": "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7",
    "rocket.jpg": "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
    "hubble_deep_field.jpg": "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4",
    "retina.jpg": "38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6",
    "camera.png": "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a",
    "coins.png": "f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba",
    "brick.png": "7966caf324f6ba843118d98f7a07746d22f6a343430add0233eca5f6eaaa8fcf",
    "gravel.png": "c48615b451bf1e606fbd72c0aa9f8cc0f068ab7111ef7d93bb9b0f2586440c12",
}
DOCUMENTS = {
    "page.png": "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3",
    "text.png": "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1",
}
PHOTO_SIZE = 256
LINE_SIZE = (320, 48)  # width, height
PAGE_SIZE = 640
PAGES = 20

LINES = [
    "Hello World 2024",
    "quantize int8 model",
    "TPU-MLIR ONNX",
    "calibration table",
    "Invoice No. 30417",
    "Total: $1,284.50",
    "12 Main Street, Apt 4B",
    "Phone +1 (555) 013-2207",
    "deep learning compiler",
    "2025-03-14 09:26:53",
    "The quick brown fox",
    "jumps over the lazy dog",
    "SALE 50% OFF",
    "Model: BM1684X",
    "layer group / memory",
    "threshold 127 / 255",
    "Page 7 of 12",
    "www.example.org",
    "Qty 3 x 19.99",
    "ACCOUNT #88-1274-03",
    "Mon Tue Wed Thu Fri",
    "kernel_shape = [3, 3]",
    "Receipt - thank you!",
    "e = mc^2",
]


def _member_bytes(names: dict[str, str]) -> Iterator[tuple[str, bytes]]:
    """Each named file of skimage/data in the pinned wheel, checked against its sha256."""
    from tpubuild.build.fetch import fetch_pypi

    with tempfile.TemporaryDirectory() as tmp:
        for name, sha in names.items():
            out = Path(tmp) / name
            fetch_pypi(SKIMAGE, f"skimage/data/{name}", sha, str(out))
            data = out.read_bytes()
            assert hashlib.sha256(data).hexdigest() == sha
            yield name, data


def _crops(img):
    """Center square, top-left and bottom-right squares of 60 %, mirrored center square of 80 %."""
    from PIL import ImageOps

    w, h = img.size
    s = min(w, h)

    def box(cx: float, cy: float, side: float):
        half = side / 2
        return (round(cx - half), round(cy - half), round(cx + half), round(cy + half))

    small, mid = 0.6 * s, 0.8 * s
    yield img.crop(box(w / 2, h / 2, s))
    yield img.crop(box(small / 2, small / 2, small))
    yield img.crop(box(w - small / 2, h - small / 2, small))
    yield ImageOps.mirror(img.crop(box(w / 2, h / 2, mid)))


def _encode(img, fmt: str, **opts) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **opts)
    return buf.getvalue()


def photos() -> Iterator[tuple[str, bytes]]:
    """(file name, JPEG bytes) of every photo crop."""
    from PIL import Image

    for name, data in _member_bytes(PHOTOS):
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
        stem = name.rsplit(".", 1)[0]
        for i, crop in enumerate(_crops(rgb)):
            crop = crop.resize((PHOTO_SIZE, PHOTO_SIZE), Image.Resampling.BILINEAR)
            yield f"{stem}_{i}.jpg", _encode(crop, "JPEG", quality=90)


def _line(i: int, text: str):
    """One text line on a 48 x 320 canvas; size, offset and contrast vary with i."""
    from PIL import Image, ImageDraw, ImageFont

    size = (22, 26, 30, 34)[i % 4]
    bg, fg = ((255, 255, 255), (0, 0, 0)) if i % 3 else ((228, 224, 212), (40, 40, 60))
    img = Image.new("RGB", LINE_SIZE, bg)
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    while right - left > LINE_SIZE[0] - 8 and size > 12:  # long strings: smaller type
        size -= 2
        font = ImageFont.load_default(size=size)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = 4 + (i * 7) % 12 - left
    y = (LINE_SIZE[1] - (bottom - top)) // 2 - top
    draw.text((x, y), text, font=font, fill=fg)
    return img


def _page(i: int):
    """A 640 x 640 page: a title and paragraphs of the LINES at several sizes."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (PAGE_SIZE, PAGE_SIZE), (255, 255, 255) if i % 2 else (242, 238, 228))
    draw = ImageDraw.Draw(img)
    y = 24 + 8 * (i % 8)
    k = 5 * i
    title = ImageFont.load_default(size=40)
    draw.text((32, y), LINES[k % len(LINES)].upper(), font=title, fill=(0, 0, 0))
    y += 64
    while y < PAGE_SIZE - 40:
        size = (18, 20, 24, 28)[(k + i) % 4]
        font = ImageFont.load_default(size=size)
        x = 32 + 40 * ((k + i) % 3 == 0)
        draw.text((x, y), f"{LINES[k % len(LINES)]}  {LINES[(k + 7) % len(LINES)]}", font=font, fill=(20, 20, 20))
        y += size + 10 + 6 * (k % 2)
        k += 1
    return img


def text_images() -> Iterator[tuple[str, bytes]]:
    """(file name, PNG bytes) of the text lines, rendered pages and scanned-page crops."""
    from PIL import Image

    for i, text in enumerate(LINES):
        yield f"line_{i:02d}.png", _encode(_line(i, text), "PNG")
    for i in range(PAGES):
        yield f"page_{i:02d}.png", _encode(_page(i), "PNG")
    for name, data in _member_bytes(DOCUMENTS):
        with Image.open(io.BytesIO(data)) as img:
            scan = img.convert("RGB")
        stem = name.rsplit(".", 1)[0]
        yield f"page_{stem}_0.png", _encode(_fit_page(scan), "PNG")
        center = next(_crops(scan)).resize((PAGE_SIZE, PAGE_SIZE), Image.Resampling.BILINEAR)
        yield f"page_{stem}_1.png", _encode(center, "PNG")


def _fit_page(scan):
    """The whole scan scaled to the page width, centered on a page of its own edge colour."""
    from PIL import Image

    w, h = scan.size
    scale = PAGE_SIZE / max(w, h)
    fitted = scan.resize((round(w * scale), round(h * scale)), Image.Resampling.BILINEAR)
    page = Image.new("RGB", (PAGE_SIZE, PAGE_SIZE), scan.getpixel((0, 0)))
    page.paste(fitted, ((PAGE_SIZE - fitted.width) // 2, (PAGE_SIZE - fitted.height) // 2))
    return page


SETS = {"photos": photos, "text": text_images}


def write_all(out_dir: str | Path) -> list[Path]:
    """Write every set to out_dir/<set>/ (atomically per file); returns the files written."""
    from tpubuild.build.files import write_bytes

    written = []
    for set_name, make in SETS.items():
        for name, data in make():
            path = Path(out_dir) / set_name / name
            write_bytes(path, data)
            written.append(path)
    return written
