r"""The test set's class prior :math:`\pi`, estimated on Frolic's own Gaussian mixture.

The paper assumes a balanced test set (Section 3.2, :math:`\pi_j = 1/K`; Proposition 2). When it
is not, its imbalance is read as model bias and "corrected" away. The GDA head is a Gaussian
mixture with a shared covariance,

.. math::
    p(x) = \sum_j \pi_j\,\mathcal N(x; \mu_j, \Sigma)\qquad\text{(Section 3.2)},

a model of the *images* that the text prior :math:`\beta` does not enter: its weights estimate
:math:`\pi` without any assumption on :math:`\beta`.

**Which mixture.** With ``head_labels="debiased"`` (the default) the mixture is the Gaussian head
itself, fitted under the *debiased zero-shot* posterior :math:`\mathrm{softmax}(f_c/\tau_c -
\ln\hat\beta_c)` whose class masses are matched to the current prior, so the text bias no
longer pulls the small classes' means towards the large ones; one fit gives the test prior (its
weights) and :math:`f_g` (its logits). With ``head_labels="zero_shot"`` (Eqs. 4-8) it is
refitted under the debiased *fused* posterior. ``source`` names the logits weighting it.

**The balanced refit and a test.** ``source`` is first matched to the balanced prior; the
mixture is refitted under that debiased posterior (one pass :math:`q^\top X`), and its
likelihood is maximised over :math:`\pi` alone with those components fixed
(maximum-likelihood label shift, Saerens et al. 2002; :func:`~frolic_tta.mixture.mixture_weights`):

.. math::
    \hat\pi = \arg\max_{\pi \in \Delta_K} \sum_i \ln\sum_j \pi_j\, e^{g_{ij}},\qquad
    g_{ij} = \ln\mathcal N(x_i; m_j, \hat\Sigma) + \text{const}_i,

a concave problem with one maximiser. Its likelihood ratio against uniform,
:math:`\Lambda = 2(\ell(\hat\pi) - \ell(\mathbf 1/K))`, gives the James-Stein weight
:math:`w = \max(0, 1 - c(K-1)/\Lambda)` (``evidence`` :math:`c`, default 0.5) and
:math:`\tilde\pi = \frac1K + w(\hat\pi - \frac1K)`. Components fitted under the balanced posterior
lean towards uniform masses, so on balanced data :math:`\Lambda/(K-1)` stays far below its
:math:`\chi^2` mean of 1; with :math:`w = 0` the result is the balanced solution.

**Refits.** Otherwise ``rounds`` times: match ``source`` to :math:`\tilde\pi`, refit the mixture
under that posterior, solve its weights again and update :math:`w` from the new :math:`\Lambda`.
Only the last refit's weights are the estimate: the others only seed the next refit, so above
4,096 classes they stop once EM's passes gain little (``settle`` of
:func:`~frolic_tta.mixture.mixture_weights`; ImageNet-21k, issue 35 item 2). Where each half of
the samples outnumbers the means' parameters, the last weights are solved once more on
densities refitted on the other half (:mod:`frolic_tta.cross_fit`; :math:`w` kept).

**Exactness.** Every solve runs to its tolerance (or settles) with its stop test on reduced
values, and the soft sums behind each refit are float64 where that is cheap
(:mod:`frolic_tta.soft_sums`): 1, 2 or 3 processes, any chunk size and any thread count give
the same prior up to rounding. ``converged``: every weight solve reached ``tol`` (or settled).
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from frolic_tta.cross_fit import cross_fitted_weights
from frolic_tta.gda import GaussianHead, MomentSums, fit_gaussian_head
from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    LogitSource,
    ReduceFn,
    fill,
    identity_reduce,
)
from frolic_tta.matching import (
    FULL_HESSIAN_MAX_CLASSES,
    MassMatch,
    floored,
    match_class_masses,
)
from frolic_tta.mixture import mixture_weights
from frolic_tta.options import FrolicOptions, Shrinkage
from frolic_tta.soft_sums import posterior_sums, refitted_sums


@dataclass(frozen=True)
class TestPriorEstimate:
    r"""Result of :func:`estimate_test_prior`, the solver's own (what a fit reports publicly
    is :class:`Priors`).

    Attributes:
        prior: ``(K,)`` :math:`\tilde\pi` (shrunk), sums to 1.
        raw: ``(K,)`` the mixture's estimate :math:`\hat\pi` before shrinkage.
        weight: :math:`w` in [0, 1] (0: the test set is treated as balanced).
        likelihood_ratio: :math:`\Lambda` of the balanced mixture's weights (>= 0).
        bias: the matching of ``source`` to ``prior`` (:math:`\hat\beta`, the offset).
        rounds: refits after the balanced one (0: taken as balanced).
        passes: passes over the logits or features (each with one reduction).
        converged: every solve of the mixture weights reached ``tol`` or settled (the
            matching reports its own, :class:`~frolic_tta.matching.MassMatch`).
        head: the last mixture refitted (its component log-likelihoods are in ``buffer``), or
            ``None`` where it could not be fitted.
    """

    prior: Tensor
    raw: Tensor
    weight: float
    likelihood_ratio: float
    bias: MassMatch
    rounds: int
    passes: int
    converged: bool
    head: GaussianHead | None = None


def estimate_test_prior(
    features: Tensor,
    prototypes: Tensor,
    source: LogitSource,
    sums: MomentSums,
    *,
    shrinkage: Shrinkage = "auto",
    evidence: float = 0.5,
    rounds: int = 3,
    tol: float = 1e-7,
    match_eps: float = 0.01,
    match_max_iter: int = 100,
    start_passes: int | None = None,
    prior_floor: float = 1e-30,
    bound: float | None = None,
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    buffer: Tensor | None = None,
    start: Tensor | None = None,
    cross_fit: bool = False,
) -> TestPriorEstimate:
    r"""The test prior :math:`\tilde\pi` and the matching of ``source`` to it (module
    docstring).

    Args:
        features: ``(N_local, d)`` features of the local shard.
        prototypes: ``(K, d)``.
        source: ``(N_local, K)`` the logits whose debiased posterior weights the mixture.
        sums: reduced moment sums of all shards (count, first and second moments are used).
        shrinkage: of the mixture's covariance (:func:`~frolic_tta.gda.fit_gaussian_head`).
        evidence: :math:`c` of the shrinkage towards uniform; ``0`` keeps :math:`\hat\pi`.
        rounds: refits after the balanced one, where the test is imbalanced.
        tol: of the mixture weights (:func:`~frolic_tta.mixture.mixture_weights`).
        match_eps: ``eps`` of :func:`~frolic_tta.matching.match_class_masses`.
        match_max_iter: its ``max_iter``.
        start_passes: cap on the balanced matching that seeds the first refit (default
            :data:`START_PASSES`; ``match_max_iter`` where that refit may be the final head).
        prior_floor: :math:`\hat\beta_j, \tilde\pi_j \ge` ``prior_floor`` / K.
        bound: ``bound`` of the matching (:func:`~frolic_tta.matching.match_class_masses`).
        reduce_fn: sums a tensor over shards (identity by default).
        chunk_size: rows per chunk.
        buffer: ``(N_local, K)`` float32 scratch for the balanced mixture's log-likelihoods
            (overwritten), or ``None``: recomputed from the features at every pass.
        start: ``(K,)`` the :math:`\hat\beta` the balanced matching starts from (default
            uniform; :func:`fit_test_prior`: the zero-shot class masses above 4,096 classes).
        cross_fit: the last weights solved again on held-out densities (module docstring).

    Returns:
        :class:`TestPriorEstimate`.
    """
    reduce_fn = reduce_fn or identity_reduce
    k = prototypes.shape[0]
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)

    def match(
        target: Tensor, last: MassMatch | None = None, cap: int = match_max_iter, lend=False
    ) -> MassMatch:
        kwargs = {"eps": match_eps, "max_iter": cap, "prior_floor": prior_floor, "bound": bound}
        init = start if last is None else last.beta  # warm start from the last round
        spare = buffer if lend else None  # free until the next refit fills it: the logits'
        kwargs["spare"] = spare  # exponentials, once per matching
        return match_class_masses(source, target, reduce_fn=reduce_fn, init=init, **kwargs)

    fitted: list[GaussianHead] = []  # the last mixture refitted

    def weights(
        bias: MassMatch, init: Tensor | None, below: float | None = None, settle: bool = False
    ) -> tuple[Tensor, float, int, bool]:
        """Refit the mixture under the posterior of ``bias``; its ML weights (and passes);
        ``settle``: they only seed the next refit (:func:`~frolic_tta.mixture.mixture_weights`)."""
        local = posterior_sums(source, bias.log_offset, features, bias.exponentials, sums.count)
        packed = reduce_fn(local)
        refit = refitted_sums(sums, packed)
        head = fit_gaussian_head(refit, prototypes, "soft", shrinkage)
        fitted[:] = [head]  # only the last refit is kept
        components: LogitSource = head.gda().source(features, chunk_size, source.exact)
        if buffer is not None:  # one pass of x W^T; the weights' EM steps then read the buffer
            components = fill(buffer, components)
        raw, ratio, inner, done = mixture_weights(
            components, init, tol=tol, reduce_fn=reduce_fn, below=below, settle=settle
        )
        return raw, ratio, 1 + inner + (buffer is not None), done

    # the balanced matching is the refit's starting posterior: a short cap (an imbalanced test
    # set keeps it from converging, and only its posterior is used), finished below if final
    bias = match(uniform, cap=min(match_max_iter, start_passes or START_PASSES), lend=True)
    try:
        # the balanced refit only decides whether w = 0 (Lambda <= c (K - 1)): its weights stop
        # as soon as that is certain (and, with refits to follow, settle)
        below = evidence * (k - 1) or None
        raw, ratio, passes, converged = weights(bias, None, below, settle=rounds > 0)
    except (ValueError, torch.linalg.LinAlgError) as error:  # identical on every shard
        warnings.warn(
            f"the test prior cannot be estimated on these features ({error}); the test set is "
            "treated as balanced",
            UserWarning,
            stacklevel=3,
        )
        bias = replace(bias if bias.converged else match(uniform, bias), exponentials=None)
        return TestPriorEstimate(uniform, uniform, 0.0, 0.0, bias, 0, bias.evaluations, True)
    passes += bias.evaluations
    weight = shrink_weight(ratio, k, evidence)
    if weight == 0.0:  # no evidence of imbalance: the balanced solution
        if not bias.converged:
            bias = match(uniform, bias)
            passes += bias.evaluations
        bias = replace(bias, exponentials=None)  # the buffer holds the refit's logits now
        return TestPriorEstimate(uniform, raw, 0.0, ratio, bias, 0, passes, converged, fitted[-1])
    for round_ in range(rounds):  # all but the last only seed the next refit: settled
        bias = match(_shrunk(raw, weight, prior_floor), bias, lend=True)
        raw, ratio, inner, done = weights(bias, raw, settle=round_ < rounds - 1)
        weight = shrink_weight(ratio, k, evidence)
        passes += bias.evaluations + inner
        converged = converged and done
    prior = _shrunk(raw, weight, prior_floor)
    bias = match(prior, bias)
    passes += bias.evaluations
    if cross_fit and weight > 0.0:  # the weights on held-out densities (frolic_tta.cross_fit)
        kwargs = {"tol": tol, "reduce_fn": reduce_fn, "chunk_size": chunk_size, "buffer": buffer}
        crossed = cross_fitted_weights(
            features, prototypes, source, bias.log_offset, sums, fitted[-1], raw,
            shrinkage=shrinkage, **kwargs,
        )  # fmt: skip
        if crossed is not None:
            (raw, inner, done), prior = crossed, _shrunk(crossed[0], weight, prior_floor)
            bias, converged = match(prior, bias), converged and done
            passes += inner + bias.evaluations
    return TestPriorEstimate(prior, raw, weight, ratio, bias, rounds, passes, converged, fitted[-1])


HEAD_LABELS_EPS = 1e-6
"""Tolerance of the matchings that debias the head's labels (``head_labels="debiased"``):
the head moves with them, so they are solved to rounding, not to ``eps``."""


def fit_test_prior(
    features: Tensor,
    prototypes: Tensor,
    source: LogitSource,
    sums: MomentSums,
    options: FrolicOptions,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    buffer: Tensor | None,
    bound: float | None,
    head: bool = False,
) -> TestPriorEstimate:
    """:func:`estimate_test_prior` with the pipeline's ``options``; warns where a weight
    solve stopped at its cap. With ``head``, the mixture is the head itself: its labels'
    matchings run to :data:`HEAD_LABELS_EPS`; above 4,096 classes their balanced one starts
    from the zero-shot class masses :math:`m_c` (21k worlds, N = 30,000: 7 passes, not 9-10)."""
    k = prototypes.shape[0]
    start = None
    if head and k > FULL_HESSIAN_MAX_CLASSES:
        start = floored(sums.soft_count / sums.count, options.solver.prior_floor)
    estimate = estimate_test_prior(
        features,
        prototypes,
        source,
        sums,
        shrinkage=options.shrinkage if options.covariance == "soft" else "auto",
        evidence=options.solver.shift_evidence,
        rounds=options.solver.prior_rounds,
        tol=options.solver.prior_tol,
        match_eps=min(options.solver.eps, HEAD_LABELS_EPS) if head else options.solver.eps,
        match_max_iter=options.solver.max_iter,
        start_passes=options.solver.max_iter if head else None,
        prior_floor=options.solver.prior_floor,
        bound=bound,
        reduce_fn=reduce_fn,
        chunk_size=chunk_size,
        buffer=buffer,
        start=start,
        cross_fit=options.solver.prior_cross_fit,
    )
    if not estimate.converged:
        warnings.warn(
            f"the test prior's mixture weights did not reach prior_tol={options.solver.prior_tol} "
            "within their cap of passes; the test prior is reported as converged: false",
            UserWarning,
            stacklevel=4,
        )
    return estimate


START_PASSES = 20
"""Cap on the passes of the balanced matching that only seeds the first refit."""


def _shrunk(raw: Tensor, weight: float, prior_floor: float) -> Tensor:
    k = raw.shape[0]
    return floored(1.0 / k + weight * (raw - 1.0 / k), prior_floor)


def shrink_weight(ratio: float, num_classes: int, evidence: float) -> float:
    r""":math:`w = \max(0, 1 - c(K-1)/\Lambda)` (1 for ``evidence`` 0)."""
    if evidence == 0.0:
        return 1.0
    return max(0.0, 1.0 - evidence * (num_classes - 1) / ratio) if ratio > 0 else 0.0


@dataclass(frozen=True)
class Priors:
    r"""What a fit estimated about class priors (for results, reports and plots).

    Attributes:
        test_prior: ``(K,)`` :math:`\tilde\pi`, the test set's class prior used (uniform with
            ``test_prior="uniform"``).
        raw_test_prior: ``(K,)`` the mixture's estimate before shrinkage, or ``None``.
        shift_weight: the shrinkage weight :math:`w` (0: treated as balanced).
        likelihood_ratio: :math:`\Lambda` of the estimate against uniform, or ``None``.
        beta: ``(K,)`` the fused classifier's label bias :math:`\hat\beta` (Eq. 13 on
            :math:`f_f`), the offset :math:`f_d` removes; it also absorbs the class sizes of
            the Gaussian head, so it is an offset more than a prior.
        beta_undetermined: ``(K,)`` bool, classes of ``beta`` the data do not determine.
        zero_shot_beta: ``(K,)`` the zero-shot model's pre-training label prior (Proposition 2
            on its own posterior :math:`f_c/\tau_c`), bounded by ``beta_ratio_bound``.
        zero_shot_beta_undetermined: ``(K,)`` bool, its classes at the bound or not moved.
        converged: every solve of the test prior reached its tolerance (or none ran).
        rounds: refits of the mixture after the balanced one (0: treated as balanced).
        passes: passes of the test-prior estimate over the logits or features.
        label_bias_evidence: :math:`\ell_U - \ell_M - (K - 1)` in nats, the evidence of a
            zero-shot label bias (:mod:`frolic_tta.evidence`; > 0: removed), ``nan`` where
            ``bias_test="off"``, ``None`` where not estimated (other options).
        fusion_gap: :math:`\ell(\text{head alone}) - \ell(\text{pooled}) - Kr/2` in nats
            (:mod:`frolic_tta.fusion`; an upper bound where a bound decided), or ``None``.
        fusion_trend: the held-out Z, :class:`~frolic_tta.fusion.FusionChoice`'s ``trend``.
        prototype_z: the statistic of the head's means against the prototypes
            (:mod:`frolic_tta.prototype_means`; on the effective counts where the soft
            counts' is under -3.09; |z| <= 3.09 and a-hat significant: the head takes the
            prototypes' directions), ``None`` where not tested.
    """

    test_prior: Tensor
    raw_test_prior: Tensor | None
    shift_weight: float
    likelihood_ratio: float | None
    beta: Tensor
    beta_undetermined: Tensor
    zero_shot_beta: Tensor
    zero_shot_beta_undetermined: Tensor
    converged: bool = True
    rounds: int = 0
    passes: int = 0
    label_bias_evidence: float | None = None
    fusion_gap: float | None = None
    fusion_trend: tuple[float, ...] | None = None
    prototype_z: float | None = None

    def summary(self, digits: int = 6) -> dict[str, object]:
        """JSON-friendly spreads, flags and per-class vectors (``digits`` significant)."""

        def spread(values: Tensor, undetermined: Tensor) -> dict[str, object]:
            values = values.double().cpu()
            return {
                "min": float(f"{float(values.min()):.{digits}g}"),
                "max": float(f"{float(values.max()):.{digits}g}"),
                "max_over_min": float(f"{float(values.max() / values.min()):.{digits}g}"),
                "undetermined": int(undetermined.sum()),
                "determined": not bool(undetermined.any()),
            }

        def listed(values: Tensor | None) -> list[float] | None:
            if values is None:
                return None
            return [float(f"{float(v):.{digits}g}") for v in values.double().cpu()]

        return {
            "test_prior": {
                "estimated": self.raw_test_prior is not None,
                "shift_weight": round(self.shift_weight, digits),
                "likelihood_ratio": None
                if self.likelihood_ratio is None
                else float(f"{self.likelihood_ratio:.{digits}g}"),
                "max_over_min": float(
                    f"{float(self.test_prior.max() / self.test_prior.min()):.{digits}g}"
                ),
                "converged": self.converged,
                "rounds": self.rounds,
                "passes": self.passes,
            },
            "beta": spread(self.beta, self.beta_undetermined),
            "zero_shot_beta": spread(self.zero_shot_beta, self.zero_shot_beta_undetermined),
            "per_class": {
                "test_prior": listed(self.test_prior),
                "raw_test_prior": listed(self.raw_test_prior),
                "beta": listed(self.beta),
                "beta_undetermined": self.beta_undetermined.tolist(),
                "zero_shot_beta": listed(self.zero_shot_beta),
                "zero_shot_beta_undetermined": self.zero_shot_beta_undetermined.tolist(),
            },
        }
