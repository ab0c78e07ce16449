"""Why the defaults: covariance candidates and label-bias loops on worlds with known truth.

Run: ``python benchmarks/defaults.py`` (about a minute on 2 cores); writes
``benchmarks/results/defaults.json`` and prints two tables (mean over seeds).

Covariance candidates (all label-free, all from one pass of sums):
  eq7            Eq. 7, class means = prototypes (the paper)
  official       0.1 diag(Eq. 7) + 0.9 I, means = prototypes (the paper's released code)
  gap_eq7        Eq. 7 after moving the prototypes into the image cone (z_j - mean z + mean x)
  gap_oas        gap_eq7 shrunk with OAS (falls back to I when Eq. 7 is not PSD)
  soft           within-class scatter under the zero-shot posterior, soft class means
  soft_oas       soft + OAS shrinkage
  soft_auto      soft, OAS only when the scatter is rank-deficient (default)
Bias loops: paper (Algorithm 2), soft (default), em (prior re-estimation towards a balanced test
posterior, Saerens et al. 2002 style), implicit, oracle (S from labels), against the truth.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import frolic_tta
from frolic_tta import accuracy
from frolic_tta.calibration import match_temperature
from frolic_tta.gda import moment_sums, oas_shrinkage, shared_covariance, shrink
from frolic_tta.synthetic import clip_world, paper_world, prior_shift_world

RESULTS = Path(__file__).parent / "results"


def head_for(candidate: str, features: torch.Tensor, prototypes: torch.Tensor):
    """``(weight, bias, center, covariance)`` of a candidate, f_g = weight (x - center) + bias."""
    sums = moment_sums(features, prototypes, 0.01)
    n = float(sums.count)
    mu = sums.feature_sum / n
    z = prototypes.double()
    if candidate.startswith("soft"):
        shrinkage = {"soft": None, "soft_oas": "oas", "soft_auto": "auto"}[candidate]
        sigma, means, _, _ = shared_covariance(sums, prototypes, "soft", shrinkage)
    else:
        means = z - z.mean(0) + mu if candidate.startswith("gap") else z
        sigma = sums.outer_sum / n - means.t() @ means / len(means)
        if candidate == "official":
            sigma = 0.1 * torch.diag(torch.diagonal(sigma)) + 0.9 * torch.eye(len(sigma)).double()
        if candidate == "gap_oas":
            psd = bool(torch.linalg.eigvalsh(sigma).min() > 0)
            identity = torch.eye(len(sigma), dtype=torch.float64)
            sigma = shrink(sigma, oas_shrinkage(sigma, n)) if psd else identity
    centred = (means - mu).t()
    weight = torch.linalg.solve(sigma, centred).t()
    bias = -0.5 * (centred.t() * weight).sum(1)
    return weight, bias, mu, sigma


def run_head(candidate: str, world) -> dict[str, float]:
    x, z, y = world.features.double(), world.prototypes.double(), world.labels
    try:
        weight, bias, mu, sigma = head_for(candidate, x, z)
    except torch.linalg.LinAlgError:  # singular covariance: the candidate cannot be used
        return {
            "f_c": accuracy(x @ z.t(), y),
            "f_g": math.nan,
            "f_f": math.nan,
            "f_d": math.nan,
            "min_eig": 0.0,
            "pd": 0.0,
        }
    gda = (x - mu) @ weight.t() + bias
    zero_shot = x @ z.t()
    tau_g = match_temperature(gda, zero_shot, 0.01)
    fused = gda / tau_g + zero_shot / 0.01
    beta = frolic_tta.estimate_label_bias(fused)
    eig = torch.linalg.eigvalsh(sigma)  # min_eig < 1e-12: numerically singular
    out = {
        "f_c": accuracy(zero_shot, y),
        "f_g": accuracy(gda, y),
        "f_f": accuracy(fused, y),
        "f_d": accuracy(fused - beta.log(), y),
        "min_eig": float(eig.min()),
        "pd": float(eig.min() > 0),
    }
    if world.covariance is not None:
        out["sigma_rel_err"] = float((sigma - world.covariance).norm() / world.covariance.norm())
    return out


def em_prior(logits: torch.Tensor, max_iter: int = 2000, tol: float = 1e-4) -> torch.Tensor:
    """beta_j <- beta_j K mean_i q_ij(beta): the debiased posterior's class mass made uniform."""
    k = logits.shape[1]
    beta = torch.full((k,), 1.0 / k, dtype=torch.float64)
    for _ in range(max_iter):
        mass = torch.softmax(logits - beta.log(), 1).mean(0)
        new = beta * mass * k
        new = new / new.sum()
        done = float((new - beta).abs().sum()) < tol
        beta = new
        if done:
            break
    return beta


