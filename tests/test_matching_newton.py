"""Newton directions of the class-mass matching (frolic_tta.matching_newton): the certified
Cholesky solve gives the eigendecomposition's pseudo-inverse direction, and a world with fewer
samples than classes takes its Newton steps without one."""

from __future__ import annotations

import pytest
import torch

import frolic_tta.matching_newton as newton
from frolic_tta.logits import TensorLogits
from frolic_tta.matching import match_class_masses
from frolic_tta.synthetic import clip_like_world


def posteriors(n: int, k: int, scale: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(n, k, generator=g, dtype=torch.float64), 1)


def reference(q: torch.Tensor, gradient: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """The pseudo-inverse direction, independently: an SVD of the free block, singular values
    below 1e-6 of the largest dropped, the rest of the gradient a step of 10 to the bound."""
    n = q.shape[0]
    hessian = (torch.diag(q.sum(0)) - q.T @ q) / n
    index = free.nonzero().squeeze(1)
    u, s, _ = torch.linalg.svd(hessian[index][:, index])
    keep = s > 1e-6 * s.max()
    local = gradient[index] - (gradient[index].mean() if bool(free.all()) else 0.0)
    direction = torch.zeros_like(gradient)
    direction[index] = u[:, keep] @ ((u[:, keep].T @ local) / s[keep])
    flat = u[:, ~keep] @ (u[:, ~keep].T @ local)
    if float(flat.abs().sum()) > 1e-6:
        direction[index] += flat * (10.0 / float(flat.abs().max()))
    return direction


def no_eigh(*args, **kwargs):
    raise AssertionError("an eigendecomposition where the Cholesky certificate holds")


@pytest.mark.parametrize("every", [True, False])
def test_a_well_conditioned_block_is_solved_without_an_eigendecomposition(monkeypatch, every):
    q = posteriors(400, 30, 2.0)
    gradient = torch.randn(30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    free = torch.ones(30, dtype=torch.bool)
    if not every:
        free[[3, 17]] = False
    expected = reference(q, gradient, free)
    monkeypatch.setattr(newton.torch.linalg, "eigh", no_eigh)
    direction = newton.newton_direction(q.T @ q, 400.0, gradient, free)
    torch.testing.assert_close(direction, expected, rtol=1e-9, atol=1e-12)
    assert bool((direction[~free] == 0).all())


def test_groups_that_share_no_sample_fail_the_certificate_and_take_the_flat_step():
    # classes 0-9 and 10-19 share no sample: H is singular along both groups' constants
    q = torch.zeros(300, 20, dtype=torch.float64)
    q[:150, :10], q[150:, 10:] = posteriors(150, 10, 1.0, 2), posteriors(150, 10, 1.0, 3)
    gradient = torch.randn(20, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    free = torch.ones(20, dtype=torch.bool)
    direction = newton.newton_direction(q.T @ q, 300.0, gradient, free)
    expected = reference(q, gradient, free)
    torch.testing.assert_close(direction, expected, rtol=1e-8, atol=1e-10)
    # the step towards the bound: one group's constant moves by 10 against the other's
    spread = float(direction[:10].mean() - direction[10:].mean())
    assert abs(abs(spread) - 20.0) < 1e-6  # 10 up for one group, 10 down for the other


def test_an_ill_conditioned_block_falls_back_to_the_eigendecomposition(monkeypatch):
    # one class nearly alone: its coupling to the rest is 1e-9 of the others'
    q = posteriors(200, 8, 1.0)
    q[:, 7] *= 1e-9
    q = q / q.sum(1, keepdim=True)
    gradient = torch.randn(8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    free = torch.ones(8, dtype=torch.bool)
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(newton.torch.linalg, "eigh", lambda a: calls.append(1) or eigh(a))
    direction = newton.newton_direction(q.T @ q, 200.0, gradient, free)
    assert calls == [1]
    torch.testing.assert_close(direction, reference(q, gradient, free), rtol=1e-6, atol=1e-9)


def test_fewer_samples_than_classes_take_most_newton_steps_without_an_eigendecomposition(
    monkeypatch,
):
    # the case that cost 28 eigendecompositions of 2,000 x 2,000 (32 of 39 s) at N = 1,000:
    # the same shape of world, scaled down (N = 150 < K = 300)
    world = clip_like_world(150, 300, 64, seed=0)
    logits = (world.features @ world.prototypes.T / 0.01).float()
    steps, eighs = [], []
    solve, eigh = newton.newton_direction, torch.linalg.eigh
    monkeypatch.setattr(newton.torch.linalg, "eigh", lambda a: eighs.append(1) or eigh(a))
    monkeypatch.setattr(
        "frolic_tta.matching.newton_direction", lambda *a: steps.append(1) or solve(*a)
    )
    match = match_class_masses(TensorLogits(logits, None), eps=1e-6, max_iter=100)
    assert match.converged and len(steps) >= 10  # measured: 12 Newton steps, 1 eigh
    assert len(eighs) <= len(steps) // 4
    debiased = torch.softmax(logits.double() + match.log_offset, 1).mean(0)
    assert float((debiased - 1 / 300).abs().sum()) < 1e-5
