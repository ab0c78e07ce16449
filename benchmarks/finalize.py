"""Finalize cost from features (no encoder): wall time per phase, passes over N x K, peak memory.

Run: ``python benchmarks/finalize.py`` (about 30 minutes on 2 CPU cores, 20 of them the 21k case
at N = 30,000; ``--quick``: seconds). Issue 35 item 2's 21k world: ``trace_21k.py``.
Writes ``benchmarks/results/finalize.json`` (``finalize_cuda.json`` with ``--device cuda``).

Every case runs in a fresh subprocess so its peak memory is its own; its timed run is repeated
(``--repeats``, default 5, except the float64 reference, the paper options and the 21k case) and
the run with the median finalize time is kept (``finalize_s_runs`` lists them all). A case does what
``FrolicModule`` does around the encoder: one ``FrolicMoments.update`` per batch of cached
features (the encode phase's share), then finalize: ``fit_frolic`` (head solve and logit
buffers, tau_g search, test prior, beta loop) and filling the per-batch outputs with the
module's own :func:`frolic_tta.lightning.outcome.fill_outputs` (softmax, prediction, confidence,
per-class probability). Phases are timed exclusively through ``fit_frolic``'s public
``progress`` hook and passes counted through its ``reduce_fn`` (one call ends each pass over the
N x K logits; :mod:`probe`); a ``TorchDispatchMode`` records the largest tensor any op creates
and whether a (K, K) or a full (N, K) tensor appeared. "Extra memory" is the peak RSS during
the phases minus the RSS before them (features, prototypes and output placeholders already
allocated, as in the module; the module copies each batch's features into one preallocated
cache while encoding, so finalize concatenates nothing).
``reference`` is a straightforward float64 implementation of the paper's algorithm (Eq. 7 with
``torch.linalg.inv``, full N x K logits, bisection for tau_g, Algorithm 2 with hard labels and
power iteration on a K x K matrix S), timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from functools import partial
from typing import Any

import common
import torch
from probe import Probe, ShapeAudit

from frolic_tta.options import FrolicOptions, paper_options

TAU_C, EPS = 0.01, 0.01
PHASES = ("moments", "test prior", "head solve", "tau search", "beta loop", "scoring")


def default_cases(quick: bool) -> list[dict[str, Any]]:
    """The sweep. ``n_run`` < ``n`` means: measured at ``n_run``, N-linear phases scaled."""

    def case(label: str, n: int, k: int, d: int, mode: str = "ours", **kw: Any) -> dict[str, Any]:
        return {
            "label": label,
            "n": n,
            "k": k,
            "d": d,
            "mode": mode,
            "n_run": n,
            "geometry": "imagenet-like",
            "chunk_size": None,  # the module's default: about 2M logits per chunk
            "keep_logits": True,
            **kw,
        }

    if quick:
        return [
            case("small", 2000, 100, 64),
            case("small, paper options", 2000, 100, 64, "ours-paper"),
            case("small, float64 reference", 2000, 100, 64, "reference"),
            case("small, streaming", 2000, 1000, 64, n_run=1000, chunk_size=256, keep_logits=False),
        ]
    return [
        case("sweep, K = 100", 10_000, 100, 512),
        case("sweep, K = 1,000", 10_000, 1_000, 512),
        case("ImageNet, ViT-B-16", 50_000, 1_000, 512),
        case("ImageNet, ViT-B-16, balanced test prior", 50_000, 1_000, 512, "ours-balanced"),
        case(
            "ImageNet, ViT-B-16, raw head labels (previous default)", 50_000, 1_000, 512, "ours-raw"
        ),
        case("ImageNet, ViT-B-16, paper options", 50_000, 1_000, 512, "ours-paper"),
        case("ImageNet, ViT-B-16, float64 reference", 50_000, 1_000, 512, "reference"),
        case("ImageNet, ViT-B-16, fit_frolic(sums=None)", 50_000, 1_000, 512, "ours-nosums"),
        case("ImageNet, ViT-L-14", 50_000, 1_000, 768),
        # zero-shot right on ~every sample: hard posteriors (issue 35, item 6)
        case("ImageNet, ViT-B-16, confident zero-shot", 50_000, 1_000, 512, geometry="confident"),
        case("separable geometry", 10_000, 1_000, 512, geometry="separable"),
        # fewer samples than classes: hard posteriors, the matching's Newton steps on the full
        # K x K Hessian (28 of them: finalize 37.3 s with an eigendecomposition each, f199669)
        case("sweep, N = 1,000 < K = 2,000", 1_000, 2_000, 256),
        # run at more samples than classes, as the full case has (a run at 10,000 < K was
        # stopped unfinished after 19 min on 2026-11-26)
        case(
            "ImageNet-21k, streaming",
            200_000,
            21_841,
            512,
            n_run=30_000,
            chunk_size=1024,
            keep_logits=False,
        ),
    ]


def run_ours(x: torch.Tensor, z: torch.Tensor, case: dict[str, Any], probe: Probe) -> Any:
    """What FrolicModule does around the encoder, from cached features."""
    from frolic_tta.lightning.outcome import fill_outputs
    from frolic_tta.logits import RowBuffer
    from frolic_tta.metrics import FrolicMoments
    from frolic_tta.pipeline import fit_frolic

    n, batch = x.shape[0], case["batch_size"]
    options = {
        "ours-paper": paper_options(),
        "ours-balanced": FrolicOptions(test_prior="uniform"),
        "ours-raw": FrolicOptions(head_labels="zero_shot"),
    }.get(case["mode"], FrolicOptions())
    sums = kept = None
    if case["mode"] != "ours-nosums":  # the module: one update per encoded batch
        probe.push("moments")
        metric = FrolicMoments(z, TAU_C, keep_logits=case["keep_logits"]).to(x.device)
        cache = RowBuffer(n)  # the module's feature cache, filled batch by batch
        for start in range(0, n, batch):
            metric.update(x[start : start + batch])
            cache.append(x[start : start + batch])
        sums, kept, x = metric.compute(), metric.zero_shot_logits(), cache.rows()
        probe.passes["moments"] += 1
        probe.pop()
    # else moment_sums on the whole shard, inside fit_frolic: in "head solve"
    probe.push("head solve")  # until fit_frolic reports its first phase (then progress hook)
    fit = fit_frolic(
        x,
        z,
        options,
        tau_c=TAU_C,
        solver={"eps": EPS},
        sums=sums,
        reduce_fn=probe.reduce,
        keep_logits=case["keep_logits"],
        chunk_size=case["chunk_size"],
        progress=probe.progress,
        zero_shot_logits=kept,
    )
    probe.push("scoring")  # FrolicModule.finalize: fill each batch's placeholders
    fill_outputs(case["outputs"], fit.logits, fit.head, x, probe.reduce, n)
    probe.pop()
    return fit


def run_reference(x: torch.Tensor, z: torch.Tensor, probe: Probe) -> dict[str, Any]:
    """The paper's algorithm, straightforwardly, in float64 with full N x K tensors."""
    n, k = x.shape[0], z.shape[0]
    x64, z64 = x.double(), z.double()

    def conf(logits: torch.Tensor) -> float:
        probe.passes[probe.stack[-1][0]] += 1
        return float(torch.softmax(logits, 1).max(1).values.mean())

    probe.push("head solve")  # Eq. 7 and Eq. 9 with an explicit inverse
    sigma = x64.t() @ x64 / n - z64.t() @ z64 / k
    w = z64 @ torch.linalg.inv(sigma)
    b = -0.5 * (w * z64).sum(1)
    probe.pop()
    probe.push("scoring")
    zero_shot, gda = x64 @ z64.t(), torch.addmm(b, x64, w.t())
    probe.passes["scoring"] += 2
    probe.pop()
    probe.push("tau search")  # bisection on ln tau until |conf - target| <= 1e-5
    target, lo, hi = conf(zero_shot / TAU_C), -30.0, 30.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        err = conf(gda / math.exp(mid)) - target
        probe.calls["tau_steps"] += 1
        if abs(err) <= 1e-5:
            break
        lo, hi = (mid, hi) if err > 0 else (lo, mid)
    tau_g = math.exp(mid)
    probe.pop()
    probe.push("beta loop")  # Algorithm 2: hard labels, S (K x K), power iteration
    fused = gda / tau_g + zero_shot / TAU_C
    probs = torch.softmax(fused, 1)
    beta = torch.full((k,), 1.0 / k, dtype=torch.float64, device=x.device)
    for _ in range(100):
        probe.calls["beta_steps"] += 1
        labels = (fused - torch.log(beta.clamp(min=1e-12))).argmax(1)
        s = torch.zeros(k, k, dtype=torch.float64, device=x.device).index_add_(1, labels, probs.t())
        counts = torch.bincount(labels, minlength=k).double()
        s = torch.where(counts > 0, s / counts.clamp(min=1), torch.full_like(s, 1.0 / k))
        new = torch.full((k,), 1.0 / k, dtype=torch.float64, device=x.device)
        for _ in range(10_000):
            probe.calls["power_iterations"] += 1
            step = s @ new
            step = step / step.sum()
            done = float((step - new).abs().sum()) < EPS
            new = step
            if done:
                break
        change = float((new - beta).abs().sum())
        beta = new
        if change < EPS:
            break
    probe.passes["beta loop"] += 1 + probe.calls["beta_steps"]
    probe.pop()
    probe.push("scoring")
    debiased = fused - torch.log(beta.clamp(min=1e-12))
    confidence, prediction = torch.softmax(debiased, 1).max(1)
    probe.passes["scoring"] += 1
    probe.pop()
    return {"tau_g": tau_g, "beta": beta, "prediction": prediction}


