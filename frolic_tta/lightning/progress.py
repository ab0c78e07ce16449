"""Lightning's predict progress for log files: plain lines instead of tqdm's carriage returns.

:class:`LineProgressBar` is what :class:`~frolic_tta.lightning.cli.FrolicCLI` gives the Trainer
when stdout is not a terminal (a log file, a batch job): ``Predicting: 25% (3/12 batches)`` at
each quarter, on rank 0, with no escape codes. At a terminal Lightning's own tqdm bar stays.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from typing_extensions import override

from frolic_tta.progress import LineProgress

__all__ = ["LineProgressBar"]


class LineProgressBar(ProgressBar):
    """A predict progress bar of a few plain lines (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._bar: LineProgress | None = None

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @property
    @override
    def is_enabled(self) -> bool:
        return self._enabled

    @override
    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = int(sum(trainer.num_predict_batches))
        show = self._enabled and trainer.is_global_zero
        self._bar = LineProgress(total, self.predict_description, "batch") if show else None

    @override
    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:  # fmt: skip
        if self._bar is not None:
            self._bar.update(1)

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
