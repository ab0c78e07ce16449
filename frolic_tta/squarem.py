r"""SQUAREM's jump for the mixture weights' EM steps (behind :mod:`frolic_tta.mixture`).

Varadhan & Roland (2008), scheme S3: two EM steps from :math:`\pi` extrapolated along their
first and second differences; :func:`~frolic_tta.mixture.mixture_weights` keeps the jump only
where the likelihood does not drop.

Shapes: K classes.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_STEP = 5.0
r"""Largest change of one ln-weight in a jump in :math:`\ln\pi` (a factor of about 150)."""


def squarem_jump(pi: Tensor, first: Tensor, second: Tensor, tiny: float) -> Tensor:
    r"""SQUAREM's S3 jump from ``pi`` through two EM steps ``first``, ``second`` ``(K,)``.

    In the weights where the jump stays positive; where it would leave the simplex (weights
    heading to 0: classes the test set lacks, e.g. fewer samples than classes), in
    :math:`\ln\pi`, where EM's geometric decay of such a weight is a straight line that the
    jump follows, its step length halved towards -1 until no weight moves by more than a
    factor :math:`e^{5}` (:data:`LOG_STEP`). Before, such jumps were dropped for the plain EM
    step: 500 passes without converging at K = 1,000, N = 500. ``second`` where the steps do
    not move.
    """
    r, v = first - pi, second - 2 * first + pi
    norm_v = float(v.norm())
    if norm_v == 0.0:
        return second
    alpha = min(-float(r.norm()) / norm_v, -1.0)
    jump = pi - 2.0 * alpha * r + alpha * alpha * v
    if bool((jump > 0).all()):
        return jump / jump.sum()
    logs = [p.clamp(min=tiny).log() for p in (pi, first, second)]
    r, v = logs[1] - logs[0], logs[2] - 2 * logs[1] + logs[0]
    norm_v = float(v.norm())
    if norm_v == 0.0:
        return second
    alpha = min(-float(r.norm()) / norm_v, -1.0)
    for _ in range(60):  # at most a factor e^LOG_STEP per weight: halve towards alpha = -1
        step = -2.0 * alpha * r + alpha * alpha * v
        if float(step.abs().max()) <= LOG_STEP or alpha == -1.0:
            break
        alpha = max((alpha - 1.0) / 2.0, -1.0) if alpha < -1.0 else -1.0
    return torch.softmax(logs[0] + step, dim=0)
