"""FrolicModule in trainer.predict, against the functional core, 1 vs 2 processes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import open_clip
import pytest
import torch
from torch.utils.data import DataLoader

import frolic_tta
import frolic_tta.lightning.checkpoint as ckpt_file
from frolic_tta import FrolicModule, FrolicPredictionWriter, join_predictions
from frolic_tta.clip.loading import WeightsNotFoundError
from frolic_tta.clip.prompts import build_class_prompts, encode_prototypes
from frolic_tta.data import IndexedDataset
from frolic_tta.lightning.writer import concat_outputs
from frolic_tta.metrics import ROW_METRICS
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import fit_frolic
from frolic_tta.rows import ROWS
from tests.generated import CLASS_NAMES, GeneratedImages

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ["a photo of a {}."]


RAW_LABELS = FrolicOptions(head_labels="zero_shot", solver={"eps": 1e-6})
"""The raw-label head, for tests that compare runs whose features differ in float32 rounding
(1 vs 2 processes batch the images differently). The random tiny CLIP puts almost every sample
on one class with confidence ~1: there the default (debiased) head's tau_g, matched to a
confidence near 1, turns that rounding into up to 1e-1 of the logit scale. With identical
features the default is exact across processes (tests/test_sharded_core.py,
tests/test_test_prior.py); the raw-label head is a function of float64 sums and keeps 1e-4.
Its label biases are solved to 1e-6, as the default's are: at ``eps=0.01`` they stop wherever
their path crosses the tolerance, and a rounding-level change of the path (the Newton solve's
Cholesky in place of an eigendecomposition, same directions to 1e-14) moved beta-hat_c by
0.4 % and one sample of "f_c - ln beta" out of 101 (2026-11-26)."""


def make_module(tiny_clip, **kwargs) -> FrolicModule:
    defaults = dict(
        model_name=tiny_clip.model_name,
        pretrained=str(tiny_clip.checkpoint_path),
        class_names=CLASS_NAMES,
        templates=TEMPLATES,
    )
    return FrolicModule(**{**defaults, **kwargs})


def make_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


def loader(n: int, batch: int = 8, seed: int = 0, labeled: bool = True) -> DataLoader:
    return DataLoader(
        IndexedDataset(GeneratedImages(n, seed=seed, labeled=labeled)), batch_size=batch
    )


def reference(tiny_clip, n: int, batch: int = 8, seed: int = 0):
    """Features and prototypes from an independently loaded copy of the model."""
    model = open_clip.create_model(
        tiny_clip.model_name, pretrained=str(tiny_clip.checkpoint_path)
    ).eval()
    tokenizer = open_clip.get_tokenizer(tiny_clip.model_name)
    with torch.no_grad():
        prototypes = encode_prototypes(
            model, tokenizer, build_class_prompts(CLASS_NAMES, TEMPLATES)
        )
        chunks = [model.encode_image(b["image"]).float() for b in loader(n, batch, seed)]
    features = torch.cat(chunks)
    return features / features.norm(dim=1, keepdim=True), prototypes


@pytest.fixture(scope="module")
def single_101(tiny_clip):
    module = make_module(tiny_clip)
    calls, seen = [], []
    original = module.clip.encode_image
    module.clip.encode_image = lambda images, **kw: (
        calls.append(images.shape[0]) or original(images, **kw)
    )
    encode = module.encode_images
    module.encode_images = lambda images: seen.append(encode(images)) or seen[-1]
    outputs = make_trainer().predict(module, loader(101))
    module.seen_features = torch.cat(seen)
    return module, concat_outputs(outputs), calls


def test_features_and_prototypes_match_an_independent_encode(tiny_clip, single_101):
    module, _, _ = single_101
    features, prototypes = reference(tiny_clip, 101)
    torch.testing.assert_close(module.seen_features, features, rtol=0, atol=1e-6)
    torch.testing.assert_close(module.head.prototypes.float(), prototypes, rtol=0, atol=1e-6)


def test_predict_equals_functional_frolic(single_101):
    module, out, _ = single_101
    prototypes = module.head.prototypes.float()
    expected = frolic_tta.frolic(module.seen_features, prototypes, tau_c=module.tau_c)
    assert torch.equal(out["index"], torch.arange(101))
    torch.testing.assert_close(out["logits"], expected.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(out["prediction"], expected.logits.argmax(1))
    assert module.head.tau_g == pytest.approx(expected.tau_g, rel=1e-5)
    torch.testing.assert_close(out["target"], torch.arange(101) % 3)


def test_encoder_runs_once_per_image(single_101):
    module, _, calls = single_101
    assert sum(calls) == 101 and len(calls) == 13  # ceil(101 / 8) forwards, no second pass
    assert module.images_encoded == 101


def test_metrics_cover_table_rows_and_match_outputs(single_101):
    module, out, _ = single_101
    keys = {
        "accuracy/f_c",
        "accuracy/f_c - ln beta",
        "accuracy/f_g",
        "accuracy/f_c + f_g",
        "accuracy/f_f",
        "accuracy/f_d",
        "accuracy/tde",
        "accuracy/implicit",
        "accuracy/oracle",
    }
    assert keys <= set(module.metrics_)
    final = float((out["prediction"] == out["target"]).double().mean())
    assert module.metrics_["accuracy/f_d"] == pytest.approx(final)


def test_exported_head_reproduces_and_scores_new_data(tiny_clip, single_101, tmp_path):
    module, out, _ = single_101
    features, _ = reference(tiny_clip, 101)
    layer = module.adapted_classifier()
    scale = float(out["logits"].abs().max())  # float32 logits: rounding relative to the scale
    torch.testing.assert_close(layer(features), out["logits"], rtol=1e-5, atol=1e-5 * scale)
    plain = module.head.to_linear(torch.float64)  # the same map as one nn.Linear: A x + c
    torch.testing.assert_close(
        plain(features.double()).float(), out["logits"], rtol=1e-5, atol=1e-5 * scale
    )
    # checkpoint round trip, then score new data with the stored head (no re-adaptation)
    fresh = make_module(tiny_clip)
    trainer = make_trainer()
    trainer.predict(fresh, loader(40))
    ckpt = tmp_path / "frolic.ckpt"
    trainer.save_checkpoint(ckpt)
    restored = FrolicModule.load_from_checkpoint(ckpt)
    torch.testing.assert_close(restored.head.debiased().weight, fresh.head.debiased().weight)
    restored.reuse_head = True
    new = concat_outputs(make_trainer().predict(restored, loader(20, seed=3)))
    new_features, _ = reference(tiny_clip, 20, seed=3)
    torch.testing.assert_close(
        new["logits"], restored.head.score(new_features), rtol=1e-5, atol=1e-4
    )
    assert restored.images_encoded == 20


def test_bf16_mixed_keeps_float64_statistics(tiny_clip, single_101):
    module = make_module(tiny_clip, ablations=False)
    out = concat_outputs(make_trainer(precision="bf16-mixed").predict(module, loader(101)))
    assert module.moments.outer_sum.dtype == torch.float64
    assert bool(torch.isfinite(out["logits"]).all())
    agreement = float((out["prediction"] == single_101[1]["prediction"]).double().mean())
    assert agreement > 0.8  # bf16 features perturb an ill-conditioned random model


def test_unlabeled_and_bf16_true(tiny_clip):
    module = make_module(tiny_clip)
    out = concat_outputs(
        make_trainer(precision="bf16-true").predict(module, loader(30, labeled=False))
    )
    assert "target" not in out and module.metrics_ == {}
    assert bool(torch.isfinite(out["logits"]).all())
    assert module.moments.outer_sum.dtype == torch.float64
    assert module.head.beta.dtype == torch.float64


def test_class_probability_and_no_logits_mode(tiny_clip, single_101):
    module, out, _ = single_101
    after = torch.softmax(out["logits"].double(), 1).mean(0)
    torch.testing.assert_close(module.class_probability_["after"], after, rtol=1e-5, atol=1e-6)
    assert float(module.class_probability_["before"].sum()) == pytest.approx(1.0)
    lean = make_module(tiny_clip, return_logits=False, ablations=False)
    lean_out = concat_outputs(make_trainer().predict(lean, loader(101)))
    assert "logits" not in lean_out
    assert torch.equal(lean_out["prediction"], out["prediction"])
    scores = {key for key in lean.metrics_ if key.split("/")[0] in ROW_METRICS}  # f_d's only
    assert scores == {f"{kind}/f_d" for kind in ("accuracy", "top5", "recall", "ece", "nll")}
    # without a buffer f_c / tau_c comes from float32 products, not from the moments' float64
    # ones: the same fit as the functional lean path (this random tiny model's fit moves by
    # percents with the logits' last float32 bit, so the two modes agree on predictions only)
    x, z = module.seen_features, module.head.prototypes.float()
    fit = fit_frolic(x, z, tau_c=module.tau_c, keep_logits=False)
    logits = fit.head.score(x).double()
    nll = float(-torch.log_softmax(logits, 1)[torch.arange(101), torch.arange(101) % 3].mean())
    assert lean.metrics_["nll/f_d"] == pytest.approx(nll, rel=1e-4)


def test_batch_without_index_is_rejected(tiny_clip):
    module = make_module(tiny_clip)
    bad = DataLoader(GeneratedImages(6), batch_size=3)
    with pytest.raises(ValueError, match="dict with 'image' and 'index'"):
        make_trainer().predict(module, bad)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """1 vs 2 processes: open_clip's encoder output depends on which images share a batch in
    the last float32 bit (measured: 6e-8), and DDP changes batch composition; the random tiny
    model's unshrunk covariance amplifies that to ~2e-5 of the logit scale under torch 2.13 and
    1.02e-4 under 2.14.1 (one logit of 303, N = 101; predictions identical). With identical
    features the sharded estimator agrees to 1e-6 (tests/test_sharded_core.py).
    """
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=0, atol=3e-4 * scale)


def run_ddp_script(tiny_clip, n: int, out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(ROOT / "tests" / "ddp_predict.py"),
        str(tiny_clip.config_path),
        str(tiny_clip.checkpoint_path),
        str(n),
        "8",
        "2",
        "ddp",
        str(out_dir),
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("n", [101, 17])
def test_two_process_ddp_equals_single_process(tiny_clip, tmp_path, n):
    single_module = make_module(tiny_clip, options=RAW_LABELS)
    single = concat_outputs(make_trainer().predict(single_module, loader(n)))
    result = run_ddp_script(tiny_clip, n, tmp_path, "labels=zero_shot")
    assert result.returncode == 0, result.stderr[-3000:]
    joined = join_predictions(tmp_path, dataset_length=n)  # every index exactly once
    assert len(list(tmp_path.glob("predictions_rank*.pt"))) == 2
    assert torch.equal(joined["prediction"], single["prediction"])
    assert_logits_close(joined["logits"], single["logits"])
    summary = torch.load(tmp_path / "summary.pt", weights_only=False)
    assert summary["tau_g"] == pytest.approx(single_module.head.tau_g, rel=1e-4)
    torch.testing.assert_close(summary["beta"], single_module.head.beta, rtol=0, atol=1e-4)
    torch.testing.assert_close(  # the test prior is reduced over ranks like the rest; it
        # is estimated from the features, so it moves with them like beta (assert_logits_close)
        summary["head"]["test_prior"],
        single_module.head.test_prior,
        rtol=0,
        atol=1e-4,
    )
    scores = {k: v for k, v in single_module.metrics_.items() if k.split("/")[0] in ROW_METRICS}
    assert len(scores) == len(ROWS) * 5  # top-1, top-5, recall, ECE, NLL of every row
    for key, value in scores.items():  # synced over ranks: same counts as one process
        counted = key.startswith(("accuracy/", "top5/", "recall/"))
        # ECE, NLL follow the logits, which move by ~1e-4 of their scale between batchings
        # (see assert_logits_close), through the label-bias solves stopped at tolerance eps
        tolerance = {"abs": 1e-6} if counted else {"rel": 5e-3}
        assert summary["metrics"][key] == pytest.approx(value, **tolerance), key
    assert set(summary["class_accuracy"]) == set(frolic_tta.ROWS)


def test_ddp_notebook_in_process_equals_single_process(tiny_clip, tmp_path):
    n = 17
    single = concat_outputs(make_trainer().predict(make_module(tiny_clip), loader(n)))
    module = make_module(tiny_clip)
    trainer = make_trainer(
        devices=2, strategy="ddp_notebook", callbacks=[FrolicPredictionWriter(tmp_path)]
    )
    trainer.predict(module, loader(n), return_predictions=False)
    joined = join_predictions(tmp_path, dataset_length=n)
    assert torch.equal(joined["prediction"], single["prediction"])
    assert_logits_close(joined["logits"], single["logits"])


def test_padding_distributed_sampler_is_detected(tiny_clip, tmp_path):
    result = run_ddp_script(tiny_clip, 17, tmp_path, "pad")
    assert result.returncode != 0
    assert "Frolic saw 18 samples over all ranks but the dataset has 17" in result.stderr


# ---------------------------------------------------------------- bad input, re-use, checkpoints


def test_metrics_of_a_labelled_run_do_not_survive_an_unlabelled_one(tiny_clip):
    module = make_module(tiny_clip)
    trainer = make_trainer()
    trainer.predict(module, loader(24))
    assert "accuracy/f_d" in module.metrics_ and module.samples_["labelled"] == 24
    trainer.predict(module, loader(24, labeled=False))
    assert module.metrics_ == {} and module.samples_["labelled"] == 0
    assert float(module.class_probability_["after"].sum()) == pytest.approx(1.0)


def test_class_names_must_be_a_list_and_fail_before_weights_load(tiny_clip, tmp_path):
    with pytest.raises(TypeError, match=r"Expected `class_names` to be a list .* got str 'catdog'"):
        FrolicModule(
            model_name=tiny_clip.model_name,
            pretrained=str(tmp_path / "missing.pt"),  # would fail later: the names fail first
            class_names="catdog",
        )
    with pytest.raises(TypeError, match="Expected `class_names` to hold strings, but got int 3"):
        make_module(tiny_clip, class_names=["cat", 3])


class SomeLabelled(GeneratedImages):
    """Labels only in batches 1 and 3 (of 8): the first batch has none."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        return image, (label if (index // 8) % 2 == 1 else None)


