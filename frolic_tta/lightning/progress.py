"""Progress that reads well in a terminal and in a log file: the predict bar and finalize.

* :class:`LineProgressBar` is what :class:`~frolic_tta.lightning.cli.FrolicCLI` gives the
  Trainer when stdout is not a terminal (a log file, a batch job): ``Predicting: 25% (3/12
  batches)`` at each quarter, on rank 0, with no escape codes. At a terminal Lightning's own
  tqdm bar stays.
* :class:`FinalizeProgress`: finalize runs after the last predict batch, behind a bar that
  already shows every batch as done. It says which phase runs (the ``progress`` callback of
  :func:`frolic_tta.fit_frolic`) and, through the counting ``reduce_fn`` every dataset-wide sum
  goes through, how many passes it has made: a line at each phase and at most one every
  ``interval`` seconds within a long phase, once per run (rank zero), through the progress
  bar's ``print`` or, without a bar, the ``frolic_tta`` logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from torch import Tensor
from typing_extensions import override

from frolic_tta.options import FrolicOptions
from frolic_tta.prior import Priors
from frolic_tta.progress import LineProgress

__all__ = ["FinalizeProgress", "LineProgressBar", "expected_phases"]

log = logging.getLogger("frolic_tta")

PHASES = ("temperature", "test prior", "label bias", "zero-shot prior")
"""The phases :func:`frolic_tta.fit_frolic` reports (then ``"done"``), in no fixed order."""


def expected_phases(options: FrolicOptions) -> int:
    """How many phases :func:`frolic_tta.fit_frolic` reports with ``options``, as
    :mod:`frolic_tta.pipeline` orders them (one more where the zero-shot prior's box needs a
    matching of its own: decided on the data, counted when it comes)."""
    debiased = options.head_labels == "debiased" and options.covariance == "soft"
    debiased = debiased and options.zero_shot != "inmap_both"  # the head's labels debiased
    first = 1 if debiased else 0  # "test prior" (em) or "zero-shot prior" (uniform)
    later_prior = 1 if options.test_prior == "em" and not debiased else 0
    last = 0 if debiased and options.bias == "soft" else 1  # "zero-shot prior" at the end
    return first + 1 + later_prior + 1 + last  # + "temperature" + "label bias"


class FinalizeProgress:
    """Reports finalize's phases on rank zero; wraps the reduce function to count passes.

    Args:
        trainer: the running Trainer (its global rank and progress bar are used).
        reduce_fn: the dataset-wide sum; :meth:`reduce` calls it and counts the call.
        num_samples: N, for the first line.
        num_classes: K, for the first line.
        interval: least seconds between two lines within one phase.
        options: the fit's options: phases are numbered ``[i/n]`` in the order they come,
            ``n`` from :func:`expected_phases` (without: ``[i]``).
    """

    def __init__(
        self,
        trainer: L.Trainer,
        reduce_fn: Callable[[Tensor], Tensor],
        num_samples: int,
        num_classes: int,
        interval: float = 10.0,
        options: FrolicOptions | None = None,
    ) -> None:
        self.trainer, self.reduce_fn, self.interval = trainer, reduce_fn, interval
        self.step, self.total = 0, None if options is None else expected_phases(options)
        self.started = self.last_line = time.perf_counter()
        self.phase, self.phase_passes, self.passes = "moments", 0, 0
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self._phase_started = self.started
        self.say(f"of N={num_samples} samples, K={num_classes} classes")

    def reduce(self, tensor: Tensor) -> Tensor:
        """``reduce_fn(tensor)``, counted as one pass of the current phase."""
        self.passes += 1
        self.phase_passes += 1
        now = time.perf_counter()
        if now - self.last_line >= self.interval:
            self.say(f"{self.phase}: pass {self.phase_passes} ({now - self.started:.0f} s)")
        return self.reduce_fn(tensor)

    def __call__(self, phase: str) -> None:
        """The ``progress`` callback: ``phase`` starts (``"done"``: finalize ends)."""
        now = time.perf_counter()
        self.seconds[self.phase] = now - self._phase_started
        self.counts[self.phase] = self.phase_passes
        self.phase, self.phase_passes, self._phase_started = phase, 0, now
        if phase == "done":
            return
        self.step += 1
        if self.total is not None:
            self.total = max(self.total, self.step)  # the zero-shot prior's own box matching
        of = "" if self.total is None else f"/{self.total}"
        self.say(f"[{self.step}{of}] {phase} ({now - self.started:.1f} s)")

    def finish(self, tau_g: float, priors: Priors) -> dict[str, dict[str, float]]:
        """The closing line; returns seconds and passes per phase."""
        state = "converged" if priors.converged else "NOT converged"
        total = sum(self.seconds.values())
        self.say(
            f"done in {total:.1f} s: tau_g={tau_g:.4g}, test prior weight "
            f"{priors.shift_weight:.3g} ({priors.passes} passes, {state})"
        )
        return {"seconds": dict(self.seconds), "passes": dict(self.counts)}

    def say(self, message: str) -> None:
        """One line on rank zero, above the progress bar if there is one."""
        self.last_line = time.perf_counter()
        if not self.trainer.is_global_zero:
            return
        line = f"Frolic finalize {message}"
        bar = self.trainer.progress_bar_callback
        if bar is not None and bar.is_enabled:
            bar.print(line)
        else:
            log.info(line)


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
