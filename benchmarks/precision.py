"""What the float32 matmul-precision flag would do to Frolic, and what the guard costs.

Run: ``python benchmarks/precision.py --device cuda`` (seconds on a GPU; writes
``benchmarks/results/precision_cuda.json``; on CPU ``precision.json``).

Lightning tells every user of a tensor-core GPU to call
``torch.set_float32_matmul_precision("high")``: float32 products then run in TF32 (and in
bfloat16 under ``"medium"`` on CPUs with AMX). ``fit_frolic`` runs its own products in IEEE
float32 whatever the flag (:mod:`frolic_tta.precision`). On the ImageNet-size world of
``finalize.py`` (50,000 x 1,000 x 512), this script fits (sums included) under ``"highest"``,
under ``"high"`` with the guard (the package as shipped), and under ``"high"`` without it
(``fit_frolic``'s undecorated body), and reports the logits' largest difference relative to the
largest logit, the predictions that change, the accuracy, tau_g and the wall time (median of 3).
"""

from __future__ import annotations

import statistics

import common
import torch

from frolic_tta.pipeline import fit_frolic

UNGUARDED = torch.no_grad()(fit_frolic.__wrapped__.__wrapped__)  # no_grad(ieee_float32(body))


def main() -> None:
    args, info, x, z, labels = common.imagenet_world_cli(__doc__.splitlines()[0])
    runs = {
        "highest": ("highest", fit_frolic),
        "high, guarded (shipped)": ("high", fit_frolic),
        "high, unguarded": ("high", UNGUARDED),
    }
    results, reference = {}, None
    for name, (flag, fit) in runs.items():
        walls = []
        for _ in range(args.repeats):
            torch.set_float32_matmul_precision(flag)
            common.sync(args.device)
            start = common.now()
            out = fit(x, z, tau_c=0.01, solver={"eps": 0.01})
            common.sync(args.device)
            walls.append(common.now() - start)
            torch.set_float32_matmul_precision("highest")
        logits = out.logits.double().cpu()
        reference = logits if reference is None else reference
        predictions = logits.argmax(1)
        results[name] = {
            "flag": flag,
            "wall_s": statistics.median(walls),
            "wall_s_runs": walls,
            "logits_diff_rel": float((logits - reference).abs().max() / reference.abs().max()),
            "predictions_changed": float((predictions != reference.argmax(1)).double().mean()),
            "accuracy": float((predictions == labels).double().mean()),
            "tau_g": out.head.tau_g,
        }
        print(name, results[name], flush=True)
    payload = {"machine": common.finish_info(info), "n": args.n, "runs": results}
    suffix = "_cuda" if "cuda" in args.device else ""
    print(f"wrote {common.write_result('precision' + suffix, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
