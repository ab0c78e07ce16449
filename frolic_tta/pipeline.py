r"""The Frolic pipeline (paper Algorithm 1).

.. math::
    f_c(x) = Z x\ \text{(Eq. 2)},\quad f_g(x) = W x + b\ \text{(Eq. 9)},\quad
    f_f = \omega(f_g/\tau_g + f_c/\tau_c)\ \text{(Eq. 12)},\quad
    f_d = f_f - \ln\hat\beta\ \text{(Eq. 13)},

with :math:`\omega = \frac12` (``fusion="pooled"``, the default) or 1 (Eq. 12 as written), see
:func:`~frolic_tta.calibration.pool_weight`.

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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor

from frolic_tta.calibration import pool_weight
from frolic_tta.debias import FUSED_BETA, ZERO_SHOT_BETA, fit_label_bias, warn_about_match
from frolic_tta.evidence import data_span, tested_estimate
from frolic_tta.fusion import choose_fusion, confidence_target, fuse
from frolic_tta.gda import MomentSums, fit_gaussian_head, moment_sums, zero_shot_buffer
from frolic_tta.head import FrolicHead
from frolic_tta.inmap import inmap_kwargs, inmap_proxies
from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    AffineMap,
    ReduceFn,
    TensorLogits,
    chunk_rows,
    compute_dtype,
    exact_arithmetic,
    fill,
    identity_reduce,
)
from frolic_tta.matching import floored
from frolic_tta.options import FrolicOptions, check_positive, resolve_options
from frolic_tta.precision import ieee_float32
from frolic_tta.prior import HEAD_LABELS_EPS, Priors, fit_test_prior
from frolic_tta.prototype_means import tested_means
from frolic_tta.released import released_proxies
from frolic_tta.soft_sums import posterior_squares, posterior_sums, refitted_sums
from frolic_tta.validation import (
    check_matrix,
    check_prototypes,
    check_samples_everywhere,
    warn_identical_prototypes,
)


def l2_normalize(tensor: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm."""
    return tensor / tensor.norm(dim=1, keepdim=True)


