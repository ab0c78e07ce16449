"""Row metrics (top-1, top-5, mean recall, ECE, NLL, per-class accuracy) against numpy/sklearn,
and 1 process == 2 processes (a gloo group, uneven shards)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy.special import log_softmax, softmax
from sklearn.metrics import balanced_accuracy_score, recall_score, top_k_accuracy_score
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

import frolic_tta
from frolic_tta.lightning.report import format_table
from frolic_tta.metrics import (
    ROW_METRICS,
    NegativeLogLikelihood,
    TopKAccuracy,
    evaluate_rows,
    metric_key,
    row_metrics,
)
from frolic_tta.rows import ROWS, RowContext, build_rows
from frolic_tta.scores import CalibrationError, RowTerms
from frolic_tta.synthetic import clip_world

SPLIT = 700  # uneven: 700 vs 500 rows


def world_data():
    return clip_world(num_samples=1200, num_classes=12, dim=32, seed=5)


def reference_ece(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error: equal-width confidence bins [b, b'); a confidence of exactly
    1 falls in a bin of its own (as torchmetrics bins it)."""
    confidence, correct = probs.max(1), probs.argmax(1) == labels
    index = np.digitize(confidence, np.linspace(0, 1, bins + 1)) - 1
    total = 0.0
    for b in np.unique(index):
        inside = index == b
        total += inside.mean() * abs(correct[inside].mean() - confidence[inside].mean())
    return total


