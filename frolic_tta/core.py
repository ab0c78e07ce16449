r"""The Frolic pipeline (paper Algorithm 1; math room).

.. math::
    f_c(x) = Z x\ \text{(Eq. 2)},\quad f_g(x) = W x + b\ \text{(Eq. 9)},\quad
    f_f = f_g/\tau_g + f_c/\tau_c\ \text{(Eq. 12)},\quad f_d = f_f - \ln\hat\beta\ \text{(Eq. 13)}.

The adapted classifier is one linear map :math:`f_d(x) = A x + c` with
:math:`A = W/\tau_g + Z/\tau_c` and :math:`c = b/\tau_g - \ln\hat\beta` (:class:`FrolicHead`).

:func:`fit_frolic` works on one shard of features and an injected ``reduce_fn``: the moments are
one reduction, the :math:`\tau_g` search and the :math:`\beta` loop reduce sums at every step,
and every rank takes the same steps. It keeps at most one ``(N_local, K)`` buffer, which becomes
the final logits (``keep_logits=True``), or none (logits recomputed chunk by chunk).
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from frolic_tta.calibration import match_temperature
from frolic_tta.debias import BiasMethod, estimate_label_bias
from frolic_tta.gda import (
    Covariance,
    GaussianHead,
    MomentSums,
    Shrinkage,
    fit_gaussian_head,
    moment_sums,
)
from frolic_tta.streams import (
    DEFAULT_CHUNK_SIZE,
    LinearLogits,
    ReduceFn,
    TensorLogits,
    check_matrix,
    chunk_rows,
    compute_dtype,
    identity_reduce,
    materialise,
)


def validate_inputs(features: Tensor, prototypes: Tensor, *, normalize: bool = False) -> None:
    """Check shapes and values of ``features`` ``(N, d)`` and ``prototypes`` ``(K, d)``.

    Raises:
        ValueError: K < 2, N < 1, a dimension mismatch, non-finite values, or (with
            ``normalize``) a zero-norm row.
    """
    check_matrix("prototypes", prototypes)
    if prototypes.shape[0] < 2:
        raise ValueError(f"Expected at least 2 classes (K >= 2), but got K={prototypes.shape[0]}")
    check_matrix("features", features, min_rows=1, cols=prototypes.shape[1])
    if normalize:
        for name, tensor in (("features", features), ("prototypes", prototypes)):
            if bool((tensor.norm(dim=1) == 0).any()):
                raise ValueError(
                    f"Expected every row of `{name}` to have non-zero norm to normalise"
                )


def l2_normalize(tensor: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm."""
    return tensor / tensor.norm(dim=1, keepdim=True)


