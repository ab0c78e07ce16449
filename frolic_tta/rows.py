r"""The rows of the paper's Table 3 and Table 4: one registry for results, metrics and reports.

Each :class:`Row` has a key (``"f_d"``), a label for tables, the paper table it comes from, and
a builder that turns a fitted :class:`~frolic_tta.head.FrolicHead` into the row's classifier,
an :class:`~frolic_tta.logits.AffineMap` (every row is affine in the features). Builders that
estimate a prior (debiased :math:`f_c`, implicit, Oracle) stream the local shard and call
``reduce_fn``; they are called in registry order on every rank, so the collectives line up.

:meth:`frolic_tta.FrolicResult.ablations`, the module's metrics, the report's table and the
benchmarks all iterate :data:`ROWS`; adding a row here adds it everywhere.

Probabilities (for calibration: ECE, NLL): :math:`f_c` and TDE are stored unscaled
(:math:`x^\top z`) and become logits divided by :math:`\tau_c`, :math:`f_g` divided by its
matched :math:`\tau_g`; the other rows are logits already (:math:`f_c - \ln\beta` is
:math:`f_c/\tau_c - \ln\beta`; ``inmap`` is the proxies over their temperature;
:math:`f_f`, :math:`f_d`, implicit and Oracle are on the scale
of Eq. 12; :math:`f_c + f_g` is the plain sum of the scores, the paper's uncalibrated fusion).
See :attr:`Row.temperature`.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from frolic_tta.debias import fit_label_bias
from frolic_tta.gda import MomentSums
from frolic_tta.head import FrolicHead
from frolic_tta.inmap import convergence, fit_proxies
from frolic_tta.logits import DEFAULT_CHUNK_SIZE, AffineMap, ReduceFn, identity_reduce
from frolic_tta.options import FrolicOptions


@dataclass(frozen=True)
class RowContext:
    """What a row builder may use: the fit and the local shard.

    Attributes:
        head: the fitted head.
        sums: the *reduced* moment sums of the whole dataset.
        features: ``(N_local, d)`` features of this shard.
        options: the options of the fit.
        labels: ``(N_local,)`` true labels of this shard, or ``None``.
        reduce_fn: sums a tensor over shards.
        chunk_size: rows per chunk when streaming logits.
    """

    head: FrolicHead
    sums: MomentSums
    features: Tensor
    options: FrolicOptions
    labels: Tensor | None = None
    reduce_fn: ReduceFn = identity_reduce
    chunk_size: int | None = DEFAULT_CHUNK_SIZE

    def offset(self, logits: AffineMap, **kwargs: object) -> Tensor:
        r"""``(K,)`` debiasing offset :math:`\ln\pi - \ln\hat\beta` of ``logits`` on the whole
        dataset (:func:`~frolic_tta.debias.fit_label_bias`; ``kwargs`` choose the method,
        target or labels)."""
        return fit_label_bias(
            logits.source(self.features, self.chunk_size),
            eps=self.options.solver.eps,
            max_iter=self.options.solver.max_iter,
            prior_floor=self.options.solver.prior_floor,
            reduce_fn=self.reduce_fn,
            **kwargs,
        ).log_offset


@dataclass(frozen=True)
class Row:
    """One row of Table 3/4.

    Attributes:
        key: short name, also the metric and JSON key (``"f_c - ln beta"``).
        label: description for tables.
        table: the paper's table (``"3"`` or ``"4"``), or ``"extra"`` (ours).
        build: ``RowContext -> AffineMap``.
        needs_labels: only built when true labels are given (the Oracle).
        needs_test_prior: only built when the test prior is estimated (``test_prior="em"``).
        temperature: the head's temperature (``"tau_c"``, ``"tau_g"``) that turns the row's
            scores into logits, or ``None``: already logits. The row's probabilities are
            ``softmax(scores / temperature)`` (calibration metrics; argmax unchanged).
    """

    key: str
    label: str
    table: str
    build: Callable[[RowContext], AffineMap]
    needs_labels: bool = False
    needs_test_prior: bool = False
    temperature: Literal["tau_c", "tau_g"] | None = None

    def available(
        self, num_classes: int, labelled: bool, options: FrolicOptions | None = None
    ) -> bool:
        """Whether the row is built for K = ``num_classes``, with or without labels, under
        ``options`` (default: the defaults). Every row is built for any K: each streams the
        logits in chunks and holds at most ``(K, d)`` and ``(K,)`` tensors (the Oracle matches
        class masses, :mod:`frolic_tta.matching`; no K x K system)."""
        if self.needs_labels and not labelled:
            return False
        return not (self.needs_test_prior and (options or FrolicOptions()).test_prior != "em")

    def in_logit_units(self, classifier: AffineMap, head: FrolicHead) -> AffineMap:
        """The row's ``classifier`` divided by its :attr:`temperature` (softmax: probabilities)."""
        if self.temperature is None:
            return classifier
        scale = 1.0 / float(getattr(head, self.temperature))
        return AffineMap(classifier.weight * scale, classifier.bias * scale, classifier.center)


def tde_logits(features: Tensor, prototypes: Tensor, mean: Tensor | None = None) -> Tensor:
    r"""TDE baseline (Tang et al. 2020; Table 4): :math:`f_c(x_\perp)` with :math:`x_\perp`
    the part of :math:`x` orthogonal to the mean feature :math:`\bar x` (of the test data).

    Returns:
        ``(N, K)`` logits.
    """
    if mean is None:
        mean = features.to(torch.float64).mean(0)
    return _tde_map(prototypes, mean).logits(features)


