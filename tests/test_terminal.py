"""What the terminal says, issue 38's smaller items (7): finalize's progress lines in order,
ending with the last phase; warnings without a source path; priors.png explains only the marks
it draws."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from matplotlib.figure import Figure

from frolic_tta import fit_frolic, paper_options, released_options
from frolic_tta.lightning.entry import short_warnings
from frolic_tta.lightning.plots import plot_priors
from frolic_tta.lightning.progress import FinalizeProgress
from frolic_tta.options import FrolicOptions
from frolic_tta.synthetic import clip_like_world
from tests.test_plots import NAMES, priors

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "options",
    [
        FrolicOptions(),
        FrolicOptions(test_prior="uniform"),
        FrolicOptions(head_labels="zero_shot"),
        FrolicOptions(bias="paper"),
        FrolicOptions(test_prior="uniform", bias="implicit"),
        paper_options(),
        released_options(solver={"inmap_tolerance": 1e-3}),
    ],
    ids=["default", "uniform", "zero_shot_labels", "paper_bias", "uniform_implicit", "paper",
         "released"],  # fmt: skip
)
def test_finalize_phases_are_numbered_in_order_and_end_with_the_last(options, caplog):
    """The default printed [2/4] test prior, [1/4] temperature, [3/4] label bias, never [4/4]."""
    world = clip_like_world(300, 5, 16, seed=0)
    trainer = SimpleNamespace(is_global_zero=True, progress_bar_callback=None)
    progress = FinalizeProgress(trainer, lambda t: t, 300, 5, options=options)
    with caplog.at_level(logging.INFO, logger="frolic_tta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fit_frolic(world.features, world.prototypes, options, tau_c=0.01,
                   reduce_fn=progress.reduce, progress=progress)  # fmt: skip
    steps = [re.search(r"\[(\d+)/(\d+)\]", m) for m in caplog.messages]
    steps = [(int(s.group(1)), int(s.group(2))) for s in steps if s]
    assert steps, caplog.messages
    total = steps[-1][1]
    assert [i for i, _ in steps] == list(range(1, total + 1)), caplog.messages
    assert steps[-1] == (total, total)


def test_a_warning_of_the_package_on_the_command_line_is_its_message(monkeypatch):
    """The skipped-image warning started with a source path ('.../samples.py:124: Skipping')."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after
    short_warnings()
    ours = str(ROOT / "frolic_tta" / "lightning" / "samples.py")
    assert warnings.formatwarning("Skipping sample 20", UserWarning, ours, 124) == (
        "warning: Skipping sample 20\n"
    )
    other = warnings.formatwarning("from elsewhere", UserWarning, "/x/other.py", 3)
    assert other.startswith("/x/other.py:3: UserWarning: from elsewhere")  # not ours: as before


def test_the_cli_prints_warnings_as_messages():
    code = (
        "import frolic_tta.lightning.cli as cli\n"
        "from frolic_tta.data.class_names import labelled_class_names\n"
        "cli.FrolicCLI = lambda args: labelled_class_names(['b', 'a'], ['a', 'b'], 'the data')\n"
        "cli.main(['predict'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        "warning: --data.class_names names the classes of the data in another order; each name "
        "is matched to its class by name and the classes keep the data's order: a, b"
    )


def test_priors_png_explains_an_x_only_where_one_is_drawn(tmp_path, monkeypatch):
    drawn: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig),
                                                                  save(fig, *a, **k)))  # fmt: skip
    balanced = torch.full((4,), 0.25, dtype=torch.float64)
    plot_priors(priors(balanced, True), NAMES, tmp_path)
    flagged = priors(balanced, True)
    flagged.beta_undetermined[1] = True
    plot_priors(flagged, NAMES, tmp_path)
    (plain, marked) = (fig.axes[0] for fig in drawn)
    assert "x:" not in plain.get_title() and "x:" in marked.get_title()
    legend = [t.get_text() for t in marked.get_legend().get_texts()]
    assert "x: not determined by the data" in legend
    assert not any("x:" in t.get_text() for t in plain.get_legend().get_texts())
