"""Frolic's per-batch path: host synchronisations per batch and host time per batch.

Run: ``python benchmarks/batch_path.py`` (seconds; ``--device cuda`` on a GPU).
Writes ``benchmarks/results/batch_path.json`` (``batch_path_cuda.json``).

A module of the user's kind (:mod:`docs/own-module.md`): ``predict_step`` passes stored features
through one linear layer (the "encoder", so the features are computed on the device) and returns
``{"features": ...}``; :class:`~frolic_tta.FrolicAdaptation` does the rest. Two runs of
``trainer.predict`` over the same ``DataLoader`` of single samples ``{"features", "index",
"label"}``:

1. **counted**: every host synchronisation (:class:`syncs.SyncCounter`; on the CPU a
   simulation of a device run, see its docstring) in the batch phase (from
   ``on_predict_batch_start`` to the end of the adaptation's ``on_predict_batch_end``, finalize
   excluded) and in finalize, each with the line that caused it;
2. **timed**: the wall time of the adaptation's ``on_predict_batch_end`` per batch (its
   finalize subtracted from the last one), median over the batches, repeated ``--repeats``
   times (the median of the medians).

Only the package's public API is used, so the same script measures another checkout
(``PYTHONPATH=/path/to/checkout python benchmarks/batch_path.py``).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import common
import lightning as L
import torch
from syncs import SyncCounter
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from frolic_tta import FrolicAdaptation

for _name in ("lightning.pytorch", "lightning.fabric"):
    import logging

    logging.getLogger(_name).setLevel(logging.WARNING)


class StoredFeatures(Dataset):
    """``n`` samples ``{"features" (d,), "index", "label"}``; ``bad`` of them NaN."""

    def __init__(self, n: int, d: int, k: int, bad: int = 0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(n, d, generator=g)
        self.features[torch.randperm(n, generator=g)[:bad]] = float("nan")
        self.labels = torch.randint(0, k, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"features": self.features[i], "index": i, "label": int(self.labels[i])}


class FeatureModule(L.LightningModule):
    """A user's module: one linear "encoder" layer, ``{"features": (n, d)}`` out."""

    tau_c = 0.01

    def __init__(self, d: int) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(d, d)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return {"features": self.encoder(batch["features"])}


class Phases(L.Callback):
    """Marks the batch phase and the batch's tensors as device-resident for ``counter``; times
    the adaptation's batch hook."""

    def __init__(self, adaptation: FrolicAdaptation, counter: SyncCounter | None) -> None:
        self.counter, self.seconds, self.finalize_s = counter, [], 0.0
        hook, finalize = adaptation.on_predict_batch_end, adaptation.finalize

        def timed_hook(*args: Any, **kwargs: Any) -> None:
            start, self.finalize_s = common.now(), 0.0
            hook(*args, **kwargs)
            self.seconds.append(common.now() - start - self.finalize_s)
            if self.counter is not None:
                self.counter.phase = "between batches"

        def marked_finalize(trainer: L.Trainer) -> None:
            if self.counter is not None:
                self.counter.phase = "finalize"
            start = common.now()
            finalize(trainer)
            self.finalize_s = common.now() - start

        adaptation.on_predict_batch_end = timed_hook  # type: ignore[method-assign]
        adaptation.finalize = marked_finalize  # type: ignore[method-assign]

    def on_predict_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any
    ) -> None:
        if self.counter is None:
            return
        self.counter.phase = "batch"
        if self.counter.cuda:
            return
        adaptation = next(c for c in trainer.callbacks if isinstance(c, FrolicAdaptation))
        moments = adaptation.moments
        states = [] if moments is None else [getattr(moments, s) for s in moments._defaults]
        state = [adaptation.prototypes_, states, getattr(moments, "prototypes", None)]
        self.counter.on_device(batch, state)  # what a GPU run holds on the device


def run(args: argparse.Namespace, counter: SyncCounter | None) -> tuple[Phases, float]:
    """One ``trainer.predict``; ``(the phases callback, wall seconds)``."""
    torch.manual_seed(0)
    module = FeatureModule(args.d)
    prototypes = torch.nn.functional.normalize(torch.randn(args.k, args.d), dim=1)
    adaptation = FrolicAdaptation(prototypes.to(args.device), tau_c=0.01)
    phases = Phases(adaptation, counter)
    trainer = L.Trainer(
        accelerator="gpu" if args.device.startswith("cuda") else "cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[phases, adaptation],
    )
    data = StoredFeatures(args.n, args.d, args.k, args.bad)
    loader = DataLoader(data, batch_size=args.batch_size, pin_memory=args.device != "cpu")
    start = common.now()
    if counter is None:
        outputs = trainer.predict(module, loader)
    else:
        with counter:
            counter.phase = "start"
            outputs = trainer.predict(module, loader)
    wall = common.now() - start
    predictions = torch.cat([o["prediction"] for o in outputs])
    if int((predictions < 0).sum()) != args.bad:
        raise RuntimeError("some predictions were not filled in")
    return phases, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--bad", type=int, default=0, help="NaN samples (skipped)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: no stalls on a shared CPU)"
    )
    parser.add_argument("--name", default=None, help="result name (default batch_path[_cuda])")
    parser.add_argument("--quick", action="store_true", help="1,024 samples, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.n, args.repeats = 1024, 1
    torch.set_num_threads(args.threads)
    info = common.machine_info(args.device)
    batches = -(-args.n // args.batch_size)
    counter = SyncCounter(args.device)
    run(args, counter)
    medians, walls = [], []
    for _ in range(args.repeats):
        phases, wall = run(args, None)
        medians.append(statistics.median(phases.seconds))
        walls.append(wall)
    result = {
        "config": vars(args),
        "batches": batches,
        "syncs_per_batch": counter.count("batch") / batches,
        "syncs_between_batches": counter.count("between batches") / batches,
        "syncs_finalize": counter.count("finalize"),
        "syncs_at_start": counter.count("start"),
        "device_ops_per_batch": counter.ops["batch"] / batches if not counter.cuda else None,
        "sites_batch": counter.sites("batch"),
        "sites_finalize": counter.sites("finalize"),
        "cpu_only_not_counted": dict(counter.cpu_only),
        "hook_us_per_batch": 1e6 * statistics.median(medians),
        "hook_us_runs": [1e6 * m for m in medians],
        "predict_wall_s": walls,
        "simulated": not counter.cuda,
    }
    print(f"{batches} batches of {args.batch_size}, K = {args.k}, d = {args.d}, {args.bad} bad")
    how = "simulated on the CPU" if result["simulated"] else "CUDA sync debug mode"
    print(f"host syncs per batch: {result['syncs_per_batch']:.2f} ({how})")
    for site, count in result["sites_batch"].items():
        print(f"  {count / batches:6.2f} / batch  {site}")
    print(f"finalize: {result['syncs_finalize']} syncs")
    print(f"adaptation's batch hook: {result['hook_us_per_batch']:.0f} us per batch "
          f"(runs: {', '.join(f'{m:.0f}' for m in result['hook_us_runs'])})")  # fmt: skip
    name = args.name or "batch_path" + ("_quick" if args.quick else "") + (
        "_cuda" if "cuda" in args.device else "")  # fmt: skip
    path = common.write_result(name, {"machine": common.finish_info(info), **result})
    print(f"wrote {path.relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