def test_labels_in_only_some_batches_are_kept_and_scored(tiny_clip):
    module = make_module(tiny_clip)
    data = DataLoader(IndexedDataset(SomeLabelled(32)), batch_size=8)
    with pytest.warns(UserWarning, match="16 of the 32 usable samples carry no label"):
        out = concat_outputs(make_trainer().predict(module, data))
    labelled = (torch.arange(32) // 8) % 2 == 1
    expected = torch.where(labelled, torch.arange(32) % 3, torch.tensor(-1))
    assert torch.equal(out["target"], expected)  # none dropped, none invented
    correct = int((out["prediction"][labelled] == out["target"][labelled]).sum())
    assert module.metrics_["accuracy/f_d"] == correct / 16
    assert module.samples_["labelled"] == 16


def test_forward_gives_the_adapted_logits_or_says_why_not(tiny_clip, single_101):
    fresh = make_module(tiny_clip)
    images = next(iter(loader(101)))["image"]
    with pytest.raises(RuntimeError, match="no adapted head yet: run trainer.predict"):
        fresh(images)
    module, out, _ = single_101
    # 8 images in one batch: encoder features differ in float32 rounding from the predict run's
    # batches, which the default head amplifies in this random model (RAW_LABELS)
    scale = float(out["logits"][:8].abs().max())
    with torch.no_grad():
        torch.testing.assert_close(module(images), out["logits"][:8], rtol=0, atol=5e-5 * scale)


def test_accuracies_are_exact_ratios(single_101):
    module, out, _ = single_101
    for key, value in module.metrics_.items():
        if key.startswith(("accuracy/", "top5/")):
            assert value * 101 == pytest.approx(round(value * 101), abs=1e-9), key
            assert value == round(value * 101) / 101, key  # no float32 noise


def test_checkpoints_self_contained_or_head_only(tiny_clip, tmp_path, monkeypatch):
    weights = tmp_path / "weights.pt"
    shutil.copy(tiny_clip.checkpoint_path, weights)
    module = make_module(tiny_clip, pretrained=str(weights))
    trainer = make_trainer()
    out = concat_outputs(trainer.predict(module, loader(30)))
    full, small = tmp_path / "full.ckpt", tmp_path / "head_only.ckpt"
    trainer.save_checkpoint(full)
    module.hparams.save_clip_weights = False
    trainer.save_checkpoint(small)
    assert small.stat().st_size < full.stat().st_size / 3
    head_only = FrolicModule.load_from_checkpoint(small)  # the weights file is still there
    torch.testing.assert_close(head_only.head.beta, module.head.beta)
    weights.unlink()
    fresh = tmp_path / "elsewhere"
    fresh.mkdir()
    monkeypatch.chdir(fresh)

    def no_weights(*args, **kwargs):
        raise AssertionError("a self-contained checkpoint must not read or download weights")

    monkeypatch.setattr(ckpt_file, "load_open_clip", no_weights)
    restored = FrolicModule.load_from_checkpoint(full)
    restored.reuse_head = True
    again = concat_outputs(make_trainer().predict(restored, loader(30)))
    torch.testing.assert_close(again["logits"], out["logits"], rtol=1e-5, atol=1e-4)
    assert not restored.adapted_
    monkeypatch.undo()
    with pytest.raises(WeightsNotFoundError, match="weights.pt"):
        FrolicModule.load_from_checkpoint(small)  # head-only: needs the weights it names


def test_head_file_scores_without_adapting_and_checks_what_it_gets(tiny_clip, tmp_path):
    module = make_module(tiny_clip)
    trainer = make_trainer()
    out = concat_outputs(trainer.predict(module, loader(30)))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    scorer = FrolicModule(
        model_name=tiny_clip.model_name,
        pretrained=str(tiny_clip.checkpoint_path),
        templates=TEMPLATES,
        head_file=str(path),
    )
    assert scorer.class_names == CLASS_NAMES and scorer.reuse_head
    new = concat_outputs(make_trainer().predict(scorer, loader(30)))
    torch.testing.assert_close(new["logits"], out["logits"], rtol=1e-5, atol=1e-4)
    assert not scorer.adapted_ and scorer.metrics_ == {}
    with pytest.raises(ValueError, match=r"Expected `class_names` to be the 3 classes of the head"):
        make_module(tiny_clip, class_names=["a", "b"], head_file=str(path))
    with pytest.raises(FileNotFoundError, match="head file .* does not exist"):
        make_module(tiny_clip, head_file=str(tmp_path / "nope.pt"))
    with pytest.raises(ValueError, match="Expected a stored head with `reuse_head`=True"):
        make_trainer().predict(make_module(tiny_clip, reuse_head=True), loader(6))
