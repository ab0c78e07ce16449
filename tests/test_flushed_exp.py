"""``flushed_exp``: the exponential of every pass over the logits, kept on the CPU's fast path."""

from __future__ import annotations

import math

import pytest
import torch

from frolic_tta import calibration, gda, mixture, mixture_newton, scores, sweeps
from frolic_tta.logits import FLUSH_BELOW, flushed_exp
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import fit_frolic
from frolic_tta.synthetic import clip_like_world


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_exp_down_to_the_bound_and_zero_below(dtype):
    low = FLUSH_BELOW[dtype]
    special = torch.tensor([-math.inf, math.inf, 0.0, low - 1.0, low, low + 0.5])
    values = torch.cat([torch.linspace(2.0 * low, 5.0, 20_001), special]).to(dtype)
    exact = torch.exp(values)
    flushed = flushed_exp(values.clone())
    kept = exact > math.exp(low + 0.01)
    assert torch.equal(flushed[kept], exact[kept])  # bit for bit above the bound
    assert bool((flushed[~kept] == 0.0).all())
    assert bool((exact[~kept] > 0.0).any())  # subnormals that torch.exp returns
    assert float(flushed[-5]) == math.inf and float(flushed[-4]) == 1.0
    assert float((exact - flushed).nan_to_num().abs().max()) <= math.exp(low + 0.01)


@pytest.mark.parametrize("values", [[math.nan, -200.0, 0.0], [-1.0, 0.0], []])
def test_nan_shallow_and_empty_inputs_are_torch_exp(values):
    values = torch.tensor(values)
    torch.testing.assert_close(flushed_exp(values.clone()), torch.exp(values), equal_nan=True)


def test_out_leaves_the_input_and_in_place_returns_it():
    values = torch.tensor([[-200.0, -1.0, 0.0]])
    out = torch.empty_like(values)
    assert flushed_exp(values, out=out) is out
    assert torch.equal(values, torch.tensor([[-200.0, -1.0, 0.0]]))
    assert flushed_exp(values) is values
    assert torch.equal(values, out)


def _plain_exp(values, out=None):
    return torch.exp(values, out=values if out is None else out)


def test_the_fit_is_unchanged_by_the_flush_where_it_flushes_millions(monkeypatch):
    """Fewer samples than classes (N = 200, K = 300): the mixture's EM passes over log-
    likelihoods more than 87 nats deep (2 million entries flushed, the case where the flush
    halves the fit's time), and the fit equals the one with the subnormals of torch.exp."""
    world = clip_like_world(200, 300, 32, noise=0.8, seed=0)
    modules = (calibration, gda, sweeps, mixture, mixture_newton, scores)
    flushed_entries = []

    def counting(values, out=None):
        low = FLUSH_BELOW.get(values.dtype, -math.inf)  # of the values' own dtype
        flushed_entries.append(int((values < low + 0.01).sum()))
        return flushed_exp(values, out)

    def fit():
        options = FrolicOptions()
        return fit_frolic(world.features, world.prototypes, options, tau_c=0.01, keep_logits=True)

    for module in modules:
        monkeypatch.setattr(module, "flushed_exp", counting)
    flushed = fit()
    assert sum(flushed_entries) > 1_000_000
    for module in modules:
        monkeypatch.setattr(module, "flushed_exp", _plain_exp)
    plain = fit()
    assert flushed.head.tau_g == plain.head.tau_g
    assert torch.equal(flushed.head.beta, plain.head.beta)
    assert torch.equal(flushed.logits, plain.logits)
