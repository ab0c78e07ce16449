"""Measuring ``fit_frolic`` from outside for ``benchmarks/finalize.py`` (nothing to run).

:class:`Probe` uses only the core's public hooks: it is ``fit_frolic``'s ``progress`` callback
(each phase's wall time, exclusively) and its ``reduce_fn`` (each call ends one pass over the
N x K logits: the passes of each phase); no function of the core is replaced.
:class:`ShapeAudit` records the largest tensor any torch op returns and whether a (K, K) or a
full (N, K) tensor appeared.
"""

from __future__ import annotations

import math
from collections import Counter
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


PHASE_OF = {
    "temperature": "tau search",
    "test prior": "test prior",
    "label bias": "beta loop",
    "zero-shot prior": "beta loop",
}
"""``fit_frolic``'s progress phases -> the benchmark's; before ``"temperature"``: the head
solve and the logit buffers (``"head solve"``)."""


class Probe:
    """Exclusive phase timers, passes per phase (``reduce_fn`` calls) and peak memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stack: list[list[Any]] = []
        self.seconds: Counter[str] = Counter()
        self.passes: Counter[str] = Counter()
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

    def progress(self, phase: str) -> None:
        """``fit_frolic``'s ``progress`` hook: close the running phase, open the next."""
        self.pop()
        if phase != "done":
            self.push(PHASE_OF.get(phase, phase))

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """``fit_frolic``'s ``reduce_fn`` (one process): counts one pass of the running phase."""
        self.calls["reduce_fn"] += 1
        self.passes[self.stack[-1][0] if self.stack else "other"] += 1
        return tensor
