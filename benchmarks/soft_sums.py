r"""What exact passes would cost and buy at ImageNet size (logits.exact_arithmetic's size rule).

Run: ``python benchmarks/soft_sums.py --device cuda`` (seconds on a GPU; writes
``benchmarks/results/soft_sums_cuda.json``; on CPU ``soft_sums.json``, about 2 minutes).

:func:`frolic_tta.logits.exact_arithmetic` makes the estimator's passes exact (float64 products
rounded once, float64 sums over samples: the soft sums :math:`\sum_i q_i x_i^\top`, the head's
logits, the matchings' and the mixture's column sums) only where :math:`N K d \le 2^{31}`; above
it (ImageNet: 50,000 x 1,000 x 512 = 2.6e10) they are float32 per row chunk, whose rounding
depends on which rows share a chunk, as it does on how the test set is split over processes.
(Results recorded before 2026-11-27 forced the soft sums alone.) On the ``finalize.py`` world
this script fits with the rule as shipped and with float64 products forced (the constant
raised), each at the default chunk size and at 777 rows per chunk (a split that shares no
boundary with it), and reports the wall time (median of 3), how far the two chunkings' logits
are apart (relative to the largest logit), the predictions that change, and the distance to a
fit on float64 features (every step in float64).
"""

from __future__ import annotations

import math
import statistics

import common

import frolic_tta.logits
from frolic_tta.pipeline import fit_frolic

SHIPPED = frolic_tta.logits.EXACT_PRODUCTS


def main() -> None:
    args, info, x, z, labels = common.imagenet_world_cli(__doc__.splitlines()[0])

    def fit(features, prototypes, chunk_size=None):
        return fit_frolic(
            features, prototypes, tau_c=0.01, solver={"eps": 0.01}, chunk_size=chunk_size
        )

    reference = fit(x.double(), z.double()).logits.double().cpu()
    scale = float(reference.abs().max())
    results = {}
    for name, limit in (("size rule (shipped)", SHIPPED), ("float64 forced", math.inf)):
        frolic_tta.logits.EXACT_PRODUCTS = limit
        walls = []
        for _ in range(args.repeats):
            common.sync(args.device)
            start = common.now()
            out = fit(x, z)
            common.sync(args.device)
            walls.append(common.now() - start)
        logits = out.logits.double().cpu()
        other = fit(x, z, chunk_size=777).logits.double().cpu()
        results[name] = {
            "wall_s": statistics.median(walls),
            "wall_s_runs": walls,
            "chunking_diff_rel": float((logits - other).abs().max()) / scale,
            "chunking_predictions_changed": float((logits.argmax(1) != other.argmax(1)).sum()),
            "float64_diff_rel": float((logits - reference).abs().max()) / scale,
            "accuracy": float((logits.argmax(1).cpu() == labels).double().mean()),
            "tau_g": out.head.tau_g,
        }
        print(name, results[name], flush=True)
    frolic_tta.logits.EXACT_PRODUCTS = SHIPPED
    payload = {"machine": common.finish_info(info), "n": args.n, "runs": results}
    suffix = "_cuda" if "cuda" in args.device else ""
    print(f"wrote {common.write_result('soft_sums' + suffix, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
