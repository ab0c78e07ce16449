"""FrolicAdaptation on LightningModules of their own (not FrolicModule): the same fit as
fit_frolic on their features, 1 vs 2 processes, the package's other callbacks with it, and a
clear error at the first batch for each kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import frolic_tta
from frolic_tta import FrolicAdaptation, FrolicPredictionWriter, join_predictions
from frolic_tta.data.store import load_store
from frolic_tta.errors import FrolicInputError
from frolic_tta.lightning.finalize import check_same_on_every_rank
from frolic_tta.lightning.online import OnlineAnswers
from frolic_tta.lightning.store import FeatureStoreWriter
from frolic_tta.lightning.writer import concat_outputs
from frolic_tta.pipeline import fit_frolic
from frolic_tta.synthetic import clip_world

ROOT = Path(__file__).resolve().parents[1]
WORLD = clip_world(num_samples=61, num_classes=5, dim=16, seed=2)


class Items(Dataset):
    """``{"index", "label"}`` items (the features live in the module, as an encoder's would)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"index": i, "label": int(WORLD.labels[i])}


class FeatureModule(L.LightningModule):
    """Any module whose predict_step returns the batch's image features."""

    def __init__(self, features: torch.Tensor = WORLD.features, **extra: object) -> None:
        super().__init__()
        self.features, self.extra, self.tau_c = features, extra, 0.01

    def predict_step(self, batch, batch_idx):
        return {"features": self.features[batch["index"]], **self.extra}


def predict(module, callbacks, n=61, batch=8, **trainer):
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
        callbacks=callbacks, **{"devices": 1, **trainer},
    )  # fmt: skip
    return trainer.predict(module, DataLoader(Items(n), batch_size=batch))


def test_adapted_outputs_equal_fit_frolic_and_the_rows_asked_for():
    frolic = FrolicAdaptation(WORLD.prototypes, tau_c="module", rows=["f_c", "f_g"])
    out = concat_outputs(predict(FeatureModule(), [frolic]))
    fit = fit_frolic(WORLD.features, WORLD.prototypes, tau_c=0.01)
    scale = float(fit.logits.abs().max())
    torch.testing.assert_close(out["logits"], fit.logits, rtol=0, atol=1e-5 * scale)
    assert torch.equal(out["prediction"], fit.logits.argmax(1))
    assert torch.equal(out["index"], torch.arange(61)) and bool(out["valid"].all())
    zero_shot = (WORLD.features @ WORLD.prototypes.t()).argmax(1)
    assert torch.equal(out["prediction/f_c"], zero_shot)
    gaussian = fit.head.gaussian.gda().logits(WORLD.features).argmax(1)
    assert torch.equal(out["prediction/f_g"], gaussian)
    assert frolic.outcome.metrics["accuracy/f_d"] == pytest.approx(
        float((fit.logits.argmax(1) == WORLD.labels).double().mean()), abs=1e-6
    )
    assert frolic.head.tau_g == pytest.approx(fit.head.tau_g, rel=1e-6)


def test_two_processes_give_the_single_process_predictions(tmp_path):
    single = concat_outputs(predict(FeatureModule(), [FrolicAdaptation(WORLD.prototypes)]))
    callbacks = [FrolicAdaptation(WORLD.prototypes), FrolicPredictionWriter(str(tmp_path))]
    predict(FeatureModule(), callbacks, devices=2, strategy="ddp_notebook")  # 31 + 30 samples
    joined = join_predictions(tmp_path, dataset_length=61)
    assert torch.equal(joined["prediction"], single["prediction"])
    scale = float(single["logits"].abs().max())
    torch.testing.assert_close(joined["logits"], single["logits"], rtol=0, atol=1e-5 * scale)


def test_online_answers_and_feature_store_work_with_a_module_of_ones_own(tmp_path):
    key = {"format": 2, "model_name": "mine", "num_samples": 61}
    callbacks = [FrolicAdaptation(WORLD.prototypes), OnlineAnswers()]
    callbacks.append(FeatureStoreWriter(str(tmp_path / "store"), key))
    out = concat_outputs(predict(FeatureModule(), callbacks))
    assert int(out["online_step"].max()) == 7 and bool((out["online_prediction"] >= 0).all())
    assert callbacks[1].summary["labelled"] == 61
    stored = load_store(tmp_path / "store", key)
    torch.testing.assert_close(stored.features, WORLD.features)
    assert stored.moments is not None  # the run's sums went with the store


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (FeatureModule(torch.randn(61, 9)), r"Expected image features of width d=16, the "
         r"prototypes' \(K=5, d=16\), but predict_step gave \(8, 9\)"),
        (FeatureModule(WORLD.features.clone().fill_(float("nan"))), r"Expected at most "
         r"max_skipped_fraction=0.05 of the samples to be unusable, but 8 of 8 seen"),
        (FeatureModule(prediction=torch.zeros(8)), r"Expected predict_step's output to leave "
         r"\['prediction'\] to FrolicAdaptation"),
    ],
    ids=["width", "non-finite", "taken key"],
)  # fmt: skip
def test_bad_features_are_one_clear_error_at_the_first_batch(module, message):
    frolic = FrolicAdaptation(WORLD.prototypes, tau_c=0.01)
    with pytest.raises(FrolicInputError, match=message):
        predict(module, [frolic])
    assert frolic.samples_seen <= 8  # the first batch


