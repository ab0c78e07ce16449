"""Finalize from features: seconds, host synchronisations and (CUDA) kernel launches per phase.

Run: ``python benchmarks/finalize_syncs.py --device cuda`` (50,000 x 1,000 x 512, three worlds;
about a minute on an H100); ``--quick``: 2,000 x 100 x 64 on the CPU in seconds.
Writes ``benchmarks/results/finalize_syncs[_quick][_cuda].json``.

What :class:`~frolic_tta.FrolicAdaptation` does around and after its last batch, from features
held on the device: ``FrolicMoments.update`` per batch of ``--batch-size`` rows with the
zero-shot logits kept (the per-batch share, listed apart as ``moments``), then **finalize**:
``fit_frolic(x, z, sums=..., zero_shot_logits=...)`` and ``fill_outputs`` into per-batch host
placeholders (``fill``); with ``--metrics`` (default) also every Table 3/4 row's metrics on the
labels (``metrics``, listed apart: a run without labels has none). Phases come from
``fit_frolic``'s ``progress`` hook: ``head`` (checks, head solve, logit buffers: before the first
phase it reports), ``temperature``, ``test prior``, ``label bias``, ``zero-shot prior``.

Worlds (K = 1,000, d = 512 unless ``--quick``): ``balanced`` and ``long-tailed 10`` are
:func:`frolic_tta.synthetic.clip_like_world` (zero-shot about 0.59), ``means`` is
:func:`~frolic_tta.synthetic.means_world` with little noise (the prototypes are the class means:
zero-shot right almost everywhere).

Runs per world: ``--repeats`` **timed** finalizes (a synchronisation at the start and the end
only; the best and the median; on CUDA the peak memory above what was allocated before
finalize: features, prototypes, sums and kept logits); one **phases** run (a synchronisation
at each phase boundary, so each phase's seconds are its own); one **counted** run
(:class:`syncs.SyncCounter`: the CUDA sync debug mode, or the CPU simulation); on CUDA one
**profiled** run without the metrics (``torch.profiler``, a ``record_function`` range per
phase: :func:`syncs.profile_counts`). The reduce function is the identity (one process).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from typing import Any

import common
import torch
from syncs import SyncCounter, profile_counts

from frolic_tta.lightning.outcome import evaluate_fit, fill_outputs
from frolic_tta.metrics import FrolicMoments
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import fit_frolic
from frolic_tta.synthetic import clip_like_world, means_world, shifted_prior

TAU_C = 0.01
PHASES = ("moments", "head", "temperature", "test prior", "label bias", "zero-shot prior",
          "fill", "metrics")  # fmt: skip
FINALIZE = PHASES[1:-1]
GOAL_S, GOAL_MIB = 0.1, 1024
CHECK_KWARG = "check_finite" in inspect.signature(FrolicMoments.update).parameters


def world(name: str, n: int, k: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(features (n, d), prototypes (k, d), labels (n,))`` on the CPU."""
    if name == "means":
        made = means_world(n, k, d, noise=2.0 / d**0.5)
    else:
        prior = shifted_prior("long-tailed:10", k) if name == "long-tailed 10" else None
        made = clip_like_world(n, k, d, noise=0.8, test_prior=prior)
    return made.features, made.prototypes, made.labels


class Clock:
    """The phase boundaries: seconds per phase, and what else follows the phase (the counter's
    phase, a profiler range)."""

    def __init__(self, device: torch.device, sync: bool | tuple[str, ...],
                 counter: SyncCounter | None = None, ranges: bool = False) -> None:  # fmt: skip
        """``sync``: synchronise at every boundary, at none, or on entering these phases."""
        self.device, self.sync, self.counter, self.ranges = device, sync, counter, ranges
        self.seconds: dict[str, float] = {}
        self.name: str | None = None
        self.started = 0.0
        self.range: Any = None

    def enter(self, name: str | None) -> None:
        """Close the running phase, open ``name`` (``None``: none)."""
        if self.sync is True or (isinstance(self.sync, tuple) and name in self.sync):
            common.sync(self.device)
        now = common.now()
        if self.name is not None:
            self.seconds[self.name] = self.seconds.get(self.name, 0.0) + now - self.started
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        self.name, self.started = name, now
        if self.counter is not None:
            self.counter.phase = name or "other"
        if self.ranges and name is not None:
            self.range = torch.profiler.record_function(name)
            self.range.__enter__()

    def progress(self, phase: str) -> None:
        """``fit_frolic``'s hook."""
        self.enter(None if phase == "done" else phase)


