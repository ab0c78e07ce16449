"""Input checks shared by the estimators: ``ValueError`` naming what was expected and what came."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from frolic_tta.errors import FrolicInputError, warn

if TYPE_CHECKING:
    from frolic_tta.gda import MomentSums
    from frolic_tta.logits import ReduceFn


def identity_reduce(tensor: Tensor) -> Tensor:
    """The reduce function of a single process: returns its input."""
    return tensor


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


def identical_prototypes(prototypes: Tensor) -> list[tuple[int, int]]:
    """Pairs ``(first, other)`` of classes whose prototypes ``(K, d)`` are the same row (one
    sort of the rows, no K x K matrix), each ``other`` paired with the first of its twins."""
    _, inverse = torch.unique(prototypes.detach(), dim=0, return_inverse=True)
    first: dict[int, int] = {}
    pairs = []
    for index, group in enumerate(inverse.tolist()):
        if group in first:
            pairs.append((first[group], index))
        else:
            first[group] = index
    return pairs


def warn_identical_prototypes(prototypes: Tensor, bias: str) -> None:
    """Warn where two classes have the same prototype row (:func:`identical_prototypes`); with
    the hard pseudo-labels of ``bias`` ``"paper"`` or ``"released"`` the result then depends on
    the classes' order (a tie's argmax is the first)."""
    if not (twins := identical_prototypes(prototypes)):
        return
    first, other = twins[0]
    message = (
        f"classes {first} and {other} have identical prototypes ({len(twins)} such pair(s)): "
        "no classifier can tell them apart"
    )
    if bias in ("paper", "released"):
        message += (
            f"; with bias={bias!r} (hard pseudo-labels) every tied sample goes to the first of "
            "them, so the other classes' results depend on their order"
        )
    warn(message)


def check_invertible(sigma: Tensor) -> None:
    r"""Raise where Eq. 7's covariance ``(d, d)`` is numerically singular: its smallest
    eigenvalue in magnitude at most :math:`d\,\epsilon` of its largest (NumPy's
    ``matrix_rank`` tolerance, float64). Eq. 7 is indefinite on unit-norm features (trace 0),
    so no positive-definiteness can be asked of it, only invertibility; an LU solve accepts
    pivots of 1e-19 (N = 20 < d = 32: rank 18) and returns logits of 1e8 that follow the row
    order. The decision is on reduced sums: every shard raises together.

    Raises:
        FrolicInputError: the covariance is singular (fewer samples than dimensions, or
            identical features).
    """
    magnitudes = torch.linalg.eigvalsh(sigma).abs()
    limit = sigma.shape[0] * torch.finfo(sigma.dtype).eps * float(magnitudes.max())
    rank = int((magnitudes > limit).sum())
    if rank < sigma.shape[0]:
        raise FrolicInputError(
            f"Expected the Eq. 7 covariance to be invertible, but it is singular (rank {rank} "
            f"of {sigma.shape[0]}: fewer samples than dimensions, or identical features); use "
            "covariance='soft' (--model.options.covariance soft)"
        )


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


def check_shards_together(
    reduce_fn: Callable[[Tensor], Tensor],
    tensors: Sequence[tuple[str, Any]] = (),
    *,
    normalize: bool | None = False,
    labels: Any = None,
) -> None:
    """Check every shard's values with one reduction, so that all shards raise or none does
    (a shard raising alone leaves the others waiting in their next collective).

    Args:
        reduce_fn: sums a tensor over shards.
        tensors: ``(name, value)`` pairs; the ``(N_local, K)`` tensors among them are checked
            for NaN/inf and for equal shapes (other values, e.g. a ``LogitSource``, are passed).
        normalize: ``True``: a zero row cannot be normalised; ``None``: rows must be unit-norm
            (both for the first tensor, the features).
        labels: ``(N_local,)`` integer labels in ``[0, K)`` of the first value's ``(N_local,
            K)`` (a tensor or a ``LogitSource``), or ``None``.

    Raises:
        ValueError: on every shard, when any shard holds NaN/inf, a zero or non-unit row
            (``normalize``), tensors of differing shapes, or a bad label.
    """
    found = [(n, t) for n, t in tensors if isinstance(t, Tensor)]
    if not found and labels is None:  # nothing to check (a LogitSource): no reduction
        return
    for name, tensor in found:
        check_matrix(name, tensor, min_rows=0, finite=False)
    local = [float((~torch.isfinite(t)).any(dim=1).sum()) if t.numel() else 0.0 for _, t in found]
    local.append(float(len({tuple(t.shape) for _, t in found}) > 1))
    first = found[0][1] if found else None
    zero = normalize is True and first is not None and bool(first.numel())
    local.append(float((first.norm(dim=1) == 0).sum()) if zero else 0.0)
    local.append(float(non_unit_rows(first)) if normalize is None and first is not None else 0.0)
    if labels is not None:
        of = tensors[0][1] if tensors else None
        num_samples, num_classes = (
            tuple(of.shape)
            if isinstance(of, Tensor)
            else (getattr(of, "num_samples", 0), getattr(of, "num_classes", 0))
        )
        labels = torch.as_tensor(labels)
        integer = not (
            labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool
        )
        shaped = integer and labels.shape == (num_samples,)
        outside = ((labels < 0) | (labels >= num_classes)).sum() if shaped else 0
        local.append(float(not shaped) + float(outside))
    counts = [int(v) for v in reduce_fn(torch.tensor(local, dtype=torch.float64)).tolist()]
    for (name, _), bad in zip(found, counts, strict=False):
        if bad:
            raise ValueError(
                f"Expected `{name}` to hold only finite values, but found NaN or inf in {bad} "
                "row(s) over all shards"
            )
    mismatch, zeros, off = counts[len(found) : len(found) + 3]
    names = " and ".join(f"`{n}`" for n, _ in found)
    if mismatch:
        raise ValueError(
            f"Expected {names} to have the same shape on every shard, but they differ on "
            f"{mismatch} shard(s)"
        )
    if zeros:
        raise ValueError(
            f"Expected every row of `{found[0][0]}` to have non-zero norm to normalise, but "
            f"{zeros} row(s) over all shards are zero"
        )
    if normalize is None and first is not None:
        check_unit_rows(found[0][0], first, count=off)
    if labels is not None and counts[-1]:
        raise ValueError(
            f"Expected integer `labels` of shape (N,) with values in [0, {num_classes - 1}] on "
            f"every shard, but {counts[-1]} label(s) or shard(s) over all shards are not"
        )


def check_sums_shapes(sums: Any, prototypes: Tensor) -> None:
    """Raise unless ``sums`` (:class:`~frolic_tta.gda.MomentSums`) fit ``prototypes``
    ``(K, d)`` and count at least one sample.

    Raises:
        ValueError: a field of another shape, or a count that is not > 0.
    """
    k, d = prototypes.shape
    expected = {"count": (), "feature_sum": (d,), "outer_sum": (d, d), "soft_count": (k,),
                "soft_sum": (k, d)}  # fmt: skip
    wrong = {
        name: tuple(getattr(sums, name).shape)
        for name, shape in expected.items()
        if tuple(getattr(sums, name).shape) != shape
    }
    if wrong:
        raise ValueError(
            f"Expected `sums` for K={k} classes and d={d} dimensions ({expected}), but got {wrong}"
        )
    if not float(sums.count) > 0:
        raise ValueError(f"Expected `sums` of at least one sample, but their count is {sums.count}")


def check_samples_everywhere(
    features: Tensor,
    reduce_fn: ReduceFn,
    sums: MomentSums | None = None,
    prototypes: Tensor | None = None,
) -> None:
    """Raise on every shard together if any shard holds a non-finite feature, if all shards
    together hold fewer than 2 samples, or if given ``sums`` are not those of ``features`` (one
    reduction).

    Raises:
        ValueError: NaN or inf in the features of some shard, N < 2 over all shards, or
            ``sums`` of other shapes, empty, or whose count and feature sum contradict the
            features (all shards raise, so none is left waiting in a collective).
    """
    if sums is not None and prototypes is not None:
        check_sums_shapes(sums, prototypes)  # reduced sums: the same on every shard
    local = 0
    if features.numel():  # a NaN or inf makes its row's sum non-finite: only those rows are
        suspect = ~torch.isfinite(features.sum(1))  # looked at entry by entry (one cheap pass)
        if bool(suspect.any()):
            local = int((~torch.isfinite(features[suspect])).any(dim=1).sum())
    counts = torch.tensor([float(local), float(features.shape[0])], dtype=torch.float64)
    if sums is not None:  # column sums in float32 (float64 input: float64): far inside the
        wide = torch.float64 if features.dtype == torch.float64 else torch.float32  # 1e-6 N test
        counts = torch.cat([counts, features.sum(0, dtype=wide).to(torch.float64).cpu()])
    reduced = reduce_fn(counts)
    bad, total = (int(v) for v in reduced[:2].tolist())
    if bad:
        raise ValueError(
            f"Expected finite features, but {bad} sample(s) hold NaN or inf; drop or "
            "repair them before fitting (FrolicModule skips them and reports their indices)"
        )
    if total < 2:
        where = "" if reduce_fn is identity_reduce else " over all shards"
        raise ValueError(f"Expected at least 2 samples (N >= 2){where}, but got N={total}")
    if sums is not None:
        given = float(sums.count)
        gap = float((sums.feature_sum.double().cpu() - reduced[2:]).abs().max())
        if abs(given - total) > 0.5 or gap > 1e-6 * max(1.0, total):
            raise ValueError(
                f"Expected `sums` to be the moment sums of `features` (N={total}), but their "
                f"count is {given:g} and their feature sum differs by up to {gap:.3g}: pass the "
                "sums of these features (reduced over all shards), or sums=None"
            )
