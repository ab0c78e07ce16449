r"""The moment sums a feature store keeps beside its features: a refit skips their pass.

A store may hold ``moments.pt``: the float64 moment sums of its usable features
(:class:`frolic_tta.gda.MomentSums` as a dict: N, :math:`\sum_i x_i`, :math:`\sum_i x_i x_i^\top`
and the zero-shot soft sums), with the prototypes ``(K, d)`` and :math:`\tau_c` they were
computed under. The manifest lists the file with its size and SHA-256 (checked when the store
is read, as the shards are). A refit uses the sums only where its prototypes are *bitwise* the
stored ones and its :math:`\tau_c` the same (other prompts, another text tower's device or
precision: computed again), and only once its own N and :math:`\sum_i x_i`, summed over its
batches, agree with them (:func:`same_samples`; a partial run computes them again). The
sums are written by ``frolic_tta.lightning.store`` (the data room only stores and checks them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from frolic_tta.data.store_files import (
    ADVICE,
    MANIFEST,
    FeatureStoreError,
    check_listed,
    load_listed,
)
from frolic_tta.data.store_key import file_sha256

__all__ = ["MOMENTS", "StoredMoments", "read_moments", "same_samples", "write_moments"]

MOMENTS = "moments.pt"


@dataclass(frozen=True)
class StoredMoments:
    """A store's moment sums (``sums``: field name -> float64 tensor, the fields of
    :class:`frolic_tta.gda.MomentSums`), the ``prototypes`` ``(K, d)`` and ``tau_c`` of their
    zero-shot posterior."""

    sums: dict[str, Tensor]
    prototypes: Tensor
    tau_c: float

    def for_run(self, prototypes: Tensor, tau_c: float) -> dict[str, Tensor] | None:
        """The sums where ``prototypes`` are bitwise the stored ones and ``tau_c`` the same,
        else ``None``. The prototypes' bits can follow the matrix library's kernels and thread
        count (MKL's AVX2 kernels on an Intel Xeon: 84 of 96 entries 1.6e-7 apart between 2
        threads and 1): a run encoded otherwise computes the sums again."""
        same = tau_c == self.tau_c and prototypes.shape == self.prototypes.shape
        stored = self.prototypes.to(prototypes.device, prototypes.dtype)
        if not same or not torch.equal(stored, prototypes.detach()):
            return None
        return self.sums


def write_moments(
    directory: str | os.PathLike[str], sums: dict[str, Tensor], prototypes: Tensor, tau_c: float
) -> dict[str, Any]:
    """Save ``sums`` (float64, on the CPU) with ``prototypes`` and ``tau_c`` as
    :data:`MOMENTS` in a store whose manifest is written, and list it there (atomically).
    Returns the manifest entry."""
    folder = Path(directory)
    path = folder / MOMENTS
    state = {
        "sums": {k: v.detach().to("cpu", torch.float64) for k, v in sums.items() if v is not None},
        "prototypes": prototypes.detach().float().cpu(),
        "tau_c": float(tau_c),
    }
    torch.save(state, path)
    entry = {
        "file": MOMENTS,
        "bytes": path.stat().st_size,
        "sha256": file_sha256(path),
        "num_classes": int(prototypes.shape[0]),
        "tau_c": float(tau_c),
    }
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["moments"] = entry
    temporary = folder / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    temporary.replace(folder / MANIFEST)
    return entry


def read_moments(
    directory: str | os.PathLike[str], manifest: dict[str, Any], verify: bool = True
) -> StoredMoments | None:
    """The store's moments (``None`` when its manifest lists none).

    Raises:
        FeatureStoreError: the file is missing, changed (size or SHA-256, with ``verify``) or
            unreadable.
    """
    entry = manifest.get("moments")
    if entry is None:
        return None
    folder = Path(directory)
    path, what = folder / MOMENTS, f"'{MOMENTS}'"
    if not path.is_file():
        raise FeatureStoreError(
            f"Expected {what} in the feature store '{folder}' (its {MANIFEST} lists it), "
            f"but it is missing: {ADVICE}"
        )
    if verify:
        check_listed(path, folder, entry.get("bytes"), entry.get("sha256"), what)
    state = load_listed(path, folder, what, lambda s: (s["sums"], s["prototypes"], s["tau_c"]))
    return StoredMoments(dict(state["sums"]), state["prototypes"], float(state["tau_c"]))


def same_samples(count: Tensor, feature_sum: Tensor, stored: dict[str, Tensor]) -> bool:
    r"""Whether a run's N and :math:`\sum_i x_i` ``(d,)`` (summed over all its ranks, float64)
    are the stored ones: N exactly, the sum to float64 rounding of a sum in another order
    (``1e-12 N`` per coordinate; one sample more, less or other moves it by about
    :math:`1/\sqrt d`)."""
    if float(count) != float(stored["count"]) or feature_sum.shape != stored["feature_sum"].shape:
        return False
    gap = (feature_sum.double().cpu() - stored["feature_sum"]).abs().max()
    return bool(gap <= 1e-12 * max(1.0, float(count)))