def finalize(data: dict[str, Any], clock: Clock, metrics: bool) -> dict[str, Any]:
    """Moments per batch, then fit and fill (and the metrics); returns the fit's summary."""
    x, z, labels, batch = data["x"], data["z"], data["labels"], data["batch_size"]
    moments = FrolicMoments(z, TAU_C, keep_logits=True, rows=x.shape[0]).to(x.device)
    clock.enter("moments")  # the per-batch updates (the metric is made at predict start)
    checked = {"check_finite": False} if CHECK_KWARG else {}  # as the adaptation (if it can)
    for start in range(0, x.shape[0], batch):
        moments.update(x[start : start + batch], **checked)
    sums, kept = moments.compute(), moments.zero_shot_logits()
    clock.enter("head")
    if clock.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cuda = clock.device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    fit = fit_frolic(x, z, FrolicOptions(), tau_c=TAU_C, sums=sums, zero_shot_logits=kept,
                     progress=clock.progress)  # fmt: skip
    clock.enter("fill")
    fill_outputs(data["outputs"], fit.logits, fit.head, x, lambda t: t, x.shape[0])
    clock.enter(None)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    inputs = (x.numel() + z.numel()) * x.element_size()
    if metrics:
        clock.enter("metrics")
        evaluate_fit(fit, x, labels, x.shape[0], FrolicOptions(), lambda t: t, None)
        clock.enter(None)
    prediction = torch.cat([o["prediction"] for o in data["outputs"]])
    return {
        "extra_mib": (peak - before) / 2**20 if cuda else 0.0,  # above what finalize found
        "extra_mib_over_features": (peak - inputs) / 2**20 if cuda else 0.0,  # and the buffers
        "acc_f_d": float((prediction == data["labels_cpu"]).double().mean()),
        "tau_g": fit.head.tau_g,
    }


