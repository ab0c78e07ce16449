"""Input checks shared by the estimators: ``ValueError`` naming what was expected and what came."""

from __future__ import annotations

import torch
from torch import Tensor


def check_matrix(
    name: str, tensor: Tensor, *, min_rows: int = 1, cols: int | None = None, finite: bool = True
) -> None:
    """Validate a 2-D floating tensor with finite values (``finite=False``: values unchecked).

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
    if finite and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"Expected `{name}` to hold only finite values, but found NaN or inf")


def check_prototypes(prototypes: Tensor) -> None:
    """Validate ``prototypes`` ``(K, d)``: 2-D floating, finite, K >= 2.

    Raises:
        ValueError: as :func:`check_matrix`, or K < 2.
    """
    check_matrix("prototypes", prototypes)
    if prototypes.shape[0] < 2:
        raise ValueError(f"Expected at least 2 classes (K >= 2), but got K={prototypes.shape[0]}")


def validate_inputs(
    features: Tensor, prototypes: Tensor, *, normalize: bool | None = False, min_rows: int = 1
) -> None:
    """Check shapes and values of ``features`` ``(N, d)`` and ``prototypes`` ``(K, d)``.

    Raises:
        ValueError: K < 2, N < ``min_rows``, a dimension mismatch, non-finite values, or (with
            ``normalize``) a zero-norm row.
    """
    check_prototypes(prototypes)
    check_matrix("features", features, min_rows=min_rows, cols=prototypes.shape[1])
    if normalize:
        for name, tensor in (("features", features), ("prototypes", prototypes)):
            if bool((tensor.norm(dim=1) == 0).any()):
                raise ValueError(
                    f"Expected every row of `{name}` to have non-zero norm to normalise"
                )


def unit_norm_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ``|norm - 1|`` of a unit row: 1e-3, or 4 machine epsilons of
    ``dtype`` when that is larger (float16, bfloat16)."""
    return max(1e-3, 4.0 * torch.finfo(dtype).eps)


def row_norms(tensor: Tensor) -> Tensor:
    """``(N,)`` L2 norms of the rows, in float32 (float64 for float64 input)."""
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return tensor.to(dtype).norm(dim=1)


def non_unit_rows(tensor: Tensor) -> int:
    """How many rows of ``tensor`` have a norm off 1 by more than :func:`unit_norm_tolerance`."""
    if tensor.shape[0] == 0:
        return 0
    off = (row_norms(tensor) - 1.0).abs() > unit_norm_tolerance(tensor.dtype)
    return int(off.sum())


def check_unit_rows(name: str, tensor: Tensor, *, count: int | None = None) -> None:
    """Raise unless every row of ``tensor`` has unit L2 norm (within :func:`unit_norm_tolerance`).

    Args:
        name: the argument's name in the message.
        tensor: ``(N, d)``.
        count: rows off unit norm over all shards (default: :func:`non_unit_rows` of ``tensor``),
            so every shard raises together.

    Raises:
        ValueError: some row is not unit-norm; the message offers ``normalize=True`` and
            ``normalize=False``.
    """
    count = non_unit_rows(tensor) if count is None else count
    if count == 0:
        return
    norms = row_norms(tensor)
    seen = (
        f"row norms from {float(norms.min()):.3g} to {float(norms.max()):.3g}"
        if norms.numel()
        else "no rows"
    )
    if count != non_unit_rows(tensor):
        seen += f" on this shard ({count} rows off unit norm over all shards)"
    raise ValueError(
        f"Expected unit-norm rows in `{name}` (Frolic works on L2-normalised CLIP embeddings; "
        f"open_clip's encode_image and encode_text do not normalise), but got {seen}. Pass "
        "normalize=True to normalise them, or normalize=False to use them as they are."
    )
