"""Frolic in Lightning: the module, the prediction writer, the report callback and the CLI.

:class:`FrolicModule` adapts a frozen open_clip model inside ``trainer.predict`` (one encoder
pass, all-reduced statistics, the estimators of :mod:`frolic_tta`);
:class:`FrolicPredictionWriter` writes one file per rank and :func:`join_predictions` merges
them by global index; :class:`FrolicReport` writes the files a person reads after a run;
:mod:`frolic_tta.lightning.cli` is ``train.py``'s LightningCLI.
"""

from frolic_tta.lightning.module import FrolicModule
from frolic_tta.lightning.report import FrolicReport
from frolic_tta.lightning.writer import FrolicPredictionWriter, concat_outputs, join_predictions

__all__ = [
    "FrolicModule",
    "FrolicPredictionWriter",
    "FrolicReport",
    "concat_outputs",
    "join_predictions",
]
