"""The policy for bad samples in a long run: an unreadable file or non-finite features skip that
sample only, every other sample gets its prediction, the report names the skipped ones, and
too many of them stop the run with one error."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import frolic_tta
import frolic_tta.lightning.checkpoint as checkpoint_file
from frolic_tta.clip.loading import load_open_clip
from frolic_tta.data import IndexedDataset
from frolic_tta.lightning.cli import main
from frolic_tta.lightning.samples import NON_FINITE
from frolic_tta.lightning.writer import concat_outputs, join_predictions
from tests.generated import GeneratedImages
from tests.test_cli import tiny_args
from tests.test_module import (
    RAW_LABELS,
    assert_logits_close,
    make_module,
    make_trainer,
    reference,
    run_ddp_script,
)


@pytest.fixture(autouse=True)
def bare_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])


def nan_loader(n: int, nan_index: int, batch: int = 8) -> DataLoader:
    return DataLoader(IndexedDataset(GeneratedImages(n, nan_index=nan_index)), batch_size=batch)


def test_non_finite_features_skip_one_sample_and_the_rest_equals_frolic(tiny_clip):
    module = make_module(tiny_clip, options=RAW_LABELS)  # re-encoded features: see RAW_LABELS
    with pytest.warns(UserWarning, match="Skipping sample 7: non-finite image features"):
        out = concat_outputs(make_trainer().predict(module, nan_loader(40, nan_index=7)))
    keep = torch.arange(40) != 7
    assert out["valid"].tolist() == keep.tolist()
    assert int(out["prediction"][7]) == -1 and bool(torch.isnan(out["logits"][7]).all())
    assert bool(torch.isfinite(out["logits"][keep]).all())
    features, prototypes = reference(tiny_clip, 40)
    expected = frolic_tta.frolic(features[keep], prototypes, RAW_LABELS)
    assert_logits_close(out["logits"][keep], expected.logits)  # float32 noise of a NaN batch
    assert torch.equal(out["prediction"][keep], expected.logits.argmax(1))
    assert module.skipped_ == [{"index": 7, "reason": NON_FINITE}]
    assert module.samples_ == {
        "dataset_length": 40,
        "used": 39,
        "skipped": 1,
        "labelled": 39,
        "partial": 0,
        "seen": 40,
    }
    correct = int((out["prediction"][keep] == out["target"][keep]).sum())
    assert module.metrics_["accuracy/f_d"] == correct / 39  # exact ratio over the labelled, used


def test_two_processes_count_skipped_samples_like_one(tiny_clip, tmp_path):
    n, bad = 41, 5
    single_module = make_module(tiny_clip, options=RAW_LABELS)  # see RAW_LABELS
    with pytest.warns(UserWarning, match="Skipping sample 5"):
        single = concat_outputs(make_trainer().predict(single_module, nan_loader(n, bad)))
    result = run_ddp_script(tiny_clip, n, tmp_path, f"nan={bad}", "labels=zero_shot")
    assert result.returncode == 0, result.stderr[-3000:]
    joined = join_predictions(tmp_path, dataset_length=n)
    assert joined["skipped"] == [{"index": bad, "reason": NON_FINITE}]
    assert joined["valid"].tolist() == single["valid"].tolist()
    assert torch.equal(joined["prediction"], single["prediction"])
    keep = single["valid"]
    assert_logits_close(joined["logits"][keep], single["logits"][keep])
    summary = torch.load(tmp_path / "summary.pt", weights_only=False)
    assert summary["samples"] == single_module.samples_  # all-reduced counts agree


def write_folder(root, n: int = 100):
    """``n`` images in 3 class folders; ``a/bad.png`` is corrupt, ``b/white.png`` all white."""
    rng = np.random.default_rng(0)
    for i in range(n - 2):
        folder = root / "abc"[i % 3]
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.normal(100, 40, (24, 24, 3))
        pixels[..., i % 3] += 80
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:03d}.png")
    (root / "a" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n but then no image at all")
    Image.new("RGB", (24, 24), (255, 255, 255)).save(root / "b" / "white.png")


def nan_for_white_images(model_name, pretrained):
    """load_open_clip, with an encoder that gives NaN features for an all-white image."""
    model, preprocess, tokenizer = load_open_clip(model_name, pretrained)
    encode = model.encode_image

    def encode_image(images, **kwargs):
        features = encode(images, **kwargs)
        white = images.flatten(1).amin(1) > 1.5  # white is about 2 after CLIP's normalisation
        features[white] = float("nan")
        return features

    model.encode_image = encode_image
    return model, preprocess, tokenizer


def test_corrupt_file_and_nan_sample_end_to_end(tiny_clip, tmp_path, monkeypatch, capsys):
    folder, out = tmp_path / "images", tmp_path / "out"
    write_folder(folder)
    monkeypatch.setattr(checkpoint_file, "load_open_clip", nan_for_white_images)
    args = tiny_args(tiny_clip, folder, out, "--trainer.enable_progress_bar", "false")
    with pytest.warns(UserWarning, match="Skipping sample"):
        main(args)
    metrics = json.loads((out / "metrics.json").read_text())
    with (out / "predictions.csv").open() as f:
        rows = list(csv.DictReader(f))
    logits = torch.load(out / "logits.pt", weights_only=True)
    paths = [row["path"] for row in rows]
    bad, white = (
        paths.index(str(folder / "a" / "bad.png")),
        paths.index(str(folder / "b" / "white.png")),
    )
    assert len(rows) == metrics["num_samples"] == 100
    skipped = {entry["index"]: entry for entry in metrics["skipped"]}
    assert sorted(skipped) == sorted([bad, white])
    assert skipped[bad]["path"].endswith("bad.png") and skipped[white]["path"].endswith("white.png")
    assert skipped[bad]["reason"].startswith("unreadable image: UnidentifiedImageError")
    assert skipped[white]["reason"] == NON_FINITE
    for i, row in enumerate(rows):  # every other sample has its prediction
        ok = i not in skipped
        assert bool(row["prediction"]) == ok and bool(row["skipped"]) == (not ok)
        assert bool(torch.isfinite(logits["logits"][i]).all()) == ok
    assert logits["valid"].tolist() == [i not in skipped for i in range(100)]
    assert metrics["num_evaluated"] == 98 and any(
        "2 sample(s) skipped" in n for n in metrics["notes"]
    )
    keep = logits["valid"]
    correct = int((logits["prediction"][keep] == logits["target"][keep]).sum())
    assert metrics["accuracy"]["f_d"] == correct / 98
    assert "note: 2 sample(s) skipped" in capsys.readouterr().out
    # the same data with a stricter limit: one error line, exit 2
    strict = [*args, "--model.max_skipped_fraction", "0.01"]
    with pytest.raises(SystemExit) as exit_info, pytest.warns(UserWarning, match="Skipping"):
        main(strict)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: Expected at most max_skipped_fraction=0.01") and err.count("\n") == 1
    )
