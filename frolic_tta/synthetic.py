r"""Generated worlds with known ground truth, for tests and benchmarks.

* :func:`paper_world` -- the paper's own model: :math:`x \sim \mathcal N(z_y, \Sigma)`,
  prototypes are the class means, no normalisation.
* :func:`prior_shift_world` -- Proposition 2's model: logits are the Bayes posterior of Gaussian
  classes under a known long-tailed pre-training prior :math:`\beta^*`; the test set is balanced.
* :func:`clip_world` -- CLIP-like geometry: unit-norm image and text embeddings in different cones
  (a modality gap), anisotropic within-class noise, and a planted per-class text bias.
* :func:`clip_like_world` -- the same idea with random class directions, so K may exceed d,
  generated in chunks for ImageNet sizes.
* :func:`means_world` -- the text prototypes are the class means: nothing to correct.

Every world takes a ``test_prior`` (the class frequencies of the generated test set; balanced
by default) and ``sample=True`` draws labels i.i.d. from it (natural count variation) instead
of exact counts; :func:`shifted_prior` builds the label-shift scenarios of the benchmarks.
"""

from __future__ import annotations

import math
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


def class_labels(
    num_samples: int,
    num_classes: int,
    generator: torch.Generator,
    test_prior: Tensor | None = None,
    sample: bool = False,
) -> Tensor:
    """``(N,)`` shuffled labels: exact counts ``N * test_prior`` (largest remainders; balanced
    if ``None``), or i.i.d. draws from ``test_prior`` with ``sample=True``."""
    if sample:
        prior = torch.full((num_classes,), 1.0 / num_classes) if test_prior is None else test_prior
        return torch.multinomial(prior.float(), num_samples, replacement=True, generator=generator)
    if test_prior is None:
        labels = torch.arange(num_samples) % num_classes
    else:
        raw = test_prior.double() / test_prior.sum() * num_samples
        counts = raw.floor().long()
        order = torch.argsort(raw - counts, descending=True)
        counts[order[: num_samples - int(counts.sum())]] += 1
        labels = torch.repeat_interleave(torch.arange(num_classes), counts)
    return labels[torch.randperm(num_samples, generator=generator)]


def shifted_prior(kind: str, num_classes: int, seed: int = 0) -> Tensor:
    """A test prior ``(K,)``: ``"balanced"``, ``"long-tailed:R"`` (max/min ``R``, exponential
    profile, random order) or ``"subset:F"`` (uniform over a random fraction ``F`` of the
    classes, the others absent).

    Raises:
        ValueError: an unknown ``kind``.
    """
    name, _, value = kind.partition(":")
    if name == "balanced":
        return torch.full((num_classes,), 1.0 / num_classes, dtype=torch.float64)
    if name == "long-tailed" and value:
        return long_tailed_prior(num_classes, float(value), seed=seed + 101)
    if name == "subset" and value:
        present = max(2, round(float(value) * num_classes))
        g = torch.Generator().manual_seed(seed + 202)
        prior = torch.zeros(num_classes, dtype=torch.float64)
        prior[torch.randperm(num_classes, generator=g)[:present]] = 1.0 / present
        return prior
    raise ValueError(f"Expected `kind` 'balanced', 'long-tailed:R' or 'subset:F', but got {kind!r}")


def paper_world(
    num_samples: int = 5000,
    num_classes: int = 10,
    dim: int = 16,
    separation: float = 1.5,
    seed: int = 0,
    test_prior: Tensor | None = None,
    sample: bool = False,
) -> World:
    r""":math:`x \sim \mathcal N(z_y, \Sigma)`, balanced, float64; Bayes classifier = LDA."""
    g = torch.Generator().manual_seed(seed)
    means = separation * torch.randn(num_classes, dim, generator=g, dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    scales = torch.linspace(0.3, 1.5, dim, dtype=torch.float64)
    covariance = basis @ torch.diag(scales**2) @ basis.t()
    labels = class_labels(num_samples, num_classes, g, test_prior, sample)
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
    test_prior: Tensor | None = None,
    sample: bool = False,
) -> World:
    r"""Proposition 2's model.

    Classes :math:`x \mid y \sim \mathcal N(\mu_y, I)`; the model's logits are the Bayes
    posterior under the pre-training prior :math:`\beta^*` (``ratio`` = max/min), i.e.
    :math:`f(x)_j = \mu_j^\top x - \frac12\|\mu_j\|^2 + \ln\beta^*_j`; on a balanced test set
    :math:`f - \ln\beta^*` is the Bayes classifier (``bayes_logits``; with a ``test_prior``
    :math:`\pi` they include :math:`\ln\pi`). ``ratio=1`` gives no bias.
    """
    g = torch.Generator().manual_seed(seed)
    means = separation * torch.randn(num_classes, dim, generator=g, dtype=torch.float64)
    labels = class_labels(num_samples, num_classes, g, test_prior, sample)
    features = means[labels] + torch.randn(num_samples, dim, generator=g, dtype=torch.float64)
    prior = long_tailed_prior(num_classes, ratio, seed)
    bayes = features @ means.t() - 0.5 * (means**2).sum(1)
    if test_prior is not None:
        bayes = bayes + torch.log(test_prior.double())
    biased = features @ means.t() - 0.5 * (means**2).sum(1) + torch.log(prior)
    return World(features, means, labels, logits=biased, prior=prior, bayes_logits=bayes)


