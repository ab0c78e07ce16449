"""Input checks shared by the estimators: ``ValueError`` naming what was expected and what came."""

from __future__ import annotations

import torch
from torch import Tensor


def check_matrix(name: str, tensor: Tensor, *, min_rows: int = 1, cols: int | None = None) -> None:
    """Validate a 2-D floating tensor with finite values.

    Raises:
        ValueError: if ``tensor`` is not 2-D floating, has fewer than ``min_rows`` rows, has a
            column count other than ``cols``, or holds NaN/inf.
    """
    if not isinstance(tensor, Tensor):
        raise ValueError(f"Expected `{name}` to be a torch.Tensor, but got {type(tensor).__name__}")
    if tensor.ndim != 2:
        raise ValueError(f"Expected `{name}` to be 2-D, but got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"Expected `{name}` to be floating point, but got {tensor.dtype}")
    if tensor.shape[0] < min_rows:
        raise ValueError(
            f"Expected `{name}` to have at least {min_rows} rows, but got {tensor.shape[0]}"
        )
    if cols is not None and tensor.shape[1] != cols:
        raise ValueError(
            f"Expected `{name}` to have {cols} columns (dimension mismatch), "
            f"but got shape {tuple(tensor.shape)}"
        )
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"Expected `{name}` to hold only finite values, but found NaN or inf")


def validate_inputs(features: Tensor, prototypes: Tensor, *, normalize: bool = False) -> None:
    """Check shapes and values of ``features`` ``(N, d)`` and ``prototypes`` ``(K, d)``.

    Raises:
        ValueError: K < 2, N < 1, a dimension mismatch, non-finite values, or (with
            ``normalize``) a zero-norm row.
    """
    check_matrix("prototypes", prototypes)
    if prototypes.shape[0] < 2:
        raise ValueError(f"Expected at least 2 classes (K >= 2), but got K={prototypes.shape[0]}")
    check_matrix("features", features, min_rows=1, cols=prototypes.shape[1])
    if normalize:
        for name, tensor in (("features", features), ("prototypes", prototypes)):
            if bool((tensor.norm(dim=1) == 0).any()):
                raise ValueError(
                    f"Expected every row of `{name}` to have non-zero norm to normalise"
                )
