"""FrolicModule(online=True): answers per batch, the transductive state at the end (1 process
and 2-process DDP with uneven ranks), the report files and the CLI flag."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

from frolic_tta import fit_frolic
from frolic_tta.lightning.online import OnlineAnswers
from frolic_tta.lightning.writer import concat_outputs, join_predictions
from tests.test_cli import tiny_args
from tests.test_module import loader, make_module, make_trainer, run_ddp_script


def assert_head_equals_fit(head, features, atol: float = 1e-6, head_atol: float = 1e-6) -> None:
    """``head`` is fit_frolic on ``features`` (its own prototypes and tau_c) to ``atol``."""
    ref = fit_frolic(features, head.prototypes.float(), tau_c=head.tau_c).head
    assert head.tau_g == pytest.approx(ref.tau_g, abs=atol)
    torch.testing.assert_close(head.beta, ref.beta, rtol=0, atol=atol)
    torch.testing.assert_close(head.test_prior, ref.test_prior, rtol=0, atol=atol)
    scale = float(ref.gaussian.weight.abs().max())
    torch.testing.assert_close(
        head.gaussian.weight, ref.gaussian.weight, rtol=0, atol=head_atol * scale
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_online_module_answers_each_batch_and_ends_in_the_transductive_state(tiny_clip):
    online = make_module(tiny_clip, online=True, ablations=False)
    trainer = make_trainer()
    out = concat_outputs(trainer.predict(online, loader(24, batch=2)))
    plain = make_module(tiny_clip, ablations=False)
    offline = concat_outputs(make_trainer().predict(plain, loader(24, batch=2)))
    # end of stream: the very state (and final pass) of the transductive module
    assert torch.equal(out["prediction"], offline["prediction"])
    assert online.head.tau_g == plain.head.tau_g and torch.equal(online.head.beta, plain.head.beta)
    callback = next(c for c in trainer.callbacks if isinstance(c, OnlineAnswers))
    assert_head_equals_fit(online.head, callback.online.features)
    # first batches (2 samples < 2 per class x 3 classes): zero-shot, refit 0
    assert out["online_refit"][:4].tolist() == [0, 0, 0, 0]
    assert torch.equal(out["online_prediction"][:4], out["zero_shot_prediction"][:4])
    assert out["online_seen"].tolist() == [2 * (i // 2 + 1) for i in range(24)]
    assert out["online_step"].tolist() == [i // 2 for i in range(24)]
    refits = [r["seen"] for r in online.online_["refits"]]
    assert refits == [6, 12, 24] and out["online_refit"][-1] == 3
    accuracy = online.online_["accuracy"]
    assert accuracy["end_of_stream"] == pytest.approx(
        float((out["prediction"] == out["target"]).double().mean())
    )
    assert set(accuracy) == {"online", "zero_shot", "end_of_stream"}


def test_online_with_a_stored_head_is_an_error(tiny_clip):
    module = make_module(tiny_clip, ablations=False)
    make_trainer().predict(module, loader(12))
    module.reuse_head = True
    module.hparams.online = True
    with pytest.raises(ValueError, match="Expected `online`=False with a stored head"):
        make_trainer().predict(module, loader(12))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_process_ddp_uneven_ends_in_the_single_process_fit(tiny_clip, tmp_path):
    result = run_ddp_script(tiny_clip, 17, tmp_path, "online")  # ranks: 9 (8 + 1) and 8 samples
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"online_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["features"].shape[0] for r in ranks] == [9, 8]
    assert ranks[0]["online"] == ranks[1]["online"]  # same refits, steps (rank 1 padded)
    assert ranks[0]["online"]["steps"] == 2 and ranks[0]["online"]["seen"] == 17
    features = torch.cat([r["features"] for r in ranks])
    for rank in ranks:  # every rank's state is fit_frolic on all features in one process
        # 17 samples: the head's labels come from matchings solved to 1e-6 in class mass
        assert_head_equals_fit(rank["head"], features, head_atol=3e-5)
    joined = join_predictions(tmp_path, dataset_length=17)
    assert (joined["online_prediction"] >= 0).all()
    assert joined["online_seen"].unique().tolist() == [16, 17]  # step 0: 8 + 8, step 1: + 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cli_online_flag_writes_the_online_report(tiny_clip, image_folder, tmp_path, monkeypatch):
    from frolic_tta.lightning.cli import main

    monkeypatch.setattr(sys, "argv", ["train.py"])
    quiet = ["--trainer.enable_progress_bar", "false", "--report.print_table", "false"]
    main(tiny_args(tiny_clip, image_folder, tmp_path, *quiet, "--model.online", "true"))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    online = metrics["online"]
    assert online["seen"] == 21 and online["steps"] == 6  # 21 images in batches of 4
    assert set(online["accuracy"]) == {"online", "zero_shot", "end_of_stream"}
    assert online["accuracy"]["end_of_stream"] == metrics["accuracy"]["f_d"]
    with (tmp_path / "online.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 21 and [int(r["step"]) for r in rows] == sorted(
        int(r["step"]) for r in rows
    )
    assert rows[0]["refit"] == "0" and rows[0]["seen"] == "4"
    assert (tmp_path / "online_accuracy.png").stat().st_size > 1000
