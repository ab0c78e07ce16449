r"""InMaP: intra-modal proxies for the zero-shot classifier (Qian et al., NeurIPS 2023).

CLIP's text prototypes :math:`z_j` live in the text cone, the images in the image cone (the
modality gap). InMaP learns K *proxies* :math:`w_j` in the image space from the unlabelled test
images, supervised by the zero-shot classifier, and classifies with :math:`f(x) = Wx`. As in the
authors' code (``github.com/idstcv/InMaP``, ``main.py``, its ImageNet defaults):

1. **Pseudo-labels** (``sinkhorn``): :math:`q_i = \mathrm{softmax}(Zx_i/\tau_t)` balanced over
   classes by ``sinkhorn_iterations`` = 20 Sinkhorn steps (equal class marginals, their
   ``gamma = 0``). Each step only rescales the columns, so the labels are
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

Deviations from the reference code: float64 proxies and reduced sums (each shard's gradient
is accumulated in the features' dtype, float32 for CLIP features, like the reference's float32
product), the labels' column scaling kept in log space and floored at the smallest float64 (a
class no image prefers would give NaN there), ``gamma > 0`` not implemented.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from frolic_tta.logits import (
    DEFAULT_CHUNK_SIZE,
    ReduceFn,
    chunk_rows,
    compute_dtype,
    identity_reduce,
)
from frolic_tta.options import check_positive
from frolic_tta.validation import check_matrix, check_shards_together

PROXY_TEMPERATURE = 0.04
r"""InMaP's :math:`\tau_i` (its ImageNet default): the proxies' softmax temperature."""


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
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    r""":math:`\sum_i q_i x_i^\top` ``(K, d)`` float64 over all shards: InMaP's balanced,
    thresholded pseudo-labels :math:`q_i` (step 1 of the module docstring) times the features.
    """
    reduce_fn = reduce_fn or identity_reduce
    chunks = _chunks(features, chunk_rows(prototypes.shape[0], chunk_size))
    z = prototypes.to(torch.float64)
    log_scale = torch.zeros(z.shape[0], dtype=torch.float64, device=features.device)

    weight = (z / text_temperature).to(device=features.device, dtype=compute_dtype(features)).t()

    def labels(block: Tensor) -> Tensor:
        return torch.softmax(torch.addmm(log_scale.to(block), block, weight), dim=1)

    for _ in range(sinkhorn_iterations):
        column = torch.zeros_like(log_scale)
        for block in chunks:
            column += labels(block).sum(0).to(column)
        column = reduce_fn(column).clamp_min(torch.finfo(torch.float64).tiny)
        log_scale = log_scale - torch.log(column)
    total = torch.zeros(z.shape, dtype=torch.float64, device=features.device)
    for block in chunks:
        q = labels(block)
        confidence, best = q.max(1)
        sure = confidence > threshold
        q[sure] = 0.0
        q[sure, best[sure]] = 1.0
        total += (q.t() @ block).to(total)
    return reduce_fn(total)


def inmap_proxies(
    features: Tensor,
    prototypes: Tensor,
    text_temperature: float = 0.01,
    *,
    temperature: float = PROXY_TEMPERATURE,
    threshold: float = 0.6,
    learning_rate: float = 10.0,
    iterations: int = 2000,
    sinkhorn_iterations: int = 20,
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> ProxyClassifier:
    r"""InMaP's proxies from the local shard ``features`` ``(N_local, d)`` and the text
    ``prototypes`` ``(K, d)`` (identical on every shard); see the module docstring.

    Args:
        features: local image features (unit rows for CLIP).
        prototypes: text prototypes :math:`z_j`, the starting point.
        text_temperature: :math:`\tau_t` of the pseudo-labels: the model's :math:`\tau_c`.
        temperature: :math:`\tau_i` of the proxies (InMaP: 0.04).
        threshold: pseudo-labels above it become one-hot (InMaP: 0.6).
        learning_rate: initial step :math:`\eta` (InMaP: 10).
        iterations: gradient steps (InMaP: 2000).
        sinkhorn_iterations: balancing steps of the pseudo-labels (InMaP: 20).
        reduce_fn: sums a tensor over shards (identity by default).
        chunk_size: rows per chunk (``None``: about 2M logits per chunk).

    Returns:
        :class:`ProxyClassifier`: ``(K, d)`` float64 unit proxies and ``temperature``.

    Example::

        >>> from frolic_tta.synthetic import clip_world
        >>> world = clip_world(num_samples=400, num_classes=5, dim=16)
        >>> proxies, tau = inmap_proxies(world.features, world.prototypes, iterations=50)
        >>> proxies.shape, tau
        (torch.Size([5, 16]), 0.04)
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
    for name, value in (("iterations", iterations), ("sinkhorn_iterations", sinkhorn_iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Expected `{name}` to be an int >= 0, but got {value!r}")
    reduce_fn = reduce_fn or identity_reduce
    count = reduce_fn(torch.tensor(float(features.shape[0]), dtype=torch.float64))
    target = pseudo_labels_sums(
        features,
        prototypes,
        text_temperature=text_temperature,
        threshold=threshold,
        sinkhorn_iterations=sinkhorn_iterations,
        reduce_fn=reduce_fn,
        chunk_size=chunk_size,
    )
    chunks = _chunks(features, chunk_rows(prototypes.shape[0], chunk_size))
    proxies = prototypes.to(device=features.device, dtype=torch.float64)
    proxies = proxies / proxies.norm(dim=1, keepdim=True)
    step, previous = float(learning_rate), float("inf")
    dtype = compute_dtype(features)
    for _ in range(iterations):
        weight = (proxies / temperature).to(dtype).t().contiguous()
        local = torch.zeros(proxies.shape, dtype=dtype, device=features.device)
        for block in chunks:  # sum_i softmax(W x_i / tau_i) x_i^T, accumulated in place
            local.addmm_(torch.softmax(block @ weight, dim=1).t(), block)
        gradient = reduce_fn(local.to(torch.float64)) - target
        norm = float(gradient.norm())
        if norm > previous:
            step /= 2.0
        previous = norm
        proxies = proxies - (step / (float(count) * temperature)) * gradient
        proxies = proxies / proxies.norm(dim=1, keepdim=True)
    return ProxyClassifier(proxies, float(temperature))
