"""frolic-tta: Frolic (NeurIPS 2024) label-free test-time adaptation of zero-shot CLIP.

Rooms: math (:mod:`~frolic_tta.gda`, :mod:`~frolic_tta.calibration`, :mod:`~frolic_tta.debias`,
:mod:`~frolic_tta.core`), statistics (:mod:`~frolic_tta.stats`), the Lightning module, and data,
prompts and CLI.
"""

from frolic_tta.calibration import confidence, match_temperature
from frolic_tta.callbacks import FrolicPredictionWriter, join_predictions
from frolic_tta.core import (
    FrolicClassifier,
    FrolicHead,
    FrolicResult,
    fit_frolic,
    frolic,
    tde_logits,
)
from frolic_tta.debias import estimate_label_bias
from frolic_tta.gda import GaussianHead, MomentSums, fit_gaussian_head, moment_sums
from frolic_tta.module import FrolicModule
from frolic_tta.streams import LinearLogits, LogitSource, TensorLogits

__all__ = [
    "FrolicModule",
    "FrolicPredictionWriter",
    "join_predictions",
    "FrolicClassifier",
    "FrolicHead",
    "FrolicResult",
    "GaussianHead",
    "LinearLogits",
    "LogitSource",
    "MomentSums",
    "TensorLogits",
    "confidence",
    "estimate_label_bias",
    "fit_frolic",
    "fit_gaussian_head",
    "frolic",
    "match_temperature",
    "moment_sums",
    "tde_logits",
]
__version__ = "0.1.0"
