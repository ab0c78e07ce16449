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

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from frolic_tta.calibration import match_temperature
from frolic_tta.debias import fit_label_bias
from frolic_tta.gda import MomentSums, fit_gaussian_head, moment_sums
from frolic_tta.head import FrolicHead
from frolic_tta.inmap import inmap_proxies
from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    AffineMap,
    ReduceFn,
    TensorLogits,
    chunk_rows,
    compute_dtype,
    identity_reduce,
)
from frolic_tta.options import FrolicOptions, check_positive, resolve_options
from frolic_tta.prior import (
    Priors,
    estimate_test_prior,
)
from frolic_tta.rows import RowContext, build_rows
from frolic_tta.validation import (
    check_matrix,
    check_prototypes,
    check_shards_together,
    check_sums_shapes,
    check_unit_rows,
    validate_inputs,
)


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
    r"""Output of :func:`fit_frolic` on one shard.

    Attributes:
        head: the adapted classifier.
        sums: the reduced moment sums of the whole dataset (zero-shot responsibilities).
        priors: the test prior and the label biases, with their diagnostics.
        logits: ``(N_local, K)`` :math:`f_d` of the shard (``keep_logits=True``), else ``None``.
    """

    head: FrolicHead
    sums: MomentSums
    priors: Priors
    logits: Tensor | None = None