@dataclass
class FrolicHead:
    """The adapted classifier: everything Algorithm 1 learns, float64.

    Attributes:
        prototypes: ``(K, d)`` :math:`z_j`.
        gaussian: the fitted :class:`~frolic_tta.gda.GaussianHead` (:math:`W, b`).
        tau_c: zero-shot temperature.
        tau_g: matched GDA temperature (Eq. 11).
        beta: ``(K,)`` label prior :math:`\\hat\\beta`.
    """

    prototypes: Tensor
    gaussian: GaussianHead
    tau_c: float
    tau_g: float
    beta: Tensor

    def centred_linear(self, *, debias: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """``(A (K, d), c (K,), mu (d,))`` with :math:`f_d(x) = A (x - \\mu) + c`.

        The numerically preferred form (see :mod:`frolic_tta.gda`); :math:`f_f` if not
        ``debias``.
        """
        g = self.gaussian
        z = self.prototypes.to(torch.float64)
        weight = g.weight / self.tau_g + z / self.tau_c
        bias = g.bias / self.tau_g + (z @ g.center) / self.tau_c
        if debias:
            bias = bias - torch.log(self.beta)
        return weight, bias, g.center

    def linear(self, *, debias: bool = True) -> tuple[Tensor, Tensor]:
        """``(A (K, d), c (K,))`` with :math:`f_d(x) = A x + c` (:math:`f_f` if not ``debias``)."""
        weight, bias, center = self.centred_linear(debias=debias)
        return weight, bias - weight @ center

    def to_linear(self, dtype: torch.dtype = torch.float32) -> torch.nn.Linear:
        """A plain ``torch.nn.Linear(d, K)`` computing :math:`f_d(x) = A x + c`.

        In float32 ``A x`` and ``c`` can be large and cancel (an ill-conditioned
        :math:`\\hat\\Sigma`); :meth:`to_module` avoids that, or use ``dtype=torch.float64``.
        """
        weight, bias = self.linear()
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        return layer.requires_grad_(False)

    def to_module(self) -> FrolicClassifier:
        """The adapted classifier as a :class:`FrolicClassifier` (centred, float32-safe)."""
        weight, bias, center = self.centred_linear()
        return FrolicClassifier(weight, bias, center)

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
        )

    def score(self, features: Tensor) -> Tensor:
        """:math:`f_d` of new features ``(n, d)`` -> ``(n, K)`` (no re-adaptation)."""
        weight, bias = self.linear()
        dtype = compute_dtype(features)
        return torch.addmm(
            bias.to(features.device, dtype),
            features.to(dtype),
            weight.to(features.device, dtype).t(),
        )


class FrolicClassifier(torch.nn.Module):
    """The adapted classifier :math:`f_d(x) = A(x - \\mu) + c`: one affine map, evaluated with
    the centring that keeps float32 exact. Buffers ``weight`` (K, d), ``bias`` (K,),
    ``center`` (d,); input ``(n, d)`` L2-normalised features, output ``(n, K)`` logits."""

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
        return torch.addmm(self.bias, features.to(self.weight) - self.center, self.weight.t())


@dataclass
class FrolicFit:
    """Output of :func:`fit_frolic` on one shard."""

    head: FrolicHead
    sums: MomentSums
    logits: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)


