r"""Statistics accumulated across ranks, as torchmetrics ``Metric`` states.

* :class:`FrolicMoments` -- the sums Frolic's head needs (its functional twin is
  :func:`frolic_tta.gda.moment_sums`). Every state is a float64 sum with
  ``dist_reduce_fx="sum"``, so torchmetrics' sync (or :meth:`MomentSums.reduce` with any
  all-reduce) merges shards exactly; ``compute()`` returns the reduced
  :class:`~frolic_tta.gda.MomentSums`.
* :func:`row_accuracies` and :func:`update_row_accuracies` -- the accuracy of every row of
  :data:`frolic_tta.rows.ROWS`, one ``MulticlassAccuracy`` per row, fed chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from frolic_tta.gda import MomentSums, moment_sums
from frolic_tta.logits import DEFAULT_CHUNK_SIZE, AffineMap
from frolic_tta.rows import available_rows


class FrolicMoments(Metric):
    r"""Accumulates :math:`N`, :math:`\sum_i x_i`, :math:`\sum_i x_i x_i^\top` and the zero-shot
    soft sums :math:`\sum_i p_{ij}`, :math:`\sum_i p_{ij} x_i` (see :mod:`frolic_tta.gda`).

    Args:
        prototypes: ``(K, d)`` class prototypes (a buffer; moves with the metric).
        tau_c: zero-shot temperature of the soft assignments.

    Memory: :math:`O(d^2 + K d)` float64, independent of N.

    Example::

        >>> import torch
        >>> metric = FrolicMoments(torch.eye(3))
        >>> metric.update(torch.eye(3))
        >>> float(metric.compute().count)
        3.0
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    count: Tensor
    feature_sum: Tensor
    outer_sum: Tensor
    soft_count: Tensor
    soft_sum: Tensor
    prototypes: Tensor

    def __init__(self, prototypes: Tensor, tau_c: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if prototypes.ndim != 2:
            raise ValueError(
                f"Expected `prototypes` of shape (K, d), but got {tuple(prototypes.shape)}"
            )
        k, d = prototypes.shape
        self.tau_c = tau_c
        self.register_buffer(
            "prototypes", prototypes.detach().to(torch.float64).clone(), persistent=False
        )
        f64 = torch.float64
        self.add_state("count", torch.zeros((), dtype=f64), dist_reduce_fx="sum")
        self.add_state("feature_sum", torch.zeros(d, dtype=f64), dist_reduce_fx="sum")
        self.add_state("outer_sum", torch.zeros(d, d, dtype=f64), dist_reduce_fx="sum")
        self.add_state("soft_count", torch.zeros(k, dtype=f64), dist_reduce_fx="sum")
        self.add_state("soft_sum", torch.zeros(k, d, dtype=f64), dist_reduce_fx="sum")

    def update(self, features: Tensor) -> None:
        """Add a batch of features ``(n, d)`` (any float dtype; accumulated in float64)."""
        if features.ndim != 2 or features.shape[1] != self.prototypes.shape[1]:
            raise ValueError(
                f"Expected `features` of shape (n, {self.prototypes.shape[1]}), "
                f"but got {tuple(features.shape)}"
            )
        sums = moment_sums(features.to(self.prototypes.device), self.prototypes, self.tau_c)
        self.count += sums.count
        self.feature_sum += sums.feature_sum
        self.outer_sum += sums.outer_sum
        self.soft_count += sums.soft_count
        self.soft_sum += sums.soft_sum

    def compute(self) -> MomentSums:
        """The (synced) sums as float64 :class:`MomentSums`."""
        return MomentSums(
            self.count.double(),
            self.feature_sum.double(),
            self.outer_sum.double(),
            self.soft_count.double(),
            self.soft_sum.double(),
        )


def metric_key(row: str) -> str:
    """A logger-friendly name for a row: ``"f_c - ln beta"`` -> ``"acc/f_c-ln_beta"``."""
    return "acc/" + row.replace(" - ", "-").replace(" + ", "+").replace(" ", "_")


def row_accuracies(num_classes: int, labelled: bool = True) -> MetricCollection:
    """One micro-averaged multiclass accuracy per available row, keyed by :func:`metric_key`."""
    return MetricCollection(
        {
            metric_key(row): MulticlassAccuracy(num_classes, average="micro")
            for row in available_rows(num_classes, labelled)
        }
    )


def update_row_accuracies(
    metrics: MetricCollection,
    rows: dict[str, AffineMap],
    features: Tensor,
    labels: Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> None:
    """Feed every row's predictions on the local shard ``features`` ``(N_local, d)`` into
    ``metrics`` (chunked; no ``(N, K)`` tensor)."""
    for row, classifier in rows.items():
        metric = metrics[metric_key(row)]
        for start, logits in classifier.source(features, chunk_size).chunks():
            target = labels[start : start + logits.shape[0]].to(logits.device)
            metric.update(logits.argmax(1), target)