def worker(case: dict[str, Any]) -> dict[str, Any]:
    """One case in this (fresh) process; returns the measurements."""
    device = torch.device(case["device"])
    n, k, d = case["n_run"], case["k"], case["d"]
    x, z, labels = common.clip_like(n, k, d, case["geometry"])
    x, z = x.to(device), z.to(device)
    outputs = []  # the module's placeholders, one dict per batch, allocated while encoding
    for start in range(0, n, case["batch_size"]):
        rows = min(case["batch_size"], n - start)
        output = {
            "valid": torch.ones(rows, dtype=torch.bool),
            "prediction": torch.full((rows,), -1, dtype=torch.long),
            "confidence": torch.full((rows,), float("nan")),
        }
        if case["keep_logits"] and case["mode"] != "reference":
            output["logits"] = torch.full((rows, k), float("nan"))
        outputs.append(output)
    case = {**case, "outputs": outputs}
    probe = Probe(device)
    audit = ShapeAudit(n, k)
    with ShapeAudit(1, 1):  # the first use of a dispatch mode costs about a second
        torch.ones(2, 2) @ torch.ones(2, 2)
    run = run_reference if case["mode"] == "reference" else partial(run_ours, case=case)
    with audit:  # shapes only: a dispatch mode costs time on every op, so it is not timed
        run(x, z, probe=Probe(device))
    runs = []
    for _ in range(case.get("repeats", 1)):  # the median finalize of a few runs (a noisy VM)
        probe = Probe(device)
        probe.start_memory()
        cpu0, t0 = common.cpu_seconds(), common.now()
        fit = run(x, z, probe=probe)
        common.sync(device)
        wall = common.now() - t0
        cpu = common.cpu_seconds() - cpu0
        probe._mark()
        runs.append((wall - probe.seconds.get("moments", 0.0), wall, cpu, probe, fit))
    runs.sort(key=lambda r: r[0])
    _, wall, cpu, probe, fit = runs[len(runs) // 2]
    finalize_runs = [r[0] for r in runs]
    extra = max(probe.peaks.values())
    if isinstance(fit, dict):
        tau_g, beta, prediction = fit["tau_g"], fit["beta"], fit["prediction"].cpu()
    else:
        tau_g, beta = fit.head.tau_g, fit.head.beta
        prediction = torch.cat([o["prediction"] for o in outputs])
    zero_shot = torch.cat([(x[i : i + 8192] @ z.t()).argmax(1).cpu() for i in range(0, n, 8192)])
    seconds = {p: probe.seconds.get(p, 0.0) for p in PHASES}
    return {
        "wall_s": wall,
        "finalize_s": wall - seconds["moments"],
        "finalize_s_runs": finalize_runs,
        "seconds": seconds,
        "unattributed_s": wall - sum(seconds.values()),
        "passes": {p: probe.passes.get(p, 0) for p in PHASES},
        "passes_total": sum(probe.passes.values()),
        # ours: reduce_fn calls (passes) of the phase; the reference counts its own steps
        "tau_steps": probe.calls["tau_steps"] or probe.passes["tau search"],
        "beta_steps": probe.calls["beta_steps"] or probe.passes["beta loop"],
        "em_passes": probe.passes["test prior"],
        "power_iterations": probe.calls["power_iterations"],
        "reduce_calls": probe.calls["reduce_fn"],
        "extra_mib": extra,
        "extra_mib_by_phase": {p: probe.peaks.get(p, 0.0) for p in PHASES},
        "baseline_mib": probe.base,
        "cpu_utilisation": cpu / wall,
        "largest_tensor": list(audit.largest),
        "kxk_tensor": audit.kxk,
        "full_nxk_tensor": audit.nxk,
        "nxk_float32_mib": n * k * 4 / 2**20,
        "kxk_float64_mib": k * k * 8 / 2**20,
        "tau_g": tau_g,
        "beta_max_over_min": float(beta.max() / beta.min()),
        "acc_zero_shot": float((zero_shot == labels).double().mean()),
        "acc_frolic": float((prediction == labels).double().mean()),
        # the estimator's own account (ours only): every solve of the test prior converged,
        # the label-bias test's evidence and the fusion choice's margin, in nats
        **({} if isinstance(fit, dict) else _priors(fit.priors)),
    }


def _priors(priors: Any) -> dict[str, Any]:
    return {
        "test_prior_converged": bool(priors.converged),
        "test_prior_passes": int(priors.passes),
        "label_bias_evidence": priors.label_bias_evidence,
        "fusion_gap": priors.fusion_gap,
    }


def scale(result: dict[str, Any], factor: float) -> dict[str, Any]:
    """Extrapolate a run at N_run to N = factor N_run: every phase but the head solve is
    linear in N (same iteration counts assumed); memory is chunk-bound when streaming."""
    seconds = {p: s * (1.0 if p == "head solve" else factor) for p, s in result["seconds"].items()}
    total = sum(seconds.values())
    return {"wall_s": total, "finalize_s": total - seconds["moments"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch-size", type=int, default=256, help="module batch size")
    parser.add_argument(
        "--n21k",
        type=int,
        default=None,
        help="N run for the 21k case (default 30,000; 200,000 = full, never completed here)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="run only cases whose label contains this (repeatable: any of them)",
    )
    parser.add_argument("--exact", action="store_true", help="--only names whole labels")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per case (the median is kept)"
    )
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=3600.0,
        help="seconds a case may take before it is stopped (the full 21k case needs hours on CPU)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    info = common.machine_info(args.device)
    name = (
        "finalize" + ("_quick" if args.quick else "") + ("_cuda" if "cuda" in args.device else "")
    )
    cases = default_cases(args.quick)
    previous = {e["case"]["label"]: e for e in (common.read_result(name) or {}).get("cases", [])}
    done = {}
    for case in cases:
        if args.only and not any(
            part == case["label"] if args.exact else part in case["label"] for part in args.only
        ):
            continue
        if args.n21k and "21k" in case["label"]:
            case["n_run"] = args.n21k
        slow = "21k" in case["label"] or case["mode"] in ("reference", "ours-paper")
        repeats = 1 if slow else args.repeats
        case.update(device=args.device, batch_size=args.batch_size, repeats=repeats)
        worker_args = ["benchmarks/finalize.py", "--worker", json.dumps(case)]
        try:
            result = common.run_json_worker(worker_args, timeout=args.case_timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as error:  # keep the other cases
            stopped = f"{common.machine_info(args.device)['date']}: {str(error)[-300:]}"
            print(f"{case['label']}: stopped ({stopped})", flush=True)
            if case["label"] in previous:  # the last completed run stays, with the attempt
                previous[case["label"]]["result"]["rerun_stopped"] = stopped
            continue
        result["date"] = common.machine_info(args.device)["date"]
        if case["n_run"] != case["n"]:
            result["extrapolated"] = scale(result, case["n"] / case["n_run"])
        done[case["label"]] = {"case": case, "result": result}
        print(f"{case['label']}: {json.dumps(result)[:200]}...", flush=True)
    # --only: keep the other cases of the previous run
    results = [done.get(c["label"], previous.get(c["label"])) for c in cases]
    results = [r for r in results if r is not None]
    for entry in results:
        same = [
            r for r in results
            if r["case"]["mode"] == "reference"
            and all(r["case"][f] == entry["case"][f] for f in "nkd")
        ]  # fmt: skip
        if same and entry["case"]["mode"] != "reference":
            entry["result"]["speedup_vs_reference"] = (
                same[0]["result"]["finalize_s"] / entry["result"]["finalize_s"]
            )
    if args.only:
        info["rerun_only"] = " | ".join(args.only)
    # "public hooks": phases from fit_frolic's progress hook, passes = reduce_fn calls
    payload = {"machine": common.finish_info(info), "cases": results, "probe": "public hooks"}
    from report import finalize_section

    print(finalize_section(payload))
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
