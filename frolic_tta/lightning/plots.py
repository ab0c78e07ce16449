"""PNG plots of a Frolic run: class probability before/after debiasing, and the priors.

Figures are drawn with :class:`matplotlib.figure.Figure` directly (Agg canvas, no display and no
pyplot global state), so importing this module does not change the user's matplotlib backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from torch import Tensor

from frolic_tta.prior import Priors

__all__ = ["plot_class_probability", "plot_priors"]

MAX_NAMED_CLASSES = 40
"""Up to this many classes the x axis names them; above, classes are ranks."""


def _check(values: Tensor, names: list[str], what: str) -> Tensor:
    values = torch.as_tensor(values).detach().double().cpu().flatten()
    if values.numel() != len(names):
        raise ValueError(
            f"Expected {what} with one value per class ({len(names)}), but got {values.numel()}"
        )
    return values


def _title(prefix: str, what: str) -> str:
    return f"{prefix}\n{what}" if prefix else what


def _figure(k: int) -> tuple[Figure, Axes]:
    width = 8.0 if k > MAX_NAMED_CLASSES else max(6.0, 0.3 * k)
    fig = Figure(figsize=(width, 4.8), layout="constrained")
    return fig, fig.subplots()


def _series(
    ax: Axes, values: Tensor, offset: float = 0.0, width: float = 0.8, **style: Any
) -> None:
    """Bars (named classes) or a line (ranked classes) of ``values`` in their given order."""
    x = [i + offset for i in range(values.numel())]
    if values.numel() <= MAX_NAMED_CLASSES:
        ax.bar(x, values, width=width, **style)
    else:
        ax.plot(range(values.numel()), values, **style)


def _finish(ax: Axes, order: Tensor, names: list[str], path: Path, fig: Figure) -> Path:
    """Uniform level, class axis, legend, and the PNG at ``path``."""
    k = order.numel()
    ax.axhline(1.0 / k, color="black", linestyle="--", linewidth=1, label="uniform 1/K", zorder=1)
    _class_axis(ax, order, names)
    ax.legend()
    fig.savefig(path, dpi=120)
    return path


def _class_axis(ax: Axes, order: Tensor, names: list[str]) -> None:
    k = order.numel()
    if k <= MAX_NAMED_CLASSES:
        ax.set_xticks(range(k))
        ax.set_xticklabels([names[i] for i in order.tolist()], rotation=60, ha="right", fontsize=8)
    else:
        ax.set_xlabel("class rank")


def plot_class_probability(
    before: Tensor, after: Tensor, names: list[str], output_dir: str | Path, title: str = ""
) -> Path:
    """Mean predicted probability per class, before (f_f) and after (f_d) debiasing.

    The paper's Fig. 1c/d: classes sorted by the probability before debiasing, with the
    uniform level 1/K; debiasing should flatten the curve.

    Args:
        before: ``(K,)`` mean softmax probability of the fused classifier.
        after: ``(K,)`` mean softmax probability of the debiased classifier.
        names: The K class names.
        output_dir: Folder of ``class_probability.png``.
        title: Prefix of the plot title.

    Returns:
        The path of the PNG.
    """
    before = _check(before, names, "`before`")
    after = _check(after, names, "`after`")
    order = torch.argsort(before, descending=True)
    fig, ax = _figure(len(names))
    _series(ax, before[order], -0.2, 0.4, label="before debiasing (f_f)")
    _series(ax, after[order], 0.2, 0.4, label="after debiasing (f_d)")
    ax.set_ylabel("mean predicted probability")
    ax.set_title(_title(title, "mean predicted probability per class, before/after debiasing"))
    return _finish(ax, order, names, Path(output_dir) / "class_probability.png", fig)


TEST_PRIOR_STYLE = {"color": "tab:green", "linestyle": ":", "linewidth": 2.5, "zorder": 2.5}
"""Above the 1/K line (``zorder`` 1), so a balanced test prior, on that line, stays visible."""


def _test_prior_label(priors: Priors, test: Tensor) -> str:
    how = "estimated" if priors.raw_test_prior is not None else "assumed"
    if torch.allclose(test, torch.full_like(test, 1.0 / test.numel()), rtol=1e-5, atol=0.0):
        return f"test prior ({how}): balanced, on 1/K"
    return f"test prior ({how})"


def plot_priors(priors: Priors, names: list[str], output_dir: str | Path, title: str = "") -> Path:
    r"""The estimated priors per class, sorted by the zero-shot model's pre-training prior, log
    scale: :math:`\hat\beta` of the zero-shot model (Proposition 2 on :math:`f_c/\tau_c`),
    the fused classifier's label bias, and the test prior :math:`\tilde\pi`; undetermined
    classes are marked with an x (and the title and legend say so only where there is one).

    Args:
        priors: :class:`~frolic_tta.prior.Priors` of the fit.
        names: The K class names.
        output_dir: Folder of ``priors.png``.
        title: Prefix of the plot title.

    Returns:
        The path of the PNG.
    """
    zero_shot = _check(priors.zero_shot_beta, names, "`zero_shot_beta`")
    order = torch.argsort(zero_shot, descending=True)
    fig, ax = _figure(len(names))
    series = (
        (zero_shot, priors.zero_shot_beta_undetermined, "pre-training prior (zero-shot)"),
        (priors.beta, priors.beta_undetermined, "label bias of f_f"),
    )
    marked = False  # an "x" is explained only where one is drawn
    for values, undetermined, label in series:
        values = _check(values, names, f"`{label}`")[order]
        ax.plot(range(len(names)), values, marker="o" if len(names) <= 40 else None, label=label)
        flagged = undetermined.cpu()[order].nonzero().flatten().tolist()
        if flagged:
            x_label = None if marked else "x: not determined by the data"
            ax.scatter(flagged, values[flagged], marker="x", color="black", zorder=3,
                       label=x_label)  # fmt: skip
            marked = True
    test = _check(priors.test_prior, names, "`test_prior`")[order]
    ax.plot(range(len(names)), test, label=_test_prior_label(priors, test), **TEST_PRIOR_STYLE)
    ax.set_yscale("log")
    ax.set_ylabel("probability")
    caption = " (x: not determined by the data)" if marked else ""
    ax.set_title(_title(title, "estimated priors per class" + caption))
    return _finish(ax, order, names, Path(output_dir) / "priors.png", fig)
