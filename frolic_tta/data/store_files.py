"""Reading a feature store's files: the one error a broken store raises, and the two checks
every listed file (a shard, ``moments.pt``) goes through, each failing with one sentence.

Shared by :mod:`frolic_tta.data.store` and :mod:`frolic_tta.data.store_moments`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from frolic_tta.data.store_key import file_sha256
from frolic_tta.errors import FrolicInputError

__all__ = ["ADVICE", "MANIFEST", "FeatureStoreError", "check_listed", "load_listed", "short"]

ADVICE = "delete the store and encode again"
MANIFEST = "manifest.json"
"""The store's manifest, written last."""


class FeatureStoreError(FrolicInputError):
    """A feature store that cannot be used for this run (the message says why, in one sentence)."""


def short(value: Any, width: int = 48) -> str:
    """``value`` on one line, cut to ``width`` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def check_listed(path: Path, folder: Path, size: Any, sha: Any, what: str) -> None:
    """Raise where ``path`` (``what``, e.g. ``"shard 'features_rank0.pt'"``) is not the file
    the manifest lists: another size or SHA-256."""
    if path.stat().st_size != size or file_sha256(path) != sha:
        raise FeatureStoreError(
            f"Expected {what} in the feature store '{folder}' to be the one its {MANIFEST} "
            f"lists, but its size or SHA-256 differs: {ADVICE}"
        )


def load_listed(
    path: Path, folder: Path, what: str, check: Callable[[Any], None] | None = None
) -> Any:
    """``torch.load`` of ``path`` (tensors only), ``check`` run on what it holds; any failure is
    one :class:`FeatureStoreError` naming ``what``."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        if check is not None:
            check(loaded)
    except Exception as error:  # noqa: BLE001 - any unreadable file is one user error
        raise FeatureStoreError(
            f"Expected a readable {what} in the feature store '{folder}', but loading it "
            f"failed ({short(error)}): {ADVICE}"
        ) from None
    return loaded
