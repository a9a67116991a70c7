"""The `tpubuild` command: single steps outside doit, and the doit graph for any manifest.

Thin on purpose: parse arguments, call one library function, turn user errors
into `tpubuild: error: ...` and an exit code (2 = bad input, 1 = a check failed).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from tpubuild.errors import TpuBuildError

EXIT_FAILED, EXIT_USAGE = 1, 2


def cmd_compile(args: argparse.Namespace) -> int:
    from tpubuild.build.runner import run_doit

    if args.cache:
        os.environ["TPUBUILD_ARTIFACT_CACHE"] = args.cache
    if args.scheduler:
        os.environ["TPUBUILD_SCHEDULER"] = args.scheduler
    return run_doit(args.manifests, args.build_dir, ["run", "-n", str(args.jobs), "compile"])


def cmd_infer(args: argparse.Namespace) -> int:
    from tpubuild.build.files import write_npz
    from tpubuild.top.inference import infer_file

    inputs = _read_npz(args.input)
    # without --all-tensors, inference returns the graph outputs only
    tensors = infer_file(args.mlir, inputs, all_tensors=args.all_tensors)
    if args.real:
        from tpubuild.ir.mlir import load_module
        from tpubuild.lower.inference import dequantized

        from tpubuild.lower.inference import source_output_names

        # a quantized tensor as scale * (q - zero point), f16/bf16 widened: comparable with TOP's by name; a
        # graph output lowering cast back to f32 (y_f32) also under the source model's name (y: onnxruntime's)
        module = load_module(args.mlir)
        tensors = dequantized(module, tensors)
        for name, source in source_output_names(module).items():
            if name in tensors:
                tensors[source] = tensors[name] if args.all_tensors else tensors.pop(name)
    write_npz(args.output, tensors)
    print(f"wrote {len(tensors)} tensors{' (real values)' if args.real else ''} to {args.output}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import json

    if args.model.endswith(".vmfb"):
        return _run_vmfb(args)

    from tpubuild.build.files import write_npz, write_text
    from tpubuild.sim.chip import run_file

    from tpubuild.codegen.model_file import read_model
    from tpubuild.lower.inference import real_float32

    header = read_model(args.model).header
    result = run_file(args.model, _read_npz(args.input))
    # each output under its source model's name; float32 real values unless the stored ones are asked for
    outputs = {
        t.source_name: result.outputs[t.name]
        if args.stored
        else real_float32(result.outputs[t.name], t.scale, t.zero_point)
        for t in header.outputs
    }
    write_npz(args.output, outputs)
    p = result.profile
    print(
        f"ran {p['gdma']['commands']} GDMA + {p['bdc']['commands']} BDC commands on {p['chip']}: "
        f"{p['total_cycles']} cycles = {p['time_ms']:.4g} ms at {p['clock_hz'] / 1e6:g} MHz; "
        f"DDR read {p['ddr_read_bytes']} B, written {p['ddr_write_bytes']} B; "
        f"utilisation GDMA {p['gdma']['utilisation']:.0%}, BDC {p['bdc']['utilisation']:.0%}"
    )
    print(f"wrote {len(outputs)} outputs ({'stored types' if args.stored else 'float32'}) to {args.output}")
    if args.profile:
        write_text(args.profile, json.dumps(p, indent=1, sort_keys=True) + "\n")
    return 0


def _run_vmfb(args: argparse.Namespace) -> int:
    """An IREE module (a cpu target's <model>.vmfb) on the local CPU."""
    import time

    from tpubuild.build.cpu import Vmfb
    from tpubuild.build.files import write_npz

    if args.profile:
        raise TpuBuildError("--profile is for .model files (the chip's cycle model); a .vmfb runs on this CPU")
    module = Vmfb(args.model)
    start = time.perf_counter()
    outputs = module.run(_read_npz(args.input))
    ms = (time.perf_counter() - start) * 1e3
    write_npz(args.output, outputs)
    print(f"ran {module.model} with IREE on the local CPU in {ms:.3f} ms (first call)")
    print(f"wrote {len(outputs)} outputs to {args.output}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tpubuild.export.tosa import export_file

    export_file(args.mlir, args.output, resources=not args.inline_weights)
    print(f"wrote {args.output}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from tpubuild.verify.compare import compare_tensors, format_row
    from tpubuild.verify.similarity import Tolerance

    try:
        tol = Tolerance.parse(args.tolerance)
    except ValueError as err:
        raise TpuBuildError(str(err)) from None
    report = compare_tensors(_read_npz(args.a), _read_npz(args.b), tol)
    for row in report["tensors"]:
        print(("  " if row["passed"] else "! ") + format_row(row))
    print(
        f"{report['compared']} compared, {report['failed']} below cos {tol.cos}, euc {tol.euc}; "
        f"{len(report['only_in_test'])} only in {args.a}, {len(report['only_in_ref'])} only in {args.b}"
    )
    if report["compared"] == 0:
        print(f"tpubuild: error: no tensor name is in both {args.a} and {args.b}", file=sys.stderr)
        return EXIT_FAILED
    return 0 if report["passed"] else EXIT_FAILED


def cmd_ops(args: argparse.Namespace) -> int:
    from tpubuild.frontend.registry import supported

    table = supported()
    names = {key: f"{key[0]}.{key[1]}" if key[0] else key[1] for key in table}
    width = max(map(len, names.values()), default=0) + 1
    for key, since in table.items():
        print(f"{names[key]:<{width}} from opset {', '.join(str(v) for v in since)}")
    print(f"{len(table)} ONNX ops supported")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from tpubuild.build.cache import ArtifactCache, cache_root, cache_url, format_bytes

    url = cache_url()
    root = cache_root()
    if url is None and root is None:
        print("the artifact cache is off (TPUBUILD_CACHE or TPUBUILD_ARTIFACT_CACHE is 'off')")
        return 0
    if url is not None:  # a cache at a URL (urlcache.py): its entries and the blobs of cluster builds
        from tpubuild.build.urlcache import UrlCache

        cache: Any = UrlCache(url)
    else:
        assert root is not None
        cache = ArtifactCache(root)
    if args.cache_command == "prune":
        if args.max_bytes is None and args.older_than is None:
            raise TpuBuildError("cache prune needs --max-bytes N and/or --older-than DAYS")
        removed, freed = cache.prune(max_bytes=args.max_bytes, older_than_days=args.older_than)
        what = "entries and blobs" if url else "entries"
        print(f"removed {removed} {what}, {format_bytes(freed)} freed")
    stats = cache.stats()
    limit = f"of at most {format_bytes(stats['max_bytes'])}" if stats["max_bytes"] else "(no size limit)"
    print(f"artifact cache {stats['root']}: {stats['entries']} entries, {format_bytes(stats['bytes'])} {limit}")
    if "blobs" in stats:
        print(
            f"  and {stats['blobs']} blobs (files by sha256 for cluster builds), {format_bytes(stats['blob_bytes'])}; "
            f"{format_bytes(stats['total_bytes'])} stored in all (hard links counted once)"
        )
    for stage, (count, size) in sorted(stats["stages"].items()):
        print(f"  {stage:<14} {count:>6} entries  {format_bytes(size):>10}")
    events = stats["events"]
    hits, misses = events.get("hit", 0), events.get("miss", 0)
    if hits or misses:
        print(
            f"since the log began: {hits} hits, {misses} misses ({hits / (hits + misses):.0%} hit rate), "
            f"{events.get('store', 0)} stored, {events.get('evict', 0)} evicted over the size limit, "
            f"{events.get('corrupt', 0)} corrupt entries dropped"
        )
    return 0


def _read_npz(path: str) -> dict:
    """read_npz with the file named in any error: missing, not a zip, pickled objects."""
    import zipfile

    from tpubuild.build.files import read_npz

    if os.path.isfile(path) and not zipfile.is_zipfile(path):
        raise TpuBuildError("not an .npz file (it is not a zip archive)", file=path)
    try:
        return read_npz(path)
    except FileNotFoundError:
        raise TpuBuildError("file not found", file=path) from None
    except Exception as err:  # zipfile.BadZipFile, ValueError (pickles), EOFError, OSError...
        raise TpuBuildError(f"not a readable .npz ({type(err).__name__}: {err})", file=path) from None


def _byte_count(text: str) -> int:
    """'500M' -> 524288000 (K, M, G are powers of 1024)."""
    from tpubuild.build.cache import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1000000, 500M, 2G)") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpubuild", description="ONNX -> TOP MLIR -> TPU model compiler.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="build manifests through the doit task graph")
    p.add_argument("manifests", nargs="+", metavar="MANIFEST.yaml", help="manifest files, folders or globs")
    p.add_argument("--build-dir", default="build", help="build tree and doit DB (default: ./build)")
    p.add_argument("-j", "--jobs", type=int, default=1, metavar="N", help="run N tasks in parallel")
    p.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        default=os.environ.get("TPUBUILD_SCHEDULER"),
        help="run the stages on this Dask cluster (tcp://host:8786; default: $TPUBUILD_SCHEDULER); "
        "the artifacts travel through the artifact cache (docs/distributed.md)",
    )
    p.add_argument(
        "--cache",
        metavar="URL",
        help="the artifact cache: a folder, file:// or s3://bucket/prefix, which every worker must reach "
        "(default: $TPUBUILD_ARTIFACT_CACHE)",
    )
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("infer", help="reference inference of a stage file (.mlir)")
    p.add_argument("mlir", metavar="FILE.mlir")
    p.add_argument("--input", required=True, metavar="in.npz", help="one array per graph input, by name")
    p.add_argument("--output", required=True, metavar="out.npz")
    p.add_argument("--all-tensors", action="store_true", help="write every tensor, not only graph outputs")
    p.add_argument(
        "--real",
        action="store_true",
        help="write quantized tensors as real values (scale * (q - zero point)) and f16/bf16 ones as "
        "float32, and graph outputs under their source model (ONNX) names, to compare a tpu.mlir with TOP or "
        "onnxruntime by name; default: the stored values",
    )
    p.set_defaults(func=cmd_infer)

    p = sub.add_parser(
        "run",
        help="run a .model file on the simulated chip (outputs and a cycle estimate), or a .vmfb with IREE on this CPU",
    )
    p.add_argument("model", metavar="MODEL.model|MODEL.vmfb")
    p.add_argument("--input", required=True, metavar="in.npz", help="one array per model input, by name")
    p.add_argument(
        "--output",
        required=True,
        metavar="out.npz",
        help="the model outputs by their names in the source model (ONNX), as float32 real values",
    )
    p.add_argument("--stored", action="store_true", help="write the outputs in their stored types instead")
    p.add_argument("--profile", metavar="profile.json", help="write cycles, time, DDR bytes and utilisation here")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "export", help="export a TOP .mlir (origin or canonical) to upstream MLIR: tosa, linalg, arith, math, tensor"
    )
    p.add_argument("--tosa", required=True, dest="mlir", metavar="FILE.mlir", help="the TOP module (weights beside it)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.mlir")
    p.add_argument(
        "--inline-weights",
        action="store_true",
        help="weights as inline dense hex instead of dense_resource blobs (what IREE's f32->f16 demotion needs)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("compare", help="compare two .npz files tensor by tensor (B is the reference)")
    p.add_argument("a", metavar="A.npz")
    p.add_argument("b", metavar="B.npz")
    p.add_argument(
        "--tolerance",
        default="0.99,0.99",
        metavar="COS,EUC",
        help="minimum cosine and euclidean similarity (default: 0.99,0.99)",
    )
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("ops", help="list the supported ONNX ops and the opsets their converters start at")
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser("cache", help="the artifact cache of stage outputs: stats, prune")
    cache_sub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    cache_sub.add_parser("stats", help="entries, bytes per stage, hits and misses")
    q = cache_sub.add_parser(
        "prune",
        help="remove entries unused for DAYS, then the least recently used past N bytes (a cache at a URL: its "
        "blobs too)",
    )
    q.add_argument("--max-bytes", type=_byte_count, metavar="N", help="keep at most N bytes (suffixes K, M, G)")
    q.add_argument("--older-than", type=float, metavar="DAYS", help="remove entries unused for DAYS days")
    p.set_defaults(func=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TpuBuildError as err:
        print(f"tpubuild: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tpubuild: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tpubuild ops | head`: the reader left; say nothing more, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
