r"""The Frolic pipeline (paper Algorithm 1).

.. math::
    f_c(x) = Z x\ \text{(Eq. 2)},\quad f_g(x) = W x + b\ \text{(Eq. 9)},\quad
    f_f = f_g/\tau_g + f_c/\tau_c\ \text{(Eq. 12)},\quad f_d = f_f - \ln\hat\beta\ \text{(Eq. 13)}.

:func:`fit_frolic` works on one shard of features and an injected ``reduce_fn``: the moments are
one reduction, the :math:`\tau_g` search and the :math:`\beta` loop reduce sums at every step,
and every rank takes the same steps. It keeps at most one ``(N_local, K)`` buffer, which becomes
the final logits (``keep_logits=True``), or none (logits recomputed chunk by chunk).
:func:`frolic` runs it on a feature matrix and returns every logit of the pipeline.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from frolic_tta.calibration import match_temperature
from frolic_tta.debias import estimate_label_bias
from frolic_tta.gda import MomentSums, fit_gaussian_head, moment_sums
from frolic_tta.head import FrolicHead
from frolic_tta.inmap import inmap_proxies
from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    ReduceFn,
    TensorLogits,
    chunk_rows,
    compute_dtype,
    identity_reduce,
)
from frolic_tta.options import FrolicOptions, resolve_options
from frolic_tta.rows import RowContext, build_rows
from frolic_tta.validation import validate_inputs


def l2_normalize(tensor: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm."""
    return tensor / tensor.norm(dim=1, keepdim=True)


def shard_moment_sums(
    features: Tensor, prototypes: Tensor, tau_c: float, chunk_size: int | None = None
) -> MomentSums:
    """:func:`~frolic_tta.gda.moment_sums` of a shard, chunk by chunk (no ``(N, K)`` float64
    temporaries); an empty shard gives zero sums (it still takes part in the reduction)."""
    rows = chunk_rows(prototypes.shape[0], chunk_size)
    local = moment_sums(features[:rows], prototypes, tau_c)
    for start in range(rows, features.shape[0], rows):
        local = local + moment_sums(features[start : start + rows], prototypes, tau_c)
    return local


@dataclass
class FrolicFit:
    """Output of :func:`fit_frolic` on one shard.

    Attributes:
        head: the adapted classifier.
        sums: the reduced moment sums of the whole dataset.
        logits: ``(N_local, K)`` :math:`f_d` of the shard (``keep_logits=True``), else ``None``.
    """

    head: FrolicHead
    sums: MomentSums
    logits: Tensor | None = None


def fit_frolic(
    features: Tensor,
    prototypes: Tensor,
    options: FrolicOptions | None = None,
    *,
    tau_c: float = 0.01,
    sums: MomentSums | None = None,
    reduce_fn: ReduceFn | None = None,
    keep_logits: bool = True,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    **overrides: Any,
) -> FrolicFit:
    r"""Run Algorithm 1 on the local shard ``features`` ``(N_local, d)``.

    Args:
        features: local features (already normalised if that is wanted).
        prototypes: ``(K, d)``, identical on every shard.
        options: the estimator's :class:`~frolic_tta.options.FrolicOptions` (default: the
            defaults); keyword ``overrides`` of its fields (``bias="paper"``) are applied on top.
        tau_c: zero-shot temperature :math:`\tau_c`; the default 0.01 is OpenAI CLIP's learned
            :math:`1/\exp(\text{logit\_scale})` (the paper's value); for another model pass its
            own (``frolic_tta.clip.model_temperature(model)``).
        sums: already *reduced* moment sums (e.g. from :class:`frolic_tta.metrics.FrolicMoments`);
            computed from ``features`` and reduced with ``reduce_fn`` if ``None`` (always with
            ``zero_shot="inmap"``, whose proxies replace ``prototypes`` and ``tau_c``).
        reduce_fn: sums a tensor over shards (identity by default).
        keep_logits: hold one ``(N_local, K)`` buffer (fast; it becomes ``FrolicFit.logits`` =
            :math:`f_d`) or recompute logits chunk by chunk (no N x K tensor at all).
        chunk_size: rows per chunk (``None``: about 2M logits per chunk).
    """
    options = resolve_options(options, **overrides)
    reduce_fn = reduce_fn or identity_reduce
    if options.zero_shot == "inmap":  # f_c := InMaP's proxies, at their temperature
        kwargs = {"reduce_fn": reduce_fn, "chunk_size": chunk_size}
        prototypes, tau_c = inmap_proxies(features, prototypes, tau_c, **kwargs)
        sums = None  # the soft sums depend on the prototypes: recomputed below (one pass)
    if sums is None:
        sums = shard_moment_sums(features, prototypes, tau_c, chunk_size).reduce(reduce_fn)
    gaussian = fit_gaussian_head(sums, prototypes, options.covariance, options.shrinkage)
    z = prototypes.to(torch.float64)
    unit_beta = torch.full((z.shape[0],), 1.0 / z.shape[0], dtype=torch.float64)
    head = FrolicHead(z, gaussian, tau_c, 1.0, unit_beta)
    zero_shot = head.zero_shot().source(features, chunk_size)
    gda = gaussian.affine().source(features, chunk_size)
    buffer = None
    if keep_logits:
        buffer = torch.empty(
            features.shape[0], z.shape[0], dtype=compute_dtype(features), device=features.device
        )
        for start, chunk in gda.chunks():
            buffer[start : start + chunk.shape[0]] = chunk
        gda = TensorLogits(buffer, chunk_size)
    head.tau_g = match_temperature(gda, zero_shot, tau_c, reduce_fn=reduce_fn)
    if buffer is not None:
        for start, chunk in zero_shot.chunks():
            rows = buffer[start : start + chunk.shape[0]]
            rows.div_(head.tau_g).add_(chunk, alpha=1.0 / tau_c)
        fused = TensorLogits(buffer, chunk_size)
    else:
        fused = head.fused().source(features, chunk_size)
    head.beta = estimate_label_bias(
        fused,
        eps=options.eps,
        method=options.bias,
        max_iter=options.max_iter,
        prior_floor=options.prior_floor,
        reduce_fn=reduce_fn,
    )
    if buffer is not None:
        buffer.sub_(torch.log(head.beta).to(buffer))
    return FrolicFit(head=head, sums=sums, logits=buffer)


