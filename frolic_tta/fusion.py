r"""How much to trust the zero-shot classifier beside the Gaussian head (``fusion="selected"``).

The pooled fusion (:func:`frolic_tta.calibration.pool_weight`) gives :math:`f_g/\tau_g` and
:math:`f_c/\tau_c` half the weight each, however much worse one of them is. Where the text
prototypes are far from the images' class structure (a modality gap, tilted class
directions), the head alone is right much more often: on the README's first world
(``clip_world``, N = 2,000) :math:`f_g` 0.59-0.64 against :math:`f_d` 0.50-0.53 (issue 35).

Both candidates are judged by the images, as the label bias is (:mod:`frolic_tta.evidence`):
each candidate's debiased posterior (its logits matched to the test prior :math:`\tilde\pi`,
Eq. 13) gives soft labels; the Gaussian mixture refitted under them (one pass, :math:`q^\top X`,
and :func:`~frolic_tta.evidence.mixture_model`) has a log-likelihood, with the weights
:math:`\tilde\pi` (one pass). The head alone's logits :math:`f_g/\tau_g` take the zero-shot
buffer in the pass that fuses (:func:`fuse`'s ``head_out``) where :math:`f_c/\tau_c` is not
read again. The candidate whose labels make the images more likely is kept:

.. math::
    f_f = \begin{cases} f_g/\tau_g & \ell(\text{head alone}) > \ell(\text{pooled})\\
    \frac12(f_g/\tau_g + f_c/\tau_c) & \text{otherwise.}\end{cases}

Both mixtures have the same parameters (K means, a shared covariance, the same weights), but
the head alone's labels are the head's own posterior: refitting under them is an EM step, whose
in-sample gain includes fitting the K r means (r the rank of the data's span) to this sample's
noise, about :math:`Kr/2` nats where both label sets are equally good (Wilks:
:math:`2\Delta\ell \sim \chi^2_{Kr}`). So the head alone is kept where

.. math::
    \ell(\text{head alone}) - \ell(\text{pooled}) > K r / 2.

Measured (``benchmarks/no_harm.py``, ``benchmarks/label_shift.py --quick``): 780-1,150 nats
against 640 on the README's world (the head alone, 0.59-0.64 against the pooled 0.50-0.53);
67-273 against 3,200 on the CLIP-like worlds and 2-36 against 80-320 on the worlds whose
prototypes are the means, where the pooled fusion is kept (taken at any positive gap, the head
alone cost up to 0.5 pt there). Every quantity is a reduced sum: every shard takes the same
decision.

The head alone is scored first. The pooled fusion's likelihood is bounded below by its
refit's evidence lower bound, from the pass that refits it (Jensen, :math:`q` its soft labels,
:math:`g` the components' log-densities):

.. math::
    \ell(\text{pooled}) \ge \sum_{ij} q_{ij}(g_{ij} + \ln\tilde\pi_j) + \sum_i H(q_i),

whose first sum is :math:`\sum_j w_j^\top(\sum_i q_{ij}x_i - n_j\hat\mu) + n_j(b_j +
\ln\tilde\pi_j)`, read off the refit's soft sums. Where that bound already exceeds
:math:`\ell(\text{head alone}) - Kr/2`, the pooled fusion is certain and its components'
product is skipped; ``gap`` is then an upper bound (:math:`\le 0`). The decision is the
same either way: at ImageNet size (``benchmarks/finalize.py``) the bound falls 16,000 and
98,000 nats short of :math:`\ell`, against margins of 296,000 and 273,000.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from frolic_tta.calibration import match_temperature, pool_weight
from frolic_tta.evidence import data_span, mixture_model
from frolic_tta.gda import GaussianHead, MomentSums, shared_covariance
from frolic_tta.head import fused_map
from frolic_tta.logits import AffineMap, LogitSource, ReduceFn, TensorLogits, fill, workspace
from frolic_tta.matching import MassMatch
from frolic_tta.mixture import log_likelihood
from frolic_tta.options import FrolicOptions
from frolic_tta.soft_sums import posterior_sums, refitted_sums


@dataclass(frozen=True)
class FusionChoice:
    r"""The outcome of :func:`choose_fusion`.

    Attributes:
        head_alone: :math:`f_f = f_g/\tau_g` (else the pooled fusion).
        bias: the matching of the chosen :math:`f_f` to the test prior (:math:`\hat\beta`).
        source: the chosen :math:`f_f`'s logits.
        gap: :math:`\ell(\text{head alone}) - \ell(\text{pooled}) - Kr/2` in nats (> 0: the
            head alone; an upper bound where the pooled fusion's bound decided).
        passes: passes over the logits or features.
    """

    head_alone: bool
    bias: MassMatch
    source: LogitSource
    gap: float
    passes: int


def label_likelihood(
    features: Tensor,
    prototypes: Tensor,
    source: LogitSource,
    bias: MassMatch,
    sums: MomentSums,
    prior: Tensor,
    span: Tensor | None,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    floor: float | None = None,
) -> float:
    r""":math:`\ell` of the Gaussian mixture refitted under the debiased posterior of
    ``source`` (``bias``'s offset), with the weights ``prior``, on the data's ``span``
    (:func:`~frolic_tta.evidence.data_span` of ``sums``; module docstring; two passes).

    ``floor``: where the refit's evidence lower bound (ELBO, module docstring) is at least
    ``floor``, that bound instead of :math:`\ell` (one pass: :math:`\ell \ge` ``floor``
    is then certain)."""
    count = sums.count
    local = posterior_sums(
        source, bias.log_offset, features, bias.exponentials, count, entropy=floor is not None
    )
    packed = reduce_fn(local)
    entropy = None if floor is None else float(packed[-1])
    refit = refitted_sums(sums, packed if floor is None else packed[:-1])
    _, means, weights, _ = shared_covariance(refit, prototypes, "soft", None)  # no head solve
    model, terms = mixture_model(means, weights, refit, span)
    if entropy is not None:  # sum_ij q_ij (g_ij + ln pi_j) from the soft sums, no product
        masses = refit.soft_count.to(model.weight)
        centred = refit.soft_sum.to(model.weight) - masses[:, None] * model.center
        logs = prior.to(model.weight).clamp(min=torch.finfo(torch.float64).tiny).log()
        expected = (model.weight * centred).sum() + masses @ (model.bias + logs)
        bound = float(expected) + entropy + terms
        if bound >= floor:
            return bound
    components = model.source(features, chunk_size, source.exact)
    return log_likelihood(components, prior, reduce_fn)[0] + terms


def choose_fusion(
    features: Tensor,
    prototypes: Tensor,
    gaussian: GaussianHead,
    tau_g: float,
    pooled: LogitSource,
    pooled_bias: MassMatch,
    sums: MomentSums,
    prior: Tensor,
    match: Callable[..., MassMatch],
    *,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    alone: LogitSource | None = None,
    zero_shot_beta: Tensor | None = None,
) -> FusionChoice:
    r"""The pooled fusion or the head alone (module docstring).

    Args:
        features: ``(N_local, d)`` the local shard.
        prototypes: ``(K, d)``.
        gaussian: the head (:math:`f_g`).
        tau_g: its temperature (Eq. 11).
        pooled: the pooled :math:`f_f` of the local shard.
        pooled_bias: its matching to ``prior``.
        sums: the reduced moment sums.
        prior: ``(K,)`` the test prior :math:`\tilde\pi`.
        match: matches a source to ``target=prior`` (the pipeline's label-bias matching).
        reduce_fn: sums a tensor over shards.
        chunk_size: rows per chunk.
        alone: the head alone's logits :math:`f_g/\tau_g`, already at hand (:func:`fuse`'s
            ``head_out``), or ``None``: recomputed by chunks at every pass.
        zero_shot_beta: ``(K,)`` :math:`\hat\beta_c`, :math:`f_c/\tau_c` matched to ``prior``,
            or ``None``. With it the head alone's matching starts from
            :math:`\hat\beta_f^{1/\omega}/\hat\beta_c` (:math:`\hat\beta_f` the pooled one's,
            :math:`\omega = \tfrac12`), where the pooled logits' bias would be were the
            matchings log-linear in the logits (as the pooled matching starts from
            :math:`\hat\beta_c^\omega`); else from uniform. 21k world, N = 30,000: 3 passes
            instead of 7.
    """
    exact = pooled.exact
    span = data_span(sums)
    rank = features.shape[1] if span is None else span.shape[1]
    if rank == 0:  # identical features: nothing to compare
        return FusionChoice(False, pooled_bias, pooled, float("nan"), 0)
    common = (sums, prior, span, reduce_fn, chunk_size)
    if alone is None:
        scaled = AffineMap(gaussian.weight / tau_g, gaussian.bias / tau_g, gaussian.center)
        alone = scaled.source(features, chunk_size, exact)
    if zero_shot_beta is None:
        alone_bias = match(alone)
    else:  # ln beta_g = ln beta_f / omega - ln beta_c, up to a constant (the matching's gauge)
        start = pooled_bias.beta.log() / pool_weight("selected") - zero_shot_beta.log()
        start = torch.exp(start - start.max())
        alone_bias = match(alone, init=start / start.sum())
    at_alone = label_likelihood(features, prototypes, alone, alone_bias, *common)
    threshold = 0.5 * prototypes.shape[0] * rank
    # the pooled fusion's ELBO where it already puts l(pooled) past l(head alone) - Kr/2: the
    # pooled fusion is then certain, without its product (ImageNet size: 1 of 8)
    at_pooled = label_likelihood(
        features, prototypes, pooled, pooled_bias, *common, floor=at_alone - threshold
    )
    passes = 4 + alone_bias.evaluations
    gap = at_alone - at_pooled - threshold
    if gap > 0.0:
        return FusionChoice(True, alone_bias, alone, gap, passes)
    return FusionChoice(False, pooled_bias, pooled, gap, passes)


def fuse(
    features: Tensor,
    zero_shot: LogitSource,
    buffer: Tensor | None,
    z: Tensor,
    tau_c: float,
    options: FrolicOptions,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    gaussian: GaussianHead,
    filled: bool = False,
    target: tuple[float, float, float] | None = None,
    head_out: Tensor | None = None,
) -> tuple[float, LogitSource]:
    r""":math:`\tau_g` (Eq. 11) and the fused logits :math:`f_f` (Eq. 12, weighted by
    :func:`~frolic_tta.calibration.pool_weight`) of ``gaussian``: :math:`f_g`, then :math:`f_f`
    in ``buffer`` where there is one (``filled``: it already holds :math:`f_g`), else
    recomputed by chunks; ``target``: the zero-shot confidence sums, if at hand;
    ``head_out``: the buffer ``zero_shot`` reads (with ``buffer`` only), which is then
    overwritten with :math:`f_g/\tau_g` in the same pass (the head alone's logits for
    :func:`choose_fusion`, without a product of their own)."""
    exact = zero_shot.exact  # the fit's decision (:func:`~frolic_tta.logits.exact_arithmetic`)
    gda = gaussian.gda().source(features, chunk_size, exact)
    if buffer is not None:
        gda = TensorLogits(buffer, chunk_size, exact) if filled else fill(buffer, gda)
    if options.fusion == "fixed":  # the released script's equal scales
        tau_g = tau_c
    else:
        tol = options.solver.temperature_tol
        kwargs = {"tol": tol, "reduce_fn": reduce_fn, "zero_shot_sums": target}
        tau_g = match_temperature(gda, zero_shot, 1.0, **kwargs)
    weight = pool_weight(options.fusion)
    if buffer is None:
        fused = fused_map(z, gaussian, tau_c, tau_g, weight)
        return tau_g, fused.source(features, chunk_size, exact)
    work: Tensor | None = None
    for start, chunk in zero_shot.chunks():
        rows = buffer[start : start + chunk.shape[0]].div_(tau_g)
        if head_out is not None:  # f_g / tau_g where f_c / tau_c was
            work = workspace(work, rows, 1)
            torch.add(rows, chunk, out=work[0])
            head_out[start : start + chunk.shape[0]].copy_(rows)
            rows.copy_(work[0])
        else:
            rows.add_(chunk)
        if weight != 1.0:
            rows.mul_(weight)
    return tau_g, TensorLogits(buffer, chunk_size, exact)


def confidence_target(sums: MomentSums) -> tuple[float, float, float]:
    """``(N, deficit, margin)`` of the zero-shot posterior from the moment sums."""
    return float(sums.count), float(sums.zero_shot_deficit), float(sums.zero_shot_margin)