def test_an_output_without_features_is_one_clear_error():
    class Logits(FeatureModule):
        def predict_step(self, batch, batch_idx):
            return {"logits": self.features[batch["index"]] @ WORLD.prototypes.t()}

    with pytest.raises(FrolicInputError, match=r"under 'features' .* but it has keys \['logits'\]"):
        predict(Logits(), [FrolicAdaptation(WORLD.prototypes, tau_c=0.01)])

    class Bare(FeatureModule):
        def predict_step(self, batch, batch_idx):
            return self.features[batch["index"]]

    with pytest.raises(FrolicInputError, match="but it returned Tensor"):
        predict(Bare(), [FrolicAdaptation(WORLD.prototypes, tau_c=0.01)])
    module = FeatureModule()
    del module.tau_c
    with pytest.raises(FrolicInputError, match="Expected the LightningModule to have a `tau_c`"):
        predict(module, [FrolicAdaptation(WORLD.prototypes)])
    with pytest.raises(ValueError, match=r"Expected `rows` among .* but got \['oracle'\]"):
        FrolicAdaptation(WORLD.prototypes, rows=["oracle"])


def test_prototypes_that_differ_between_ranks_stop_every_rank():
    class TwoRanks(SimpleNamespace):
        """Two ranks' fingerprints meeting in one max all-reduce."""

        def reduce(self, tensor, reduce_op):
            assert reduce_op == "max"
            return torch.maximum(tensor, self.other)

    from frolic_tta.lightning.finalize import fingerprint

    z = WORLD.prototypes
    moved = z.clone()
    moved[3, 7] += 1e-3
    for other, what in ((moved, "values"), (z[:4], "shapes"), (z, "tau_c")):
        tau_c = 0.02 if what == "tau_c" else 0.01
        theirs = fingerprint(other, tau_c)
        strategy = TwoRanks(other=torch.cat([theirs, -theirs]))
        with pytest.raises(FrolicInputError, match=f"Expected the same prototypes .* {what}"):
            check_same_on_every_rank(z, 0.01, strategy)
    same = fingerprint(z, 0.01)
    check_same_on_every_rank(z, 0.01, TwoRanks(other=torch.cat([same, -same])))


def test_prototypes_built_differently_on_two_real_ranks_stop_both():
    def per_rank(module):  # a seed that differs by rank: a bug the check must catch
        return WORLD.prototypes + 0.01 * module.global_rank

    with pytest.raises(Exception, match="Expected the same prototypes"):
        predict(FeatureModule(), [FrolicAdaptation(per_rank)], devices=2,
                strategy="ddp_notebook")  # fmt: skip


# ---------------------------------------------------------------- a transformers CLIPModel


def run_hf(devices: int, n: int, out_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "hf_clip.py"), str(devices), str(n), str(out_dir)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip


def test_transformers_clip_module_1_and_2_processes_equal_fit_frolic(tmp_path):
    pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[hf]' (.[dev])"
    )
    from tests.hf_clip import CLASS_NAMES, TEMPLATES, ClipZeroShot, Pictures, embeddings, tiny_clip

    n = 21  # 2 processes: 11 and 10 samples
    runs = {devices: tmp_path / f"devices{devices}" for devices in (1, 2)}
    for devices, folder in runs.items():
        done = run_hf(devices, n, folder)
        assert done.returncode == 0, done.stderr[-3000:]
    logits = {d: torch.load(f / "report" / "logits.pt", weights_only=True) for d, f in runs.items()}
    assert torch.equal(logits[1]["prediction"], logits[2]["prediction"])
    for key in ("prediction/f_c", "prediction/f_g"):
        assert torch.equal(logits[1][key], logits[2][key]), key
    module = ClipZeroShot(tiny_clip(), CLASS_NAMES, TEMPLATES)  # the same weights, encoded here
    with torch.no_grad():
        images = Pictures(n).images
        features = torch.cat([embeddings(module.model.get_image_features(pixel_values=x[None]))
                              for x in images])  # fmt: skip
        prototypes = module.text_prototypes()
    summary = torch.load(runs[1] / "summary.pt", weights_only=False)
    torch.testing.assert_close(summary["prototypes"], prototypes, rtol=0, atol=1e-6)
    fit = fit_frolic(torch.nn.functional.normalize(features, dim=1), prototypes, tau_c=module.tau_c)
    scale = float(fit.logits.abs().max())
    for run in logits.values():
        torch.testing.assert_close(run["logits"], fit.logits, rtol=0, atol=1e-5 * scale)
        assert torch.equal(run["prediction"], fit.logits.argmax(1))
    for folder in runs.values():  # the report of a module that is not FrolicModule, complete
        report = folder / "report"
        names = {"metrics.json", "predictions.csv", "logits.pt", "head.pt", "priors.png",
                 "class_probability.png"}  # fmt: skip
        assert names <= {p.name for p in report.iterdir()}
        metrics = json.loads((report / "metrics.json").read_text())
        assert metrics["model"] == "ClipZeroShot" and metrics["num_samples"] == n
        assert metrics["per_class"]["class_names"] == CLASS_NAMES
        assert set(metrics["accuracy"]) == set(frolic_tta.ROWS)
        rows = (report / "predictions.csv").read_text().splitlines()
        assert len(rows) == n + 1 and rows[0].endswith("prediction/f_c,prediction/f_g")