def run_bias(world) -> dict[str, dict[str, float]]:
    y, logits = world.labels, world.logits
    rows = {}
    for name in ("paper", "soft", "em", "implicit", "oracle"):
        start = time.perf_counter()
        if name == "em":
            beta = em_prior(logits)
        elif name == "oracle":
            beta = frolic_tta.estimate_label_bias(logits, labels=y)
        else:
            beta = frolic_tta.estimate_label_bias(logits, method=name)
        rows[name] = {
            "l1": float((beta - world.prior).abs().sum()),
            "acc": accuracy(logits - beta.log(), y),
            "seconds": time.perf_counter() - start,
        }
    rows["biased"] = {
        "l1": float((1 / len(world.prior) - world.prior).abs().sum()),
        "acc": accuracy(logits, y),
        "seconds": 0.0,
    }
    rows["bayes"] = {"l1": 0.0, "acc": accuracy(world.bayes_logits, y), "seconds": 0.0}
    return rows


def mean_rows(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    keys = runs[0].keys()
    return {k: {m: sum(r[k][m] for r in runs) / len(runs) for m in runs[0][k]} for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seeds = range(2 if args.quick else args.seeds)
    candidates = ("eq7", "official", "gap_eq7", "gap_oas", "soft", "soft_oas", "soft_auto")
    worlds = {
        "clip": lambda s: clip_world(num_samples=4000, seed=s),
        "clip_n=2d": lambda s: clip_world(num_samples=128, seed=s),  # N/d = 2
        "clip_n<d": lambda s: clip_world(num_samples=48, seed=s),  # N/d = 0.75
        "paper": lambda s: paper_world(num_samples=4000, seed=s),
    }
    heads = {}
    for wname, make in worlds.items():
        per_seed = [{c: run_head(c, make(s)) for c in candidates} for s in seeds]
        heads[wname] = mean_rows(per_seed)
    bias = {}
    for sep in (0.5, 0.7):
        for ratio in (20.0, 1.0):
            runs = [
                run_bias(prior_shift_world(20000, separation=sep, ratio=ratio, seed=s))
                for s in seeds
            ]
            bias[f"sep={sep},ratio={ratio:g}"] = mean_rows(runs)
    print(f"GDA heads (mean over {len(seeds)} seeds; accuracy, PD = share of seeds PD)")
    for wname, table in heads.items():
        print(f"\n[{wname} world]  " + "  ".join(f"{m:>8}" for m in next(iter(table.values()))))
        for cand, row in table.items():
            print(f"{cand:>10}  " + "  ".join(f"{v:8.4f}" for v in row.values()))
    print("\nLabel-bias loops on Proposition 2's model (L1 to beta*, debiased accuracy, seconds)")
    for wname, table in bias.items():
        print(f"\n[{wname}]")
        for method, row in table.items():
            print(f"{method:>10}  l1 {row['l1']:.3f}  acc {row['acc']:.4f}  {row['seconds']:.2f}s")
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "seeds": len(seeds),
        "heads": heads,
        "bias": bias,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    (RESULTS / "defaults.json").write_text(
        json.dumps(
            payload,
            indent=1,
            default=lambda v: None if isinstance(v, float) and math.isnan(v) else v,
        )
    )


if __name__ == "__main__":
    main()
