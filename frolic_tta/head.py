r"""The adapted classifier: everything Algorithm 1 learns, as one affine map.

.. math::
    f_d(x) = \underbrace{\omega(f_g(x)/\tau_g + f_c(x)/\tau_c)}_{f_f\ \text{(Eq. 12)}}
    - \ln\hat\beta + \ln\hat\pi \quad\text{(Eq. 13)} = A(x - \hat\mu) + c,\qquad
    A = \omega(W/\tau_g + Z/\tau_c),\quad
    c = \omega(b/\tau_g + Z\hat\mu/\tau_c) - \ln\hat\beta + \ln\hat\pi,

with :math:`f_g(x) = W(x - \hat\mu) + b` the centred GDA head (Eq. 9 up to a constant per
sample, see :mod:`frolic_tta.gda`), :math:`f_c(x) = Zx` (Eq. 2), :math:`\hat\beta` the
pre-training label bias and :math:`\hat\pi` the test set's class prior (uniform in the paper,
where :math:`\ln\hat\pi` is a constant) and :math:`\omega` the pool weight (1 in Eq. 12,
1/2 with ``fusion="pooled"``, :func:`frolic_tta.calibration.pool_weight`).
Shapes: K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from frolic_tta.gda import GaussianHead
from frolic_tta.logits import AffineMap
from frolic_tta.precision import full_precision
from frolic_tta.validation import check_matrix


def fused_map(
    prototypes: Tensor,
    gaussian: GaussianHead,
    tau_c: float,
    tau_g: float,
    pool_weight: float = 1.0,
    zero_shot_weight: float | None = None,
) -> AffineMap:
    r""":math:`f_f = \omega f_g/\tau_g + \omega_c f_c/\tau_c` (Eq. 12; :math:`\omega` =
    ``pool_weight``, 1 in the paper, see :func:`~frolic_tta.calibration.pool_weight`;
    :math:`\omega_c` = ``zero_shot_weight``, :math:`\omega` where ``None``, 0 where the head
    alone is chosen, :mod:`frolic_tta.fusion`), centred at :math:`\hat\mu` (float64)."""
    z = prototypes.to(torch.float64)
    omega_c = pool_weight if zero_shot_weight is None else zero_shot_weight
    weight = gaussian.weight * (pool_weight / tau_g) + z * (omega_c / tau_c)
    bias = gaussian.bias * (pool_weight / tau_g) + (z @ gaussian.center) * (omega_c / tau_c)
    return AffineMap(weight, bias, gaussian.center)


@dataclass(frozen=True)
class FrolicHead:
    r"""The adapted classifier (float64), built once by :func:`~frolic_tta.fit_frolic` from
    everything it estimated (nothing is set on it afterwards).

    Attributes:
        prototypes: ``(K, d)`` :math:`z_j`.
        gaussian: the fitted :class:`~frolic_tta.gda.GaussianHead` (:math:`W, b`).
        tau_c: zero-shot temperature.
        tau_g: matched GDA temperature (Eq. 11).
        beta: ``(K,)`` pre-training label prior :math:`\hat\beta`.
        test_prior: ``(K,)`` the test set's class prior :math:`\hat\pi` (``None``: uniform).
        zero_shot_beta: ``(K,)`` the zero-shot model's pre-training prior (Proposition 2 on
            :math:`f_c/\tau_c`), used by the debiased zero-shot row (``None``: not estimated).
        pool_weight: :math:`\omega` of :math:`f_f = \omega(f_g/\tau_g + f_c/\tau_c)`: 1 (Eq. 12)
            or 0.5 (``fusion="pooled"``, :func:`~frolic_tta.calibration.pool_weight`).
        zero_shot_weight: :math:`\omega_c`, the weight of :math:`f_c/\tau_c` in :math:`f_f`:
            ``None`` for ``pool_weight``, 0 where ``fusion="selected"`` keeps the head alone
            (:mod:`frolic_tta.fusion`).
    """

    prototypes: Tensor
    gaussian: GaussianHead
    tau_c: float
    tau_g: float
    beta: Tensor
    test_prior: Tensor | None = None
    zero_shot_beta: Tensor | None = None
    pool_weight: float = 1.0
    zero_shot_weight: float | None = None

    def log_offset(self, beta: Tensor | None = None) -> Tensor:
        r"""``(K,)`` :math:`\ln\hat\pi - \ln\hat\beta` (of ``beta`` if given)."""
        offset = -torch.log((self.beta if beta is None else beta).to(torch.float64))
        if self.test_prior is not None:
            offset = offset + torch.log(self.test_prior.to(torch.float64))
        return offset

    def zero_shot(self) -> AffineMap:
        r""":math:`f_c(x) = Zx` (Eq. 2, unscaled)."""
        z = self.prototypes.to(torch.float64)
        return AffineMap(z, torch.zeros(z.shape[0], dtype=torch.float64))

    def fused(self) -> AffineMap:
        r""":math:`f_f = \omega(f_g/\tau_g + f_c/\tau_c)` (Eq. 12), centred at :math:`\hat\mu`."""
        weights = (self.pool_weight, self.zero_shot_weight)
        return fused_map(self.prototypes, self.gaussian, self.tau_c, self.tau_g, *weights)

    def debiased(self) -> AffineMap:
        r""":math:`f_d = f_f - \ln\hat\beta + \ln\hat\pi` (Eq. 13), centred at :math:`\hat\mu`."""
        return self.fused().shift(self.log_offset())

    def score(self, features: Tensor) -> Tensor:
        r""":math:`f_d` of new features ``(n, d)`` -> ``(n, K)`` (no re-adaptation), in float32
        without autocast or TF32 (:func:`~frolic_tta.precision.full_precision`).

        Raises:
            ValueError: ``features`` is not a 2-D floating tensor with d columns.
        """
        check_matrix("features", features, min_rows=0, cols=self.prototypes.shape[1], finite=False)
        with full_precision(features.device.type):
            return self.debiased().logits(features)

    def to_module(self) -> FrolicClassifier:
        """The adapted classifier as a :class:`FrolicClassifier` (centred, float32-safe)."""
        final = self.debiased()
        return FrolicClassifier(final.weight, final.bias, final.center)

    def to_linear(self, dtype: torch.dtype = torch.float32) -> torch.nn.Linear:
        r"""A plain ``torch.nn.Linear(d, K)`` computing :math:`f_d(x) = A x + c'`.

        The uncentred form: in float32 :math:`Ax` and :math:`c'` can be large and cancel (an
        ill-conditioned :math:`\hat\Sigma`); :meth:`to_module` is the float32-safe export, or
        pass ``dtype=torch.float64``.
        """
        weight, bias = self.debiased().uncentred()
        layer = _CheckedLinear(weight.shape[1], weight.shape[0], dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        return layer.requires_grad_(False)

    def state_dict(self) -> dict[str, Tensor | float]:
        """Everything needed to rebuild the head, as plain tensors and floats (float64)."""
        g = self.gaussian
        return {
            "prototypes": self.prototypes,
            "weight": g.weight,
            "bias": g.bias,
            "center": g.center,
            "class_means": g.class_means,
            "shared_covariance": g.shared_covariance,
            "shrinkage": g.shrinkage,
            "class_weights": g.class_weights,
            "tau_c": self.tau_c,
            "tau_g": self.tau_g,
            "beta": self.beta,
            "test_prior": self.test_prior,
            "zero_shot_beta": self.zero_shot_beta,
            "pool_weight": self.pool_weight,
            "zero_shot_weight": self.zero_shot_weight,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor | float]) -> FrolicHead:
        """Inverse of :meth:`state_dict`."""
        gaussian = GaussianHead(
            weight=state["weight"],
            bias=state["bias"],
            center=state["center"],
            class_means=state["class_means"],
            shared_covariance=state["shared_covariance"],
            shrinkage=float(state["shrinkage"]),
            class_weights=state["class_weights"],
        )
        return cls(
            prototypes=state["prototypes"],
            gaussian=gaussian,
            tau_c=float(state["tau_c"]),
            tau_g=float(state["tau_g"]),
            beta=state["beta"],
            test_prior=state.get("test_prior"),
            zero_shot_beta=state.get("zero_shot_beta"),
            pool_weight=float(state.get("pool_weight", 1.0)),  # heads saved before: Eq. 12
            zero_shot_weight=_optional_float(state.get("zero_shot_weight")),
        )


def _optional_float(value: Tensor | float | None) -> float | None:
    return None if value is None else float(value)


class FrolicClassifier(torch.nn.Module):
    r"""The adapted classifier :math:`f_d(x) = A(x - \mu) + c` as an ``nn.Module``.

    Buffers ``weight`` (K, d), ``bias`` (K,), ``center`` (d,), float32; evaluated centred, as
    :class:`~frolic_tta.logits.AffineMap`, so float32 stays exact. Input ``(n, d)``
    L2-normalised image features, output ``(n, K)`` logits.
    """

    weight: Tensor
    bias: Tensor
    center: Tensor

    def __init__(self, weight: Tensor, bias: Tensor, center: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().float().clone())
        self.register_buffer("bias", bias.detach().float().clone())
        self.register_buffer("center", center.detach().float().clone())

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> FrolicClassifier:
        """Rebuild from :meth:`state_dict`."""
        return cls(state["weight"], state["bias"], state["center"])

    def forward(self, features: Tensor) -> Tensor:
        check_matrix("features", features, min_rows=0, cols=self.weight.shape[1], finite=False)
        return AffineMap(self.weight, self.bias, self.center).logits(features)


class _CheckedLinear(torch.nn.Linear):
    """``torch.nn.Linear`` that says what it expected when given features of another width or
    an integer tensor (instead of a size-mismatch ``RuntimeError``)."""

    def forward(self, features: Tensor) -> Tensor:
        if not isinstance(features, Tensor) or not features.is_floating_point():
            what = features.dtype if isinstance(features, Tensor) else type(features).__name__
            raise ValueError(f"Expected `features` to be floating point, but got {what}")
        if features.ndim == 0 or features.shape[-1] != self.in_features:
            raise ValueError(
                f"Expected `features` to have {self.in_features} columns (dimension mismatch), "
                f"but got shape {tuple(features.shape)}"
            )
        return super().forward(features)