def clip_world(
    num_samples: int = 4000,
    num_classes: int = 20,
    dim: int = 64,
    bias_strength: float = 0.04,
    seed: int = 0,
    test_prior: Tensor | None = None,
    sample: bool = False,
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
    labels = class_labels(num_samples, num_classes, g, test_prior, sample)
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


def _unit(tensor: Tensor) -> Tensor:
    return tensor / tensor.norm(dim=-1, keepdim=True)


def clip_like_world(
    num_samples: int = 20000,
    num_classes: int = 50,
    dim: int = 128,
    noise: float = 0.5,
    tilt: float = 0.3,
    text_bias: float = 0.03,
    seed: int = 0,
    test_prior: Tensor | None = None,
    sample: bool = False,
    chunk: int = 16384,
) -> World:
    r"""Unit-norm float32 CLIP-like features for any K vs d (random class directions).

    Images :math:`x = \mathrm{normalise}(0.53\,g_{img} + 0.16\,u'_y + \text{noise}/\sqrt d)`
    with :math:`u'_y` the class direction tilted by ``tilt``; text
    :math:`z_j = \mathrm{normalise}(0.8\,g_{txt} + u_j + (0.5 + \delta_j) g_{img} + \ldots)`
    with a planted per-class bias :math:`\delta_j \sim \mathcal N(0, \text{text\_bias}^2)`.
    At K = 50, d = 128, ``noise=0.5``: zero-shot about 0.59, like CLIP ViT-B/16 on ImageNet;
    at K = 1000, d = 512, ``noise=0.8``: about 0.59 too. Generated in chunks of ``chunk`` rows.
    """
    g = torch.Generator().manual_seed(seed)
    gap_img, gap_txt = _unit(torch.randn(dim, generator=g)), _unit(torch.randn(dim, generator=g))
    classes = _unit(torch.randn(num_classes, dim, generator=g))
    image_dirs = _unit(classes + tilt * _unit(torch.randn(num_classes, dim, generator=g)))
    labels = class_labels(num_samples, num_classes, g, test_prior, sample)
    features = torch.empty(num_samples, dim)
    for start in range(0, num_samples, chunk):
        y = labels[start : start + chunk]
        spread = noise / math.sqrt(dim) * torch.randn(len(y), dim, generator=g)
        features[start : start + len(y)] = _unit(0.53 * gap_img + 0.16 * image_dirs[y] + spread)
    delta = text_bias * torch.randn(num_classes, generator=g)
    text = 0.8 * gap_txt + classes + (0.5 + delta)[:, None] * gap_img
    text += 0.2 / math.sqrt(dim) * torch.randn(num_classes, dim, generator=g)
    return World(features, _unit(text), labels)


def means_world(
    num_samples: int = 2000,
    num_classes: int = 10,
    dim: int = 16,
    noise: float = 0.6,
    seed: int = 0,
    test_prior: Tensor | None = None,
    sample: bool = False,
) -> World:
    r"""A world whose text prototypes *are* the class means: nothing for Frolic to correct.

    :math:`x = \mathrm{normalise}(\mu_y + \text{noise}\,\epsilon)`, :math:`z_j = \mu_j`
    (random unit directions), float32: zero-shot is the right direction, with no modality gap
    and no planted bias; only the test set's own class prior (``test_prior``) shifts it. At
    K = 10, d = 16 zero-shot is right on about 0.78 / 0.55 / 0.34 of the samples at ``noise``
    0.4 / 0.6 / 1.0; at K = 20, d = 32 on about 0.70 / 0.52 at 0.4 / 0.5.
    """
    g = torch.Generator().manual_seed(seed)
    means = _unit(torch.randn(num_classes, dim, generator=g, dtype=torch.float64))
    labels = class_labels(num_samples, num_classes, g, test_prior, sample)
    spread = noise * torch.randn(num_samples, dim, generator=g, dtype=torch.float64)
    return World(_unit(means[labels] + spread).float(), means.float(), labels)


def zero_shot_view(world: World) -> tuple[Tensor, Tensor]:
    r"""Features and prototypes of :func:`prior_shift_world` whose zero-shot logits
    :math:`x^\top z` are exactly the biased posterior logits ``world.logits``: features
    :math:`[x, 1]`, prototypes :math:`[\mu_j, -\frac12\|\mu_j\|^2 + \ln\beta^*_j]`
    (use ``tau_c=1``)."""
    if world.prior is None:
        raise ValueError("Expected a prior_shift_world (with `prior`), but got a world without")
    x, mu = world.features, world.prototypes
    ones = torch.ones(x.shape[0], 1, dtype=x.dtype)
    offset = -0.5 * (mu**2).sum(1) + torch.log(world.prior)
    return torch.cat([x, ones], 1), torch.cat([mu, offset[:, None]], 1)


MEANS_WORLDS = (
    (10, 16, 0.4, "balanced", 2000),
    (20, 32, 0.4, "balanced", 4000),
    (10, 16, 1.0, "long-tailed:10", 2000),
    (10, 16, 0.6, "long-tailed:10", 2000),
    (20, 32, 0.5, "long-tailed:10", 4000),
    (10, 16, 0.6, "long-tailed:100", 2000),
)
"""``(K, d, noise, test prior, N)`` of the :func:`means_world` cases of issue 35 (zero-shot
0.33-0.78): ``benchmarks/no_harm.py`` prints them, ``tests/test_no_harm.py`` asserts them."""