def _tde_map(prototypes: Tensor, mean: Tensor) -> AffineMap:
    # f_c(P x) with P = I - u u^T symmetric: the rows of Z projected
    z = prototypes.to(torch.float64)
    direction = mean.to(torch.float64) / mean.to(torch.float64).norm()
    weight = z - (z @ direction)[:, None] * direction[None, :]
    return AffineMap(weight, torch.zeros(z.shape[0], dtype=torch.float64))


def _debiased_zero_shot(ctx: RowContext) -> AffineMap:
    head = ctx.head
    scaled = AffineMap(head.prototypes.to(torch.float64) / head.tau_c, _zeros(ctx))
    if head.zero_shot_beta is not None:  # estimated by the fit, with its test prior
        return scaled.shift(head.log_offset(head.zero_shot_beta))
    name = "beta-hat of f_c for the 'f_c - ln beta' row"
    return scaled.shift(ctx.offset(scaled, method=ctx.options.bias, name=name))


def _inmap(ctx: RowContext) -> AffineMap:
    """InMaP alone: the proxies of the fit (``zero_shot`` "inmap" / "inmap_both"), else InMaP's
    own proxies learned now from the text prototypes (:func:`~frolic_tta.inmap.fit_proxies`,
    the stopping rule of ``solver.inmap_tolerance``), at their temperature."""
    head = ctx.head
    if ctx.options.zero_shot != "text":
        proxies, temperature = head.prototypes.to(torch.float64), head.tau_c
    else:
        fit = fit_proxies(
            ctx.features,
            head.prototypes,
            head.tau_c,
            **convergence(ctx.options),
            reduce_fn=ctx.reduce_fn,
            chunk_size=ctx.chunk_size,
        )
        proxies, temperature = fit.prototypes, fit.temperature
    return AffineMap(proxies / temperature, _zeros(ctx))


def _gda(ctx: RowContext) -> AffineMap:
    return ctx.head.gaussian.gda()


def _tde(ctx: RowContext) -> AffineMap:
    return _tde_map(ctx.head.prototypes, ctx.sums.mean)


def _sum(ctx: RowContext) -> AffineMap:
    g, z = ctx.head.gaussian, ctx.head.prototypes.to(torch.float64)
    return AffineMap(z + g.weight, g.bias + z @ g.center, g.center)


def _implicit(ctx: RowContext) -> AffineMap:
    fused = ctx.head.fused()
    return fused.shift(ctx.offset(fused, method="implicit"))  # Eq. 15: no test prior


def _oracle(ctx: RowContext) -> AffineMap:
    fused = ctx.head.fused()
    name = "beta-hat of f_f for the oracle row"
    return fused.shift(ctx.offset(fused, labels=ctx.labels, name=name))


def _balanced(ctx: RowContext) -> AffineMap:
    fused = ctx.head.fused()
    name = "beta-hat of f_f for the 'f_d balanced' row"
    return fused.shift(ctx.offset(fused, method=ctx.options.bias, name=name))


def _zeros(ctx: RowContext) -> Tensor:
    return torch.zeros(ctx.head.prototypes.shape[0], dtype=torch.float64)


_ROWS = (
    Row("f_c", "zero-shot CLIP", "3", lambda ctx: ctx.head.zero_shot(), temperature="tau_c"),
    Row("inmap", "InMaP alone (its image proxies)", "extra", _inmap),
    Row("f_c - ln beta", "zero-shot, debiased", "3", _debiased_zero_shot),
    Row("f_g", "Gaussian head (GDA)", "3", _gda, temperature="tau_g"),
    Row("f_c + f_g", "sum, uncalibrated", "3", _sum),
    Row("f_f", "fused, tau_g matched", "3", lambda ctx: ctx.head.fused()),
    Row("f_d", "Frolic (fused, debiased)", "3", lambda ctx: ctx.head.debiased()),
    Row("tde", "TDE (Table 4)", "4", _tde, temperature="tau_c"),
    Row("implicit", "implicit bias (Table 4)", "4", _implicit),
    Row("oracle", "oracle bias, labels (Table 4)", "4", _oracle, needs_labels=True),
    Row(
        "f_d balanced",
        "Frolic assuming a balanced test set",
        "extra",
        _balanced,
        needs_test_prior=True,
    ),
)
ROWS: dict[str, Row] = {row.key: row for row in _ROWS}
"""Every row, in table order: Table 3 ``f_c`` ... ``f_d`` with ``inmap`` (InMaP alone, the
InMaP column of Tables 1-2, beside the zero-shot row), Table 4 ``tde``, ``implicit``,
``oracle`` (labels: the class masses matched to the true label frequencies), and
``f_d balanced`` (the paper's balanced-test assumption, next to the estimated test prior)."""


def accuracy(logits: Tensor, labels: Tensor) -> float:
    """Top-1 accuracy of ``logits`` ``(N, K)`` against ``labels`` ``(N,)``."""
    return float((logits.argmax(1) == labels.to(logits.device)).double().mean())


def available_rows(
    num_classes: int, labelled: bool, options: FrolicOptions | None = None
) -> list[str]:
    """Keys of the rows built for K = ``num_classes``, with or without labels, under
    ``options``."""
    return [key for key, row in ROWS.items() if row.available(num_classes, labelled, options)]


def build_rows(ctx: RowContext, keys: Iterable[str] | None = None) -> dict[str, AffineMap]:
    """The classifier of every available row (of ``keys``, default all), in registry order.

    Raises:
        ValueError: an unknown key.
    """
    wanted = list(ROWS) if keys is None else list(keys)
    unknown = [key for key in wanted if key not in ROWS]
    if unknown:
        raise ValueError(f"Expected row keys among {list(ROWS)}, but got {unknown}")
    k = ctx.head.prototypes.shape[0]
    labelled = ctx.labels is not None
    return {
        key: row.build(ctx)
        for key, row in ROWS.items()
        if key in wanted and row.available(k, labelled, ctx.options)
    }