@dataclass
class FrolicResult:
    r"""What :func:`frolic` returns. Logit tensors are ``(N, K)``.

    Attributes:
        logits: final :math:`f_d` (Eq. 13).
        zero_shot_logits: :math:`f_c = x^\top z` (Eq. 2, unscaled).
        gda_logits: :math:`f_g` (Eq. 9, up to a per-sample constant; see :mod:`frolic_tta.gda`).
        fused_logits: :math:`f_f` (Eq. 12).
        tau_g: Eq. 11.
        beta: ``(K,)`` positive, sums to 1.
        head: the adapted :class:`~frolic_tta.head.FrolicHead` (one affine map).
        features: the features the result was computed on (normalised if asked).
        sums: the moment sums of ``features``.
        options: the options of the fit.
    """

    logits: Tensor
    zero_shot_logits: Tensor
    gda_logits: Tensor
    fused_logits: Tensor
    tau_g: float
    beta: Tensor
    head: FrolicHead
    features: Tensor
    sums: MomentSums
    options: FrolicOptions

    def ablations(self, labels: Tensor | None = None) -> dict[str, Tensor]:
        """Logits of the paper's Table 3 and Table 4 rows (:data:`frolic_tta.rows.ROWS`).

        Keys: ``f_c``, ``f_c - ln beta``, ``f_g``, ``f_c + f_g``, ``f_f``, ``f_d`` (Table 3);
        ``tde``, ``implicit`` (Table 4); ``oracle`` when ``labels`` ``(N,)`` are given.
        Each value is ``(N, K)`` logits; ``accuracy(logits, labels)`` scores them.
        """
        ctx = RowContext(self.head, self.sums, self.features, self.options, labels=labels)
        return {key: row.logits(self.features) for key, row in build_rows(ctx).items()}


def frolic(
    features: Tensor,
    prototypes: Tensor,
    options: FrolicOptions | None = None,
    *,
    tau_c: float = 0.01,
    normalize: bool = False,
    reduce_fn: ReduceFn | None = None,
    **overrides: Any,
) -> FrolicResult:
    r"""Frolic on a feature matrix (Algorithm 1): every logit of the pipeline.

    Args:
        features: ``(N, d)`` image features (this shard's, with ``reduce_fn``).
        prototypes: ``(K, d)`` text prototypes :math:`z_j`.
        options: :class:`~frolic_tta.options.FrolicOptions` (default: the defaults); keyword
            ``overrides`` of its fields (``covariance="paper"``, ``bias="paper"``, ``eps``, ...)
            are applied on top.
        tau_c: zero-shot temperature; the default 0.01 is OpenAI CLIP's learned
            :math:`1/\exp(\text{logit\_scale})` (the paper's value); for another model pass its
            own (``frolic_tta.clip.model_temperature(model)``).
        normalize: L2-normalise features and prototypes first (CLIP features).
        reduce_fn: sums a tensor over shards; ``features`` is then the local shard.

    Returns:
        :class:`FrolicResult`.

    Example::

        >>> import torch, frolic_tta
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3, 8, generator=g)
        >>> x = z[torch.arange(60) % 3] + 0.5 * torch.randn(60, 8, generator=g)
        >>> res = frolic_tta.frolic(x, z)
        >>> res.logits.shape, round(float(res.beta.sum()), 6)
        (torch.Size([60, 3]), 1.0)
    """
    options = resolve_options(options, **overrides)
    validate_inputs(features, prototypes, normalize=normalize)
    if features.shape[0] < 2 and reduce_fn is None:
        raise ValueError(f"Expected at least 2 samples (N >= 2), but got N={features.shape[0]}")
    if normalize:
        features, prototypes = l2_normalize(features), l2_normalize(prototypes)
    fit = fit_frolic(
        features, prototypes, options, tau_c=tau_c, reduce_fn=reduce_fn, keep_logits=True
    )
    head = fit.head
    fused = fit.logits + torch.log(head.beta).to(fit.logits)
    return FrolicResult(
        logits=fit.logits,
        zero_shot_logits=head.zero_shot().logits(features),
        gda_logits=head.gaussian.affine().logits(features),
        fused_logits=fused,
        tau_g=head.tau_g,
        beta=head.beta,
        head=head,
        features=features,
        sums=fit.sums,
        options=options,
    )
