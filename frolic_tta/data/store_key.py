r"""The key of a feature store: what decides which features a run encodes (hashes, no I/O
beyond reading the files it hashes).

:func:`feature_key` is compared by :func:`frolic_tta.data.store.load_store`; its parts are the
model (name, and a hash of its config file when it is a path), the weights (the open_clip tag,
or a SHA-256 of the checkpoint file or ``local-dir:`` folder), the image preprocessing, the
dataset, split, ``limit``, N and a hash of the per-index files (:func:`samples_fingerprint`).

**When a changed image is noticed.** By default each file enters the key by its path (relative
to the common folder), size and modification time in nanoseconds: replacing, rewriting or
touching an image changes the key, and the store is not reused; moving the dataset keeps it
when the times are kept (``mv``, ``cp -p``, ``rsync -a``). A file rewritten with the same size
*and* its old time restored (``touch -r``, some archive tools) is not noticed: for that, the
full-hash mode ``--data.feature_store_verify true`` hashes every file's content instead (reads
every image once more; a store is read only in the mode it was written in, ``samples_rule``).
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

FORMAT = 2
"""Version of the store layout (part of the key; 2: file times or content in the key)."""


def file_sha256(
    path: str | os.PathLike[str],
    remember: bool = True,
    _cache: dict[Any, str] = {},  # noqa: B006
) -> str:
    """SHA-256 of a file, remembered per (path, size, mtime) within the process (``remember``
    ``False``: always read)."""
    stat = Path(path).stat()
    marker = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if marker not in _cache or not remember:
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


SAMPLES_RULES = {False: "path+size+mtime", True: "path+sha256"}
"""How each file enters :func:`samples_fingerprint`: by its size and time, or by its content."""


def samples_fingerprint(paths: Sequence[str] | None, verify: bool = False) -> str | None:
    """SHA-256 over the per-index files: relative path, size and modification time (ns), or
    with ``verify`` relative path and the SHA-256 of the content.

    A moved dataset keeps its fingerprint (when its file times are kept); a replaced or
    rewritten image changes it. ``None`` when the paths are unknown.
    """
    if not paths:
        return None
    base = os.path.commonpath([os.path.abspath(p) for p in paths])
    if len(paths) == 1:
        base = os.path.dirname(base)
    digest = hashlib.sha256()
    for path in paths:
        try:
            stat = os.stat(path)
            what = (
                file_sha256(path, remember=False)
                if verify
                else f"{stat.st_size}\t{stat.st_mtime_ns}"
            )
        except OSError:
            what = "unreadable"
        digest.update(f"{os.path.relpath(os.path.abspath(path), base)}\t{what}\n".encode())
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
    verify: bool = False,
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
        "samples": samples_fingerprint(paths, verify),
        "samples_rule": SAMPLES_RULES[bool(verify)],
    }
