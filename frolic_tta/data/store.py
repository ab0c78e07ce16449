r"""The feature store: image features saved once, refit many times without the image encoder.

A store is a folder holding one shard per rank of the run that wrote it,
``features_rank{r}.pt`` (``index`` ``(n_r,)`` global dataset indices, ``features`` ``(n_r, d)``
L2-normalised, float32 or float16, ``label`` ``(n_r,)`` when labelled), and ``manifest.json``,
written last: the *key* of what produced the features, N, d, the dtype, each shard's size and
SHA-256, and how the run was made (world size, precision, accelerator, versions; recorded, not
compared). Shards are joined by global index, so a store written by 8 processes is read by 1
and vice versa.

The key (:func:`~frolic_tta.data.store_key.feature_key`, importable from here) names
everything that decides the features: the model (name, and a hash of its config file when it is
a path), the weights (the open_clip tag, or a SHA-256 of the checkpoint file or ``local-dir:``
folder), the image preprocessing, the dataset, its split, ``limit``, N and a hash of the
per-index file paths (relative to their common folder, so a moved dataset still matches) and
file sizes. A store is read only when its key equals the run's; anything else (another key, a
shard missing, changed or unreadable, an index missing or twice, a manifest naming a file
outside the store) raises :class:`FeatureStoreError` with one sentence, and nothing is reused.

**Concurrent writers.** A run writes its shards and manifest into a private folder beside the
store (:func:`staging_dir`) and publishes it whole by renaming (:func:`publish`); an earlier
store is moved aside first and deleted. A reader sees a complete store or none, never shards of
two runs under one manifest; of two runs writing one store, the one that publishes last stays.
Every shard records the key of the run that wrote it: a manifest vouches only for shards of its
own key (:func:`write_manifest` refuses another run's), and a read refuses a shard whose key is
not its manifest's, so two runs writing one folder directly (A's shard, B's shard, B's manifest,
A's manifest) give A's key A's features or a :class:`FeatureStoreError`, never B's.

Shapes: N samples, d embedding dim.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from frolic_tta.data.feature_dataset import FeatureDataset, collate_stored
from frolic_tta.data.store_files import (
    MANIFEST,
    FeatureStoreError,
    check_listed,
    load_listed,
    short,
)
from frolic_tta.data.store_key import (
    FORMAT,
    feature_key,
    file_sha256,
    preprocess_signature,
    samples_fingerprint,
    weights_fingerprint,
)
from frolic_tta.data.store_moments import StoredMoments, read_moments

__all__ = [
    "DTYPES",
    "FORMAT",
    "MANIFEST",
    "FeatureDataset",
    "collate_stored",
    "FeatureStoreError",
    "StoredFeatures",
    "feature_key",
    "file_sha256",
    "has_manifest",
    "load_store",
    "preprocess_signature",
    "samples_fingerprint",
    "publish",
    "shard_name",
    "staging_dir",
    "weights_fingerprint",
    "write_manifest",
    "write_shard",
]

DTYPES = {"float32": torch.float32, "float16": torch.float16}
"""Storage dtypes: ``float16`` halves the size; read back as float32 and re-normalised."""


def shard_name(rank: int) -> str:
    """File name of rank ``rank``'s shard."""
    return f"features_rank{rank}.pt"


