"""Instrumentation of the core for ``benchmarks/finalize.py`` (not a benchmark; nothing to run).

:class:`Probe` times phases exclusively, counts rows streamed through ``LogitSource.chunks``
(passes = rows / N), step calls and ``reduce_fn`` calls; :func:`instrument` patches the core's
functions in the calling (worker) process only; :class:`ShapeAudit` records the largest tensor
any torch op returns and whether a (K, K) or a full (N, K) tensor appeared.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import common
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class ShapeAudit(TorchDispatchMode):
    """Records the largest tensor any op returns and whether a (K, K) / full (N, K) appeared."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.n, self.k = n, k
        self.largest: tuple[int, ...] = ()
        self.kxk = self.nxk = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                if t.numel() > math.prod(self.largest or (0,)):
                    self.largest = tuple(t.shape)
                self.kxk |= tuple(t.shape[-2:]) == (self.k, self.k)
                self.nxk |= t.numel() >= self.n * self.k
        return out


class Probe:
    """Exclusive phase timers, rows streamed per phase, call counts and reduce_fn calls."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stack: list[list[Any]] = []
        self.seconds: Counter[str] = Counter()
        self.rows: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.peaks: Counter[str] = Counter()  # MiB above ``base`` at the peak of each phase
        self.base = 0.0

    def start_memory(self) -> None:
        """Reset the peak; memory is measured from here (per phase, then overall)."""
        common.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            self.base = common.rss_mib()

    def _mark(self) -> None:
        """Attribute the peak since the last mark to the current phase, reset the peak."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        else:
            peak = common.peak_mib()
            common.reset_peak()
        name = self.stack[-1][0] if self.stack else "other"
        self.peaks[name] = max(self.peaks[name], peak - self.base)

    def push(self, name: str) -> None:
        common.sync(self.device)
        self._mark()
        t = common.now()
        if self.stack:
            self.seconds[self.stack[-1][0]] += t - self.stack[-1][1]
        self.stack.append([name, t])

    def pop(self) -> None:
        common.sync(self.device)
        self._mark()
        t = common.now()
        name, start = self.stack.pop()
        self.seconds[name] += t - start
        if self.stack:
            self.stack[-1][1] = t

    def phase(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.push(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.pop()

        return wrapped

    def counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    def streamed(self, fn: Callable[..., Iterator[tuple[int, torch.Tensor]]]) -> Callable[..., Any]:
        probe = self

        @functools.wraps(fn)
        def chunks(source: Any) -> Iterator[tuple[int, torch.Tensor]]:
            for start, block in fn(source):
                probe.rows[probe.stack[-1][0] if probe.stack else "other"] += block.shape[0]
                yield start, block

        return chunks

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls["reduce_fn"] += 1
        return tensor


def instrument(probe: Probe) -> None:
    """Patch the core (this worker process only) to time phases and count passes."""
    import frolic_tta.calibration as calibration
    import frolic_tta.debias as debias
    import frolic_tta.logits as streams
    import frolic_tta.matching as matching
    import frolic_tta.pipeline as core
    import frolic_tta.prior as prior

    core.moment_sums = probe.phase("moments", core.moment_sums)
    core.estimate_test_prior = probe.phase("test prior", core.estimate_test_prior)
    core.fit_gaussian_head = probe.phase("head solve", core.fit_gaussian_head)
    core.match_temperature = probe.phase("tau search", core.match_temperature)
    core.fit_label_bias = probe.phase("beta loop", core.fit_label_bias)
    calibration._confidence_sums = probe.counted("tau_steps", calibration._confidence_sums)
    prior._posterior_sums = probe.counted("em_passes", prior._posterior_sums)  # mixture refits
    matching._sums = probe.counted("beta_steps", matching._sums)
    debias._hard_class_matrix = probe.counted("beta_steps", debias._hard_class_matrix)
    debias.power_iteration = probe.counted("power_iterations", debias.power_iteration)
    for cls in (streams.TensorLogits, streams.LinearLogits):
        cls.chunks = probe.streamed(cls.chunks)  # type: ignore[method-assign]
