r"""The authors' released method, as options of this package (:func:`~frolic_tta.released_options`).

The paper's numbers come from ``main_zeroshot.py`` of github.com/zhuhsingyuu/Frolic, which
computes something other than the paper's Algorithm 1 (:func:`~frolic_tta.paper_options`):

1. **Gaussian head** (``covariance="released"``, :func:`~frolic_tta.gda.released_gaussian`):
   the prototypes are the class means (nothing is fitted to the images but a variance), and the
   shared covariance is :math:`\hat\Sigma = 0.9 I + 0.1\,\mathrm{diag}(v)`, :math:`v` the
   unbiased per-dimension variance of the images stacked with the prototypes (:math:`N + K`
   rows): the script's
   ``(1 - 0.9) * cov(cat(test_features, llm_weights)) * eye + 0.9 * eye``.
2. **Two InMaP classifiers** (``zero_shot="inmap_both"``, :func:`released_proxies`): InMaP's
   proxies (:mod:`frolic_tta.inmap`) learned twice from the text prototypes, once with the
   zero-shot logits as pseudo-labels and once with the Gaussian head's, both at
   :math:`\tau_c` and InMaP's ``sinkhorn(..., gamma=1)`` (the class masses of the first softmax
   are kept). They replace :math:`f_c` and :math:`f_g`.
3. **Fixed scales** (``fusion="fixed"``): :math:`f_f = (f_g + f_c)/\tau_c`, the script's
   ``100 * InMap_logits_v3 + 100 * InMap_logits_v1``; no :math:`\tau_g` matching.
4. **Label bias** (``bias="released"``, :func:`released_label_bias`): ``solver.max_iter``
   (11) rounds; each keeps the samples whose two largest current logits differ by more than
   :math:`1/K`, labels them by argmax, forms :math:`P_{kj}` = the mean softmax probability of
   class :math:`j` over the samples labelled :math:`k` (a zero row for an empty class), takes
   the power iteration of :math:`P^\top` from uniform (tolerance ``solver.eps`` = 0.001 in L1,
   at most 100 steps, the iterate *before* the one that met the tolerance), and subtracts
   :math:`\ln(p + 10^{-12})` from the logits. :math:`\hat\beta` is the normalised product of
   the rounds' :math:`p + 10^{-12}`.

The script's ``utils.py`` was never released; ``image_opt`` and ``sinkhorn`` are InMaP's
(github.com/idstcv/InMaP, ``main.py``), read with the script's calls: ``image_opt(features,
init, plabel, test_labels, alpha=0.6)`` passes the labels fourth, so its ``image_opt`` takes them
(for logging, we assume) before InMaP's defaults ``lr=10, iter=2000, tau_i=0.04``; ``sinkhorn``'s
defaults ``tau_t=0.01, iter=20``. The script's two text classifiers (CLIP templates and LLM
descriptions) are one set of prototypes here. ``tests/test_released.py`` checks the logits
against a float64 transcription of the script on generated features.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from frolic_tta.gda import GaussianHead
from frolic_tta.inmap import fit_proxies, inmap_kwargs
from frolic_tta.logits import DEFAULT_CHUNK_SIZE, LogitSource, ReduceFn, identity_reduce
from frolic_tta.options import FrolicOptions

PROBABILITY_FLOOR = 1e-12
"""Added to each round's stationary vector before the logarithm (the script's ``1e-12``)."""
POWER_STEPS = 100
"""Cap on the steps of each round's power iteration (the script's ``max_iter``)."""


def released_proxies(
    features: Tensor,
    prototypes: Tensor,
    gaussian: GaussianHead,
    tau_c: float,
    options: FrolicOptions,
    *,
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, GaussianHead]:
    r"""The script's two InMaP classifiers: ``(W_c (K, d), head)``, the proxies supervised by
    the text (the new :math:`f_c` prototypes) and ``gaussian`` with its affine map replaced by
    the proxies supervised by it (:math:`f_g(x) = W_g x`, centred)."""
    kwargs = {"reduce_fn": reduce_fn, "chunk_size": chunk_size, **inmap_kwargs(options)}
    text = fit_proxies(features, prototypes, tau_c, **kwargs)
    head = fit_proxies(features, prototypes, tau_c, labels_from=gaussian.gda(), **kwargs)
    weight = head.prototypes.to(gaussian.center)
    return text.prototypes, replace(gaussian, weight=weight, bias=weight @ gaussian.center)


def power_iteration(matrix: Tensor, tol: float, max_iter: int = POWER_STEPS) -> Tensor:
    r"""The script's power iteration of ``matrix`` ``(K, K)`` from uniform: L1-normalised,
    clamped at 0; stops when a step moves less than ``tol`` in L1 and returns the iterate
    before that step."""
    k = matrix.shape[0]
    current = torch.full((k,), 1.0 / k, dtype=matrix.dtype, device=matrix.device)
    for _ in range(max_iter):
        following = matrix @ current
        following = (following / following.abs().sum()).clamp(min=0.0)
        if float((following - current).abs().sum()) < tol:
            break
        current = following
    return current


def _class_probabilities(source: LogitSource, shift: Tensor, reduce_fn: ReduceFn) -> Tensor:
    """``P`` (K, K): row k = mean softmax of ``logits + shift`` over the samples labelled k
    (argmax) whose two largest logits differ by more than 1/K; zero for an empty class."""
    k = source.num_classes
    sums = torch.zeros(k + 1, k, dtype=torch.float64)  # last row: counts
    for _, logits in source.chunks():
        logits = logits + shift.to(logits)
        top = logits.topk(2, dim=1).values
        kept = logits[(top[:, 0] - top[:, 1]).abs() > 1.0 / k]
        labels = kept.argmax(1).cpu()
        sums[:k].index_add_(0, labels, torch.softmax(kept, dim=1).to(torch.float64).cpu())
        sums[k].index_add_(0, labels, torch.ones(labels.shape[0], dtype=torch.float64))
    sums = reduce_fn(sums)
    counts = sums[k][:, None]
    return torch.where(counts > 0, sums[:k] / counts.clamp(min=1.0), torch.zeros_like(sums[:k]))


def released_label_bias(
    source: LogitSource,
    *,
    rounds: int = 11,
    eps: float = 1e-3,
    reduce_fn: ReduceFn | None = None,
) -> Tensor:
    r"""The script's label bias of the logits ``source`` (see the module docstring):
    ``(K,)`` :math:`\hat\beta`, positive, sums to 1; the debiased logits are
    :math:`f - \ln\hat\beta` up to one constant. One pass over the logits per round."""
    reduce_fn = reduce_fn or identity_reduce
    log_beta = torch.zeros(source.num_classes, dtype=torch.float64)
    for _ in range(rounds):
        matrix = _class_probabilities(source, -log_beta, reduce_fn)
        stationary = power_iteration(matrix.t(), eps)
        log_beta = log_beta + torch.log(stationary + PROBABILITY_FLOOR)
    return torch.softmax(log_beta, dim=0)
