"""priors.png shows the test prior also when it is balanced (on the 1/K line)."""

from __future__ import annotations

import pytest
import torch
from matplotlib.figure import Figure

from frolic_tta.lightning.plots import plot_priors
from frolic_tta.prior import Priors

NAMES = ["cat", "dog", "bird", "fish"]
BALANCED = torch.full((4,), 0.25, dtype=torch.float64)


def priors(test_prior: torch.Tensor, estimated: bool) -> Priors:
    beta = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    flags = torch.zeros(4, dtype=torch.bool)
    raw = test_prior if estimated else None
    return Priors(test_prior, raw, 0.0, 1.0 if estimated else None, beta, flags, beta, flags)


@pytest.mark.parametrize(
    ("test_prior", "estimated", "label"),
    [
        (BALANCED, True, "test prior (estimated): balanced, on 1/K"),
        (BALANCED, False, "test prior (assumed): balanced, on 1/K"),
        (torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), True, "test prior (estimated)"),
    ],
)  # fmt: skip
def test_the_test_prior_is_drawn_above_the_uniform_line(
    tmp_path, monkeypatch, test_prior, estimated, label
):
    drawn: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))
    )
    path = plot_priors(priors(test_prior, estimated), NAMES, tmp_path)
    assert path.is_file() and len(drawn) == 1
    ax = drawn[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    test, uniform = lines[label], lines["uniform 1/K"]
    assert sorted(test.get_ydata()) == sorted(test_prior.tolist())
    assert (
        test.get_zorder() > uniform.get_zorder() and test.get_linewidth() > uniform.get_linewidth()
    )
    assert label in [text.get_text() for text in ax.get_legend().get_texts()]