def blank(n: int, k: int, batch: int) -> list[dict[str, torch.Tensor]]:
    """The module's host placeholders, one dict per batch."""
    outputs = []
    for start in range(0, n, batch):
        rows = min(batch, n - start)
        outputs.append({
            "valid": torch.ones(rows, dtype=torch.bool),
            "logits": torch.full((rows, k), float("nan")),
            "prediction": torch.full((rows,), -1, dtype=torch.long),
            "confidence": torch.full((rows,), float("nan")),
        })  # fmt: skip
    return outputs


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every run of one world."""
    device = torch.device(args.device)
    x, z, labels = world(name, args.n, args.k, args.d)
    zero_shot = float(((x @ z.t()).argmax(1) == labels).double().mean())
    data = {"x": x.to(device), "z": z.to(device), "labels": labels.to(device),
            "labels_cpu": labels, "batch_size": args.batch_size}  # fmt: skip
    data["outputs"] = blank(args.n, args.k, args.batch_size)
    finalize(data, Clock(device, True), metrics=False)  # warm-up (kernels, allocator)
    walls, summary = [], {}
    for _ in range(args.repeats):  # synchronised where finalize starts, and by its end
        clock = Clock(device, sync=("head",))
        summary = finalize(data, clock, metrics=False)
        walls.append(sum(clock.seconds[p] for p in FINALIZE if p in clock.seconds))
    phased = Clock(device, sync=True)
    finalize(data, phased, args.metrics)
    counter = SyncCounter(device)
    counted = Clock(device, sync=False, counter=counter)
    with counter:
        if not counter.cuda:
            counter.on_device(data["x"], data["z"], data["labels"])
        finalize(data, counted, args.metrics)
    profiled: dict[str, dict[str, float]] = {}
    if device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            finalize(data, Clock(device, sync=False, ranges=True), metrics=False)
        profiled = profile_counts(prof, list(PHASES))
    phases = [p for p in PHASES if p in phased.seconds]
    return {
        "world": name,
        "acc_zero_shot": zero_shot,
        **summary,
        "finalize_s_best": min(walls),
        "finalize_s_median": statistics.median(walls),
        "finalize_s_runs": walls,
        "seconds": {p: phased.seconds[p] for p in phases},
        "syncs": {p: counter.count(p) for p in phases},
        "syncs_finalize": sum(counter.count(p) for p in FINALIZE),
        "sites": {p: dict(list(counter.sites(p).items())[:8]) for p in phases},
        "cpu_only_not_counted": dict(counter.cpu_only),
        "device_ops": dict(counter.ops) if not counter.cuda else None,
        "profile": profiled,
    }


def table(result: dict[str, Any]) -> str:
    """One world's phases as a markdown table."""
    headers = ["phase", "s", "host syncs"]
    profiled = result["profile"]
    if profiled:
        headers += ["kernel launches", "runtime syncs", "copies", "GPU kernel ms"]
    elif result["device_ops"]:
        headers += ["ops on device tensors"]
    rows = []
    for phase, seconds in result["seconds"].items():
        row = [phase, seconds, result["syncs"][phase]]
        if profiled:
            found = profiled.get(phase, {})
            row += [int(found.get(k, 0)) for k in ("launches", "syncs", "copies")]
            row += [found.get("gpu_ms", 0.0)]
        elif result["device_ops"]:
            row += [result["device_ops"].get(phase, 0)]
        rows.append(row)
    return common.markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", default="balanced,long-tailed 10,means")
    parser.add_argument("--no-metrics", dest="metrics", action="store_false",
                        help="leave out the labelled metrics phase")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="2,000 x 100 x 64, 2 repeats")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: 1 on the CPU, a shared machine stalls "
                        "with more)")  # fmt: skip
    args = parser.parse_args()
    if args.threads or not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads or 1)
    if args.quick:
        args.n, args.k, args.d, args.repeats = 2000, 100, 64, 2
    info = common.machine_info(args.device)
    results = []
    for name in args.worlds.split(","):
        result = measure(name, args)
        results.append(result)
        how = "CUDA sync debug mode" if args.device.startswith("cuda") else "simulated"
        print(f"\n{name}: {args.n:,} x {args.k:,} x {args.d}, zero-shot "
              f"{result['acc_zero_shot']:.3f} -> f_d {result['acc_f_d']:.3f}; finalize "
              f"{result['finalize_s_best']:.4f} s best, {result['finalize_s_median']:.4f} s "
              f"median of {args.repeats}; {result['syncs_finalize']} host syncs "
              f"({how})")  # fmt: skip
        if args.device.startswith("cuda"):
            print(f"CUDA memory at finalize's peak: {result['extra_mib']:.0f} MiB above what it "
                  f"found, {result['extra_mib_over_features']:.0f} MiB above the features and "
                  "prototypes")  # fmt: skip
        print(table(result))
        for phase, sites in result["sites"].items():
            if sites:
                print(f"  {phase}: " + "; ".join(f"{c} x {s}" for s, c in sites.items()))
    worst = max(r["finalize_s_best"] for r in results)
    memory = max(r["extra_mib_over_features"] for r in results)
    goals = {"finalize_s_goal": GOAL_S, "finalize_s_worst_world": worst,
             "finalize_goal_met": worst <= GOAL_S, "extra_mib_goal": GOAL_MIB,
             "extra_mib_worst_world": memory}  # fmt: skip
    if args.device.startswith("cuda"):
        print(f"\nGoal finalize <= {GOAL_S} s: {'met' if worst <= GOAL_S else 'NOT met'} "
              f"(worst world {worst:.4f} s); extra CUDA memory {memory:.0f} MiB "
              f"(goal <= {GOAL_MIB})")  # fmt: skip
    name = "finalize_syncs" + ("_quick" if args.quick else "") + (
        "_cuda" if "cuda" in args.device else "")  # fmt: skip
    payload = {"machine": common.finish_info(info), "config": vars(args), **goals,
               "worlds": results}  # fmt: skip
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
