"""``pystdlib``: byte-level text that every machine has offline — this Python's own standard library.

The corpus is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (the directory of
``os.__file__``), read as raw bytes (vocabulary 256, no decoding) in a fixed order: sorted by
their relative POSIX path. Skipped, with the reason:

* directories named ``site-packages`` / ``dist-packages`` (installed packages, not the library;
  they differ between machines with the same Python);
* ``test``, ``tests``, ``idle_test`` (the test suites: half the library's bytes, much of it
  generated fixtures) and ``__pycache__``;
* ``encodings`` and ``pydoc_data`` (generated data: charmap tables and the docs' text as one
  string literal, ~2.2 MB that is not Python code).

Split (whole files, so training and held-out never share a byte of any file):

* held-out: the files whose ``sha256(relative path)`` is 0 modulo ``held_out_every`` (default
  16), in the fixed order, concatenated and cut at ``held_out_bytes`` (default 256 KiB). A hash
  of the path, not the file's position, picks them, so a file added or removed in another Python
  version does not reshuffle which modules are held out;
* training: every other file, in the fixed order, concatenated and cut at ``max_bytes``
  (default 8 MiB). On CPython 3.11 the corpus has 610 files (9.9 MB), 33 of them held out; 8 MiB
  is ~89% of the other 577 files' 9.5 MB, and the calibration run
  (1500 steps x 4 workers x 16 x 128 bytes = 12.3M predicted bytes) makes ~1.5 passes over it.

No file is in both splits, but the library repeats itself — licence boilerplate, code shared by
``cProfile.py`` and ``profile.py`` — so on CPython 3.11 about 4% of the held-out 128-byte chunks
also occur verbatim in the training bytes (``tests/test_pystdlib.py`` bounds it at 10%).

Files are concatenated as they are, with no separator; nothing is cached on
disk — reading the ~600 files takes ~0.1 s. The bytes depend on the Python version (and on
a distribution's patches): :attr:`PyStdlibText.fingerprint` says exactly what a result trained on.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch

#: directory names skipped anywhere under the standard library (see the module docstring)
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                          "encodings", "pydoc_data"})
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_HELD_OUT_BYTES = 256 * 1024
DEFAULT_HELD_OUT_EVERY = 16


@dataclass(frozen=True)
class PyStdlibText:
    """The two splits of the corpus and what identifies them.

    Attributes:
        train: uint8 tensor (train_bytes,), the training bytes.
        held_out: uint8 tensor (held_out_bytes,), the held-out bytes (from other files).
        train_files: relative paths whose bytes ``train`` holds (the last one may be cut).
        held_out_files: relative paths whose bytes ``held_out`` holds (the last one may be cut).
        python_version: ``platform.python_version()`` of the interpreter that read the files.
        stdlib: the directory that was read.
        train_sha256, held_out_sha256: hex sha256 of each split's bytes.
    """

    train: torch.Tensor
    held_out: torch.Tensor
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    python_version: str
    stdlib: str
    train_sha256: str
    held_out_sha256: str

    @property
    def fingerprint(self) -> str:
        """``"pystdlib-py<version>-<16 hex>"``: the Python version and the first 64 bits of the
        sha256 of both splits' digests (equal fingerprints: the same bytes in both splits)."""
        both = hashlib.sha256(f"{self.train_sha256}:{self.held_out_sha256}".encode()).hexdigest()
        return f"pystdlib-py{self.python_version}-{both[:16]}"

    def info(self) -> dict[str, Any]:
        """JSON-ready description for result files: fingerprint, version, sizes, digests, files."""
        return {"data": "pystdlib", "fingerprint": self.fingerprint, "python_version": self.python_version,
                "stdlib": self.stdlib, "train_bytes": int(self.train.numel()),
                "held_out_bytes": int(self.held_out.numel()), "train_sha256": self.train_sha256,
                "held_out_sha256": self.held_out_sha256, "train_files": len(self.train_files),
                "held_out_files": list(self.held_out_files)}


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative POSIX paths of the corpus's ``.py`` files under ``root`` (default: this Python's
    standard library), sorted; the :data:`SKIPPED_DIRS` are pruned, never entered."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if name not in SKIPPED_DIRS]
        relative = os.path.relpath(folder, root)
        for name in files:
            if name.endswith(".py"):
                path = name if relative == "." else os.path.join(relative, name)
                found.append(path.replace(os.sep, "/"))
    return sorted(found)


def is_held_out(relative_path: str, every: int) -> bool:
    """True when ``relative_path`` belongs to the held-out files (1 in ``every`` on average)."""
    return int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) % every == 0


def _collect(root: str, paths: list[str], limit: int) -> tuple[bytes, tuple[str, ...]]:
    """The first ``limit`` bytes of ``paths`` concatenated, and the paths that contributed."""
    chunks, used, size = [], [], 0
    for path in paths:
        if size >= limit:
            break
        with open(os.path.join(root, path), "rb") as handle:
            chunk = handle.read(limit - size)
        chunks.append(chunk)
        used.append(path)
        size += len(chunk)
    return b"".join(chunks), tuple(used)


@functools.lru_cache(maxsize=4)  # train_method builds the workload once per method: read once per process
def pystdlib(max_bytes: int = DEFAULT_MAX_BYTES, held_out_bytes: int = DEFAULT_HELD_OUT_BYTES,
             held_out_every: int = DEFAULT_HELD_OUT_EVERY, root: str | None = None) -> PyStdlibText:
    """Read the standard library's sources and split them (see the module docstring).

    Args:
        max_bytes: cap on the training split, in bytes (it is shorter if the files run out).
        held_out_bytes: exact size of the held-out split, in bytes.
        held_out_every: about 1 in this many files is held out (by a hash of its path).
        root: the directory to read (default ``sysconfig.get_paths()["stdlib"]``; for tests).

    Returns:
        A :class:`PyStdlibText` (cached per arguments: the tensors are shared, treat them as
        read-only).

    Raises:
        ValueError: a size or ``held_out_every`` below 1 (or 2), or the held-out files holding
            fewer than ``held_out_bytes`` bytes.
    """
    for name, value, low in (("max_bytes", max_bytes, 1), ("held_out_bytes", held_out_bytes, 1),
                             ("held_out_every", held_out_every, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    root = root or sysconfig.get_paths()["stdlib"]
    paths = stdlib_files(root)
    held = [path for path in paths if is_held_out(path, held_out_every)]
    held_set = set(held)
    held_bytes, held_files = _collect(root, held, held_out_bytes)
    if len(held_bytes) < held_out_bytes:
        raise ValueError(f"held_out_bytes={held_out_bytes}: the held-out files of {root} hold only "
                         f"{len(held_bytes)} bytes")
    train_bytes, train_files = _collect(root, [path for path in paths if path not in held_set], max_bytes)

    def tensor(raw: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)

    return PyStdlibText(tensor(train_bytes), tensor(held_bytes), train_files, held_files, platform.python_version(),
                        root, hashlib.sha256(train_bytes).hexdigest(), hashlib.sha256(held_bytes).hexdigest())