@torch.no_grad()
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

    Runs under ``torch.no_grad()``: nothing it returns requires grad.

    Raises:
        TypeError: ``tau_c`` is not a real number.
        ValueError: ``tau_c`` is not finite and > 0, bad ``prototypes`` (K < 2, not floating,
            NaN/inf) or feature shape/dtype, some shard holds a non-finite feature, or fewer
            than 2 samples over all shards (every shard raises together).
    """
    options = resolve_options(options, **overrides)
    tau_c = check_positive("tau_c", tau_c)
    check_prototypes(prototypes)  # identical on every shard: every shard raises or none
    # values are checked over all shards together (below), so no shard raises alone
    check_matrix("features", features, min_rows=0, cols=prototypes.shape[1], finite=False)
    reduce_fn = reduce_fn or identity_reduce
    check_samples_everywhere(features, reduce_fn, sums, prototypes)
    if options.zero_shot == "inmap":  # f_c := InMaP's proxies, at their temperature
        kwargs = {"reduce_fn": reduce_fn, "chunk_size": chunk_size}
        prototypes, tau_c = inmap_proxies(features, prototypes, tau_c, **kwargs)
        sums = None  # the soft sums depend on the prototypes: recomputed below (one pass)
    if sums is None:
        sums = shard_moment_sums(features, prototypes, tau_c, chunk_size).reduce(reduce_fn)
    k = prototypes.shape[0]
    em = None
    if options.test_prior == "em":
        em = estimate_test_prior(
            features,
            prototypes,
            sums,
            shrinkage=options.shrinkage if options.covariance == "soft" else "auto",
            iterations=options.em_iterations,
            evidence=options.shift_evidence,
            prior_floor=options.prior_floor,
            reduce_fn=reduce_fn,
            chunk_size=chunk_size,
        )
    gaussian = fit_gaussian_head(sums, prototypes, options.covariance, options.shrinkage)
    z = prototypes.to(torch.float64)
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    head = FrolicHead(z, gaussian, tau_c, 1.0, uniform)
    zero_shot = head.zero_shot().source(features, chunk_size)
    gda = gaussian.affine().source(features, chunk_size)
    buffer = None
    if keep_logits:
        buffer = torch.empty(
            features.shape[0], k, dtype=compute_dtype(features), device=features.device
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
    test_prior = None if em is None else floored(em.prior, options.prior_floor)
    solve = partial(
        fit_label_bias,
        method=options.bias,
        target=test_prior,
        eps=options.eps,
        max_iter=options.max_iter,
        prior_floor=options.prior_floor,
        reduce_fn=reduce_fn,
    )
    bias = solve(fused)
    scaled = AffineMap(z / tau_c, torch.zeros(k, dtype=torch.float64))
    box = None if options.beta_ratio_bound is None else math.log(options.beta_ratio_bound) / 2
    zero_shot_bias = solve(scaled.source(features, chunk_size), bound=box)
    head.beta, head.test_prior, head.zero_shot_beta = bias.beta, test_prior, zero_shot_bias.beta
    if buffer is not None:
        buffer.add_(head.log_offset().to(buffer))
    priors = Priors(
        test_prior=uniform if test_prior is None else test_prior,
        raw_test_prior=None if em is None else em.raw,
        shift_weight=0.0 if em is None else em.weight,
        likelihood_ratio=None if em is None else em.likelihood_ratio,
        beta=bias.beta,
        beta_undetermined=bias.undetermined,
        zero_shot_beta=zero_shot_bias.beta,
        zero_shot_beta_undetermined=zero_shot_bias.undetermined,
    )
    return FrolicFit(head=head, sums=sums, priors=priors, logits=buffer)


def floored(prior: Tensor, prior_floor: float) -> Tensor:
    """``prior`` with every entry at least ``prior_floor`` / K, renormalised (float64)."""
    prior = prior.to(torch.float64).cpu().clamp(min=prior_floor / prior.shape[0])
    return prior / prior.sum()


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
    local = (~torch.isfinite(features)).any(dim=1).sum() if features.numel() else 0
    counts = torch.tensor([float(local), float(features.shape[0])], dtype=torch.float64)
    if sums is not None:
        counts = torch.cat([counts, features.to(torch.float64).sum(0).cpu()])
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
        priors: the test prior :math:`\tilde\pi` and the label biases (fused and zero-shot),
            with what the data left undetermined (:class:`~frolic_tta.prior.Priors`).
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
    priors: Priors

    def ablations(self, labels: Tensor | None = None) -> dict[str, Tensor]:
        """Logits of the paper's Table 3 and Table 4 rows (:data:`frolic_tta.rows.ROWS`).

        Keys: ``f_c``, ``f_c - ln beta``, ``f_g``, ``f_c + f_g``, ``f_f``, ``f_d`` (Table 3);
        ``tde``, ``implicit`` (Table 4); ``oracle`` when ``labels`` ``(N,)`` are given.
        Each value is ``(N, K)`` logits; ``accuracy(logits, labels)`` scores them.
        """
        ctx = RowContext(self.head, self.sums, self.features, self.options, labels=labels)
        return {key: row.logits(self.features) for key, row in build_rows(ctx).items()}


@torch.no_grad()
def frolic(
    features: Tensor,
    prototypes: Tensor,
    options: FrolicOptions | None = None,
    *,
    tau_c: float = 0.01,
    normalize: bool | None = None,
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
        normalize: ``None`` (default): require unit-norm rows (CLIP embeddings after L2
            normalisation) and raise otherwise; ``True``: L2-normalise features and prototypes
            first; ``False``: use them as they are (e.g. the paper's Gaussian model).
        reduce_fn: sums a tensor over shards; ``features`` is then the local shard.

    Returns:
        :class:`FrolicResult`. It runs under ``torch.no_grad()``: no output requires grad.

    Raises:
        TypeError: ``tau_c`` is not a real number, ``normalize`` not a bool or ``None``.
        ValueError: bad shapes or values (:func:`~frolic_tta.validation.validate_inputs`),
            ``tau_c`` not finite and > 0, fewer than 2 samples (over all shards), or
            non-unit rows with ``normalize=None``.

    Example::

        >>> import torch, frolic_tta
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3, 8, generator=g)
        >>> x = z[torch.arange(60) % 3] + 0.5 * torch.randn(60, 8, generator=g)
        >>> res = frolic_tta.frolic(x, z, normalize=False)  # the paper's model: no unit norm
        >>> res.logits.shape, round(float(res.beta.sum()), 6)
        (torch.Size([60, 3]), 1.0)
    """
    options = resolve_options(options, **overrides)
    tau_c = check_positive("tau_c", tau_c)
    if normalize is not None and not isinstance(normalize, bool):
        raise TypeError(f"Expected `normalize` to be True, False or None, but got {normalize!r}")
    if reduce_fn is None:
        validate_inputs(features, prototypes, normalize=normalize)
        if features.shape[0] < 2:
            raise ValueError(f"Expected at least 2 samples (N >= 2), but got N={features.shape[0]}")
    else:  # values decided over all shards (one reduction); N >= 2 checked by fit_frolic
        check_matrix("features", features, min_rows=0, finite=False)  # the structure: local
        validate_inputs(features[:0], prototypes, normalize=normalize, min_rows=0)
        check_shards_together(reduce_fn, [("features", features)], normalize=normalize)
    if normalize is None:
        if reduce_fn is None:
            check_unit_rows("features", features)
        check_unit_rows("prototypes", prototypes)  # identical on every shard
    if normalize:
        features, prototypes = l2_normalize(features), l2_normalize(prototypes)
    fit = fit_frolic(
        features, prototypes, options, tau_c=tau_c, reduce_fn=reduce_fn, keep_logits=True
    )
    head = fit.head
    fused = fit.logits - head.log_offset().to(fit.logits)
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
        priors=fit.priors,
    )
