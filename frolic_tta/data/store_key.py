r"""The key of a feature store: what decides which features a run encodes (hashes, no I/O
beyond reading the files it hashes).

:func:`feature_key` is compared by :func:`frolic_tta.data.store.load_store`; its parts are the
model (name, and a hash of its config file when it is a path), the weights (the open_clip tag,
or a SHA-256 of the checkpoint file or ``local-dir:`` folder), the image preprocessing, the
dataset, split, ``limit``, N and a hash of the per-index file paths (relative to their common
folder) and file sizes.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "feature_key",
    "file_sha256",
    "preprocess_signature",
    "samples_fingerprint",
    "weights_fingerprint",
]

FORMAT = 1
"""Version of the store layout (part of the key)."""


def file_sha256(path: str | os.PathLike[str], _cache: dict[Any, str] = {}) -> str:  # noqa: B006
    """SHA-256 of a file, remembered per (path, size, mtime) within the process."""
    stat = Path(path).stat()
    marker = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if marker not in _cache:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _cache[marker] = digest.hexdigest()
    return _cache[marker]


def _folder_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder)}:{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def weights_fingerprint(model_name: str, pretrained: str | None) -> dict[str, str | None]:
    """What identifies a model's architecture and weights, as :func:`feature_key` stores it.

    ``{"model_name": ..., "model_config": ..., "weights": ...}``: a model-config JSON path is
    named by its file name and the SHA-256 of its content; a ``local-dir:`` folder by the
    SHA-256 of its files; a checkpoint file by its SHA-256; an open_clip tag or ``hf-hub:`` name
    by itself (their files are fixed by open_clip and the Hub).
    """
    name = str(model_name)
    config = None
    if name.startswith("local-dir:"):
        folder = Path(name[len("local-dir:") :]).expanduser()
        return {"model_name": folder.name, "model_config": None, "weights": _folder_sha256(folder)}
    if not name.startswith("hf-hub:") and Path(name).is_file():
        config, name = f"sha256:{file_sha256(name)}", Path(name).name
    weights = pretrained
    if name.startswith("hf-hub:"):
        weights = None
    elif pretrained is not None and Path(str(pretrained)).expanduser().is_file():
        weights = f"sha256:{file_sha256(Path(str(pretrained)).expanduser())}"
    return {"model_name": name, "model_config": config, "weights": weights}


def preprocess_signature(transform: Any) -> str:
    """``repr`` of an image transform, without memory addresses (stable across processes)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))


def samples_fingerprint(paths: Sequence[str] | None) -> str | None:
    """SHA-256 of the per-index file paths, relative to their common folder, and file sizes.

    A moved dataset keeps its fingerprint; another folder with the same file names almost
    surely does not (its files differ in size). ``None`` when the paths are unknown.
    """
    if not paths:
        return None
    base = os.path.commonpath([os.path.abspath(p) for p in paths])
    if len(paths) == 1:
        base = os.path.dirname(base)
    digest = hashlib.sha256()
    for path in paths:
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1
        digest.update(f"{os.path.relpath(os.path.abspath(path), base)}\t{size}\n".encode())
    return digest.hexdigest()


def feature_key(
    model_name: str,
    pretrained: str | None,
    transform: Any,
    dataset: str,
    split: str | None,
    limit: int | None,
    num_samples: int,
    paths: Sequence[str] | None,
) -> dict[str, Any]:
    """The key of a store: everything that decides which features a run encodes.

    Not in it: text prompts and Frolic options (the refit recomputes them), batch size, and the
    precision and device of the encoding run (recorded in the manifest), so that a store
    written on GPUs in mixed precision is read by a CPU run.
    """
    return {
        "format": FORMAT,
        **weights_fingerprint(model_name, pretrained),
        "preprocess": preprocess_signature(transform),
        "dataset": dataset,
        "split": split,
        "limit": limit,
        "num_samples": int(num_samples),
        "samples": samples_fingerprint(paths),
    }
