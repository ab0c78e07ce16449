"""How the test prior's refits move f_d and the prior, refit by refit (``solver.prior_rounds``).

Run: ``python benchmarks/rounds_path.py`` (about 5 minutes on 2 CPU cores; prints, writes
nothing). On ``label_shift.py``'s imbalanced worlds (the ImageNet-size one at seed 0, the small
ones at seeds 0-2), for r = 3 (the default), 4, 5, 6, 8, 12 and 20 refits: f_d's accuracy, the
L1 distance of the test prior to the test set's label frequencies, and the fit's wall time.
``label_shift.py``'s "30 refits" candidate reports the end point over every world; this shows
the path to it.
"""

from __future__ import annotations

import time

import label_shift
import torch

import frolic_tta
from frolic_tta import accuracy
from frolic_tta.options import FrolicOptions, SolverOptions

WORLDS = (
    ("imagenet long-tailed 10", (0,)),
    ("clip N=2000 long-tailed 10", (0, 1, 2)),
    ("prop2 long-tailed 10", (0, 1, 2)),
    ("clip long-tailed 100", (0,)),
    ("clip 30% of classes", (0,)),
)
ROUNDS = (3, 4, 5, 6, 8, 12, 20)


def main() -> None:
    specs = label_shift.world_specs(quick=False)
    print("world, seed: per number of refits r, accuracy / L1(test prior, truth) / seconds")
    for name, seeds in WORLDS:
        for seed in seeds:
            world, x, z, tau_c = label_shift.build(specs[name], seed)
            y = world.labels
            truth = torch.bincount(y, minlength=z.shape[0]).double() / len(y)
            cells = []
            for rounds in ROUNDS:
                options = FrolicOptions(solver=SolverOptions(prior_rounds=rounds))
                started = time.perf_counter()
                result = frolic_tta.frolic(x, z, options, tau_c=tau_c, normalize=False)
                seconds = time.perf_counter() - started
                correct = accuracy(result.logits, y)
                error = float((result.priors.test_prior - truth).abs().sum())
                cells.append(f"r{rounds} {correct:.4f}/{error:.3f}/{seconds:.1f}s")
            print(f"{name}, {seed}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