def shard_moment_sums(
    features: Tensor,
    prototypes: Tensor,
    tau_c: float,
    chunk_size: int | None = None,
    out: Tensor | None = None,
) -> MomentSums:
    r""":func:`~frolic_tta.gda.moment_sums` of a shard, chunk by chunk (no ``(N, K)`` float64
    temporaries); an empty shard gives zero sums (it still takes part in the reduction). With
    ``out`` ``(N, K)``, the chunks' :math:`f_c/\tau_c` (rounded from the float64 products) are
    written into it, as :class:`~frolic_tta.metrics.FrolicMoments` keeps them."""
    rows = chunk_rows(prototypes.shape[0], chunk_size)
    local: MomentSums | None = None
    for start in range(0, max(1, features.shape[0]), rows):
        keep: list[Tensor] | None = None if out is None else []
        block = moment_sums(features[start : start + rows], prototypes, tau_c, keep)
        local = block if local is None else local + block
        if keep:
            out[start : start + keep[0].shape[0]] = keep[0]
    return cast(MomentSums, local)  # one chunk at least (an empty one for an empty shard)


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
@ieee_float32()
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
    zero_shot_logits: Tensor | None = None,
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
        progress: called with the name of each phase as it starts (by default
            ``"temperature"``, ``"test prior"``, ``"label bias"``, ``"zero-shot prior"``, then
            ``"done"``; ``head_labels="debiased"`` starts with ``"test prior"``); on every
            shard alike, so a caller reports it once (rank zero).
        zero_shot_logits: ``(N_local, K)`` the shard's :math:`f_c/\tau_c`, already computed
            (:meth:`frolic_tta.metrics.FrolicMoments.zero_shot_logits`): with ``keep_logits``
            it becomes the scratch buffer (overwritten) instead of one ``(N, K, d)`` product;
            ignored without ``keep_logits`` and with InMaP's proxies (``zero_shot="inmap"``).

    Runs under ``torch.no_grad()``: nothing it returns requires grad.

    Raises:
        TypeError: ``tau_c`` is not a real number.
        ValueError: ``tau_c`` is not finite and > 0, bad ``prototypes`` (K < 2, not floating,
            NaN/inf) or feature shape/dtype, some shard holds a non-finite feature, or fewer
            than 2 samples over all shards (every shard raises together); ``zero_shot_logits``
            not of shape ``(N_local, K)``.
    """
    options = resolve_options(options, **overrides)
    tau_c = check_positive("tau_c", tau_c)
    check_prototypes(prototypes)  # identical on every shard: every shard raises or none
    warn_identical_prototypes(prototypes, options.bias)
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
    k = prototypes.shape[0]
    buffer = scratch = None  # f_g, then f_f, then f_d in `buffer`; f_c / tau_c in `scratch`
    given = None if options.zero_shot == "inmap" else zero_shot_logits  # of other prototypes
    if sums is None:  # the products' f_c / tau_c fill the scratch, as in the module
        made = _new_buffer(features, k) if keep_logits and given is None else None
        sums = shard_moment_sums(features, prototypes, tau_c, chunk_size, made).reduce(reduce_fn)
        given = given if made is None else made
    report = progress or _silent
    exact = exact_arithmetic(sums.count, k, features.shape[1])  # the same on every shard
    z = prototypes.to(torch.float64)
    scaled = AffineMap(z / tau_c, torch.zeros(k, dtype=torch.float64))  # f_c / tau_c
    zero_shot = scaled.source(features, chunk_size, exact)
    if keep_logits:
        scratch = zero_shot_buffer(features, z, tau_c, chunk_size, given)
        zero_shot, buffer = TensorLogits(scratch, chunk_size, exact), _new_buffer(features, k)
    box = None if (bound := options.solver.beta_ratio_bound) is None else math.log(bound) / 2
    match = partial(
        fit_label_bias,
        eps=options.solver.eps,
        max_iter=options.solver.max_iter,
        prior_floor=options.solver.prior_floor,
        reduce_fn=reduce_fn,
    )
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    # the head's soft labels: the debiased zero-shot posterior (its mixture is also the one
    # whose weights estimate the test prior), or the raw one (Eqs. 4-8; the test prior is then
    # estimated on a mixture refitted under the debiased fused posterior)
    debias_head = options.head_labels == "debiased" and options.covariance == "soft"
    debias_head = debias_head and options.zero_shot != "inmap_both"
    estimate = zero_shot_bias = gaussian = head_bias = evidence = means_z = None
    head_eps = min(options.solver.eps, HEAD_LABELS_EPS)
    # the head's labels are balanced without the box on beta-hat_c: where over-confident
    # posteriors push beta-hat_c past it, a boxed matching leaves their class masses
    # unbalanced and the head (and the test prior read off it) biased; the box bounds the
    # reported zero-shot prior only (below). With fewer samples than classes some classes
    # cannot get their mass at all and an unboxed matching crawls to the floor: boxed there
    head_box = None if float(sums.count) >= k else box
    if debias_head and options.test_prior == "em":
        report("test prior")
        estimate = fit_test_prior(
            features,
            prototypes,
            zero_shot,
            sums,
            options,
            reduce_fn,
            chunk_size,
            buffer,
            head_box,
            head=True,
        )
        estimate, evidence = tested_estimate(  # the label bias removed only where it is seen
            features,
            prototypes,
            zero_shot,
            sums,
            estimate,
            options,
            reduce_fn=reduce_fn,
            chunk_size=chunk_size,
            buffer=buffer,
            bound=head_box,
            eps=head_eps,
        )
        gaussian, head_bias = estimate.head, estimate.bias
    elif debias_head:
        report("zero-shot prior")
        spare = {"bound": head_box, "eps": head_eps, "spare": buffer}  # f_g's, until filled
        head_bias = match(zero_shot, method="soft", name=ZERO_SHOT_BETA, **spare)
        packed = posterior_sums(
            zero_shot, head_bias.log_offset, features, head_bias.exponentials, sums.count
        )
        head_bias = dataclasses.replace(head_bias, exponentials=None)
        head_sums = refitted_sums(sums, reduce_fn(packed))
        gaussian = fit_gaussian_head(head_sums, prototypes, "soft", options.shrinkage)
    if head_bias is not None and options.bias == "soft":  # the reported beta-hat_c, boxed
        target = None if estimate is None else floored(estimate.prior, options.solver.prior_floor)
        log_beta = torch.log(head_bias.beta)
        if box is None or float(log_beta.max() - log_beta.min()) <= 2.0 * box:
            zero_shot_bias = head_bias
            warn_about_match(zero_shot_bias, k, options.solver.max_iter, head_eps, ZERO_SHOT_BETA)
        else:
            report("zero-shot prior")
            zero_shot_bias = match(
                zero_shot,
                method="soft",
                target=target,
                bound=box,
                eps=head_eps,
                init=head_bias.beta,
                name=ZERO_SHOT_BETA,
            )
    raw = gaussian is None or head_bias is None or (evidence is not None and evidence <= 0.0)
    if gaussian is None:  # the raw zero-shot posterior's head (or no mixture could be fitted)
        gaussian = fit_gaussian_head(sums, prototypes, options.covariance, options.shrinkage)
    filled = estimate is not None and estimate.head is not None  # f_g is in `buffer`
    if options.head_means == "tested" and debias_head:  # debias_head: covariance="soft"
        labels = None if raw else head_bias.log_offset  # the head's labels on f_c / tau_c
        squares = partial(posterior_squares, zero_shot, labels, reduce_fn)
        tested, means_z = tested_means(gaussian, prototypes, sums, data_span(sums), squares)
        filled, gaussian = filled and tested is gaussian, tested  # on the prototypes: refill
    if options.zero_shot == "inmap_both":  # the released script: proxies for f_c and f_g
        kwargs = {"reduce_fn": reduce_fn, "chunk_size": chunk_size, "options": options}
        prototypes, gaussian = released_proxies(features, prototypes, gaussian, tau_c, **kwargs)
        z = prototypes.to(torch.float64)
        scaled = AffineMap(z / tau_c, torch.zeros(k, dtype=torch.float64))
        zero_shot = scaled.source(features, chunk_size, exact)
        zero_shot = zero_shot if scratch is None else fill(scratch, zero_shot)
    report("temperature")
    summed = sums.zero_shot_deficit is not None and options.zero_shot != "inmap_both"
    # f_g / tau_g, the fusion choice's head alone, takes f_c / tau_c's buffer in the pass that
    # fuses where f_c / tau_c is not read again (its prior matched): no product of its own
    choosing = options.fusion == "selected" and options.bias == "soft"
    alone = scratch if choosing and zero_shot_bias is not None and buffer is not None else None
    tau_g, fused = fuse(
        features,
        zero_shot,
        buffer,
        z,
        tau_c,
        options,
        reduce_fn,
        chunk_size,
        gaussian,
        filled=filled,
        target=confidence_target(sums) if summed else None,
        head_out=alone,
    )
    if options.test_prior == "em" and estimate is None:  # on the fused posterior
        report("test prior")
        estimate = fit_test_prior(
            features, prototypes, fused, sums, options, reduce_fn, chunk_size, scratch, None
        )
        if scratch is not None:  # the scratch held the mixture's logits: f_c / tau_c again
            zero_shot = fill(scratch, scaled.source(features, chunk_size, exact))
        bias = estimate.bias if options.bias == "soft" else None
    else:
        bias = None
    test_prior = None if estimate is None else floored(estimate.prior, options.solver.prior_floor)
    report("label bias")
    if bias is None:
        tight = {"eps": min(options.solver.eps, HEAD_LABELS_EPS)} if debias_head else {}
        if head_bias is not None and zero_shot_bias is not None:  # f_g has no label bias of
            start = head_bias.beta ** pool_weight(options.fusion)  # its own, f_f holds omega f_c:
            tight["init"] = start / start.sum()  # its bias starts near beta_c^omega (warm)
        if zero_shot_bias is not None and alone is None:  # f_c / tau_c is not read again:
            tight["spare"] = scratch  # the scratch is spare
        bias = match(fused, method=options.bias, target=test_prior, name=FUSED_BETA, **tight)
    else:
        warn_about_match(bias, k, options.solver.max_iter, options.solver.eps, FUSED_BETA)
    weight, zero_shot_weight, fusion = pool_weight(options.fusion), None, {}
    if choosing:  # pooled, or the head alone
        choice = choose_fusion(
            features,
            prototypes,
            gaussian,
            tau_g,
            fused,
            bias,
            sums,
            uniform if test_prior is None else test_prior,
            partial(match, method="soft", target=test_prior, name=FUSED_BETA),
            reduce_fn=reduce_fn,
            chunk_size=chunk_size,
            alone=None if alone is None else TensorLogits(alone, chunk_size, zero_shot.exact),
            zero_shot_beta=None if head_bias is None else head_bias.beta,
            image=options.zero_shot == "text",  # InMaP's proxies saw every fold
        )
        fusion = {"fusion_gap": choice.gap, "fusion_trend": choice.trend}
        if choice.head_alone:  # f_f = f_g / tau_g
            bias, weight, zero_shot_weight = choice.bias, 1.0, 0.0
            if buffer is not None:
                fill(buffer, choice.source)
    if zero_shot_bias is None:
        report("zero-shot prior")
        zero_shot_bias = match(
            zero_shot, method=options.bias, target=test_prior, bound=box, name=ZERO_SHOT_BETA
        )
    head = FrolicHead(z, gaussian, tau_c, tau_g, bias.beta, test_prior, zero_shot_bias.beta,
                      weight, zero_shot_weight)  # fmt: skip
    if buffer is not None:  # f_f -> f_d
        buffer.add_(head.log_offset().to(buffer))
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
        label_bias_evidence=evidence,
        **fusion,
        prototype_z=means_z,
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
    return floored(fit.priors.test_prior, options.solver.prior_floor)
