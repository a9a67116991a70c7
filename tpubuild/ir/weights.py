"""The weight store: named arrays in an npz file next to each .mlir."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import numpy as np

from tpubuild.build.files import read_npz, write_npz
from tpubuild.errors import TpuBuildError


class WeightStore:
    """name -> array, referenced from the IR by ``top.Weight`` ops located at the name."""

    def __init__(self, arrays: dict[str, np.ndarray] | None = None):
        self._arrays: dict[str, np.ndarray] = dict(arrays or {})

    @classmethod
    def load(cls, path: str | os.PathLike) -> WeightStore:
        try:
            return cls(read_npz(path))
        except FileNotFoundError:
            raise TpuBuildError(
                "weight file not found", file=str(path), hint="rebuild the stage that writes it"
            ) from None
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise TpuBuildError(
                f"not a readable npz weight file ({e})", file=str(path), hint="rebuild the stage that writes it"
            ) from None

    def save(self, path: str | os.PathLike) -> None:
        write_npz(path, self._arrays)

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._arrays[name]
        except KeyError:
            raise TpuBuildError(
                f"weight {name!r} is not in the weight file",
                hint="the .mlir and its weight npz are out of step; rebuild both",
            ) from None

    def __contains__(self, name: str) -> bool:
        return name in self._arrays

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def unique_name(self, base: str) -> str:
        name, i = base, 1
        while name in self._arrays:
            name = f"{base}_{i}"
            i += 1
        return name

    def add(self, base: str, array: np.ndarray) -> str:
        """Store ``array`` under ``base`` (or a fresh variant of it); returns the name used."""
        name = self.unique_name(base)
        self._arrays[name] = np.asarray(array, order="C")  # (ascontiguousarray turns 0-d into 1-d)
        return name

    def set(self, name: str, array: np.ndarray) -> None:
        self._arrays[name] = np.asarray(array, order="C")  # (ascontiguousarray turns 0-d into 1-d)

    def keep_only(self, names: Iterable[str]) -> WeightStore:
        """A store with just the named arrays (dropping weights no op refers to)."""
        return WeightStore({n: self[n] for n in sorted(set(names))})


T = TypeVar("T")


class ByIdentity(Generic[T]):
    """Values made from weight arrays, by the identity of those arrays (and ``extra``): the mixed-precision search
    lowers one model dozens of times from the same arrays, and would make each value again. An entry keeps its
    arrays, so their ids stay theirs; at ``limit`` entries the cache starts over."""

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: dict[tuple, tuple[tuple, T]] = {}

    def get(self, arrays: tuple, extra: tuple, make: Callable[[], T]) -> T:
        key = (tuple(map(id, arrays)), extra)
        hit = self._entries.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], arrays, strict=True)):
            return hit[1]
        if len(self._entries) >= self.limit:
            self._entries.clear()
        value = make()
        self._entries[key] = (arrays, value)
        return value