def has_manifest(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a finished store (its manifest is written last)."""
    return (Path(directory) / MANIFEST).is_file()


def _key_diffs(stored: Any, expected: dict[str, Any], ours: str, theirs: str) -> list[str]:
    """``"<field>: <ours> <value>, <theirs> <value>"`` for every field where the keys differ
    (both compared as JSON, as the manifest keeps them)."""
    stored = json.loads(json.dumps(stored)) if isinstance(stored, dict) else {}
    expected = json.loads(json.dumps(expected))
    order = list(expected) + sorted(f for f in stored if f not in expected)
    return [
        f"{f}: {ours} {short(expected.get(f))!s}, {theirs} {short(stored.get(f))!s}"
        for f in order
        if stored.get(f) != expected.get(f)
    ]


def check_key(stored: dict[str, Any], expected: dict[str, Any], directory: Path) -> None:
    """Raise :class:`FeatureStoreError` naming every field where ``stored`` differs."""
    diffs = _key_diffs(stored, expected, "this run", "the store")
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
    *,
    key: dict[str, Any],
) -> Path:
    """Save one rank's ``index`` ``(n,)``, ``features`` ``(n, d)``, ``labels`` ``(n,)`` and,
    when any sample has one, the reason per sample it could not be read (``""``: read), with
    the run's ``key`` (:func:`feature_key`): the manifest of another key does not vouch for it."""
    path = Path(directory) / shard_name(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    shard: dict[str, Any] = {"index": index.long().cpu(), "features": features.cpu()}
    shard["key"] = json.loads(json.dumps(key))  # as the manifest keeps it
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
        FeatureStoreError: a shard is missing, unreadable or written with another key (another
            run wrote the folder at the same time), shards differ in d, or they hold another
            number of samples than the key's ``num_samples`` (a run that saw part of the data,
            e.g. with ``limit_predict_batches``, writes no store).
    """
    folder = Path(directory)
    shards, total, dim, dtype, labelled = [], 0, None, None, False
    for rank in range(world_size):
        path = folder / shard_name(rank)
        part = _load_shard(path, folder)
        diffs = _key_diffs(part.get("key"), key, "this run", "the shard")
        if diffs:
            raise FeatureStoreError(
                f"Expected shard '{path.name}' in '{folder}' to be written by this run, but it "
                f"holds the features of another ({'; '.join(diffs)}): two runs wrote one store "
                "folder at once; write it again"
            )
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


def staging_dir(directory: str | os.PathLike[str]) -> Path:
    """A new private folder beside ``directory`` for one run's store before it is published."""
    target = Path(directory)
    return target.parent / f".{target.name}.writing-{uuid.uuid4().hex[:12]}"


def publish(staging: str | os.PathLike[str], directory: str | os.PathLike[str]) -> None:
    """Move the finished store ``staging`` to ``directory`` by renaming; a store already there
    (another run's, or an earlier one) is moved aside and deleted."""
    staging, target = Path(staging), Path(directory)
    for _ in range(10):  # another run may publish between our two renames
        if target.exists():
            aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
            try:
                target.rename(aside)
            except FileNotFoundError:
                aside = None
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
        try:
            staging.rename(target)
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    raise FeatureStoreError(f"Expected to publish the feature store '{target}', but other runs "
                            "kept replacing it: write it once, then read it")  # fmt: skip


# ------------------------------------------------------------------ reading
def _load_shard(path: Path, folder: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise FeatureStoreError(
            f"Expected shard '{path.name}' in the feature store '{folder}', but it is missing: "
            "delete the store, or pass --data.feature_store_mode write to encode again"
        )
    return load_listed(path, folder, f"shard '{path.name}'", _check_shard)


def _check_shard(part: dict[str, Tensor]) -> None:
    n, _ = part["features"].shape
    if part["index"].shape != (n,) or ("label" in part and part["label"].shape != (n,)):
        raise ValueError("index, features and label lengths differ")


@dataclass(frozen=True)
class StoredFeatures:
    """A loaded store: ``features`` ``(N, d)`` float32 in global index order, ``labels``
    ``(N,)`` or ``None``, the ``manifest``, ``errors`` (per sample, why its image could not
    be read, ``""`` if it was; ``None`` when every image was read) and the store's ``moments``
    (:mod:`frolic_tta.data.store_moments`; ``None``: it keeps none)."""

    features: Tensor
    labels: Tensor | None
    manifest: dict[str, Any]
    errors: list[str] | None = None
    moments: StoredMoments | None = None

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
        FeatureStoreError: no manifest, another key, a shard (or the moments file) missing,
            changed or unreadable, or an index out of range, missing or seen twice.
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
            f"{short(error)}: delete the store and encode again"
        ) from None
    outside = [name for name, _, _ in shards if name in ("", ".", "..") or Path(name).name != name]
    if outside:
        raise FeatureStoreError(
            f"Expected the shards listed in the {MANIFEST} of the feature store '{folder}' to be "
            f"files inside it, but it lists {outside[0]!r}: delete the store and encode again"
        )
    stored_key = manifest.get("key", {})
    if key is not None:
        check_key(stored_key, key, folder)
        if key.get("num_samples", n) != n:
            raise FeatureStoreError(
                f"Expected {key['num_samples']} samples in the feature store '{folder}', but "
                f"its {MANIFEST} says {n}: delete the store and encode again"
            )
    features, labels, seen = None, None, torch.zeros(n, dtype=torch.bool)
    errors: list[str] | None = None
    for name, size, sha in shards:
        path = folder / name
        if verify and path.is_file():
            check_listed(path, folder, size, sha, f"shard '{path.name}'")
        part = _load_shard(path, folder)
        recorded = part.get("key")  # None: written before shards recorded their key
        diffs = _key_diffs(recorded, stored_key, "the manifest", "the shard") if recorded else []
        if diffs:
            raise FeatureStoreError(
                f"Expected shard '{path.name}' of the feature store '{folder}' to be written "
                f"with the key of its {MANIFEST}, but it holds other features "
                f"({'; '.join(diffs)}): delete the store and encode again"
            )
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
    moments = read_moments(folder, manifest, verify)
    return StoredFeatures(features, labels, manifest, errors, moments)
