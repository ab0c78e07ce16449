"""Small truths of the printed table and metrics.json (issue 17, item 7)."""

from __future__ import annotations

import numpy as np

from frolic_tta.lightning.report import _float32, _ratio
from frolic_tta.lightning.summary_table import _evidence, format_table
from frolic_tta.lightning.summary_table import short_name as _short


def summary(**changes):
    base = {
        "dataset": "folder", "model": "ViT-B-16", "pretrained": "openai", "num_samples": 100,
        "num_classes": 3, "accuracy": {"f_d": 0.79}, "tau_c": 0.01, "tau_g": 0.02,
        "test_prior": {"estimated": True, "shift_weight": 0.0, "likelihood_ratio": -3.5,
                       "max_over_min": 1.0},
    }  # fmt: skip
    return base | changes


def test_models_that_bring_their_weights_are_titled_with_their_own_name():
    assert _short("hf-hub:org/some-clip") == "hf-hub:org/some-clip"
    assert _short("local-dir:/data/models/my-clip") == "local-dir:my-clip"
    assert _short("/path/to/model.pt") == "model.pt"
    title = format_table(summary(model="hf-hub:org/some-clip", pretrained=None)).splitlines()[0]
    assert title.startswith("Frolic on folder with hf-hub:org/some-clip: N=100")
    assert "(openai)" in format_table(summary()).splitlines()[0]


def test_a_balanced_set_prints_no_negative_likelihood_ratio():
    assert "likelihood ratio 0 (no better fit than balanced)" in format_table(summary())
    assert _evidence(15.44) == "15.44" and "-" not in _evidence(-1e-9)


def test_metrics_are_rounded_to_their_precision():
    assert _float32(float(np.float32(0.79))) == 0.79
    assert _ratio(float(np.float32(79 / 100)), 100) == 0.79
    assert _ratio(float(np.float32(1 / 3)), 3) == 1 / 3


def test_one_spelling_of_metric_keys_in_python_and_metrics_json(
    tiny_clip, image_folder, tmp_path, monkeypatch
):
    """``model.metrics_["<key>/<row>"]`` is ``metrics.json["<key>"]["<row>"]``."""
    import json
    import sys

    import pytest

    from frolic_tta.lightning.cli import FrolicCLI
    from frolic_tta.metrics import ROW_METRICS
    from frolic_tta.rows import ROWS
    from tests.test_cli import tiny_args

    monkeypatch.setattr(sys, "argv", ["train.py"])
    quiet = ["--trainer.enable_progress_bar", "false", "--report.print_table", "false"]
    out = tmp_path / "run"
    cli = FrolicCLI(args=tiny_args(tiny_clip, image_folder, out, *quiet, "--report.plots", "false"))
    stored = json.loads((out / "metrics.json").read_text())
    nested = {k: v for k, v in cli.model.metrics_.items() if "/" in k}
    assert {k.split("/")[0] for k in nested} == set(ROW_METRICS) | {"test_prior"}
    assert {k.split("/", 1)[1] for k in nested if k.startswith("accuracy/")} == set(ROWS)
    for key, value in nested.items():
        group, name = key.split("/", 1)
        assert stored[group][name] == pytest.approx(value, rel=1e-6), key
    assert stored["tau_g"] == pytest.approx(cli.model.metrics_["tau_g"], rel=1e-12)


def test_config_comments_say_split_files_are_picked_up():
    """Every shipped config of a dataset with a standard split says it is found on its own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    told = [p.name for p in root.rglob("*.yaml") if "pass --data.split_file" in p.read_text()]
    assert told == []
