r"""Generated worlds with known ground truth, for tests and benchmarks.

* :func:`paper_world` -- the paper's own model: :math:`x \sim \mathcal N(z_y, \Sigma)`,
  prototypes are the class means, no normalisation.
* :func:`prior_shift_world` -- Proposition 2's model: logits are the Bayes posterior of Gaussian
  classes under a known long-tailed pre-training prior :math:`\beta^*`; the test set is balanced.
* :func:`clip_world` -- CLIP-like geometry: unit-norm image and text embeddings in different cones
  (a modality gap), anisotropic within-class noise, and a planted per-class text bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class World:
    r"""A generated dataset.

    Attributes:
        features: ``(N, d)``.
        prototypes: ``(K, d)``.
        labels: ``(N,)``.
        covariance: ``(d, d)`` true shared covariance when the model has one.
        logits: ``(N, K)`` biased posterior logits (prior-shift world).
        prior: ``(K,)`` true pre-training prior :math:`\beta^*` (prior-shift world).
        bayes_logits: ``(N, K)`` logits of the Bayes classifier on the test distribution.
    """

    features: Tensor
    prototypes: Tensor
    labels: Tensor
    covariance: Tensor | None = None
    logits: Tensor | None = None
    prior: Tensor | None = None
    bayes_logits: Tensor | None = None


def _balanced_labels(num_samples: int, num_classes: int, generator: torch.Generator) -> Tensor:
    labels = torch.arange(num_samples) % num_classes
    return labels[torch.randperm(num_samples, generator=generator)]


def paper_world(
    num_samples: int = 5000,
    num_classes: int = 10,
    dim: int = 16,
    separation: float = 1.5,
    seed: int = 0,
) -> World:
    r""":math:`x \sim \mathcal N(z_y, \Sigma)`, balanced, float64; Bayes classifier = LDA."""
    g = torch.Generator().manual_seed(seed)
    means = separation * torch.randn(num_classes, dim, generator=g, dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    scales = torch.linspace(0.3, 1.5, dim, dtype=torch.float64)
    covariance = basis @ torch.diag(scales**2) @ basis.t()
    labels = _balanced_labels(num_samples, num_classes, g)
    noise = torch.randn(num_samples, dim, generator=g, dtype=torch.float64) * scales
    features = means[labels] + noise @ basis.t()
    precision_means = torch.linalg.solve(covariance, means.t()).t()
    bayes = features @ precision_means.t() - 0.5 * (means * precision_means).sum(1)
    return World(features, means, labels, covariance=covariance, bayes_logits=bayes)


def long_tailed_prior(num_classes: int, ratio: float = 20.0, seed: int = 0) -> Tensor:
    """Exponential profile from 1 to ``1/ratio``, randomly permuted, normalised; ``(K,)``."""
    g = torch.Generator().manual_seed(seed)
    profile = ratio ** (-torch.linspace(0, 1, num_classes, dtype=torch.float64))
    profile = profile[torch.randperm(num_classes, generator=g)]
    return profile / profile.sum()


def prior_shift_world(
    num_samples: int = 20000,
    num_classes: int = 10,
    dim: int = 16,
    separation: float = 1.0,
    ratio: float = 20.0,
    seed: int = 0,
) -> World:
    r"""Proposition 2's model.

    Classes :math:`x \mid y \sim \mathcal N(\mu_y, I)`; the model's logits are the Bayes
    posterior under the pre-training prior :math:`\beta^*` (``ratio`` = max/min), i.e.
    :math:`f(x)_j = \mu_j^\top x - \frac12\|\mu_j\|^2 + \ln\beta^*_j`; the test set is
    balanced, so :math:`f - \ln\beta^*` is the Bayes classifier. ``ratio=1`` gives no bias.
    """
    g = torch.Generator().manual_seed(seed)
    means = separation * torch.randn(num_classes, dim, generator=g, dtype=torch.float64)
    labels = _balanced_labels(num_samples, num_classes, g)
    features = means[labels] + torch.randn(num_samples, dim, generator=g, dtype=torch.float64)
    prior = long_tailed_prior(num_classes, ratio, seed)
    bayes = features @ means.t() - 0.5 * (means**2).sum(1)
    return World(
        features, means, labels, logits=bayes + torch.log(prior), prior=prior, bayes_logits=bayes
    )


def clip_world(
    num_samples: int = 4000,
    num_classes: int = 20,
    dim: int = 64,
    bias_strength: float = 0.04,
    seed: int = 0,
) -> World:
    r"""CLIP-like geometry with a modality gap and a planted class bias (float32, unit norm).

    Images: :math:`x = \mathrm{normalise}(a\,g_{img} + c\,u_y + \text{noise})` with noise
    strongest along a few shared "nuisance" directions that leak into the class directions.
    Text: :math:`z_j = \mathrm{normalise}(a_t g_{txt} + c_t u_j + \delta_j g_{img})`; the
    planted bias :math:`\delta_j` (spread ``bias_strength``) raises every image's similarity
    to some classes. Typical cosines: :math:`\approx 0.35` to the true prototype and
    :math:`\approx 0.27` to the others.
    """
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    gap_img, gap_txt = basis[:, 0], basis[:, 1]
    class_dirs = basis[:, 2 : 2 + num_classes].t()
    nuisance = basis[:, 2 + num_classes :].t()
    # the image class directions are tilted away from the text ones
    tilt = torch.randn(num_classes, nuisance.shape[0], generator=g, dtype=torch.float64)
    img_dirs = class_dirs + 0.6 * tilt @ nuisance / nuisance.shape[0] ** 0.5
    img_dirs = img_dirs / img_dirs.norm(dim=1, keepdim=True)
    labels = _balanced_labels(num_samples, num_classes, g)
    scales = torch.linspace(0.02, 0.09, nuisance.shape[0], dtype=torch.float64)
    noise = (
        torch.randn(num_samples, nuisance.shape[0], generator=g, dtype=torch.float64) * scales
    ) @ nuisance
    noise += 0.035 * torch.randn(num_samples, dim, generator=g, dtype=torch.float64)
    images = 0.53 * gap_img + 0.16 * img_dirs[labels] + noise
    images = images / images.norm(dim=1, keepdim=True)
    delta = bias_strength * torch.randn(num_classes, generator=g, dtype=torch.float64)
    text = 0.8 * gap_txt + 0.3 * class_dirs + (0.5 + delta)[:, None] * gap_img
    text += 0.05 * torch.randn(num_classes, dim, generator=g, dtype=torch.float64)
    text = text / text.norm(dim=1, keepdim=True)
    return World(images.float(), text.float(), labels)
