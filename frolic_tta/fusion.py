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
decision. Where the margin keeps the pooled fusion but each half of the samples outnumbers the
means' parameters (N/2 > K r), a held-out reading decides (:mod:`frolic_tta.held_out`): the
head alone where the held-out likelihood rises significantly from the zero-shot labels to the
pooled ones to the head alone's, and the sample means beat the prototypes' image (at
``benchmarks/peers.py``'s size, N = 20,000, the head alone is right on 0.7-1.7 pt more samples
in all 15 fits, at in-sample gaps of 200-400 nats).

The head alone is scored first. The pooled fusion's likelihood is bounded below by the
evidence lower bound (ELBO) of its labels :math:`q` under *any* mixture :math:`g` of the same
family (Jensen, :math:`g` the components' log-densities):

.. math::
    \ell(\text{pooled}) \ge \sum_{ij} q_{ij}(g_{ij} + \ln\tilde\pi_j) + \sum_i H(q_i),

at the pooled refit's own :math:`g`; and since the refit's means and shared covariance
maximise :math:`\sum_{ij} q_{ij}\ln\mathcal N(x_i; \mu_j, \Sigma)` (the M-step), the
right-hand side at any other mixture's :math:`g`, the head alone's included, is lower still.
Two bounds follow, tried in turn:

* **the head alone's mixture**, in the pass that computes :math:`\ell(\text{head alone})`:
  the pooled logits of the same rows give :math:`q` (:class:`_CrossBound`, less a derived
  bound on its float rounding). Where it already exceeds :math:`\ell(\text{head alone}) -
  Kr/2`, the pooled fusion is certain and nothing of its own is computed (neither its soft
  sums nor its components). At ImageNet size (``benchmarks/finalize.py``) it clears that mark
  by 168,500 and 241,700 nats (benchmark and confident worlds): the pooled refit's pass is
  skipped (0.49-0.60 s; finalize 4.7 s → 4.2-4.3 s on 2 cores of an Intel Xeon, the head
  alone's pass taking 0.11-0.17 s more; docs/benchmarks.md).
* **the pooled refit's own**, from the pass that refits it, whose first sum is
  :math:`\sum_j w_j^\top(\sum_i q_{ij}x_i - n_j\hat\mu) + n_j(b_j + \ln\tilde\pi_j)`,
  read off the refit's soft sums: where it clears the mark, the components' product is
  skipped.

``gap`` is then an upper bound (:math:`\le 0`); the decision is the same either way, except
where the pooled refit's within-class covariance is rank-deficient on the data's span: it is
then shrunk (:func:`~frolic_tta.evidence.mixture_model`), no longer the M-step's maximiser,
and :math:`\ell(\text{pooled})` is taken as the larger of its own and the first bound (the
pooled labels' best mixture of the two).
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from frolic_tta.calibration import match_temperature, pool_weight
from frolic_tta.debias import ZERO_SHOT_BETA
from frolic_tta.evidence import data_span, mixture_model
from frolic_tta.gda import GaussianHead, MomentSums, shared_covariance
from frolic_tta.head import fused_map
from frolic_tta.held_out import Difference, enough_samples, held_out_trend, rises
from frolic_tta.logits import (
    AffineMap,
    LogitSource,
    ReduceFn,
    TensorLogits,
    fill,
    flushed_exp,
    workspace,
)
from frolic_tta.matching import MassMatch
from frolic_tta.mixture import log_likelihood, log_likelihood_beside, log_weights
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
        trend: Vuong's Z of the held-out likelihood, ``(head alone, zero-shot alone)``
            against the pooled fusion, and (with ``image``) the zero-shot labels' sample means
            against the prototypes' image (:mod:`frolic_tta.held_out`), or ``None`` where not
            read.
    """

    head_alone: bool
    bias: MassMatch
    source: LogitSource
    gap: float
    passes: int
    trend: tuple[float, ...] | None = None


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
    model, terms, bound = refitted_mixture(
        features, prototypes, source, bias, sums, prior, span, reduce_fn, floor is not None
    )
    if bound is not None and floor is not None and bound >= floor:
        return bound
    components = model.source(features, chunk_size, source.exact)
    return log_likelihood(components, prior, reduce_fn)[0] + terms


def refitted_mixture(
    features: Tensor,
    prototypes: Tensor,
    source: LogitSource,
    bias: MassMatch,
    sums: MomentSums,
    prior: Tensor,
    span: Tensor | None,
    reduce_fn: ReduceFn,
    entropy: bool = False,
) -> tuple[AffineMap, float, float | None]:
    r"""The mixture refitted under the debiased posterior of ``source`` (one pass):
    ``(g, terms, bound)``, its centred component logits and terms
    (:func:`~frolic_tta.evidence.mixture_model`), and with ``entropy`` its evidence lower
    bound at the weights ``prior`` (module docstring; else ``None``)."""
    local = posterior_sums(
        source, bias.log_offset, features, bias.exponentials, sums.count, entropy=entropy
    )
    packed = reduce_fn(local)
    refit = refitted_sums(sums, packed[:-1] if entropy else packed)
    _, means, weights, _ = shared_covariance(refit, prototypes, "soft", None)  # no head solve
    model, terms = mixture_model(means, weights, refit, span)
    if not entropy:
        return model, terms, None
    # sum_ij q_ij (g_ij + ln pi_j) from the soft sums, no product
    masses = refit.soft_count.to(model.weight)
    centred = refit.soft_sum.to(model.weight) - masses[:, None] * model.center
    logs = log_weights(prior).to(model.weight)
    expected = (model.weight * centred).sum() + masses @ (model.bias + logs)
    return model, terms, float(expected) + float(packed[-1]) + terms


class _CrossBound(LogitSource):
    r"""The chunks of ``components`` (the head alone's refit, :math:`g`); as each is read, the
    same rows of ``other`` (the pooled logits :math:`f`) give the evidence lower bound of the
    head alone's mixture under the pooled fusion's debiased posterior
    :math:`q_i = \mathrm{softmax}(f_i + \text{offset})`, less its rounding (module
    docstring): :attr:`sums` ``[bound, rounding]`` of the local shard, float64.

    Per row, with :math:`z'_{ij} = f_{ij} + \text{offset}_j - \max_k(\ldots)` and
    :math:`e = \exp z'`, :math:`s_i = \sum_j e_{ij}`:
    :math:`\sum_j q_{ij}(g_{ij} + \ln\pi_j) + H(q_i) = \ln s_i +
    \sum_j e_{ij}(g_{ij} + \ln\pi_j - z'_{ij})/s_i`. Its float rounding (two sums of K
    terms, pairwise, and three roundings per term) is at most
    :math:`(\lceil\log_2 K\rceil + 6)\,u\,(\max_j|g_{ij}| + \max_j|z'_{ij}| +
    \max_j|\ln\pi_j| + 1)`, u the unit roundoff of the logits' dtype: summed into
    ``rounding``, which the bound is taken less of."""

    def __init__(
        self, components: LogitSource, other: LogitSource, offset: Tensor, log_prior: Tensor
    ) -> None:
        self.components, self.other = components, other
        self.num_samples, self.num_classes = components.num_samples, components.num_classes
        self.exact = components.exact
        self.offset, self.log_prior = offset, log_prior
        self.sums = torch.zeros(2, dtype=torch.float64)

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        work: Tensor | None = None  # two chunk-sized temporaries for every chunk
        local = offset = log_prior = None  # summed where the chunks are: one copy a pass
        apart = False
        others = self.other.chunks()
        for start, values in self.components.chunks():
            at, logits = next(others, (None, None))
            apart = apart or at != start or logits is None or logits.shape != values.shape
            if apart:  # rows apart (another chunking): no bound
                yield start, values
                continue
            if local is None or local.device != logits.device:
                local = torch.zeros(2, dtype=torch.float64, device=logits.device)
                offset, log_prior = self.offset.to(logits), self.log_prior.to(logits)
                reach = float(self.log_prior.abs().max()) + 1.0  # on the host
                unit = torch.finfo(logits.dtype).eps / 2  # u
                factor = (math.ceil(math.log2(self.num_classes)) + 6) * unit
            work = workspace(work, logits, 2)
            shifted = torch.add(logits, offset, out=work[0])
            shifted.sub_(shifted.amax(dim=1, keepdim=True))  # z' <= 0, 0 at the top
            depth = shifted.amin(dim=1).neg()  # max_j |z'_ij|
            exp = flushed_exp(shifted, out=work[1])
            norm = exp.sum(1)  # s_i >= 1
            terms = torch.sub(values, shifted, out=shifted).add_(log_prior)  # g + ln pi - z'
            rows = norm.log() + exp.mul_(terms).sum(1) / norm
            size = torch.maximum(values.amax(1).abs(), values.amin(1).abs()) + depth + reach
            local[0] += rows.sum(dtype=torch.float64)
            local[1] += factor * size.sum(dtype=torch.float64)
            yield start, values
        if apart:
            self.sums = torch.tensor([-math.inf, 0.0], dtype=torch.float64)
        elif local is not None:
            self.sums = local.cpu()


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
    image: bool = True,
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
        image: the trend also asks the sample means to beat the prototypes' image (``False``
            where the prototypes saw these images, InMaP's proxies; :mod:`frolic_tta.held_out`).
    """
    exact = pooled.exact
    span = data_span(sums)
    rank = features.shape[1] if span is None else span.shape[1]
    if rank == 0:  # identical features: nothing to compare
        return FusionChoice(False, pooled_bias, pooled, float("nan"), 0)
    common = (sums, prior, span, reduce_fn)
    if alone is None:
        scaled = AffineMap(gaussian.weight / tau_g, gaussian.bias / tau_g, gaussian.center)
        alone = scaled.source(features, chunk_size, exact)
    if zero_shot_beta is None:
        alone_bias = match(alone)
    else:  # ln beta_g = ln beta_f / omega - ln beta_c, up to a constant (the matching's gauge)
        start = pooled_bias.beta.log() / pool_weight("selected") - zero_shot_beta.log()
        start = torch.exp(start - start.max())
        alone_bias = match(alone, init=start / start.sum())
    model, terms, _ = refitted_mixture(features, prototypes, alone, alone_bias, *common)
    components = model.source(features, chunk_size, exact)
    # the pooled fusion's labels under the head alone's mixture, in the same pass: a lower
    # bound of l(pooled) (module docstring; ImageNet size: the pooled fusion is then certain)
    cross = _CrossBound(components, pooled, pooled_bias.log_offset, log_weights(prior))
    at_alone, beside = log_likelihood_beside(cross, prior, reduce_fn, lambda: cross.sums)
    at_alone, bound = at_alone + terms, float(beside[0] - beside[1]) + terms
    threshold = 0.5 * prototypes.shape[0] * rank
    passes = 2 + alone_bias.evaluations
    if bound >= at_alone - threshold:  # the pooled fusion is certain: nothing of its own
        gap = at_alone - bound - threshold
    else:  # the pooled fusion's own ELBO where it already puts l(pooled) past
        # l(head alone) - Kr/2: the pooled fusion is then certain, without its product
        floor = at_alone - threshold
        at_pooled = label_likelihood(
            features, prototypes, pooled, pooled_bias, *common, chunk_size, floor=floor
        )
        gap, passes = at_alone - max(at_pooled, bound) - threshold, passes + 2
        if gap > 0.0:
            return FusionChoice(True, alone_bias, alone, gap, passes)
    if not enough_samples(float(sums.count), prototypes.shape[0], rank):
        return FusionChoice(False, pooled_bias, pooled, gap, passes)
    # the held-out trend (frolic_tta.held_out): f_c / tau_c is the pooled logits' rest
    weight = pool_weight("selected")
    zero_shot = Difference(pooled, alone, weight)
    start = None if zero_shot_beta is None else zero_shot_beta / zero_shot_beta.sum()
    zero_shot_bias = match(zero_shot, init=start, name=ZERO_SHOT_BETA)
    pairs = ((pooled, pooled_bias), (alone, alone_bias), (zero_shot, zero_shot_bias))
    labels = [(source, matched.log_offset) for source, matched in pairs]
    trend, more = held_out_trend(
        features, prototypes, labels, sums, prior, span, reduce_fn, chunk_size, 2 if image else None
    )
    passes += more + zero_shot_bias.evaluations
    if trend is None:  # a fold too small (duplicated rows share their fold)
        return FusionChoice(False, pooled_bias, pooled, gap, passes)
    chosen = rises(trend)
    bias, source = (alone_bias, alone) if chosen else (pooled_bias, pooled)
    return FusionChoice(chosen, bias, source, gap, passes, tuple(float(t) for t in trend))


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
