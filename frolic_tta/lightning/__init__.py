"""Frolic in Lightning: the adaptation callback, the module, the writer, the report and the CLI.

:class:`FrolicAdaptation` adapts any LightningModule whose ``predict_step`` returns image
features (all-reduced statistics, the estimators of :mod:`frolic_tta`); :class:`FrolicModule`
is a frozen open_clip model with its prompts and that callback (one encoder pass);
:class:`FrolicPredictionWriter` writes one file per rank and :func:`join_predictions` merges
them by global index; :class:`FrolicReport` writes the files a person reads after a run;
:mod:`frolic_tta.lightning.cli` is ``train.py``'s LightningCLI.
"""

from frolic_tta.lightning.adaptation import FrolicAdaptation
from frolic_tta.lightning.module import FrolicModule
from frolic_tta.lightning.report import FrolicReport
from frolic_tta.lightning.writer import FrolicPredictionWriter, concat_outputs, join_predictions

__all__ = [
    "FrolicAdaptation",
    "FrolicModule",
    "FrolicPredictionWriter",
    "FrolicReport",
    "concat_outputs",
    "join_predictions",
]
