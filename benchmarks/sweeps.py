"""Cost of one pass over ImageNet-size logits, per kind of pass: ``python benchmarks/sweeps.py``.

The estimator's passes at ImageNet size (50,000 x 1,000, keep-logits buffer) are not exact
(:func:`frolic_tta.logits.exact_arithmetic`), so their sums are float32 per chunk: the
mixture's EM pass and the soft sums of a refit take their row and column sums as
matrix-vector products with the exponentials (:mod:`frolic_tta.sweeps`). This script times
each pass on the benchmark's CLIP-like world (``common.clip_like``, f_c / tau_c at tau_c = 0.01
and a debiasing shift): the best and the median of ``--repeats`` runs, in one process.

To compare two commits, run it under each (the functions it calls keep their signatures):
``PYTHONPATH=<checkout of the other commit> python benchmarks/sweeps.py``. It prints which
checkout it measured. Seconds only; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import common
import torch

import frolic_tta
from frolic_tta.logits import TensorLogits
from frolic_tta.matching import exponentials
from frolic_tta.mixture import _mixture_sums
from frolic_tta.soft_sums import posterior_sums


def timed(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best and median wall seconds of ``repeats`` calls."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds), statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--k", type=int, default=1_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    features, prototypes, _ = common.clip_like(args.n, args.k, args.d, "imagenet-like")
    logits = features @ prototypes.t() / 0.01
    source = TensorLogits(logits)  # the module's default chunks, not exact at this size
    shift = torch.linspace(-2.0, 2.0, args.k, dtype=torch.float64)  # a debiasing offset
    log_prior = torch.log_softmax(shift, 0)
    spare = exponentials(source, torch.empty_like(logits))
    count = float(args.n)
    cases = {
        "mixture EM pass (_mixture_sums)": lambda: _mixture_sums(source, log_prior),
        "soft sums, exponentials at hand": lambda: posterior_sums(
            source, shift, features, spare, count
        ),
        "soft sums, one exponential per entry": lambda: posterior_sums(
            source, shift, features, None, count
        ),
        "soft sums with the entropy (the ELBO)": lambda: posterior_sums(
            source, shift, features, spare, count, entropy=True
        ),
        "one N x K x d product (for scale)": lambda: [
            features[i : i + source.chunk_size] @ prototypes.t()
            for i in range(0, args.n, source.chunk_size)
        ],
    }
    checkout = Path(frolic_tta.__file__).resolve().parents[1]
    print(f"{args.n:,} x {args.k:,} x {args.d}, chunks of {source.chunk_size} rows")
    print(f"code: {checkout} ({common.git_commit() if checkout == common.ROOT else 'other'})")
    print(f"machine: {common.cpu_model()}, {torch.get_num_threads()} threads")
    rows = [[label, *(1e3 * s for s in timed(run, args.repeats))] for label, run in cases.items()]
    print(common.markdown_table(["pass", "best ms", "median ms"], rows))


if __name__ == "__main__":
    main()
