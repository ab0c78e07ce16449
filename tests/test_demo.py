"""The offline demo, ``python -m frolic_tta.demo``, end to end on a fresh cache (fewer
pre-training steps than the default; the same code path), and its cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frolic_tta.demo import digits
from frolic_tta.errors import FrolicInputError
from tests.noise import assert_quiet

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FROLIC_TTA_CACHE": str(folder / "cache")}
    command = [sys.executable, "-m", "frolic_tta.demo", "--steps", str(STEPS),
               "--output_dir", str(folder / "out")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=folder, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, done


def test_demo_trains_caches_adapts_and_writes_the_usual_outputs(demo_run):
    folder, done = demo_run
    entry = folder / "cache" / "digits_clip" / f"v2_seed0_imbalance20_steps{STEPS}"
    assert (entry / "model.pt").is_file() and (entry / "demo.yaml").is_file()
    assert len(list((entry / "heldout").glob("*/*.png"))) == 300
    assert f"Pre-training the demo CLIP on digits: 100% ({STEPS}/{STEPS} steps)" in done.stderr
    for row in ("f_c ", "f_d "):
        assert any(line.strip().startswith(row) for line in done.stdout.splitlines()), row
    metrics = json.loads((folder / "out" / "metrics.json").read_text())
    assert metrics["num_samples"] == 300 and metrics["num_classes"] == 10
    assert set(metrics["accuracy"]) >= {"f_c", "f_d"}
    for name in ("predictions.csv", "logits.pt", "head.pt", "config.yaml", "priors.png"):
        assert (folder / "out" / name).is_file(), name
    assert f"python train.py predict --config {entry / 'demo.yaml'}" in done.stdout


def test_a_successful_demo_run_is_quiet(demo_run):
    assert_quiet(demo_run[1].stderr)


def test_the_second_demo_run_reads_the_cache(demo_run, monkeypatch):
    folder, _ = demo_run

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(digits, "_train", no_training)
    model = digits.pretrain(0, 20.0, STEPS, folder / "cache" / "digits_clip")
    assert model.checkpoint_path.is_file() and len(model.heldout_images) == 300


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FROLIC_TTA_CACHE", str(tmp_path / "mine"))
    assert digits.default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("FROLIC_TTA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert digits.default_cache_dir() == tmp_path / "xdg" / "frolic-tta"


def test_without_scikit_learn_the_demo_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails
    with pytest.raises(FrolicInputError, match=r'pip install "frolic-tta\[demo\]"'):
        digits.load_digits()
