r"""The Frolic pipeline (paper Algorithm 1).

.. math::
    f_c(x) = Z x\ \text{(Eq. 2)},\quad f_g(x) = W x + b\ \text{(Eq. 9)},\quad
    f_f = f_g/\tau_g + f_c/\tau_c\ \text{(Eq. 12)},\quad f_d = f_f - \ln\hat\beta\ \text{(Eq. 13)}.

:func:`fit_frolic` works on one shard of features and an injected ``reduce_fn``: the moments are
one reduction, the :math:`\tau_g` search and the :math:`\beta` loop reduce sums at every step,
and every rank takes the same steps. It keeps at most one ``(N_local, K)`` buffer, which becomes
the final logits (``keep_logits=True``), or none (logits recomputed chunk by chunk).
:func:`frolic_tta.frolic` (:mod:`frolic_tta.functional`) runs it on a feature matrix.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from frolic_tta.calibration import match_temperature
from frolic_tta.debias import FUSED_BETA, ZERO_SHOT_BETA, fit_label_bias, warn_about_match
from frolic_tta.gda import MomentSums, fit_gaussian_head, moment_sums
from frolic_tta.head import FrolicHead
from frolic_tta.inmap import inmap_kwargs, inmap_proxies
from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    AffineMap,
    ReduceFn,
    TensorLogits,
    chunk_rows,
    compute_dtype,
    fill,
    identity_reduce,
)
from frolic_tta.options import FrolicOptions, check_positive, resolve_options
from frolic_tta.prior import (
    Priors,
    estimate_test_prior,
)
from frolic_tta.released import released_proxies
from frolic_tta.validation import (
    check_matrix,
    check_prototypes,
    check_sums_shapes,
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
    progress: Callable[[str], None] | None = None,
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
        progress: called with the name of each phase as it starts (``"temperature"``,
            ``"test prior"``, ``"label bias"``, ``"zero-shot prior"``, ``"done"``); on every
            shard alike, so a caller reports it once (rank zero).

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
        kwargs = {"reduce_fn": reduce_fn, "chunk_size": chunk_size, **inmap_kwargs(options)}
        if options.test_prior == "em" and options.inmap_gamma == 0:  # labels to pi-tilde
            text = (features, prototypes, tau_c, sums, options, reduce_fn, chunk_size)
            kwargs["target"] = text_test_prior(*text)
        prototypes, tau_c = inmap_proxies(features, prototypes, tau_c, **kwargs)
        sums = None  # the soft sums depend on the prototypes: recomputed below (one pass)
    if sums is None:
        sums = shard_moment_sums(features, prototypes, tau_c, chunk_size).reduce(reduce_fn)
    k = prototypes.shape[0]
    report = progress or _silent
    gaussian = fit_gaussian_head(sums, prototypes, options.covariance, options.shrinkage)
    if options.zero_shot == "inmap_both":  # the released script: proxies for f_c and f_g
        kwargs = {"reduce_fn": reduce_fn, "chunk_size": chunk_size}
        prototypes, gaussian = released_proxies(
            features, prototypes, gaussian, tau_c, options, **kwargs
        )
    z = prototypes.to(torch.float64)
    scaled = AffineMap(z / tau_c, torch.zeros(k, dtype=torch.float64))  # f_c / tau_c
    zero_shot = scaled.source(features, chunk_size)
    gda = gaussian.affine().source(features, chunk_size)
    buffer = scratch = None
    if keep_logits:  # f_g, then f_f, then f_d in `buffer`; f_c / tau_c in `scratch`
        buffer, scratch = (_new_buffer(features, k) for _ in range(2))
        fill(buffer, gda)
        fill(scratch, zero_shot)
        gda, zero_shot = TensorLogits(buffer, chunk_size), TensorLogits(scratch, chunk_size)
    report("temperature")
    if options.fusion == "fixed":  # the released script's equal scales
        tau_g = tau_c
    else:
        tau_g = match_temperature(gda, zero_shot, 1.0, reduce_fn=reduce_fn)
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    head = FrolicHead(z, gaussian, tau_c, tau_g, uniform)
    if buffer is not None:
        for start, chunk in zero_shot.chunks():
            buffer[start : start + chunk.shape[0]].div_(tau_g).add_(chunk)
        fused = TensorLogits(buffer, chunk_size)
    else:
        fused = head.fused().source(features, chunk_size)
    match = partial(
        fit_label_bias,
        eps=options.eps,
        max_iter=options.max_iter,
        prior_floor=options.prior_floor,
        reduce_fn=reduce_fn,
    )
    estimate = None
    if options.test_prior == "em":
        report("test prior")
        estimate = estimate_test_prior(
            features,
            prototypes,
            fused,
            sums,
            shrinkage=options.shrinkage if options.covariance == "soft" else "auto",
            evidence=options.shift_evidence,
            rounds=options.prior_rounds,
            tol=options.prior_tol,
            match_eps=options.eps,
            match_max_iter=options.max_iter,
            prior_floor=options.prior_floor,
            reduce_fn=reduce_fn,
            chunk_size=chunk_size,
            buffer=scratch,
        )
        if not estimate.converged:
            warnings.warn(
                f"the test prior's mixture weights did not reach prior_tol={options.prior_tol} "
                "within their cap of passes; the test prior is reported as converged: false",
                UserWarning,
                stacklevel=3,
            )
    test_prior = None if estimate is None else floored(estimate.prior, options.prior_floor)
    report("label bias")
    if estimate is not None and options.bias == "soft":
        bias = estimate.bias
        warn_about_match(bias, k, options.max_iter, options.eps, FUSED_BETA)
    else:
        bias = match(fused, method=options.bias, target=test_prior, name=FUSED_BETA)
    head.beta, head.test_prior = bias.beta, test_prior
    if buffer is not None:
        buffer.add_(head.log_offset().to(buffer))
    report("zero-shot prior")
    if scratch is not None:
        if estimate is not None:  # the scratch held the mixture's logits: f_c / tau_c again
            fill(scratch, scaled.source(features, chunk_size))
        zero_shot = TensorLogits(scratch, chunk_size)
    box = None if options.beta_ratio_bound is None else math.log(options.beta_ratio_bound) / 2
    zero_shot_bias = match(
        zero_shot, method=options.bias, target=test_prior, bound=box, name=ZERO_SHOT_BETA
    )
    head.zero_shot_beta = zero_shot_bias.beta
    priors = Priors(
        test_prior=uniform if test_prior is None else test_prior,
        raw_test_prior=None if estimate is None else estimate.raw,
        shift_weight=0.0 if estimate is None else estimate.weight,
        likelihood_ratio=None if estimate is None else estimate.likelihood_ratio,
        beta=bias.beta,
        beta_undetermined=bias.undetermined,
        zero_shot_beta=zero_shot_bias.beta,
        zero_shot_beta_undetermined=zero_shot_bias.undetermined,
        converged=True if estimate is None else estimate.converged,
        rounds=0 if estimate is None else estimate.rounds,
        passes=0 if estimate is None else estimate.passes,
    )
    report("done")
    return FrolicFit(head=head, sums=sums, priors=priors, logits=buffer)


def _silent(phase: str) -> None:
    """The default ``progress``: says nothing."""


def _new_buffer(features: Tensor, k: int) -> Tensor:
    return torch.empty(features.shape[0], k, dtype=compute_dtype(features), device=features.device)


def text_test_prior(
    features: Tensor,
    prototypes: Tensor,
    tau_c: float,
    sums: MomentSums | None,
    options: FrolicOptions,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
) -> Tensor:
    r"""The test prior :math:`\tilde\pi` of Frolic on the text prototypes (``options`` with
    ``zero_shot="text"``), floored: the class masses InMaP's pseudo-labels are balanced to with
    ``zero_shot="inmap"`` and ``test_prior="em"`` (InMaP itself balances to equal masses,
    which under label shift costs its proxies, and Frolic after them, several points)."""
    text = dataclasses.replace(options, zero_shot="text")
    kwargs = {"sums": sums, "reduce_fn": reduce_fn, "chunk_size": chunk_size}
    fit = fit_frolic(features, prototypes, text, tau_c=tau_c, **kwargs)
    return floored(fit.priors.test_prior, options.prior_floor)


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
