r"""Shrinkage of a covariance towards a multiple of the identity (the Gaussian head's, when its
scatter is numerically rank-deficient: :func:`frolic_tta.gda.shared_covariance`).
Shapes: d embedding dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


def oas_shrinkage(covariance: Tensor, num_samples: float) -> float:
    r"""Oracle Approximating Shrinkage intensity, as scikit-learn's ``oas``.

    .. math::
        \rho = \min\!\Big(1, \frac{\alpha + \mu^2}{(N + 1)(\alpha - \mu^2/d)}\Big),\quad
        \mu = \frac{\operatorname{tr}\Sigma}{d},\ \alpha = \operatorname{mean}(\Sigma^{\circ 2})

    Args:
        covariance: ``(d, d)`` empirical covariance.
        num_samples: N.
    """
    d = covariance.shape[0]
    mu = torch.diagonal(covariance).sum() / d
    alpha = (covariance**2).mean()
    den = (num_samples + 1.0) * (alpha - mu**2 / d)
    if float(den) <= 0.0:
        return 1.0
    return float(torch.clamp((alpha + mu**2) / den, max=1.0))


def shrink(covariance: Tensor, shrinkage: float) -> Tensor:
    r""":math:`(1-\rho)\Sigma + \rho\,\frac{\operatorname{tr}\Sigma}{d} I`, ``(d, d)``."""
    d = covariance.shape[0]
    mu = torch.diagonal(covariance).sum() / d
    shrunk = (1.0 - shrinkage) * covariance
    shrunk.diagonal().add_(shrinkage * mu)
    return shrunk
