"""Small generated worlds shared by the test-prior tests (known labels and test priors)."""

from __future__ import annotations

from torch import Tensor

from frolic_tta.synthetic import clip_like_world, shifted_prior


def long_tailed_world(n: int = 3000, k: int = 30, seed: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """``(features, prototypes, labels)``: a CLIP-like world with a long-tailed (x10) test set."""
    world = clip_like_world(n, k, 64, seed=seed, test_prior=shifted_prior("long-tailed:10", k, 3))
    return world.features, world.prototypes, world.labels


def uneven_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, unequal row ranges covering ``range(n)`` (the last one longest)."""
    cuts = [0] + [n * (2 * r + 1) // (2 * parts + 1) for r in range(1, parts)] + [n]
    return list(zip(cuts[:-1], cuts[1:], strict=True))
