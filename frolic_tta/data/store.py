r"""The feature store: image features saved once, refit many times without the image encoder.

A store is a folder holding one shard per rank of the run that wrote it,
``features_rank{r}.pt`` (``index`` ``(n_r,)`` global dataset indices, ``features`` ``(n_r, d)``
L2-normalised, float32 or float16, ``label`` ``(n_r,)`` when labelled), and ``manifest.json``,
written last: the *key* of what produced the features, N, d, the dtype, each shard's size and
SHA-256, and how the run was made (world size, precision, accelerator, versions; recorded, not
compared). Shards are joined by global index, so a store written by 8 processes is read by 1
and vice versa.

The key (:func:`feature_key`) names everything that decides the features: the model (name,
and a hash of its config file when it is a path), the weights (the open_clip tag, or a SHA-256
of the checkpoint file or ``local-dir:`` folder), the image preprocessing, the dataset, its
split, ``limit``, N and a hash of the per-index file paths (relative to their common folder, so
a moved dataset still matches) and file sizes. A store is read only when its key equals the
run's; anything else (another key, a shard missing, changed or unreadable, an index missing or
twice) raises :class:`FeatureStoreError` with one sentence, and nothing is reused.

Shapes: N samples, d embedding dim.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "DTYPES",
    "FORMAT",
    "MANIFEST",
    "FeatureDataset",
    "FeatureStoreError",
    "StoredFeatures",
    "feature_key",
    "file_sha256",
    "has_manifest",
    "load_store",
    "preprocess_signature",
    "samples_fingerprint",
    "shard_name",
    "weights_fingerprint",
    "write_manifest",
    "write_shard",
]

FORMAT = 1
"""Version of the store layout (part of the key)."""
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16}
"""Storage dtypes: ``float16`` halves the size; read back as float32 and re-normalised."""


class FeatureStoreError(ValueError):
    """A feature store that cannot be used for this run (the message says why, in one sentence)."""


def shard_name(rank: int) -> str:
    """File name of rank ``rank``'s shard."""
    return f"features_rank{rank}.pt"


