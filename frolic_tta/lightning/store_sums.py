r"""A feature store's moment sums in a predict run (:mod:`frolic_tta.data.store_moments`).

:func:`stored_sums` finds the sums a store keeps for this run's prototypes and
:math:`\tau_c`; :func:`checked_sums` decides at finalize whether they are the run's own (the
same N and :math:`\sum_i x_i`), so that the fit skips their float64 pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from frolic_tta.data.feature_dataset import FeatureDataset
from frolic_tta.data.store_moments import same_samples
from frolic_tta.gda import MomentSums


def stored_sums(dataset: Any, prototypes: Tensor, tau_c: float) -> dict[str, Tensor] | None:
    """A feature store's sums for ``prototypes`` (bitwise) and ``tau_c``, when ``dataset`` is
    a :class:`~frolic_tta.data.store.FeatureDataset` that has them, else ``None``."""
    moments = dataset.moments if isinstance(dataset, FeatureDataset) else None
    return None if moments is None else moments.for_run(prototypes, tau_c)


def checked_sums(
    computed: MomentSums,
    stored: dict[str, Tensor] | None,
    say: Callable[[str], None] | None = None,
) -> MomentSums | None:
    r"""The sums finalize fits with: ``computed`` (the run's reduced sums) when nothing is
    ``stored``; else ``stored`` as :class:`~frolic_tta.gda.MomentSums` on ``computed``'s
    device where the run's N and :math:`\sum_i x_i` are theirs, or ``None`` (the fit computes
    every sum: a run over part of the store, other samples), saying so."""
    if stored is None:
        return computed
    if same_samples(computed.count, computed.feature_sum, stored):
        device = computed.count.device
        return MomentSums(**{name: value.to(device) for name, value in stored.items()})
    if say is not None:
        say("moments: the feature store's are not of this run's samples; computing them")
    return None
