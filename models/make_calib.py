"""Write the shipped calibration image sets, deterministically (tpubuild/calib/datasets.py).

    python models/make_calib.py [OUT_DIR]      (default: models/calib)

models/calib/photos/*.jpg: crops of scikit-image's sample photographs (from its
pinned PyPI wheel, sha256-checked); models/calib/text/*.png: rendered text
lines and pages, and crops of its scanned pages, for OCR models. Same script,
same wheel and Pillow version, same bytes: a test regenerates and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpubuild.calib.datasets import write_all  # noqa: E402  (after sys.path: the repo before an installed copy)


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "calib"
    files = write_all(out)
    print(f"wrote {len(files)} files under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
