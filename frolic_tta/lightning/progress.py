"""Finalize talks: its phases, pass counts and time, once per run (rank zero).

Finalize runs after the last predict batch, behind a progress bar that already shows the batches
as done. :class:`FinalizeProgress` says which phase runs (the ``progress`` callback of
:func:`frolic_tta.fit_frolic`) and, through the counting ``reduce_fn`` every dataset-wide sum goes
through, how many passes it has made: a line at each phase and at most one every
``interval`` seconds within a long phase. Lines go through the progress bar's ``print`` (above
the bar, no escape codes in a log file) or, without a bar, the ``frolic_tta`` logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import lightning as L
from torch import Tensor

from frolic_tta.prior import Priors

log = logging.getLogger("frolic_tta")

PHASES = ("temperature", "test prior", "label bias", "zero-shot prior")
"""The phases :func:`frolic_tta.fit_frolic` reports, in order (then ``"done"``)."""


class FinalizeProgress:
    """Reports finalize's phases on rank zero; wraps the reduce function to count passes.

    Args:
        trainer: the running Trainer (its global rank and progress bar are used).
        reduce_fn: the dataset-wide sum; :meth:`reduce` calls it and counts the call.
        interval: least seconds between two lines within one phase.
    """

    def __init__(
        self,
        trainer: L.Trainer,
        reduce_fn: Callable[[Tensor], Tensor],
        num_samples: int,
        num_classes: int,
        interval: float = 10.0,
    ) -> None:
        self.trainer, self.reduce_fn, self.interval = trainer, reduce_fn, interval
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
        step = PHASES.index(phase) + 1 if phase in PHASES else 0
        self.say(f"[{step}/{len(PHASES)}] {phase} ({now - self.started:.1f} s)")

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
