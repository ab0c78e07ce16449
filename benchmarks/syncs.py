"""Counting host synchronisations (nothing to run; used by ``gpu_pipeline.py``,
``batch_path.py`` and ``finalize_syncs.py``).

A host synchronisation is a point where Python waits for the GPU: reading a value
(``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``), a copy to the host (``.cpu()``), a
blocking copy to the device (``.to(device)`` of a pageable tensor, ``torch.tensor(...,
device=...)``), or an op whose output size depends on the data (``nonzero``, a boolean mask).
While Python waits, nothing new is queued; after it, the GPU idles until Python queues work again.

:class:`SyncCounter` counts them, each with the phase it falls in (:attr:`SyncCounter.phase`, set
by the caller) and the line that caused it (the innermost frame outside torch and this file):

* **CUDA**: ``torch.cuda.set_sync_debug_mode("warn")``; PyTorch warns at every synchronising
  operation and each warning is one count. This is the measurement.
* **CPU** (no device to wait for): a simulation. Tensors given to :meth:`SyncCounter.on_device`
  and every tensor an op computes from one of them count as device-resident; host reads of them,
  host copies to and from them and data-dependent shapes are counted where a GPU run would
  synchronise. What is on the device is guessed where a real device would be named: a tensor
  made with ``device=<a torch.device>`` (``torch.zeros(..., device=x.device)``; from host data,
  ``torch.tensor(data, device=...)``, it is a blocking copy) is on the device, one made with
  ``device="cpu"`` or none on the host; ``t.to(d)`` with ``d`` a ``torch.device`` counts as a
  copy to the device when ``t`` is a host tensor and as a no-op when it is already on the
  device, except in Lightning's code, where it is the move of the outputs to the host; a
  ``copy_`` between a host and a device tensor is a copy. Code that branches on
  ``device.type == "cpu"`` takes its CPU branch (:data:`CPU_ONLY` lists the known ones).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
_SKIP = (str(Path(torch.__file__).parent), __file__, warnings.__file__)
_SHAPE_OPS = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
              "unique_dim", "repeat_interleave", "argwhere"}  # fmt: skip
"""Ops whose output shape depends on the values (a device->host read of a count)."""
FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "eye",
             "linspace", "randn", "rand", "randint")  # fmt: skip
"""Functions whose result the CPU simulation puts on the device when given a ``torch.device``."""


CPU_ONLY = {"flushed_exp"}
"""Functions whose host read happens on the CPU only (``frolic_tta.logits.flushed_exp`` tests
for its CPU slow path; a GPU's exp has none): listed by the simulation, not counted."""


def _frame() -> Any:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    return frame


def call_site() -> str:
    """``path:line`` of the innermost frame outside torch and this file (repo-relative)."""
    frame = _frame()
    if frame is None:
        return "?"
    name = Path(frame.f_code.co_filename)
    shown = name.relative_to(ROOT) if name.is_relative_to(ROOT) else name
    if "site-packages" in name.parts:
        shown = Path(*name.parts[name.parts.index("site-packages") + 1 :])
    return f"{shown}:{frame.f_lineno}"


class SyncCounter(TorchDispatchMode):
    """Counts host synchronisations by ``(phase, kind, site)`` (see the module docstring).

    Args:
        device: the run's device; ``cuda``: PyTorch's sync debug mode, else the simulation.

    Use as a context manager; set :attr:`phase` to attribute what follows.
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.cuda = torch.device(device).type == "cuda"
        self.phase = "other"
        self.events: Counter[tuple[str, str, str]] = Counter()
        self.ops: Counter[str] = Counter()  # CPU: ops on device tensors (launches) per phase
        self.cpu_only: Counter[str] = Counter()  # CPU: host reads a GPU run does not make
        self._device: dict[int, weakref.ref] = {}
        self._saved: dict[str, Any] = {}
        self._own: set[str] = set()
        self._reading = False  # inside a counted host read (its scalar read is not recounted)
        self._warnings: Any = None

    # ------------------------------------------------------------------ results
    def count(self, phase: str | None = None) -> int:
        """Synchronisations in ``phase`` (all phases: ``None``)."""
        return sum(v for (p, _, _), v in self.events.items() if phase in (None, p))

    def by_phase(self) -> dict[str, int]:
        phases: Counter[str] = Counter()
        for (phase, _, _), v in self.events.items():
            phases[phase] += v
        return dict(phases)

    def sites(self, phase: str | None = None) -> dict[str, int]:
        """``"kind at path:line" -> count`` (most frequent first)."""
        found: Counter[str] = Counter()
        for (p, kind, site), v in self.events.items():
            if phase in (None, p):
                found[f"{kind} at {site}"] += v
        return dict(found.most_common())

    def record(self, kind: str) -> None:
        frame = _frame()
        if not self.cuda and frame is not None and frame.f_code.co_name in CPU_ONLY:
            self.cpu_only[f"{kind} at {call_site()}"] += 1
            return
        self.events[(self.phase, kind, call_site())] += 1

    # ------------------------------------------------------------------ CPU simulation
    def on_device(self, *tensors: Any) -> None:
        """Mark ``tensors`` (any nesting of lists, dicts) as device-resident (CPU simulation)."""
        for t in tree_leaves(list(tensors)):
            if isinstance(t, torch.Tensor):
                self._device[id(t)] = weakref.ref(t, self._forget(id(t)))

    def _forget(self, key: int) -> Any:
        return lambda _: self._device.pop(key, None)  # the tensor is gone: its id is free

    def is_device(self, t: Any) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = func.__name__.split(".")[0]
        if name == "copy_" and self.is_device(args[0]) != self.is_device(args[1]):
            if not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                to = "device" if self.is_device(args[0]) else "host"
                self.record(f"copy to {to} (copy_)")
            return out  # the destination stays where it is
        if any(self.is_device(t) for t in inputs):
            self.ops[self.phase] += 1
            if name in _SHAPE_OPS:
                self.record(name)
            elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in tree_leaves(list(args[1:2]))
            ):
                self.record("boolean mask")
            elif name == "_local_scalar_dense" and not self._reading:  # from C++ (not seen
                self.record("host read (scalar)")  # under torch.inference_mode)
            self.on_device(out)
        return out

    def _patch(self) -> None:
        counter, original = self, {}

        def host_read(name: str, kind: str) -> Any:
            method = original[name] = getattr(torch.Tensor, name)

            def read(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                if counter.is_device(t) and not counter._reading:
                    counter.record(f"host read ({kind})")
                reading, counter._reading = counter._reading, True
                try:
                    return method(t, *a, **k)
                finally:
                    counter._reading = reading

            return read

        def cpu(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            if not counter.is_device(t):
                return original["cpu"](t, *a, **k)
            counter.record("copy to host (.cpu())")
            return counter._host_copy(t)

        def to(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            target = k.get("device", a[0] if a and isinstance(a[0], str | torch.device) else None)
            out = original["to"](t, *a, **k)
            blocking = not k.get("non_blocking", False)
            to_host = isinstance(target, str) and target == "cpu"
            lightning = isinstance(target, torch.device) and call_site().startswith("lightning/")
            if counter.is_device(t) and (to_host or lightning):  # Lightning: outputs to host
                if blocking:
                    counter.record("copy to host (.to('cpu'))")
                return counter._host_copy(out) if out is t else out
            if not counter.is_device(t) and isinstance(target, torch.device) and not lightning:
                if blocking:
                    counter.record("copy to device (.to(device))")
                out = out.clone() if out is t else out
                counter.on_device(out)
            return out

        def factory(name: str) -> Any:
            function = original[name] = getattr(torch, name)
            copies = name in ("tensor", "as_tensor")  # from host data: a blocking copy

            def make(*a: Any, **k: Any) -> torch.Tensor:
                out = function(*a, **k)
                if isinstance(k.get("device"), torch.device):
                    given = a[0] if a else k.get("data")
                    on_device = isinstance(given, torch.Tensor) and counter.is_device(given)
                    if copies and not on_device:
                        counter.record(f"copy to device (torch.{name}(..., device=))")
                    counter.on_device(out)
                return out

            return make

        reads = {"item": "item", "__bool__": "bool", "__float__": "float", "__int__": "int",
                 "__index__": "int", "tolist": "tolist", "numpy": "numpy"}  # fmt: skip
        patches = {name: host_read(name, kind) for name, kind in reads.items()}
        patches.update(cpu=cpu, to=to)
        original["cpu"], original["to"] = torch.Tensor.cpu, torch.Tensor.to
        self._own = {name for name in patches if name in vars(torch.Tensor)}
        for name, patch in patches.items():
            setattr(torch.Tensor, name, patch)
        for name in FACTORIES:
            setattr(torch, name, factory(name))
        self._saved = original

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()  # what a GPU run gets: a new host tensor
        self._device.pop(id(copy), None)
        return copy

    def _unpatch(self) -> None:
        for name, method in self._saved.items():
            if name in FACTORIES:
                setattr(torch, name, method)
            elif name in self._own:
                setattr(torch.Tensor, name, method)
            else:  # inherited from torch._C.TensorBase: drop the shadowing attribute
                delattr(torch.Tensor, name)
        self._saved = {}

    # ------------------------------------------------------------------ CUDA
    def _on_warning(self, message: Any, category: Any, filename: str, lineno: int,
                    file: Any = None, line: Any = None) -> None:  # fmt: skip
        if "synchroniz" in str(message):
            self.record("synchronising CUDA operation")
        else:
            self._show(message, category, filename, lineno, file, line)

    def __enter__(self) -> SyncCounter:
        if self.cuda:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("always", message=".*synchroniz")
            self._show, warnings.showwarning = warnings.showwarning, self._on_warning
            torch.cuda.set_sync_debug_mode("warn")
            return self
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            return
        super().__exit__(*exc)
        self._unpatch()


def profile_counts(prof: Any, ranges: list[str]) -> dict[str, dict[str, float]]:
    """Per named ``record_function`` range of a CUDA ``torch.profiler`` run: the CUDA runtime's
    kernel launches, synchronisations (stream, device, event) and memory copies, and the GPU
    time of the kernels the range's ops launched (ms; each op's self device time). Untested on
    a GPU so far: a count of 0 may also mean the profiler did not record that runtime call."""
    events = prof.events()
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.name in ranges]
    found: dict[str, Counter[str]] = {name: Counter() for name in ranges}

    def where(start: float) -> str | None:
        return next((n for n, s, e in spans if s <= start <= e), None)

    for e in events:
        phase = where(e.time_range.start)
        if phase is None or e.name == phase:
            continue
        name = e.name
        kind = ("launches" if "LaunchKernel" in name else
                "syncs" if "Synchronize" in name else
                "copies" if "Memcpy" in name else None)  # fmt: skip
        if kind is not None:
            found[phase][kind] += 1
        self_device = getattr(e, "self_device_time_total", None)
        if self_device is None:
            self_device = getattr(e, "self_cuda_time_total", 0.0)
        found[phase]["gpu_ms"] += self_device / 1000
    return {name: dict(values) for name, values in found.items()}
