"""Accuracy against known truth on generated worlds: every Table 3/4 row, defaults vs literal.

Run: ``python benchmarks/accuracy.py`` (about a minute on 2 CPU cores; ``--quick``: seconds).
Writes ``benchmarks/results/accuracy.json``.

Worlds (``frolic_tta.synthetic`` and ``benchmarks.common.clip_like``), 3 fixed seeds, mean:

* ``paper``: the paper's model x ~ N(z_y, Σ), prototypes = class means; Bayes classifier known.
* ``prop2``: Proposition 2's model. (a) The label-bias loops on the biased Bayes logits
  f = μᵀx − ½‖μ‖² + ln β* (long-tailed β*, balanced test set), with ‖β̂ − β*‖₁.
  (b) The whole pipeline with f_c equal to those logits: features [x, 1], prototypes
  [μ_j, −½‖μ_j‖² + ln β*_j], τ_c = 1.
* ``clip``: ``clip_world`` (unit norm, modality gap, planted text bias), K = 20, d = 64.
* ``clip-like``: the generator of ``finalize.py`` at K = 100, d = 128 (ImageNet-like geometry).

Columns: the defaults (``covariance="soft"``, ``bias="soft"``) and the paper-literal options
(``"paper"``, ``"paper"``). Reference rows: scikit-learn's supervised LDA (fit with the labels,
on the same data: an upper bound a label-free method should not beat) and the Bayes classifier
where the world defines it.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import common
import torch

import frolic_tta
from frolic_tta import ROWS, accuracy
from frolic_tta.synthetic import World, clip_world, paper_world, prior_shift_world, zero_shot_view

OPTIONS = {"default": {}, "paper": {"covariance": "paper", "bias": "paper"}}
BIAS_METHODS = ("none", "paper", "implicit", "soft", "oracle")


def table_rows(
    features: torch.Tensor, prototypes: torch.Tensor, labels: torch.Tensor, tau_c: float
) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Accuracy of every row under each option set, and any warnings the core emitted."""
    out: dict[str, dict[str, float]] = {}
    caught: list[str] = []
    for option, kwargs in OPTIONS.items():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out[option] = {row: float("nan") for row in ROWS}
            try:
                # the paper's Gaussian worlds are not unit-norm: used as they are
                result = frolic_tta.frolic(
                    features, prototypes, tau_c=tau_c, normalize=False, **kwargs
                )
                try:
                    rows = result.ablations(labels)
                except (RuntimeError, torch.linalg.LinAlgError) as error:  # the Oracle's solve
                    caught.append(f"{option}: ablations(labels): {type(error).__name__}: {error}")
                    rows = result.ablations()
                out[option].update({row: accuracy(rows[row], labels) for row in rows})
            except (ValueError, RuntimeError, torch.linalg.LinAlgError) as error:
                caught.append(f"{option}: {type(error).__name__}: {error}")
        caught += [f"{option}: {w.message}" for w in record]
    return out, caught


def bias_rows(world: World) -> dict[str, dict[str, float]]:
    """Prop-2 (a): each label-bias method on the biased logits: accuracy and L1 to beta*."""
    out = {}
    for method in BIAS_METHODS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if method == "oracle":
                beta = frolic_tta.estimate_label_bias(world.logits, labels=world.labels)
            else:
                beta = frolic_tta.estimate_label_bias(world.logits, method=method)  # type: ignore
        out[method] = {
            "accuracy": accuracy(world.logits - beta.log(), world.labels),
            "l1_to_truth": float((beta - world.prior).abs().sum()),
        }
    out["truth (Bayes)"] = {"accuracy": accuracy(world.bayes_logits, world.labels),
                            "l1_to_truth": 0.0}  # fmt: skip
    return out


def run_world(name: str, make: Callable[[int], World], seed: int) -> dict[str, Any]:
    world = make(seed)
    labels = world.labels
    if name == "prop2":
        features, prototypes = zero_shot_view(world)
        tau_c = 1.0
    else:
        features, prototypes, tau_c = world.features, world.prototypes, 0.01
    rows, caught = table_rows(features, prototypes, labels, tau_c)
    result: dict[str, Any] = {"rows": rows, "warnings": caught}
    result["lda"] = common.lda_accuracy(world.features.double(), labels)
    if world.bayes_logits is not None:
        result["bayes"] = accuracy(world.bayes_logits, labels)
    if name == "prop2":
        result["bias"] = bias_rows(world)
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and sd over seeds of every number in the runs."""
    out: dict[str, Any] = {"rows": {}, "warnings": sorted({w for r in runs for w in r["warnings"]})}
    for option in OPTIONS:
        out["rows"][option] = {
            row: common.mean_sd([r["rows"][option][row] for r in runs])
            for row in runs[0]["rows"][option]
        }
    for key in ("lda", "bayes"):
        if key in runs[0]:
            out[key] = common.mean_sd([r[key] for r in runs])
    if "bias" in runs[0]:
        out["bias"] = {
            method: {m: common.mean_sd([r["bias"][method][m] for r in runs]) for m in values}
            for method, values in runs[0]["bias"].items()
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 seed, smaller worlds")
    args = parser.parse_args()
    scale = 4 if args.quick else 1
    seeds = range(1 if args.quick else args.seeds)
    info = common.machine_info()

    def clip_like_world(seed: int) -> World:
        x, z, y = common.clip_like(20_000 // scale, 100, 128, seed=seed)
        return World(x, z, y)

    worlds: dict[str, tuple[str, Callable[[int], World]]] = {
        "paper": (f"N={5000 // scale} K=10 d=16", lambda s: paper_world(5000 // scale, seed=s)),
        "prop2": (
            f"N={20_000 // scale} K=10 d=16 separation 0.5, β* max/min 20",
            lambda s: prior_shift_world(20_000 // scale, separation=0.5, seed=s),
        ),
        "clip": (f"N={4000 // scale} K=20 d=64", lambda s: clip_world(4000 // scale, seed=s)),
        "clip-like": (f"N={20_000 // scale} K=100 d=128 imagenet-like", clip_like_world),
    }
    results = {}
    for name, (description, make) in worlds.items():
        runs = [run_world(name, make, seed) for seed in seeds]
        results[name] = {"description": description, **summarise(runs)}
        print(f"{name}: done", flush=True)
    payload = {"machine": common.finish_info(info), "seeds": list(seeds), "worlds": results}
    name = "accuracy_quick" if args.quick else "accuracy"
    from report import accuracy_section

    print(accuracy_section(payload))
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