def has_manifest(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a finished store (its manifest is written last)."""
    return (Path(directory) / MANIFEST).is_file()


# ------------------------------------------------------------------ the key
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


def _short(value: Any) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= 48 else text[:45] + "..."


def check_key(stored: dict[str, Any], expected: dict[str, Any], directory: Path) -> None:
    """Raise :class:`FeatureStoreError` naming every field where ``stored`` differs."""
    order = list(expected) + sorted(f for f in stored if f not in expected)
    diffs = [
        f"{f}: this run {_short(expected.get(f))!s}, the store {_short(stored.get(f))!s}"
        for f in order
        if stored.get(f) != expected.get(f)
    ]
    if diffs:
        raise FeatureStoreError(
            f"Expected the feature store in '{directory}' to match this run, but it was written "
            f"for other features ({'; '.join(diffs)}): delete it, or pass "
            "--data.feature_store_mode write to encode again and replace it"
        )


# ------------------------------------------------------------------ writing
def write_shard(
    directory: str | os.PathLike[str],
    rank: int,
    index: Tensor,
    features: Tensor,
    labels: Tensor | None = None,
    errors: Sequence[str] | None = None,
) -> Path:
    """Save one rank's ``index`` ``(n,)``, ``features`` ``(n, d)``, ``labels`` ``(n,)`` and,
    when any sample has one, the reason per sample it could not be read (``""``: read)."""
    path = Path(directory) / shard_name(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    shard: dict[str, Any] = {"index": index.long().cpu(), "features": features.cpu()}
    if labels is not None:
        shard["label"] = labels.long().cpu()
    if errors is not None and any(errors):
        shard["error"] = [str(e) for e in errors]
    torch.save(shard, path)
    return path


def write_manifest(
    directory: str | os.PathLike[str],
    key: dict[str, Any],
    world_size: int,
    written_by: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Check the ``world_size`` shards, then write ``manifest.json`` (atomically, last).

    Raises:
        FeatureStoreError: a shard is missing or unreadable, shards differ in d, or they hold
            another number of samples than the key's ``num_samples`` (a run that saw part of
            the data, e.g. with ``limit_predict_batches``, writes no store).
    """
    folder = Path(directory)
    shards, total, dim, dtype, labelled = [], 0, None, None, False
    for rank in range(world_size):
        path = folder / shard_name(rank)
        part = _load_shard(path, folder)
        n, d = part["features"].shape
        if dim is not None and d != dim:
            raise FeatureStoreError(
                f"Expected every shard in '{folder}' to hold {dim}-dim features, but "
                f"'{path.name}' holds {d}-dim ones"
            )
        shards.append(
            {"file": path.name, "num_samples": n, "bytes": path.stat().st_size,
             "sha256": file_sha256(path)}
        )  # fmt: skip
        total += n
        dim, dtype, labelled = d, dtype or part["features"].dtype, labelled or "label" in part
    expected = key.get("num_samples")
    if expected is not None and total != expected:
        raise FeatureStoreError(
            f"Expected the shards in '{folder}' to hold all {expected} samples, but they hold "
            f"{total} (a run over part of the data writes no feature store)"
        )
    names = {v: k for k, v in DTYPES.items()}
    manifest = {
        "format": FORMAT,
        "key": key,
        "num_samples": total,
        "dim": dim,
        "dtype": names.get(dtype, str(dtype)),
        "labelled": bool(labelled),
        "shards": shards,
        "written_by": {
            "world_size": world_size,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            **(written_by or {}),
        },
    }
    temporary = folder / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    temporary.replace(folder / MANIFEST)
    return manifest


# ------------------------------------------------------------------ reading
def _load_shard(path: Path, folder: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise FeatureStoreError(
            f"Expected shard '{path.name}' in the feature store '{folder}', but it is missing: "
            "delete the store, or pass --data.feature_store_mode write to encode again"
        )
    try:
        part = torch.load(path, map_location="cpu", weights_only=True)
        n, _ = part["features"].shape
        if part["index"].shape != (n,) or ("label" in part and part["label"].shape != (n,)):
            raise ValueError("index, features and label lengths differ")
    except Exception as error:  # noqa: BLE001 - any unreadable shard is one user error
        raise FeatureStoreError(
            f"Expected a readable shard '{path.name}' in the feature store '{folder}', but "
            f"loading it failed ({_short(error)}): delete the store and encode again"
        ) from None
    return part


@dataclass(frozen=True)
class StoredFeatures:
    """A loaded store: ``features`` ``(N, d)`` float32 in global index order, ``labels``
    ``(N,)`` or ``None``, the ``manifest``, and ``errors`` (per sample, why its image could not
    be read, ``""`` if it was; ``None`` when every image was read)."""

    features: Tensor
    labels: Tensor | None
    manifest: dict[str, Any]
    errors: list[str] | None = None

    def describe(self, directory: str | os.PathLike[str]) -> str:
        """One line for reports: where the features come from."""
        m = self.manifest
        by = m["written_by"]
        how = ", ".join(f"{by[k]}" for k in ("precision", "accelerator") if by.get(k))
        return (
            f"feature store {directory} ({m['num_samples']} x {m['dim']} {m['dtype']}, written "
            f"by {by['world_size']} process{'es' if by['world_size'] != 1 else ''}"
            + (f", {how}" if how else "")
            + ")"
        )


def load_store(
    directory: str | os.PathLike[str], key: dict[str, Any] | None = None, verify: bool = True
) -> StoredFeatures:
    """Load a store written by any number of ranks, checked against ``key``.

    Args:
        directory: The store's folder.
        key: The run's :func:`feature_key`; ``None`` skips the comparison.
        verify: Compare each shard's size and SHA-256 with the manifest.

    Raises:
        FeatureStoreError: no manifest, another key, a shard missing, changed or unreadable,
            or an index out of range, missing or seen twice.
    """
    folder = Path(directory)
    if not has_manifest(folder):
        raise FeatureStoreError(
            f"Expected a feature store in '{folder}', but there is no {MANIFEST}: run once with "
            "--data.feature_store_mode auto or write to encode the images and store them"
        )
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        n = int(manifest["num_samples"])
        shards = [(str(e["file"]), int(e["bytes"]), str(e["sha256"])) for e in manifest["shards"]]
    except (ValueError, KeyError, TypeError) as error:
        raise FeatureStoreError(
            f"Expected a readable {MANIFEST} in the feature store '{folder}', but got "
            f"{_short(error)}: delete the store and encode again"
        ) from None
    if key is not None:
        check_key(manifest.get("key", {}), key, folder)
        if key.get("num_samples", n) != n:
            raise FeatureStoreError(
                f"Expected {key['num_samples']} samples in the feature store '{folder}', but "
                f"its {MANIFEST} says {n}: delete the store and encode again"
            )
    features, labels, seen = None, None, torch.zeros(n, dtype=torch.bool)
    errors: list[str] | None = None
    for name, size, sha in shards:
        path = folder / name
        checked = verify and path.is_file()
        if checked and (path.stat().st_size != size or file_sha256(path) != sha):
            raise FeatureStoreError(
                f"Expected shard '{path.name}' in the feature store '{folder}' to be the one "
                f"its {MANIFEST} lists, but its size or SHA-256 differs: delete the store "
                "and encode again"
            )
        part = _load_shard(path, folder)
        index = part["index"]
        if features is None:
            features = torch.empty(n, part["features"].shape[1], dtype=torch.float32)
            labels = torch.full((n,), -1, dtype=torch.long) if "label" in part else None
        bad = (index < 0) | (index >= n)
        if bool(bad.any()) or bool(seen[index].any()) or index.unique().numel() != index.numel():
            raise FeatureStoreError(
                f"Expected every index 0..{n - 1} once in the feature store '{folder}', but "
                f"shard '{path.name}' repeats one or is out of range: delete the store and "
                "encode again"
            )
        seen[index] = True
        features[index] = part["features"].float()
        if labels is not None and "label" in part:
            labels[index] = part["label"]
        if "error" in part:
            errors = errors or [""] * n
            for i, reason in zip(index.tolist(), part["error"], strict=True):
                errors[i] = reason
    if features is None or not bool(seen.all()):
        count = int(seen.sum())
        raise FeatureStoreError(
            f"Expected {n} samples in the feature store '{folder}', but its shards hold {count}: "
            "delete the store and encode again"
        )
    if manifest.get("dtype") != "float32":  # rounded: back on the unit sphere
        features = features / features.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return StoredFeatures(features, labels, manifest, errors)


class FeatureDataset(Dataset):
    """Stored features as FrolicModule batches: ``{"features", "index"[, "label", "error"]}``.

    ``FrolicModule.predict_step`` uses ``features`` instead of running the image encoder.

    Args:
        features: ``(N, d)`` features in global index order.
        labels: ``(N,)`` labels or ``None``.
        errors: ``N`` reasons a sample's image could not be read (``""``: read), or ``None``.
    """

    def __init__(
        self, features: Tensor, labels: Tensor | None = None, errors: list[str] | None = None
    ) -> None:
        self.features, self.labels, self.errors = features, labels, errors

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {"features": self.features[index], "index": int(index)}
        if self.labels is not None:
            item["label"] = int(self.labels[index])
        if self.errors is not None:
            item["error"] = self.errors[index]
        return item
