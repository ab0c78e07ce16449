"""``python train.py predict --help``: short, plain, with the data options inline."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from frolic_tta.lightning.cli import main
from frolic_tta.lightning.cli_help import PREDICT_DESCRIPTION, STORED_HELP, plain_text
from frolic_tta.lightning.help_file import write_help

ROOT = Path(__file__).resolve().parents[1]

MAX_LINES = 200
"""The help page at 100 columns (173 lines when written; Lightning's own was 573)."""

TRAINING_ONLY = (
    "max_epochs", "min_epochs", "max_steps", "max_time", "limit_train_batches",
    "limit_val_batches", "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps",
    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
    "enable_checkpointing", "overfit_batches", "reload_dataloaders_every_n_epochs",
    "sync_batchnorm", "detect_anomaly", "fast_dev_run", "log_every_n_steps", "model_registry",
)  # fmt: skip

SPHINX = re.compile(r":\w+:`|``|`_\b|^\s*\.\. \w+::|\\(tau|beta|hat|text|math)", re.M)


def predict_help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as stop:
        main(["predict", "--help"])
    assert stop.value.code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_predict_help_is_short_plain_and_lists_the_data_options(capsys, monkeypatch):
    text = predict_help(capsys, monkeypatch)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines"
    assert lines[0].startswith("usage: python train.py predict")
    # the data options inline: the default datamodule's and ImageFolderDataModule's own
    for option in ("--data.dataset", "--data.root", "--data.split_file", "--data.batch_size",
                   "--data.limit", "--data.class_names", "--data.labeled"):  # fmt: skip
        assert re.search(rf"^  {re.escape(option)}\b", text, re.M), option
    assert "Data: ImageFolderDataModule" in text
    assert SPHINX.search(text) is None, SPHINX.search(text)
    for name in TRAINING_ONLY:
        assert f"--trainer.{name}" not in text, name
    for option in ("--trainer.devices", "--trainer.strategy", "--trainer.precision",
                   "--trainer.limit_predict_batches", "--model.model_name", "--output_dir",
                   "--model.options.bias", "--report.plots", "--ckpt_path",
                   "--model.options.solver.prior_tol 1e-07"):  # fmt: skip
        assert option in text, option
    assert "known subclasses" not in text and "Linked arguments" not in text


def test_hidden_options_are_still_accepted(tmp_path, capsys, monkeypatch):
    """Hidden from the help, not from the parser: a saved config.yaml carries every Trainer key."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["predict", "--trainer.max_epochs", "3", "--trainer.gradient_clip_val", "1.0",
              "--data.dataset", "eurosat", "--print_config"])  # fmt: skip
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "max_epochs: 3" in out and "gradient_clip_val: 1.0" in out


@pytest.mark.parametrize(
    ("markup", "plain"),
    [
        (":class:`~frolic_tta.options.FrolicOptions` fields", "FrolicOptions fields"),
        ("see :mod:`frolic_tta.prior`", "see frolic_tta.prior"),
        ("temperature :math:`\\tau_c`", "temperature τ_c"),
        (":math:`1/\\exp(\\text{logit\\_scale})`", "1/exp(logit_scale)"),
        (":math:`\\max_j\\hat\\beta_j \\ge 1`", "max_jβ̂_j ≥ 1"),
        ('``"soft"`` (default)', '"soft" (default)'),
        ("the `Notes <https://x.org/a>`_.", "the Notes (https://x.org/a)."),
        ("a\n.. math::\nb", "a\n\nb"),
    ],
)
def test_plain_text(markup, plain):
    assert plain_text(markup) == plain


# ---------------------------------------------------------------- issue 38, item 4


def test_every_example_of_the_help_runs(capsys, monkeypatch):
    """The help showed `--config configs/eurosat_vit_b16.yaml`, a file that does not exist."""
    monkeypatch.chdir(ROOT)
    examples = [line.strip() for line in PREDICT_DESCRIPTION.splitlines() if line.startswith("  ")]
    assert len(examples) >= 2
    for example in examples:
        words = shlex.split(example)
        assert words[:3] == ["python", "train.py", "predict"], example
        with pytest.raises(SystemExit) as stop:
            main([*words[2:], "--print_config"])
        assert stop.value.code == 0, (example, capsys.readouterr().err)
        assert "model:" in capsys.readouterr().out


def test_the_help_holds_no_latex(capsys, monkeypatch):
    """'mathrmsoftmax(...)' and 'frac12(...)' were left of the docstrings' maths."""
    text = predict_help(capsys, monkeypatch)
    for leftover in ("mathrm", "frac1", "fracN", "\\", "^{", "_{"):
        assert leftover not in text, leftover
    assert "softmax(f_c/τ_c - ln β̂_c)" in " ".join(text.split())
    assert "f_f = 1/2(f_g/τ_g + f_c/τ_c)" in " ".join(text.split())


def test_the_stored_help_is_the_parsers_and_train_py_prints_it_without_torch(tmp_path):
    """train.py prints STORED_HELP for a bare `predict --help` (the parser imports torch,
    Lightning and open_clip first: about 8 s on 2 CPU cores)."""
    assert write_help(tmp_path / "help.txt") == STORED_HELP.read_text(encoding="utf-8"), (
        "the stored help is stale: python -m frolic_tta.lightning.help_file"
    )
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "train.py"), "predict", "--help"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == STORED_HELP.read_text(encoding="utf-8")
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()}
    assert not imported & {"torch", "lightning", "open_clip", "frolic_tta"}
