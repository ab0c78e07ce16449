r"""Frolic on a feature matrix (Algorithm 1): :func:`frolic` returns every logit of the pipeline
(:func:`frolic_tta.pipeline.fit_frolic` on one shard), :class:`FrolicResult` holds them.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from frolic_tta.gda import MomentSums
from frolic_tta.head import FrolicHead
from frolic_tta.logits import ReduceFn
from frolic_tta.options import FrolicOptions, check_positive, resolve_options
from frolic_tta.pipeline import fit_frolic, l2_normalize
from frolic_tta.prior import Priors
from frolic_tta.rows import RowContext, build_rows
from frolic_tta.validation import (
    check_matrix,
    check_shards_together,
    check_unit_rows,
    validate_inputs,
)


@dataclass
class FrolicResult:
    r"""What :func:`frolic` returns. Logit tensors are ``(N, K)``.

    Attributes:
        logits: final :math:`f_d` (Eq. 13).
        zero_shot_logits: :math:`f_c = x^\top z` (Eq. 2, unscaled).
        gda_logits: :math:`f_g` (Eq. 9, up to a per-sample constant; see :mod:`frolic_tta.gda`).
        fused_logits: :math:`f_f` (Eq. 12).
        head: the adapted :class:`~frolic_tta.head.FrolicHead` (one affine map); the one
            owner of :math:`\tau_g` and :math:`\hat\beta` (:attr:`tau_g`, :attr:`beta` read it).
        features: the features the result was computed on (normalised if asked).
        sums: the moment sums of ``features``.
        options: the options of the fit.
        priors: the test prior :math:`\tilde\pi` and the label biases (fused and zero-shot),
            with what the data left undetermined (:class:`~frolic_tta.prior.Priors`).
    """

    logits: Tensor
    zero_shot_logits: Tensor
    gda_logits: Tensor
    fused_logits: Tensor
    head: FrolicHead
    features: Tensor
    sums: MomentSums
    options: FrolicOptions
    priors: Priors

    @property
    def tau_g(self) -> float:
        r""":math:`\tau_g` (Eq. 11) of :attr:`head`."""
        return self.head.tau_g

    @property
    def beta(self) -> Tensor:
        r"""``(K,)`` :math:`\hat\beta` of :attr:`head` (positive, sums to 1)."""
        return self.head.beta

    def ablations(self, labels: Tensor | None = None) -> dict[str, Tensor]:
        """Logits of the paper's Table 3 and Table 4 rows (:data:`frolic_tta.rows.ROWS`).

        Keys: ``f_c``, ``f_c - ln beta``, ``f_g``, ``f_c + f_g``, ``f_f``, ``f_d`` (Table 3);
        ``tde``, ``implicit`` (Table 4); ``oracle`` when ``labels`` ``(N,)`` are given.
        Each value is ``(N, K)`` logits; ``accuracy(logits, labels)`` scores them.
        """
        ctx = RowContext(self.head, self.sums, self.features, self.options, labels=labels)
        return {key: row.logits(self.features) for key, row in build_rows(ctx).items()}


@torch.no_grad()
def frolic(
    features: Tensor,
    prototypes: Tensor,
    options: FrolicOptions | None = None,
    *,
    tau_c: float = 0.01,
    normalize: bool | None = None,
    reduce_fn: ReduceFn | None = None,
    **overrides: Any,
) -> FrolicResult:
    r"""Frolic on a feature matrix (Algorithm 1): every logit of the pipeline.

    Args:
        features: ``(N, d)`` image features (this shard's, with ``reduce_fn``).
        prototypes: ``(K, d)`` text prototypes :math:`z_j`.
        options: :class:`~frolic_tta.options.FrolicOptions` (default: the defaults); keyword
            ``overrides`` of its fields (``covariance="paper"``, ``bias="paper"``,
            ``solver={"eps": ...}``) are applied on top.
        tau_c: zero-shot temperature; the default 0.01 is OpenAI CLIP's learned
            :math:`1/\exp(\text{logit\_scale})` (the paper's value); for another model pass its
            own (``frolic_tta.clip.model_temperature(model)``).
        normalize: ``None`` (default): require unit-norm rows (CLIP embeddings after L2
            normalisation) and raise otherwise; ``True``: L2-normalise features and prototypes
            first; ``False``: use them as they are (e.g. the paper's Gaussian model).
        reduce_fn: sums a tensor over shards; ``features`` is then the local shard.

    Returns:
        :class:`FrolicResult`. It runs under ``torch.no_grad()``: no output requires grad.

    Raises:
        TypeError: ``tau_c`` is not a real number, ``normalize`` not a bool or ``None``.
        ValueError: bad shapes or values (:func:`~frolic_tta.validation.validate_inputs`),
            ``tau_c`` not finite and > 0, fewer than 2 samples (over all shards), or
            non-unit rows with ``normalize=None``.

    Example::

        >>> import torch, frolic_tta
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3, 8, generator=g)
        >>> x = z[torch.arange(60) % 3] + 0.5 * torch.randn(60, 8, generator=g)
        >>> res = frolic_tta.frolic(x, z, normalize=False)  # the paper's model: no unit norm
        >>> res.logits.shape, round(float(res.beta.sum()), 6)
        (torch.Size([60, 3]), 1.0)
    """
    options = resolve_options(options, **overrides)
    tau_c = check_positive("tau_c", tau_c)
    if normalize is not None and not isinstance(normalize, bool):
        raise TypeError(f"Expected `normalize` to be True, False or None, but got {normalize!r}")
    if reduce_fn is None:
        validate_inputs(features, prototypes, normalize=normalize)
        if features.shape[0] < 2:
            raise ValueError(f"Expected at least 2 samples (N >= 2), but got N={features.shape[0]}")
    else:  # values decided over all shards (one reduction); N >= 2 checked by fit_frolic
        check_matrix("features", features, min_rows=0, finite=False)  # the structure: local
        validate_inputs(features[:0], prototypes, normalize=normalize, min_rows=0)
        check_shards_together(reduce_fn, [("features", features)], normalize=normalize)
    if normalize is None:
        if reduce_fn is None:
            check_unit_rows("features", features)
        check_unit_rows("prototypes", prototypes)  # identical on every shard
    if normalize:
        features, prototypes = l2_normalize(features), l2_normalize(prototypes)
    fit = fit_frolic(
        features, prototypes, options, tau_c=tau_c, reduce_fn=reduce_fn, keep_logits=True
    )
    head = fit.head
    return FrolicResult(
        logits=fit.logits,
        zero_shot_logits=head.zero_shot().logits(features),
        gda_logits=head.gaussian.gda().logits(features),
        fused_logits=head.fused().logits(features),
        head=head,
        features=features,
        sums=fit.sums,
        options=options,
        priors=fit.priors,
    )
