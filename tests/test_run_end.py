"""The end of a run says what was written and where, and online mode prints its online result
beside the table (issue 38, item 5: `train.py predict` printed only the table; the online
accuracy, below zero-shot on a class-ordered folder, was only in metrics.json)."""

from __future__ import annotations

import json
import sys

from frolic_tta.lightning.cli import main
from frolic_tta.lightning.summary_table import format_outputs, format_table
from tests.test_cli import tiny_args
from tests.test_report_text import summary

QUIET = ["--trainer.enable_progress_bar", "false"]


def test_a_run_prints_where_its_outputs_are(tiny_clip, image_folder, tmp_path, capsys,
                                            monkeypatch):  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["train.py"])
    out = tmp_path / "run"
    main(tiny_args(tiny_clip, image_folder, out, *QUIET, "--save_checkpoint",
                   str(tmp_path / "adapted.ckpt")))  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == (
        f"Outputs in {out}/: metrics.json, predictions.csv, logits.pt, head.pt, "
        "class_probability.png, priors.png, config.yaml"
    )
    checkpoint = tmp_path / "adapted.ckpt"
    assert lines[-1] == f"Checkpoint: {checkpoint} (--model.head_file scores with it)"
    assert all((out / name).is_file() for name in lines[-2].split(": ", 1)[1].split(", "))


def test_online_mode_prints_its_online_accuracy_and_files(tiny_clip, image_folder, tmp_path,
                                                          capsys, monkeypatch):  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["train.py"])
    main(tiny_args(tiny_clip, image_folder, tmp_path, *QUIET, "--model.online", "true"))
    text = capsys.readouterr().out
    online = json.loads((tmp_path / "metrics.json").read_text())["online"]
    accuracy = online["accuracy"]
    line = next(line for line in text.splitlines() if line.startswith("  online:"))
    assert line.startswith(
        f"  online: {100 * accuracy['online']:.2f}% as answered (zero-shot "
        f"{100 * accuracy['zero_shot']:.2f}%, end of stream {100 * accuracy['end_of_stream']:.2f}%)"
        f", {len(online['refits'])} refits"
    )
    assert text.strip().splitlines()[-1].endswith("online.csv, online_accuracy.png, config.yaml")


def test_online_below_zero_shot_is_said():
    online = {"steps": 10, "seen": 200, "refits": [{"seen": 40}, {"seen": 80}], "labelled": 200,
              "accuracy": {"online": 0.40, "zero_shot": 0.50, "end_of_stream": 0.70}}  # fmt: skip
    table = format_table(summary(online=online))
    assert "  online: 40.00% as answered (zero-shot 50.00%, end of stream 70.00%), 2 refits " \
           "(at n = 40, 80): below zero-shot" in table  # fmt: skip
    unlabelled = {"steps": 3, "seen": 30, "refits": [], "labelled": 0}
    assert "  online: 30 answers in 3 steps, 0 refits (no labels: no accuracy)" in format_table(
        summary(online=unlabelled)
    )
    assert format_outputs("out", ["metrics.json"]) == "Outputs in out/: metrics.json"


def test_the_top_k_column_says_k_where_there_are_fewer_than_5_classes():
    """Issue 38, item 7: the header said top-5 for K = 3 (the metric is top-K there)."""
    scores = {"top5": {"f_d": 1.0}, "recall": {"f_d": 0.79}, "ece": {"f_d": 0.1},
              "nll": {"f_d": 0.5}}  # fmt: skip
    assert format_table(summary(**scores)).splitlines()[1].split()[:3] == ["row", "top-1", "top-3"]
    wide = format_table(summary(num_classes=10, **scores)).splitlines()[1]
    assert wide.split()[:3] == ["row", "top-1", "top-5"]