def scale_of(row: str, head) -> float:
    """Each row's probabilities, written out independently of the registry."""
    return {"f_c": 1 / head.tau_c, "tde": 1 / head.tau_c, "f_g": 1 / head.tau_g}.get(row, 1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_row_metrics_match_numpy_and_sklearn(dtype):
    world = world_data()
    features, labels = world.features.to(dtype), world.labels
    result = frolic_tta.frolic(features, world.prototypes)
    ctx = RowContext(result.head, result.sums, features, result.options, labels, chunk_size=97)
    rows = build_rows(ctx)
    scalars, per_class = evaluate_rows(
        rows, result.head, features, labels, num_labelled=len(labels), chunk_size=97
    )
    assert set(scalars) == {metric_key(r, kind) for r in ROWS for kind in ROW_METRICS}
    y, k = labels.numpy(), world.prototypes.shape[0]
    # torchmetrics' states are float32 (NLL's are float64): float32 rounding at most
    tolerance = 1e-6 if dtype == torch.float64 else 2e-5
    for row, logits in result.ablations(labels).items():
        scaled = logits.double().numpy() * scale_of(row, result.head)
        probs = softmax(scaled, axis=1)
        assert probs.max() < 1.0 or dtype == torch.float32, row  # no saturated confidence
        expected = {
            "accuracy": float((scaled.argmax(1) == y).mean()),
            "top5": top_k_accuracy_score(y, scaled, k=5, labels=np.arange(k)),
            "recall": balanced_accuracy_score(y, scaled.argmax(1)),
            "ece": reference_ece(probs, y),
            "nll": float(-log_softmax(scaled, axis=1)[np.arange(len(y)), y].mean()),
        }
        for kind, value in expected.items():
            assert scalars[metric_key(row, kind)] == pytest.approx(value, abs=tolerance), (
                row,
                kind,
            )
        class_recall = recall_score(y, scaled.argmax(1), average=None, labels=np.arange(k))
        np.testing.assert_allclose(per_class[row].numpy(), class_recall, atol=1e-6)
    assert scalars["accuracy/f_d"] == round(scalars["accuracy/f_d"] * 1200) / 1200  # exact ratio


def test_nll_metric_and_small_k():
    metric = NegativeLogLikelihood()
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    metric.update(logits, torch.tensor([0, 1]))
    expected = -torch.log_softmax(logits.double(), 1)[[0, 1], [0, 1]].mean()
    assert float(metric.compute()) == pytest.approx(float(expected), rel=0, abs=1e-7)
    with pytest.raises(ValueError, match=r"Expected `logits` \(n, K\) and `target` \(n,\)"):
        metric.update(logits, torch.tensor([0]))
    metrics = row_metrics(3, rows=["f_d"])  # K < 5: top-K
    assert sorted(metrics.keys()) == sorted(
        ["accuracy/f_d", "top5/f_d", "recall/f_d", "ece/f_d", "nll/f_d", "class_acc/f_d"]
    )
    assert metrics["top5/f_d"].k == 3  # top-K where K < 5


def _gloo_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    torch.set_num_threads(1)
    data = world_data()
    part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
    features, labels = data.features[part], data.labels[part]

    def reduce_fn(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    fit = frolic_tta.fit_frolic(features, data.prototypes, reduce_fn=reduce_fn)
    options = frolic_tta.FrolicOptions()
    ctx = RowContext(fit.head, fit.sums, features, options, labels, reduce_fn, chunk_size=64)
    scalars, per_class = evaluate_rows(
        build_rows(ctx), fit.head, features, labels, num_labelled=1200, chunk_size=64
    )
    torch.save((scalars, per_class), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_process_gloo_group_equals_one_process():
    data = world_data()
    fit = frolic_tta.fit_frolic(data.features, data.prototypes)
    options = frolic_tta.FrolicOptions()
    ctx = RowContext(fit.head, fit.sums, data.features, options, data.labels)
    whole, whole_class = evaluate_rows(
        build_rows(ctx), fit.head, data.features, data.labels, num_labelled=1200
    )
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        mp.spawn(_gloo_worker, args=(2, init_file, out_dir), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    for scalars, per_class in ranks:
        assert set(scalars) == set(whole)
        for key, value in whole.items():
            tolerance = 0.0 if key.startswith(("accuracy/", "top5/", "recall/")) else 1e-5
            assert scalars[key] == pytest.approx(value, abs=tolerance), key
        for row, values in whole_class.items():
            torch.testing.assert_close(per_class[row], values, rtol=0, atol=1e-7)


def test_table_shows_every_metric_with_top1_first():
    summary = {
        "dataset": "d",
        "model": "m",
        "pretrained": None,
        "num_samples": 10,
        "num_classes": 3,
        "accuracy": {"f_c": 0.5, "f_d": 0.7},
        "top5": {"f_c": 1.0, "f_d": 1.0},
        "recall": {"f_c": 0.45, "f_d": 0.7},
        "ece": {"f_c": 0.0123, "f_d": 0.2},
        "nll": {"f_c": 1.5, "f_d": 0.75},
        "tau_c": 0.01,
        "tau_g": 1.0,
        "beta": {"min": 0.3, "max": 0.4, "max_over_min": 1.3, "std_log": 0.1},
    }
    lines = format_table(summary).splitlines()
    # K = 3: the column is top-3 (issue 38: the header said top-5, computed as top-K, K < 5)
    assert lines[1].split()[:6] == ["row", "top-1", "top-3", "recall", "ECE", "NLL"]
    assert lines[2].split()[:6] == ["f_c", "50.00%", "100.00%", "45.00%", "0.012", "1.500"]
    del summary["top5"], summary["ece"]  # a stored head: top-1 alone
    assert format_table(summary).splitlines()[3].split()[:6] == [
        "f_d",
        "70.00%",
        "-",
        "70.00%",
        "-",
        "0.750",
    ]


def test_top_k_accuracy_counts_as_torchmetrics_top_k():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(500, 12, generator=generator).round()  # rounded: many ties
    target = torch.randint(0, 12, (500,), generator=generator)
    for k in (1, 3, 5):
        ours = TopKAccuracy(12, k)
        ours.update(logits, target)
        theirs = MulticlassAccuracy(12, top_k=k, average="micro")
        theirs.update(logits, target)
        assert float(ours.compute()) == float(theirs.compute())


def test_one_exponential_pass_gives_torchmetrics_ece_and_float64_nll():
    # a confident, many-class chunk: logits spread over 60 nats, K = 1,000, ties in the top
    generator = torch.Generator().manual_seed(6)
    logits = 20.0 * torch.randn(400, 1000, generator=generator)
    logits[:50, 1] = logits[:50, 0] = logits[:50].max(1).values + 1.0  # tied top classes
    target = torch.randint(0, 1000, (400,), generator=generator)
    target[:200] = logits[:200].argmax(1)  # half right, half mostly wrong
    ours = CalibrationError(1000, n_bins=15, norm="l1")
    theirs = MulticlassCalibrationError(1000, n_bins=15, norm="l1")
    terms = RowTerms.of(logits)
    ours.update(logits, target, terms)
    theirs.update(torch.softmax(logits, 1), target)
    assert float(ours.compute()) == pytest.approx(float(theirs.compute()), abs=1e-6)
    assert torch.equal(terms.top, logits.argmax(1))  # ties: the first class, as argmax
    nll = NegativeLogLikelihood()
    nll.update(logits, target)  # its own pass
    exact = -log_softmax(logits.double().numpy(), axis=1)[np.arange(400), target.numpy()]
    assert float(nll.compute()) == pytest.approx(float(exact.mean()), rel=0, abs=1e-6)
    per_row = terms.nll(logits, target).numpy()
    assert np.abs(per_row - exact).max() <= 2e-7  # (m - l_y) exact, ln s to float32 rounding
