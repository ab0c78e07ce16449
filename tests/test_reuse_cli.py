"""The command line's reuse contract: ``--save_checkpoint``, ``--ckpt_path`` (the command line
wins), unwritable outputs and a DDP rank's error as one line."""

from __future__ import annotations

import errno
import json
import pathlib
import shutil

import pytest
import torch
import yaml

from frolic_tta.errors import FrolicInputError
from frolic_tta.lightning.cli import main
from frolic_tta.lightning.writer import save_file
from tests.test_cli import bare_argv, one_error_line, run_train, tiny_args  # noqa: F401

QUIET = ["--trainer.enable_progress_bar", "false"]


def test_save_checkpoint_then_ckpt_path_scores_with_the_command_line_options(
    tiny_clip, image_folder, tmp_path, capsys
):
    # issue 16, found 3: --ckpt_path re-applied the checkpoint's hyperparameters over the
    # command line, and the CLI could not write a checkpoint at all
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "model.ckpt"
    main(tiny_args(tiny_clip, image_folder, first, *QUIET, "--save_checkpoint", str(ckpt)))
    assert "clip.logit_scale" in torch.load(ckpt, weights_only=True)["state_dict"]
    missing = str(tmp_path / "gone.pt")  # not read: the checkpoint brings its CLIP weights
    options = ["--model.options.test_prior", "uniform", "--model.pretrained", missing]
    main(tiny_args(tiny_clip, image_folder, second, *QUIET, "--ckpt_path", str(ckpt), *options))
    config = yaml.safe_load((second / "config.yaml").read_text())
    assert config["model"]["head_file"] == str(ckpt) and config["ckpt_path"] is None
    assert config["model"]["options"]["test_prior"] == "uniform"  # the command line's value
    assert not json.loads((second / "metrics.json").read_text())["adapted"]
    adapted = torch.load(first / "logits.pt", weights_only=True)["logits"]
    scored = torch.load(second / "logits.pt", weights_only=True)["logits"]
    torch.testing.assert_close(scored, adapted, rtol=1e-5, atol=1e-4)
    both = ["--ckpt_path", str(ckpt), "--model.head_file", str(first / "head.pt")]
    err = one_error_line(tiny_args(tiny_clip, image_folder, tmp_path / "x", *both), capsys)
    assert err.startswith("error: Expected one head to score with, but got --ckpt_path")


def test_unwritable_output_is_one_line_naming_the_path(
    tiny_clip, image_folder, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "readonly" / "run"
    original = pathlib.Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(out)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    err = one_error_line(tiny_args(tiny_clip, image_folder, out, *QUIET), capsys)
    assert err.startswith(f"error: could not write '{out}") and "Read-only file system" in err


def test_disk_full_while_saving_is_one_error_naming_the_file(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(FrolicInputError, match=r"could not write '.*x\.pt': basic_ios::clear"):
        save_file({"a": 1}, tmp_path / "x.pt")


def test_ddp_error_of_one_rank_is_one_line_and_exit_2(tiny_clip, image_folder, tmp_path):
    # issue 16, found 8: rank 1 alone exceeded its share of unreadable images; only rank 0
    # printed, so the user saw gloo's "Connection closed by peer" and exit status 1
    folder = tmp_path / "images"
    shutil.copytree(image_folder, folder)
    files = sorted(p for p in folder.rglob("*.png"))
    for path in files[1::2]:  # the odd indices: rank 1's share (no shuffling in predict)
        path.write_bytes(b"not a png")
    two = ["--trainer.devices", "2", "--trainer.strategy", "ddp", *QUIET]
    result = run_train(tiny_args(tiny_clip, folder, tmp_path / "out", *two))
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and "max_skipped_fraction" in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_rank_zero_prints_another_ranks_error_while_it_is_still_busy(tmp_path):
    # the race behind an exit -9 without an error line: rank 1 left its error and exited while
    # rank 0 was still at work, and Lightning's launcher killed rank 0 before it could print
    import subprocess
    import sys
    import time

    busy_rank_zero = (
        "import os, pathlib, time\n"
        "from frolic_tta.lightning.entry import ERROR_DIR, error_folder\n"
        "with error_folder():\n"
        "    folder = pathlib.Path(os.environ[ERROR_DIR])\n"
        "    (folder / 'rank1.txt').write_text('rank 1 could not read its images')\n"
        "    time.sleep(60)  # encoding its own share, far from any collective\n"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", busy_rank_zero], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["error: rank 1 could not read its images"]
    assert time.monotonic() - start < 30  # printed at once, not after the work
