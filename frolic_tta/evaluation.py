"""Accuracy of the paper's Table 3 / Table 4 rows on a shard, streamed (statistics room).

Each row is a :class:`torchmetrics.classification.MulticlassAccuracy` (micro accuracy, synced
over the process group by torchmetrics); logits are produced chunk by chunk so no extra
``(N, K)`` tensor is held.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from frolic_tta.core import FrolicHead
from frolic_tta.debias import estimate_label_bias
from frolic_tta.gda import MomentSums
from frolic_tta.streams import DEFAULT_CHUNK_SIZE, LinearLogits, ReduceFn

ORACLE_MAX_CLASSES = 4096
"""The Oracle row solves the (K, K) system of Proposition 2; above this K it is skipped."""

ROWS = (
    "f_c",
    "f_c - ln beta",
    "f_g",
    "f_c + f_g",
    "f_f",
    "f_d",
    "tde",
    "implicit",
    "oracle",
)
"""Table 3: f_c ... f_d; Table 4: TDE, implicit, and the Oracle (S from true labels)."""


def metric_key(row: str) -> str:
    """A logger-friendly name for a row: ``"f_c - ln beta"`` -> ``"acc/f_c-ln_beta"``."""
    return "acc/" + row.replace(" - ", "-").replace(" + ", "+").replace(" ", "_")


def make_accuracy_metrics(num_classes: int) -> MetricCollection:
    """One micro-averaged multiclass accuracy per row, keyed by :func:`metric_key`."""
    rows = [r for r in ROWS if r != "oracle" or num_classes <= ORACLE_MAX_CLASSES]
    return MetricCollection(
        {metric_key(row): MulticlassAccuracy(num_classes, average="micro") for row in rows}
    )


def row_heads(
    head: FrolicHead,
    features: Tensor,
    labels: Tensor,
    sums: MomentSums,
    *,
    eps: float,
    reduce_fn: ReduceFn,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> dict[str, tuple[Tensor, Tensor, Tensor | None]]:
    """Every row as a linear map ``(weight (K, d), bias (K,), center (d,) or None)``.

    Estimating the extra priors (debiased :math:`f_c`, implicit, Oracle) costs passes and
    ``reduce_fn`` calls, identical on every rank. The Oracle row needs a ``(K, K)`` matrix and
    is left out when K > ``ORACLE_MAX_CLASSES``.
    """
    z = head.prototypes
    k = z.shape[0]
    zeros = torch.zeros(k, dtype=torch.float64)
    gaussian = head.gaussian
    mu = gaussian.center
    fused_weight, fused_bias, _ = head.centred_linear(debias=False)
    final_weight, final_bias, _ = head.centred_linear()
    scaled = LinearLogits(features, z / head.tau_c, None, chunk_size)
    fused = LinearLogits(features, fused_weight, fused_bias, chunk_size, mu)
    beta_c = estimate_label_bias(scaled, eps=eps, reduce_fn=reduce_fn)
    implicit = estimate_label_bias(fused, method="implicit", reduce_fn=reduce_fn)
    rows = {}
    if k <= ORACLE_MAX_CLASSES:
        oracle = estimate_label_bias(fused, eps=eps, labels=labels, reduce_fn=reduce_fn)
        rows["oracle"] = (fused_weight, fused_bias - torch.log(oracle), mu)
    # TDE: f_c of the component orthogonal to the mean test feature = f_c of P x, P symmetric
    direction = sums.feature_sum / sums.feature_sum.norm()
    tde_weight = z - (z @ direction)[:, None] * direction[None, :]
    return {
        **rows,
        "f_c": (z, zeros, None),
        "f_c - ln beta": (z / head.tau_c, -torch.log(beta_c), None),
        "f_g": (gaussian.weight, gaussian.bias, mu),
        "f_c + f_g": (z + gaussian.weight, gaussian.bias + z @ mu, mu),
        "f_f": (fused_weight, fused_bias, mu),
        "f_d": (final_weight, final_bias, mu),
        "tde": (tde_weight, zeros, None),
        "implicit": (fused_weight, fused_bias - torch.log(implicit), mu),
    }


def update_accuracies(
    metrics: MetricCollection,
    heads: dict[str, tuple[Tensor, Tensor, Tensor | None]],
    features: Tensor,
    labels: Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> None:
    """Feed every row's predictions on the local shard into ``metrics`` (chunked)."""
    for row, (weight, bias, center) in heads.items():
        source = LinearLogits(features, weight, bias, chunk_size, center)
        metric = metrics[metric_key(row)]
        for start, logits in source.chunks():
            target = labels[start : start + logits.shape[0]].to(logits.device)
            metric.update(logits.argmax(1), target)