def fit_frolic(
    features: Tensor,
    prototypes: Tensor,
    *,
    tau_c: float = 0.01,
    eps: float = 0.01,
    covariance: Covariance = "soft",
    shrinkage: Shrinkage = "auto",
    bias: BiasMethod = "soft",
    sums: MomentSums | None = None,
    reduce_fn: ReduceFn | None = None,
    keep_logits: bool = True,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> FrolicFit:
    """Run Algorithm 1 on the local shard ``features`` ``(N_local, d)``.

    Args:
        features: local features (already normalised if that is wanted).
        prototypes: ``(K, d)``, identical on every shard.
        tau_c: zero-shot temperature :math:`\\tau_c`.
        eps: tolerance of Algorithm 2.
        covariance: ``"soft"`` (default) or ``"paper"`` (Eq. 7), see :mod:`frolic_tta.gda`.
        shrinkage: for ``"soft"``: ``"auto"`` (default), ``"oas"``, a float or ``None``.
        bias: ``"soft"`` (default), ``"paper"``, ``"implicit"`` or ``"none"``.
        sums: already *reduced* moment sums (e.g. from :class:`frolic_tta.stats.FrolicMoments`);
            computed from ``features`` and reduced with ``reduce_fn`` if ``None``.
        reduce_fn: sums a tensor over shards (identity by default).
        keep_logits: hold one ``(N_local, K)`` buffer (fast; it becomes ``FrolicFit.logits`` =
            :math:`f_d`) or recompute logits chunk by chunk (no N x K tensor at all).
        chunk_size: rows per chunk (``None``: about 2M logits per chunk).
    """
    reduce_fn = reduce_fn or identity_reduce
    if sums is None:  # chunk by chunk: no (N, K) float64 temporaries
        rows = chunk_rows(prototypes.shape[0], chunk_size)
        local = None
        for start in range(0, features.shape[0], rows):
            part = moment_sums(features[start : start + rows], prototypes, tau_c)
            local = part if local is None else local + part
        if local is None:  # an empty shard still takes part in the reduction
            local = moment_sums(features, prototypes, tau_c)
        sums = local.reduce(reduce_fn)
    gaussian = fit_gaussian_head(sums, prototypes, covariance, shrinkage)
    z = prototypes.to(torch.float64)
    zero_shot = LinearLogits(features, z, None, chunk_size)
    gda = LinearLogits(features, gaussian.weight, gaussian.bias, chunk_size, gaussian.center)
    buffer = None
    if keep_logits:
        buffer = torch.empty(
            features.shape[0], z.shape[0], dtype=compute_dtype(features), device=features.device
        )
        for start, chunk in gda.chunks():
            buffer[start : start + chunk.shape[0]] = chunk
        gda = TensorLogits(buffer, chunk_size)
    tau_g = match_temperature(gda, zero_shot, tau_c, reduce_fn=reduce_fn)
    if buffer is not None:
        for start, chunk in zero_shot.chunks():
            rows = buffer[start : start + chunk.shape[0]]
            rows.div_(tau_g).add_(chunk, alpha=1.0 / tau_c)
        fused = TensorLogits(buffer, chunk_size)
    else:
        head = FrolicHead(z, gaussian, tau_c, tau_g, torch.ones(z.shape[0], dtype=torch.float64))
        fused_weight, fused_bias, center = head.centred_linear(debias=False)
        fused = LinearLogits(features, fused_weight, fused_bias, chunk_size, center)
    beta = estimate_label_bias(fused, eps=eps, method=bias, reduce_fn=reduce_fn)
    if buffer is not None:
        buffer.sub_(torch.log(beta).to(buffer))
    head = FrolicHead(prototypes=z, gaussian=gaussian, tau_c=tau_c, tau_g=tau_g, beta=beta)
    return FrolicFit(head=head, sums=sums, logits=buffer)


@dataclass
class FrolicResult:
    """What :func:`frolic` returns. Logit tensors are ``(N, K)``.

    Attributes:
        logits: final :math:`f_d` (Eq. 13).
        zero_shot_logits: :math:`f_c = x^\\top z` (Eq. 2, unscaled).
        gda_logits: :math:`f_g` (Eq. 9, up to a per-sample constant; see :mod:`frolic_tta.gda`).
        fused_logits: :math:`f_f` (Eq. 12).
        tau_g: Eq. 11.
        beta: ``(K,)`` positive, sums to 1.
        head: the adapted :class:`FrolicHead` (one linear map).
        features: the features the result was computed on (normalised if asked).
    """

    logits: Tensor
    zero_shot_logits: Tensor
    gda_logits: Tensor
    fused_logits: Tensor
    tau_g: float
    beta: Tensor
    head: FrolicHead
    features: Tensor

    def ablations(self, labels: Tensor | None = None, *, eps: float = 0.01) -> dict[str, Tensor]:
        """Logits of the paper's Table 3 and Table 4 rows, each ``(N, K)``.

        Keys: ``f_c``, ``f_c - ln beta`` (debiasing of :math:`f_c/\\tau_c` with the default
        method), ``f_g``, ``f_c + f_g``, ``f_f``, ``f_d`` (Table 3); ``tde``, ``implicit``
        (Table 4); ``oracle`` when ``labels`` are given.
        """
        tau_c = self.head.tau_c
        scaled = self.zero_shot_logits / tau_c
        rows = {
            "f_c": self.zero_shot_logits,
            "f_c - ln beta": scaled - torch.log(estimate_label_bias(scaled, eps=eps)).to(scaled),
            "f_g": self.gda_logits,
            "f_c + f_g": self.zero_shot_logits + self.gda_logits,
            "f_f": self.fused_logits,
            "f_d": self.logits,
            "tde": tde_logits(self.features, self.head.prototypes),
        }
        implicit = estimate_label_bias(self.fused_logits, method="implicit")
        rows["implicit"] = self.fused_logits - torch.log(implicit).to(self.fused_logits)
        if labels is not None:
            oracle = estimate_label_bias(self.fused_logits, eps=eps, labels=labels)
            rows["oracle"] = self.fused_logits - torch.log(oracle).to(self.fused_logits)
        return rows


def tde_logits(features: Tensor, prototypes: Tensor, mean: Tensor | None = None) -> Tensor:
    r"""TDE baseline (Tang et al. 2020; Table 4): :math:`f_c(x_\perp)` with :math:`x_\perp`
    the part of :math:`x` orthogonal to the mean feature :math:`\bar x` (of the test data).

    Returns:
        ``(N, K)`` logits.
    """
    dtype = compute_dtype(features)
    x = features.to(dtype)
    direction = x.mean(0) if mean is None else mean.to(dtype)
    direction = direction / direction.norm()
    orthogonal = x - (x @ direction)[:, None] * direction[None, :]
    return orthogonal @ prototypes.to(dtype).t()


def frolic(
    features: Tensor,
    prototypes: Tensor,
    *,
    tau_c: float = 0.01,
    eps: float = 0.01,
    covariance: Covariance = "soft",
    bias: BiasMethod = "soft",
    shrinkage: Shrinkage = "auto",
    normalize: bool = False,
    reduce_fn: ReduceFn | None = None,
) -> FrolicResult:
    """Frolic on a feature matrix (Algorithm 1): every logit of the pipeline.

    Args:
        features: ``(N, d)`` image features (this shard's, with ``reduce_fn``).
        prototypes: ``(K, d)`` text prototypes :math:`z_j`.
        tau_c: zero-shot temperature (CLIP's learned 0.01).
        eps: tolerance of Algorithm 2.
        covariance: ``"soft"`` (default, PD on unit-norm features) or ``"paper"`` (Eq. 7).
        bias: ``"soft"`` (default), ``"paper"`` (Algorithm 2 as written), ``"implicit"``,
            ``"none"``.
        shrinkage: ``"auto"`` (default: OAS only when the scatter is rank-deficient),
            ``"oas"``, a float in [0, 1] or ``None``; ``"soft"`` covariance only.
        normalize: L2-normalise features and prototypes first (CLIP features).
        reduce_fn: sums a tensor over shards; ``features`` is then the local shard.

    Returns:
        :class:`FrolicResult`.

    Example::

        >>> import torch, frolic_tta
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3, 8, generator=g)
        >>> x = z[torch.arange(60) % 3] + 0.5 * torch.randn(60, 8, generator=g)
        >>> res = frolic_tta.frolic(x, z)
        >>> res.logits.shape, round(float(res.beta.sum()), 6)
        (torch.Size([60, 3]), 1.0)
    """
    validate_inputs(features, prototypes, normalize=normalize)
    if features.shape[0] < 2 and reduce_fn is None:
        raise ValueError(f"Expected at least 2 samples (N >= 2), but got N={features.shape[0]}")
    if normalize:
        features, prototypes = l2_normalize(features), l2_normalize(prototypes)
    fit = fit_frolic(
        features,
        prototypes,
        tau_c=tau_c,
        eps=eps,
        covariance=covariance,
        shrinkage=shrinkage,
        bias=bias,
        reduce_fn=reduce_fn,
        keep_logits=True,
    )
    head = fit.head
    dtype = compute_dtype(features)
    x = features.to(dtype)
    zero_shot = x @ head.prototypes.to(dtype).t()
    gda = materialise(
        LinearLogits(x, head.gaussian.weight, head.gaussian.bias, center=head.gaussian.center)
    )
    fused = fit.logits + torch.log(head.beta).to(dtype)
    return FrolicResult(
        logits=fit.logits,
        zero_shot_logits=zero_shot,
        gda_logits=gda,
        fused_logits=fused,
        tau_g=head.tau_g,
        beta=head.beta,
        head=head,
        features=features,
    )
