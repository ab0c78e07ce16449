r"""Statistics accumulated across ranks, as torchmetrics ``Metric`` states.

* :class:`FrolicMoments` -- the sums Frolic's head needs (its functional twin is
  :func:`frolic_tta.gda.moment_sums`). Every state is a float64 sum with
  ``dist_reduce_fx="sum"``, so torchmetrics' sync (or :meth:`MomentSums.reduce` with any
  all-reduce) merges shards exactly; ``compute()`` returns the reduced
  :class:`~frolic_tta.gda.MomentSums`.
* :func:`row_metrics`, :func:`update_row_metrics` and :func:`compute_row_metrics` -- what
  users compare on, for every row of :data:`frolic_tta.rows.ROWS`: top-1 and top-5 accuracy,
  mean per-class recall, expected calibration error, negative log-likelihood and per-class
  accuracy (:data:`ROW_METRICS`), torchmetrics metrics fed chunk by chunk (no ``(N, K)``
  tensor beyond one chunk) and synced over the process group by ``compute()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassRecall

from frolic_tta.gda import MomentSums, moment_sums, scaled_zero_shot
from frolic_tta.head import FrolicHead
from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    AffineMap,
    RowBuffer,
    TensorLogits,
    compute_dtype,
    workspace,
)
from frolic_tta.options import check_positive
from frolic_tta.rows import ROWS, available_rows
from frolic_tta.scores import CalibrationError, NegativeLogLikelihood, RowTerms, TopKAccuracy
from frolic_tta.validation import check_matrix, check_prototypes


class FrolicMoments(Metric):
    r"""Accumulates :math:`N`, :math:`\sum_i x_i`, :math:`\sum_i x_i x_i^\top` and the zero-shot
    soft sums :math:`\sum_i p_{ij}`, :math:`\sum_i p_{ij} x_i` (see :mod:`frolic_tta.gda`).

    Args:
        prototypes: ``(K, d)`` class prototypes (a buffer; moves with the metric); floating,
            finite, K >= 2.
        tau_c: zero-shot temperature of the soft assignments (finite, > 0).
        keep_logits: also keep this rank's zero-shot logits :math:`f_c/\tau_c` ``(n, K)`` of
            every batch (rounded from the float64 products the soft sums are computed from;
            local, never synced) for :meth:`zero_shot_logits`: finalize's first buffer
            without one more ``(N, K, d)`` product.
        rows: rows this rank expects (the kept logits' buffer is allocated once for them).
        soft: accumulate every sum; ``False``: N and :math:`\sum_i x_i` only (with the kept
            logits), where the rest is known (a feature store's sums,
            :mod:`frolic_tta.data.store_moments`, checked against these two): no float64
            products for the soft sums.

    Raises:
        TypeError: ``tau_c`` is not a real number.
        ValueError: bad ``prototypes`` or ``tau_c`` (the checks of :func:`frolic_tta.frolic`).

    Memory: :math:`O(d^2 + K d)` float64, independent of N (with ``keep_logits``, plus
    :math:`N_\text{local} K` float32).

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
    zero_shot_deficit: Tensor
    zero_shot_margin: Tensor
    prototypes: Tensor

    def __init__(
        self,
        prototypes: Tensor,
        tau_c: float = 0.01,
        keep_logits: bool = False,
        soft: bool = True,
        rows: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.keep_logits, self.soft, self.rows = keep_logits, soft, rows
        self.kept = RowBuffer(rows)
        check_prototypes(prototypes)
        k, d = prototypes.shape
        self.tau_c = check_positive("tau_c", tau_c)
        self.register_buffer(
            "prototypes", prototypes.detach().to(torch.float64).clone(), persistent=False
        )
        f64 = torch.float64
        self.add_state("count", torch.zeros((), dtype=f64), dist_reduce_fx="sum")
        self.add_state("feature_sum", torch.zeros(d, dtype=f64), dist_reduce_fx="sum")
        self.add_state("outer_sum", torch.zeros(d, d, dtype=f64), dist_reduce_fx="sum")
        self.add_state("soft_count", torch.zeros(k, dtype=f64), dist_reduce_fx="sum")
        self.add_state("soft_sum", torch.zeros(k, d, dtype=f64), dist_reduce_fx="sum")
        self.add_state("zero_shot_deficit", torch.zeros((), dtype=f64), dist_reduce_fx="sum")
        self.add_state("zero_shot_margin", torch.zeros((), dtype=f64), dist_reduce_fx="sum")

    def update(self, features: Tensor, check_finite: bool = True) -> None:
        """Add a batch of features ``(n, d)`` (any float dtype; accumulated in float64).

        Args:
            features: the batch.
            check_finite: raise on NaN or inf; ``False`` where the caller has checked the
                values already (on a GPU the check reads a flag back: one host
                synchronisation per batch).

        Raises:
            ValueError: ``features`` is not a 2-D floating tensor with d columns, or holds NaN
                or inf (checked as in :func:`frolic_tta.frolic`).
        """
        cols = self.prototypes.shape[1]
        check_matrix("features", features, min_rows=0, cols=cols, finite=check_finite)
        x = features.to(self.prototypes.device)
        if self.keep_logits:
            self.kept.dtype = compute_dtype(x)
        if not self.soft:
            self.count += x.shape[0]
            self.feature_sum += x.to(torch.float64).sum(0)
            if self.keep_logits:  # rounded on copy, as moment_sums rounds them
                self.kept.append(scaled_zero_shot(x, self.prototypes, self.tau_c))
            return
        keep: list[Tensor] | None = [] if self.keep_logits else None
        sums = moment_sums(x, self.prototypes, self.tau_c, keep)
        if keep:
            self.kept.append(keep[0])
        self.count += sums.count
        self.feature_sum += sums.feature_sum
        self.outer_sum += sums.outer_sum
        self.soft_count += sums.soft_count
        self.soft_sum += sums.soft_sum
        self.zero_shot_deficit += cast(Tensor, sums.zero_shot_deficit)
        self.zero_shot_margin += cast(Tensor, sums.zero_shot_margin)

    def zero_shot_logits(self) -> Tensor | None:
        r"""This rank's kept :math:`f_c/\tau_c` ``(N_local, K)`` in update order (``None``
        without ``keep_logits``); handed over once: the metric keeps no reference."""
        if not self.keep_logits:
            return None
        kept, self.kept = self.kept, RowBuffer(self.rows)
        empty = self.prototypes.new_empty((0, self.prototypes.shape[0]), dtype=torch.float32)
        return kept.rows(empty)

    def reset(self) -> None:
        """Zero the sums and drop the kept logits."""
        super().reset()
        self.kept = RowBuffer(self.rows)

    def compute(self) -> MomentSums:
        """The (synced) sums as float64 :class:`MomentSums`."""
        return MomentSums(
            self.count.double(),
            self.feature_sum.double(),
            self.outer_sum.double(),
            self.soft_count.double(),
            self.soft_sum.double(),
            self.zero_shot_deficit.double(),
            self.zero_shot_margin.double(),
        )


ROW_METRICS: dict[str, str] = {
    "accuracy": "top-1 accuracy",
    "top5": "top-5 accuracy (top-K when K < 5)",
    "recall": "mean per-class recall (balanced accuracy)",
    "ece": "expected calibration error (15 equal-width confidence bins, L1)",
    "nll": "negative log-likelihood of the true class (nats per sample)",
}
"""Scalar metrics of every row, by key prefix (``"accuracy/f_d"``), named as in ``metrics.json``
(``metrics.json["accuracy"]["f_d"]``). Per-class accuracy (recall of
each class, ``(K,)``) is ``"class_acc/<row>"``. Probabilities are the row's
(:meth:`frolic_tta.rows.Row.in_logit_units`)."""
CLASS_ACCURACY = "class_acc"


def metric_key(row: str, metric: str = "accuracy") -> str:
    """The key of ``metrics.json[metric][row]`` as one name, ``<metric>/<row>``:
    ``metric_key("f_c - ln beta")`` -> ``"accuracy/f_c - ln beta"``, ``metric_key("f_d", "ece")``
    -> ``"ece/f_d"`` (one spelling in Python, in loggers and in ``metrics.json``)."""
    return f"{metric}/{row}"


def _row_metric(kind: str, num_classes: int) -> Metric:
    if kind == "accuracy":
        return MulticlassAccuracy(num_classes, average="micro")
    if kind == "top5":
        return TopKAccuracy(num_classes, min(5, num_classes))
    if kind == "recall":
        return MulticlassRecall(num_classes, average="macro")
    if kind == CLASS_ACCURACY:
        return MulticlassRecall(num_classes, average="none")
    if kind == "ece":
        return CalibrationError(num_classes, n_bins=15, norm="l1")
    return NegativeLogLikelihood()


def row_metrics(
    num_classes: int,
    labelled: bool = True,
    rows: Iterable[str] | None = None,
    kinds: Iterable[str] = (*ROW_METRICS, CLASS_ACCURACY),
) -> MetricCollection:
    """The metrics ``kinds`` (default: all of :data:`ROW_METRICS` and per-class accuracy) of
    every available row (of ``rows``, default all), keyed by :func:`metric_key`.

    Mean per-class recall is torchmetrics' macro recall: a class with no labelled sample is
    left out unless it is predicted (then it counts 0, as scikit-learn's ``recall_score``);
    with every class present it is scikit-learn's ``balanced_accuracy_score``.
    """
    wanted = available_rows(num_classes, labelled)
    wanted = wanted if rows is None else [key for key in wanted if key in set(rows)]
    return MetricCollection(
        {metric_key(row, kind): _row_metric(kind, num_classes) for row in wanted for kind in kinds},
        compute_groups=False,
    )


def row_accuracies(num_classes: int, labelled: bool = True) -> MetricCollection:
    """Top-1 accuracy only (:func:`row_metrics` with ``kinds=("accuracy",)``)."""
    return row_metrics(num_classes, labelled, kinds=("accuracy",))


def update_row_metrics(
    metrics: MetricCollection,
    rows: dict[str, AffineMap],
    features: Tensor,
    labels: Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    given: dict[str, Tensor] | None = None,
) -> None:
    """Feed every row's predictions on the local shard ``features`` ``(N_local, d)`` with
    ``labels`` ``(N_local,)`` into those of ``metrics`` that exist (chunked; no ``(N, K)``).

    ``rows`` map keys to classifiers *in logit units* (softmax gives the row's probabilities:
    :meth:`frolic_tta.rows.Row.in_logit_units`); accuracies depend on the argmax only, taken
    once per chunk. ``given``: rows whose ``(N_local, K)`` logits (in logit units) are at
    hand, read instead of computed (the fit's :math:`f_d` buffer).
    """
    for row, classifier in rows.items():
        present = {
            kind: metrics[metric_key(row, kind)]
            for kind in (*ROW_METRICS, CLASS_ACCURACY)
            if metric_key(row, kind) in metrics
        }
        source = classifier.source(features, chunk_size)
        chunks = source.chunks() if given is None or row not in given else None
        if chunks is None:
            chunks = TensorLogits(given[row], source.chunk_size).chunks()
        softmax = "ece" in present or "nll" in present  # one exponential pass for both
        space: Tensor | None = None
        for start, logits in chunks:
            target = labels[start : start + logits.shape[0]].to(logits.device)
            terms = None
            if softmax:
                space = workspace(space, logits)
                terms = RowTerms.of(logits, space[0])
            top = logits.argmax(dim=1) if terms is None else terms.top
            for kind, metric in present.items():
                if kind in ("ece", "nll"):
                    metric.update(logits, target, terms)
                elif kind == "top5":
                    metric.update(logits, target)
                else:  # top-1 accuracy, recall, per-class accuracy: the argmax
                    metric.update(top, target)


def exact_ratio(value: float, count: int) -> float:
    """A float32 ratio ``correct / count`` as the exact float64 ratio (``count < 2**23``)."""
    if count <= 0 or count >= 2**23:
        return float(value)
    return round(float(value) * count) / count


def compute_row_metrics(
    metrics: MetricCollection, rows: Iterable[str], num_labelled: int | None = None
) -> tuple[dict[str, float], dict[str, Tensor]]:
    """``metrics.compute()`` (synced over the process group) split into the scalars, keyed
    by :func:`metric_key`, and the per-class accuracies ``(K,)`` of ``rows``, keyed by row.
    With ``num_labelled`` (all ranks'), top-1 and top-5 are exact ratios over it."""
    computed = metrics.compute()
    class_keys = {metric_key(row, CLASS_ACCURACY): row for row in rows}
    scalars = {k: float(v) for k, v in computed.items() if k not in class_keys}
    if num_labelled is not None:
        for key in [k for k in scalars if k.split("/")[0] in ("accuracy", "top5")]:
            scalars[key] = exact_ratio(scalars[key], num_labelled)
    per_class = {class_keys[k]: v.double().cpu() for k, v in computed.items() if k in class_keys}
    return scalars, per_class


def evaluate_rows(
    rows: dict[str, AffineMap],
    head: FrolicHead,
    features: Tensor,
    labels: Tensor,
    *,
    num_labelled: int | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    given: dict[str, Tensor] | None = None,
) -> tuple[dict[str, float], dict[str, Tensor]]:
    """Every metric of the built ``rows`` (:func:`frolic_tta.rows.build_rows`) on the local
    shard ``features`` ``(N_local, d)`` with ``labels`` ``(N_local,)``, synced over the process
    group: :func:`compute_row_metrics` of :func:`row_metrics` fed by :func:`update_row_metrics`
    with each row in logit units (:meth:`frolic_tta.rows.Row.in_logit_units`; ``given``:
    rows' logits at hand, already in those units)."""
    logits = {key: ROWS[key].in_logit_units(row, head) for key, row in rows.items()}
    metrics = row_metrics(head.prototypes.shape[0], rows=rows).to(features.device)
    target = labels.to(features.device)
    update_row_metrics(metrics, logits, features, target, chunk_size, given)
    return compute_row_metrics(metrics, rows, num_labelled)
