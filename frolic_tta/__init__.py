"""frolic-tta: Frolic (NeurIPS 2024) label-free test-time adaptation of zero-shot CLIP.

``import frolic_tta`` loads torch only: the estimators (:func:`frolic`, :func:`fit_frolic`,
:func:`match_temperature`, :func:`estimate_label_bias`, the head and the options). The Lightning
parts (:class:`FrolicModule`, the writer, the report, the CLI) live in
:mod:`frolic_tta.lightning`, the torchmetrics statistics in :mod:`frolic_tta.metrics`; the
names below are importable from here too and load those packages on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from frolic_tta.calibration import confidence, match_temperature
from frolic_tta.debias import estimate_label_bias
from frolic_tta.functional import FrolicResult, frolic
from frolic_tta.gda import GaussianHead, MomentSums, fit_gaussian_head, moment_sums
from frolic_tta.head import FrolicClassifier, FrolicHead
from frolic_tta.logits import AffineMap, LinearLogits, LogitSource, TensorLogits
from frolic_tta.options import FrolicOptions, SolverOptions, paper_options, released_options
from frolic_tta.pipeline import FrolicFit, fit_frolic
from frolic_tta.rows import ROWS, accuracy, tde_logits

if TYPE_CHECKING:
    from frolic_tta.lightning import (
        FrolicAdaptation,
        FrolicModule,
        FrolicPredictionWriter,
        FrolicReport,
        join_predictions,
    )
    from frolic_tta.metrics import FrolicMoments

_LAZY = {
    "FrolicAdaptation": "frolic_tta.lightning",
    "FrolicModule": "frolic_tta.lightning",
    "FrolicPredictionWriter": "frolic_tta.lightning",
    "FrolicReport": "frolic_tta.lightning",
    "join_predictions": "frolic_tta.lightning",
    "FrolicMoments": "frolic_tta.metrics",
}


def __getattr__(name: str) -> Any:
    """Load the Lightning and torchmetrics parts on first use (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'frolic_tta' has no attribute {name!r}")


__all__ = [
    "ROWS",
    "AffineMap",
    "FrolicAdaptation",
    "FrolicClassifier",
    "FrolicFit",
    "FrolicHead",
    "FrolicModule",
    "FrolicMoments",
    "FrolicOptions",
    "FrolicPredictionWriter",
    "FrolicReport",
    "FrolicResult",
    "GaussianHead",
    "LinearLogits",
    "LogitSource",
    "MomentSums",
    "SolverOptions",
    "TensorLogits",
    "accuracy",
    "confidence",
    "estimate_label_bias",
    "fit_frolic",
    "fit_gaussian_head",
    "frolic",
    "join_predictions",
    "match_temperature",
    "moment_sums",
    "paper_options",
    "released_options",
    "tde_logits",
]
__version__ = "0.1.0"
