r"""InMaP: intra-modal proxies for the zero-shot classifier (Qian et al., NeurIPS 2023).

CLIP's text prototypes :math:`z_j` live in the text cone, the images in the image cone (the
modality gap). InMaP learns K *proxies* :math:`w_j` in the image space from the unlabelled test
images, supervised by the zero-shot classifier, and classifies with :math:`f(x) = Wx`. As in the
authors' code (``github.com/idstcv/InMaP``, ``main.py``, its ImageNet defaults):

1. **Pseudo-labels** (``sinkhorn``): :math:`q_i = \mathrm{softmax}(Zx_i/\tau_t)` balanced over
   classes by ``sinkhorn_iterations`` = 20 Sinkhorn steps (equal class marginals, their
   ``gamma = 0``; ``gamma = 1`` keeps the first softmax's class masses). Each step only
   rescales the columns, so the labels are
   :math:`q_i = \mathrm{softmax}(Zx_i/\tau_t + \ln v)` with a column scaling :math:`v`
   ``(K,)`` updated as :math:`v_j \leftarrow v_j / \sum_i q_{ij}`: the dataset-wide sum is
   reduced, nothing ``(N, K)`` is stored. Rows whose largest label exceeds ``threshold``
   :math:`\alpha = 0.6` become one-hot.
2. **Proxies** (``image_opt``): from :math:`W = Z` (rows normalised),
   ``iterations`` = 2000 steps of gradient descent on the cross-entropy
   :math:`-\sum_i \sum_j q_{ij} \ln\mathrm{softmax}(Wx_i/\tau_i)_j` with
   :math:`\tau_i = 0.04`,

   .. math::
       G = \textstyle\sum_i (\mathrm{softmax}(Wx_i/\tau_i) - q_i)\, x_i^\top,\quad
       W \leftarrow \mathrm{normalise}\big(W - \tfrac{\eta}{N\tau_i} G\big),

   :math:`\eta = 10`, halved whenever :math:`\|G\|_F` grows from one step to the next.

Both :math:`\sum_i q_i x_i^\top` and :math:`G` are sums over samples: each goes through the
injected ``reduce_fn``, and the step-size decision is taken on the reduced :math:`\|G\|_F`,
so every shard takes the same steps and 2 shards give the proxies of 1. ``tau_t`` is the
zero-shot temperature :math:`\tau_c` of the model (InMaP's 0.01 is OpenAI CLIP's).

**Cost.** One pass over the features per Sinkhorn step, one for the labels, and per proxy step
two ``(N, d) x (d, K)`` products (one pass): with ``fit_frolic``'s extra moment pass 2,022
passes, about :math:`4\,\text{iterations}\,NKd` flops (:math:`2\times10^{14}` at ImageNet
size, N = 50,000, K = 1,000, d = 512), about an hour on 2 CPU cores (1.7 s per step, measured
by ``benchmarks/inmap.py``; not measured on a GPU); memory one ``(chunk, K)`` block.

**Convergence test** (``tolerance`` and ``relative_tolerance``, ours): the step is halved
whenever :math:`\|G\|_F` grows, and :math:`\|G\|_F` cannot reach 0 (its radial part is
removed by the normalisation). On balanced data the steps then shrink geometrically and the
proxies stop moving long before 2,000 steps (about 60-100 on the CLIP-like worlds, then
:math:`< 10^{-12}` per step); with labels balanced to a shifted prior (``target``) the step is
never halved and :math:`\|G\|_F` creeps down for all 2,000 steps (moves of
:math:`10^{-3}` to :math:`10^{-4}`). The loop stops once the largest move of a proxy in one
step, :math:`\max_j\|w_j^{t} - w_j^{t-1}\|_2`, is below ``tolerance``, or once
:math:`\|G\|_F` fell in one step by less than ``relative_tolerance`` times itself
(:data:`RELATIVE_TOLERANCE` = :math:`10^{-3}` with ``FrolicOptions().solver.inmap_tolerance``): on
the CLIP-like label-shift worlds (N = 5,000, K = 50) 23-41 steps instead of 60-2,000, with the
same or a higher top-1 than after 2,000 steps (``benchmarks/peers.py``). Both are reduced
float64 values: every shard stops together; ``iterations`` stays the cap.

**Released Frolic** (``zero_shot="inmap_both"``, :mod:`frolic_tta.released`) calls the same
two functions with ``gamma=1`` (the column masses of the first softmax are kept: the Sinkhorn
steps change nothing but rounding) and with the Gaussian head's logits as the labels'
source (``labels_from``), still starting the proxies from :math:`Z`.

Deviations from the reference code: float64 proxies and reduced sums (each shard's gradient
is accumulated in the features' dtype, float32 for CLIP features, like the reference's float32
product), the labels' column scaling kept in log space and floored at the smallest float64 (a
class no image prefers would give NaN there). Where the passes are exact
(:math:`NKd \le 2.1\cdot10^9`, :func:`~frolic_tta.logits.exact_arithmetic`, the estimator's
rule), the logits are float64 products rounded once to the features' dtype (the softmax
stays there, as in the reference) and the sums over samples are float64: a float32 product's
rounding follows the rows in it, which put 1 and 2 shards 2.0e-5 apart after 500 steps
(``tests/test_inmap.py``'s world, MKL's AVX2 kernels on an Intel Xeon; now 7e-15). It costs
2.3x the float32 steps (``benchmarks/peers.py``'s world, N = 20,000, K = 50, d = 128, 2 cores
of an Intel Xeon: 2,000 steps 13.1 s → 30.6 s, the 21 of the convergence test 0.29 s → 0.58 s;
top-1 0.8652 and 0.8692 both times).
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    AffineMap,
    ReduceFn,
    chunk_rows,
    compute_dtype,
    exact_arithmetic,
    identity_reduce,
)
from frolic_tta.options import FrolicOptions, check_positive
from frolic_tta.validation import check_matrix, check_shards_together

PROXY_TEMPERATURE = 0.04
r"""InMaP's :math:`\tau_i` (its ImageNet default): the proxies' softmax temperature."""

RELATIVE_TOLERANCE = 1e-3
r"""Stop once :math:`\|G\|_F` falls by less than this fraction of itself in one step (used
with every ``solver.inmap_tolerance`` of the options, see :func:`convergence`)."""


class ProxyClassifier(NamedTuple):
    r"""InMaP's classifier :math:`f(x) = Wx` and the temperature of its probabilities.

    Attributes:
        prototypes: ``(K, d)`` float64 proxies :math:`w_j`, unit rows.
        temperature: :math:`\tau_i`: probabilities are :math:`\mathrm{softmax}(Wx/\tau_i)`.
    """

    prototypes: Tensor
    temperature: float


def _chunks(features: Tensor, rows: int) -> list[Tensor]:
    """Row blocks in the compute dtype (views for float32 / float64 features)."""
    dtype = compute_dtype(features)
    return [features[s : s + rows].to(dtype) for s in range(0, features.shape[0], rows)]


def pseudo_labels_sums(
    features: Tensor,
    prototypes: Tensor,
    *,
    text_temperature: float = 0.01,
    threshold: float = 0.6,
    sinkhorn_iterations: int = 20,
    gamma: float = 0.0,
    labels_from: AffineMap | None = None,
    target: Tensor | None = None,
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    exact: bool = False,
) -> Tensor:
    r""":math:`\sum_i q_i x_i^\top` ``(K, d)`` float64 over all shards: InMaP's balanced,
    thresholded pseudo-labels :math:`q_i` (step 1 of the module docstring) times the features.
    ``exact``: float64 products rounded once to the features' dtype and float64 sums over
    samples (module docstring; :func:`fit_proxies` decides).

    ``gamma``: InMaP's exponent of the target column masses, :math:`(\sum_i
    \mathrm{softmax}_i)^\gamma` normalised (0: equal masses). ``labels_from``: the classifier
    whose logits, divided by ``text_temperature``, give the labels (default :math:`Zx`).
    ``target``: ``(K,)`` class masses to balance the labels to (e.g. an estimated test prior),
    instead of ``gamma``'s.
    """
    reduce_fn = reduce_fn or identity_reduce
    chunks = _chunks(features, chunk_rows(prototypes.shape[0], chunk_size))
    z = prototypes.to(torch.float64)
    if labels_from is None:
        labels_from = AffineMap(z, torch.zeros(z.shape[0], dtype=torch.float64))
    dtype, device = compute_dtype(features), features.device
    work = torch.float64 if exact else dtype  # the products'
    weight = (labels_from.weight / text_temperature).to(device=device, dtype=work).t()
    bias = labels_from.bias.to(device=device, dtype=torch.float64) / text_temperature
    center = labels_from.center
    center = None if center is None else center.to(device=device, dtype=work)
    log_scale = torch.zeros(z.shape[0], dtype=torch.float64, device=device)
    log_target = torch.zeros_like(log_scale)
    if target is not None:  # class masses to balance to (a test prior), instead of gamma's
        log_target = torch.log(target.to(log_scale).clamp_min(torch.finfo(torch.float64).tiny))

    def labels(block: Tensor) -> Tensor:
        block = block.to(work) if center is None else block.to(work) - center
        logits = torch.addmm((bias + log_scale).to(block), block, weight)
        return torch.softmax(logits.to(dtype), dim=1)

    for step in range(sinkhorn_iterations):
        column = torch.zeros_like(log_scale)
        for block in chunks:
            q = labels(block)
            column += (q.double() if exact else q).sum(0).to(column)
        column = reduce_fn(column).clamp_min(torch.finfo(torch.float64).tiny)
        if step == 0 and gamma > 0 and target is None:  # q = (first softmax masses)^gamma
            log_target = gamma * torch.log(column)
            log_target = log_target - torch.logsumexp(log_target, 0)
        log_scale = log_scale + log_target - torch.log(column)
    total = torch.zeros(z.shape, dtype=torch.float64, device=features.device)
    for block in chunks:
        q = labels(block)
        confidence, best = q.max(1)
        sure = confidence > threshold
        q[sure] = 0.0
        q[sure, best[sure]] = 1.0
        total += (q.to(work).t() @ block.to(work)).to(total)
    return reduce_fn(total)


@dataclass(frozen=True)
class ProxyFit:
    r"""What :func:`fit_proxies` returns.

    Attributes:
        prototypes: ``(K, d)`` float64 unit proxies.
        temperature: :math:`\tau_i`.
        steps: gradient steps taken.
        passes: passes over the features (Sinkhorn, labels, one per step).
        converged: stopped by ``tolerance`` (``False`` with ``tolerance=None``).
    """

    prototypes: Tensor
    temperature: float
    steps: int
    passes: int
    converged: bool

    def classifier(self) -> ProxyClassifier:
        """The proxies as a :class:`ProxyClassifier`."""
        return ProxyClassifier(self.prototypes, self.temperature)


def convergence(options: FrolicOptions) -> dict[str, float | None]:
    """The :func:`fit_proxies` stopping arguments of ``options``: ``solver.inmap_tolerance``
    and, with it, :data:`RELATIVE_TOLERANCE` (``None``: InMaP's fixed step count)."""
    tolerance = options.solver.inmap_tolerance
    relative = None if tolerance is None else RELATIVE_TOLERANCE
    return {"tolerance": tolerance, "relative_tolerance": relative}


def inmap_kwargs(options: FrolicOptions) -> dict[str, float | None]:
    """The :func:`fit_proxies` arguments that ``options`` set (``gamma``, the stopping rule)."""
    return {"gamma": options.inmap_gamma, **convergence(options)}


def inmap_proxies(
    features: Tensor,
    prototypes: Tensor,
    text_temperature: float = 0.01,
    **kwargs: object,
) -> ProxyClassifier:
    r"""InMaP's proxies from the local shard ``features`` ``(N_local, d)`` and the text
    ``prototypes`` ``(K, d)`` (identical on every shard): :func:`fit_proxies` (same arguments)
    without its diagnostics.

    Example::

        >>> from frolic_tta.synthetic import clip_world
        >>> world = clip_world(num_samples=400, num_classes=5, dim=16)
        >>> proxies, tau = inmap_proxies(world.features, world.prototypes, iterations=50)
        >>> proxies.shape, tau
        (torch.Size([5, 16]), 0.04)
    """
    return fit_proxies(features, prototypes, text_temperature, **kwargs).classifier()


def fit_proxies(
    features: Tensor,
    prototypes: Tensor,
    text_temperature: float = 0.01,
    *,
    temperature: float = PROXY_TEMPERATURE,
    threshold: float = 0.6,
    learning_rate: float = 10.0,
    iterations: int = 2000,
    sinkhorn_iterations: int = 20,
    gamma: float = 0.0,
    labels_from: AffineMap | None = None,
    target: Tensor | None = None,
    tolerance: float | None = None,
    relative_tolerance: float | None = None,
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> ProxyFit:
    r"""InMaP's proxies (see the module docstring) with the steps and passes they took.

    Args:
        features: local image features (unit rows for CLIP).
        prototypes: text prototypes :math:`z_j`, the starting point.
        text_temperature: :math:`\tau_t` of the pseudo-labels: the model's :math:`\tau_c`.
        temperature: :math:`\tau_i` of the proxies (InMaP: 0.04).
        threshold: pseudo-labels above it become one-hot (InMaP: 0.6).
        learning_rate: initial step :math:`\eta` (InMaP: 10).
        iterations: gradient steps, or their cap with ``tolerance`` (InMaP: 2000).
        sinkhorn_iterations: balancing steps of the pseudo-labels (InMaP: 20).
        gamma: exponent of the labels' target class masses (InMaP: 0, equal masses).
        labels_from: classifier whose logits / ``text_temperature`` give the labels
            (default: the prototypes, :math:`Zx`).
        target: ``(K,)`` class masses of the labels (replaces ``gamma``), or ``None``.
        tolerance: stop once no proxy moves more than this in one step (``None``: run all
            ``iterations``, as InMaP).
        relative_tolerance: stop once :math:`\|G\|_F` falls by less than this fraction of
            itself in one step (``None``: not tested).
        reduce_fn: sums a tensor over shards (identity by default).
        chunk_size: rows per chunk (``None``: about 2M logits per chunk).

    Returns:
        :class:`ProxyFit`.
    """
    check_matrix("prototypes", prototypes, min_rows=2)
    check_matrix("features", features, min_rows=0, cols=prototypes.shape[1], finite=not reduce_fn)
    if reduce_fn is not None:  # values decided over all shards: every shard raises or none
        check_shards_together(reduce_fn, [("features", features)])
    for name, value in (
        ("text_temperature", text_temperature),
        ("temperature", temperature),
        ("learning_rate", learning_rate),
        ("threshold", threshold),
    ):
        check_positive(name, value)
    check_positive("gamma", gamma, allow_zero=True)
    for name, value in (("tolerance", tolerance), ("relative_tolerance", relative_tolerance)):
        if value is not None:
            check_positive(name, value)
    for name, value in (("iterations", iterations), ("sinkhorn_iterations", sinkhorn_iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Expected `{name}` to be an int >= 0, but got {value!r}")
    reduce_fn = reduce_fn or identity_reduce
    count = reduce_fn(torch.tensor(float(features.shape[0]), dtype=torch.float64))
    exact = exact_arithmetic(count, prototypes.shape[0], prototypes.shape[1])  # module docstring
    target = pseudo_labels_sums(
        features,
        prototypes,
        text_temperature=text_temperature,
        threshold=threshold,
        sinkhorn_iterations=sinkhorn_iterations,
        gamma=gamma,
        labels_from=labels_from,
        target=target,
        reduce_fn=reduce_fn,
        chunk_size=chunk_size,
        exact=exact,
    )
    chunks = _chunks(features, chunk_rows(prototypes.shape[0], chunk_size))
    proxies = prototypes.to(device=features.device, dtype=torch.float64)
    proxies = proxies / proxies.norm(dim=1, keepdim=True)
    step, previous = float(learning_rate), float("inf")
    dtype = compute_dtype(features)
    work = torch.float64 if exact else dtype  # the products' and the sums'
    steps, converged = 0, False
    while steps < iterations and not converged:
        weight = (proxies / temperature).to(work).t().contiguous()
        local = torch.zeros(proxies.shape, dtype=work, device=features.device)
        for block in chunks:  # sum_i softmax(W x_i / tau_i) x_i^T, accumulated in place
            block = block.to(work)  # exact: a float64 copy of the chunk
            scores = torch.softmax((block @ weight).to(dtype), dim=1)  # exact: rounded once
            local.addmm_(scores.to(work).t(), block)
        gradient = reduce_fn(local.to(torch.float64)) - target
        norm = float(gradient.norm())
        if norm > previous:
            step /= 2.0
        elif relative_tolerance is not None:  # G fell, by less than this fraction: stalled
            converged = previous - norm < relative_tolerance * norm
        previous = norm
        moved = proxies - (step / (float(count) * temperature)) * gradient
        moved = moved / moved.norm(dim=1, keepdim=True)
        if tolerance is not None:
            converged = converged or float((moved - proxies).norm(dim=1).max()) < tolerance
        proxies, steps = moved, steps + 1
    passes = sinkhorn_iterations + 1 + steps
    return ProxyFit(proxies, float(temperature), steps, passes, converged)
