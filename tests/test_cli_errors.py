"""Every option mistake, under any option group, is one ``error:`` line with the option, what was
expected and a "did you mean" where there is one; exit status 2 (issue 38, item 3: under
``--data.*`` jsonargparse printed 11 to 18 lines, "Does not validate against any of the Union
subtypes ... NestedArg(key='labled', ...)")."""

from __future__ import annotations

import sys

import pytest

from frolic_tta.lightning.cli import main
from frolic_tta.lightning.cli_errors import one_line
from tests.test_cli import tiny_args

MISTAKES = [
    (["--model.onlnie", "true"],
     "unknown option --model.onlnie; did you mean --model.online?"),
    (["--model.options.bias", "papr"],
     "--model.options.bias: expected one of soft, paper, implicit, none, released, but got "
     "'papr'; did you mean 'paper'?"),
    (["--model.tau_c", "hot"], "--model.tau_c: expected one of model or a number, but got 'hot'"),
    (["--data.labled", "false"],
     "unknown option --data.labled of ImageFolderDataModule; did you mean --data.labeled?"),
    (["--data.class_names", "circle,square"],
     "--data.class_names: expected a list such as '[a, b]' or a mapping such as '{a: b}' or "
     "null, but got 'circle,square'; did you mean '[circle, square]'?"),
    (["--data.batch_size", "many"], "--data.batch_size: expected an integer, but got 'many'"),
    (["--data.feature_store_mode", "raed"],
     "--data.feature_store_mode: expected one of auto, read, write, but got 'raed'; did you "
     "mean 'read'?"),
    (["--data.split", "test"],
     "unknown option --data.split of ImageFolderDataModule; it is an option of --data "
     "FrolicDataModule"),
    (["--trainer.devcies", "2"],
     "unknown option --trainer.devcies; did you mean --trainer.devices?"),
    (["--trainer.precision", "17"],
     "--trainer.precision: expected one of 64, 32, 16, transformer-engine, "
     "transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, 32-true, 64-true, "
     "bf16 or null, but got '17'"),
    (["--trainer.devices", "two"], "--trainer: `devices` selected with `CPUAccelerator` should"),
    (["--trainer.callbacks", "FrolicPredictionWritr"],
     "--trainer.callbacks: expected a class name or import path, but got "
     "'FrolicPredictionWritr', which is not one; did you mean FrolicPredictionWriter?"),
    (["--report.print_tabel", "false"],
     "unknown option --report.print_tabel; did you mean --report.print_table?"),
    (["--report.print_table", "maybe"], "--report.print_table: expected true or false, but got "
                                        "'maybe'"),
    (["--output_dirr", "x"], "unknown option --output_dirr; did you mean --output_dir?"),
    (["--config", "no/such.yaml"], "--config: no file at '"),  # then the absolute path
]  # fmt: skip


@pytest.mark.parametrize("extra, expected", MISTAKES, ids=[m[0][0] for m in MISTAKES])
def test_each_option_mistake_is_one_error_line(tiny_clip, image_folder, tmp_path, capsys,
                                               monkeypatch, extra, expected):  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_args(tiny_clip, image_folder, tmp_path, *extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err  # the whole of stderr
    assert err[len("error: "):].startswith(expected), err
    assert not (tmp_path / "metrics.json").exists()


def test_a_message_without_a_known_shape_is_still_one_line():
    assert one_line("something\n  went wrong:\n    here") == "something went wrong: here"
    assert one_line("unrecognized arguments: --x 1", ["--model.online"]).startswith(
        "unknown option --x (python train.py predict --help"
    )
