"""Layer group, memory assign and codegen of one source tree against another's: the same groups, cycles and bytes.

For each target's tpu.mlir under a build folder (``build/<model>/<chip>-<mode>[-asym]/tpu.mlir`` and its
tpu_weights.npz, as `doit lower` leaves them), runs the layergroup, assign and codegen stages of the
current tree and of ``--base`` (a commit, exported with `git archive` to a temporary folder and imported
from there) and compares what they wrote: lg.mlir, addr.mlir and the .model by sha256, and the group count
and estimated cycles the layergroup stage prints. Exit status 1 if any target differs.

    python bench/layergroup_identity.py --base main --build build            # every target built there
    python bench/layergroup_identity.py --base main --build build --json     # the comparison as JSON
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# run inside the tree under test (PYTHONPATH): the three stages on each target, one JSON line per target
_WORKER = r"""
import contextlib, hashlib, io, json, re, sys, tempfile
from pathlib import Path
import tpubuild
from tpubuild.build import stages

def sha(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()

for line in sys.stdin:
    tpu = Path(line.strip())
    model, target = tpu.parent.parent.name, tpu.parent.name
    chip = target.split("-")[0]
    with tempfile.TemporaryDirectory() as tmp:
        lg, addr, out = Path(tmp, "lg.mlir"), Path(tmp, "addr.mlir"), Path(tmp, model + ".model")
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            stages.layergroup(model, chip, str(tpu), str(lg))
            stages.assign(model, chip, str(lg), str(addr))
            stages.codegen(model, chip, str(addr), str(tpu.parent / "tpu_weights.npz"), str(out))
        m = re.search(r"(\d+) groups \((\d+) local\), estimated (\d+) cycles", said.getvalue())
        print(json.dumps({
            "target": f"{model}/{target}", "source": tpubuild.__file__,
            "groups": int(m.group(1)), "local": int(m.group(2)), "cycles": int(m.group(3)),
            "lg.mlir": sha(lg), "addr.mlir": sha(addr), ".model": sha(out),
        }), flush=True)
"""

FIELDS = ("groups", "local", "cycles", "lg.mlir", "addr.mlir", ".model")


def targets(build: Path, only: list[str]) -> list[Path]:
    found = sorted(build.glob("*/*/tpu.mlir"))
    found = [p for p in found if (p.parent / "tpu_weights.npz").is_file()]
    if only:
        found = [p for p in found if any(o in f"{p.parent.parent.name}/{p.parent.name}" for o in only)]
    return found


def run_tree(src: Path, tpus: list[Path]) -> dict[str, dict]:
    """The worker over ``tpus`` with ``src`` (a folder holding the tpubuild package) first on the path."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER],
        input="".join(f"{p.resolve()}\n" for p in tpus),
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
        check=False,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"the stages failed in {src}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in rows:  # the tree that ran is the one asked for
        if not r.pop("source").startswith(str(src)):
            raise SystemExit(f"{src}: the worker imported tpubuild from elsewhere")
    return {r["target"]: r for r in rows}


def export(commit: str, into: Path) -> Path:
    """``commit``'s tpubuild/ (and configs/, which it reads) extracted into ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "tpubuild", "configs"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="the commit to compare with (default: main)")
    ap.add_argument("--head", help="a commit to compare instead of this working tree")
    ap.add_argument("--build", type=Path, default=REPO / "build", help="folder of <model>/<target>/tpu.mlir")
    ap.add_argument("--only", nargs="*", default=[], help="targets whose <model>/<target> contains one of these")
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = ap.parse_args()
    tpus = targets(args.build, args.only)
    if not tpus:
        raise SystemExit(f"no <model>/<target>/tpu.mlir with tpu_weights.npz under {args.build} (run `doit lower`)")
    base_rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", args.base], capture_output=True, text=True, check=True
    ).stdout.strip()
    head_rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", args.head or "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "tpubuild"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base = run_tree(export(args.base, Path(tmp)), tpus)
    if args.head:
        dirty = False
        with tempfile.TemporaryDirectory() as tmp:
            ours = run_tree(export(args.head, Path(tmp)), tpus)
    else:
        ours = run_tree(REPO, tpus)
    seconds = time.perf_counter() - start
    rows = []
    for name in sorted(ours):
        a, b = base.get(name), ours[name]
        same = a is not None and all(a[f] == b[f] for f in FIELDS)
        rows.append({**{f: b[f] for f in FIELDS}, "target": name, "identical": same})
    differ = [r["target"] for r in rows if not r["identical"]]
    if args.json:
        print(json.dumps({"base": base_rev, "head": head_rev + ("+" if dirty else ""), "rows": rows}, indent=1))
    else:
        print(
            f"layer group identity: base {base_rev} vs this tree ({head_rev}{' + changes' if dirty else ''}), "
            f"{len(rows)} targets under {args.build}, {seconds:.0f} s"
        )
        print(
            f"{'target':<36}{'groups':>7}{'local':>6}{'cycles':>12}  {'lg.mlir':<12}{'addr.mlir':<12}{'.model':<12}same"
        )
        for r in rows:
            print(
                f"{r['target']:<36}{r['groups']:>7}{r['local']:>6}{r['cycles']:>12}  {r['lg.mlir'][:10]:<12}"
                f"{r['addr.mlir'][:10]:<12}{r['.model'][:10]:<12}{'yes' if r['identical'] else 'NO'}"
            )
        print(
            f"{len(rows) - len(differ)} of {len(rows)} identical" + (f"; differ: {', '.join(differ)}" if differ else "")
        )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
