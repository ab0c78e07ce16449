"""``python train.py predict`` end to end, the configs, and clear user errors."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import open_clip
import pytest
import torch
import yaml
from PIL import Image

from frolic_tta import FrolicClassifier, FrolicHead
from frolic_tta.lightning.cli import main
from frolic_tta.rows import ROWS
from tests.conftest import IMAGE_FOLDER_CLASSES, IMAGES_PER_CLASS
from tests.noise import assert_quiet

ROOT = Path(__file__).resolve().parents[1]
N = len(IMAGE_FOLDER_CLASSES) * IMAGES_PER_CLASS
REPORT_FILES = (
    "metrics.json",
    "predictions.csv",
    "logits.pt",
    "head.pt",
    "class_probability.png",
    "priors.png",
    "config.yaml",
)


def tiny_args(tiny_clip, folder: Path, out: Path, *extra: str) -> list[str]:
    return [
        "predict",
        "--model.model_name",
        str(tiny_clip.config_path),
        "--model.pretrained",
        str(tiny_clip.checkpoint_path),
        "--model.templates",
        "[a photo of a {}.]",
        "--data",
        "ImageFolderDataModule",
        "--data.root",
        str(folder),
        "--data.batch_size",
        "4",
        "--data.num_workers",
        "0",
        "--trainer.accelerator",
        "cpu",
        "--output_dir",
        str(out),
        *extra,
    ]


def run_train(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2-core CI: no thread oversubscription
    command = [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


@pytest.fixture(autouse=True)
def bare_argv(monkeypatch):
    """In-process ``main(args)``: no pytest arguments in ``sys.argv`` (LightningCLI warns)."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def read_report(out: Path) -> dict:
    for name in REPORT_FILES:
        assert (out / name).is_file(), name
    for name in ("class_probability.png", "priors.png"):
        with Image.open(out / name) as image:
            assert image.format == "PNG" and min(image.size) > 100
    assert not (out / "predictions").exists()  # per-rank shards joined and removed
    with (out / "predictions.csv").open() as f:
        rows = list(csv.DictReader(f))
    return {
        "metrics": json.loads((out / "metrics.json").read_text()),
        "rows": rows,
        "logits": torch.load(out / "logits.pt", weights_only=True),
        "head": torch.load(out / "head.pt", weights_only=True),
    }


@pytest.fixture(scope="module")
def ddp_then_single(tiny_clip, image_folder, tmp_path_factory):
    """2 processes (DDP), then 1 process into the same output folder."""
    out = tmp_path_factory.mktemp("cli_out")
    two = run_train(
        tiny_args(
            tiny_clip, image_folder, out, "--trainer.devices", "2", "--trainer.strategy", "ddp"
        )
    )
    assert two.returncode == 0, two.stderr[-3000:]
    ddp = read_report(out)
    shutil.copytree(out, out.parent / "ddp_copy")
    one = run_train(tiny_args(tiny_clip, image_folder, out, "--trainer.devices", "1"))
    assert one.returncode == 0, one.stderr[-3000:]
    return ddp, read_report(out), one.stdout, two.stderr


def test_report_files(ddp_then_single, tiny_clip, image_folder):
    _, single, stdout, _ = ddp_then_single
    metrics, rows, logits = single["metrics"], single["rows"], single["logits"]
    assert metrics["num_samples"] == N and metrics["num_classes"] == 3
    assert metrics["labelled"] and metrics["dataset"] == "folder"
    assert set(metrics["accuracy"]) == set(
        ROWS
    )  # Table 3: f_c .. f_d; Table 4: tde, implicit, oracle
    assert metrics["tau_g"] > 0 and metrics["beta"]["max_over_min"] >= 1
    assert metrics["zero_shot_beta"]["max_over_min"] >= 1 and "test_prior" in metrics
    assert metrics["tau_c"] == pytest.approx(0.01, rel=1e-6)  # the model's: logit_scale ln 100
    assert len(metrics["per_class"]["probability_before"]) == 3
    assert "f_d" in stdout and "tau_g" in stdout and f"N={N}" in stdout  # terminal table
    table = stdout[stdout.index("Frolic on folder") :]  # after the progress bar, not inside it
    assert stdout[stdout.index("Frolic on folder") - 1] == "\n" and "Predicting" not in table
    assert "Frolic accuracy" not in stdout  # no second copy of the table
    for value in metrics["accuracy"].values():  # exact ratios, no float32 noise
        assert value == round(value * N) / N and metrics["num_evaluated"] == N
    for kind in ("top5", "recall", "ece", "nll"):  # every row, beside top-1
        assert set(metrics[kind]) == set(ROWS), kind
    assert metrics["top5"]["f_d"] == 1.0  # K = 3
    per_class = metrics["per_class"]
    assert sum(per_class["support"]) == N and set(per_class["accuracy"]) == set(ROWS)
    support = torch.tensor(per_class["support"], dtype=torch.float64)
    recall = torch.tensor(per_class["accuracy"]["f_d"], dtype=torch.float64)
    assert float((support * recall).sum()) / N == pytest.approx(metrics["accuracy"]["f_d"])
    assert metrics["options"]["zero_shot"] == "text"
    assert "top-3" in stdout and "ECE" in stdout  # K = 3 (top-5 where K >= 5)
    # CSV: every index once, file paths, class names, targets
    assert [int(r["index"]) for r in rows] == list(range(N))
    assert all(Path(r["path"]).is_file() and r["path"].startswith(str(image_folder)) for r in rows)
    names = logits["class_names"]
    assert {r["prediction"] for r in rows} <= set(names)
    assert [names.index(r["prediction"]) for r in rows] == logits["prediction"].tolist()
    assert [r["target"] for r in rows] == [names[t] for t in logits["target"].tolist()]
    accuracy = float((logits["prediction"] == logits["target"]).double().mean())
    assert metrics["accuracy"]["f_d"] == pytest.approx(accuracy)
    # the saved linear head reproduces the logits from independently encoded features
    model, _, preprocess = open_clip.create_model_and_transforms(
        tiny_clip.model_name, pretrained=str(tiny_clip.checkpoint_path)
    )
    images = torch.stack([preprocess(Image.open(r["path"]).convert("RGB")) for r in rows])
    with torch.no_grad():
        features = model.eval().encode_image(images).float()
    features = features / features.norm(dim=1, keepdim=True)
    layer = FrolicClassifier.from_state_dict(single["head"]["classifier"])
    with torch.no_grad():
        torch.testing.assert_close(layer(features), logits["logits"], rtol=1e-4, atol=1e-4)
    head = FrolicHead.from_state_dict(single["head"]["frolic_head"])
    assert head.tau_g == pytest.approx(metrics["tau_g"])


def test_a_successful_ddp_run_is_quiet(ddp_then_single):
    """No Lightning tips, no library deprecation notices, no escape codes or carriage returns,
    and each of our warnings once (by rank 0, not once per rank), attributed to our code."""
    assert_quiet(ddp_then_single[3])


def test_one_and_two_devices_agree(ddp_then_single):
    ddp, single, _, _ = ddp_then_single
    assert ddp["metrics"]["world_size"] == 2 and single["metrics"]["world_size"] == 1
    assert [r["index"] for r in ddp["rows"]] == [str(i) for i in range(N)]
    assert torch.equal(ddp["logits"]["prediction"], single["logits"]["prediction"])
    assert [r["prediction"] for r in ddp["rows"]] == [r["prediction"] for r in single["rows"]]
    scale = float(single["logits"]["logits"].abs().max())  # see test_module.assert_logits_close
    torch.testing.assert_close(
        ddp["logits"]["logits"], single["logits"]["logits"], rtol=0, atol=1e-4 * scale
    )
    assert ddp["metrics"]["accuracy"] == pytest.approx(single["metrics"]["accuracy"], abs=1e-6)


def test_unlabeled_folder_gives_predictions_without_metrics(
    tiny_clip, image_folder, tmp_path, capsys, one_thread
):
    names = "[red square, green circle, blue stripes]"
    args = ["--data.labeled", "false", "--data.class_names", names]
    main(
        tiny_args(
            tiny_clip, image_folder, tmp_path, *args, "--trainer.enable_progress_bar", "false"
        )
    )
    report = read_report(tmp_path)
    assert report["metrics"]["accuracy"] == {} and not report["metrics"]["labelled"]
    assert "target" not in report["rows"][0] and "target" not in report["logits"]
    assert len(report["rows"]) == N
    assert "no labels" in capsys.readouterr().out


def test_unlabeled_folder_without_class_names_says_how(tiny_clip, image_folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_args(tiny_clip, image_folder, tmp_path, "--data.labeled", "false"))
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "--data.class_names" in err and "--data.labeled true" in err
    folder = yaml.safe_load((ROOT / "configs" / "folder.yaml").read_text())["data"]["init_args"]
    assert folder["labeled"] is True  # the config agrees with ImageFolderDataModule's default
    flat = tmp_path / "flat"
    shutil.copytree(image_folder / "red_square", flat)
    err = one_error_line(tiny_args(tiny_clip, flat, tmp_path), capsys)
    assert "--data.labeled false with --data.class_names" in err


def test_missing_data_is_one_clear_error(tmp_path, capsys):
    args = ["predict", "--data.dataset", "eurosat", "--data.root", str(tmp_path / "nowhere")]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("error: EuroSAT") and err.count("\n") == 1
    assert "--data.root" in err and "--data.download true" in err


def test_missing_checkpoint_is_one_clear_error_without_traceback(tiny_clip, image_folder, tmp_path):
    args = tiny_args(tiny_clip, image_folder, tmp_path)
    args[args.index("--model.pretrained") + 1] = str(tmp_path / "missing.pt")
    result = run_train(args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "--model.pretrained /path/to.ckpt" in result.stderr


def test_only_predict_is_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit"])
    assert exit_info.value.code != 0
    assert "predict" in capsys.readouterr().err


# ---------------------------------------------------------------- bad input, smoke runs, re-use


def one_error_line(args: list[str], capsys) -> str:
    """Run ``main(args)``, expect exit 2 and one ``error:`` line, the last, no traceback."""
    capsys.readouterr()  # earlier output
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    assert "Traceback" not in err, err
    return lines[-1]


def test_bad_templates_or_prompts_file_fail_before_anything_loads(tiny_clip, tmp_path, capsys):
    missing = ["--model.pretrained", str(tmp_path / "missing.pt")]  # would fail later
    bad_key = tiny_args(tiny_clip, tmp_path, tmp_path, *missing, "--model.templates", "eurosatt")
    err = one_error_line(bad_key, capsys)
    assert "templates must be 'openai', 'simple', a dataset key" in err and "'eurosatt'" in err
    no_file = tiny_args(
        tiny_clip, tmp_path, tmp_path, *missing, "--model.prompts_file", str(tmp_path / "d.json")
    )
    err = one_error_line(no_file, capsys)
    assert "descriptions file not found" in err and "missing.pt" not in err


def test_fewer_samples_than_processes_stops_before_launching(
    tiny_clip, image_folder, tmp_path, capsys
):
    args = ["--data.limit", "1", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    err = one_error_line(tiny_args(tiny_clip, image_folder, tmp_path, *args), capsys)
    assert "Expected at least one sample per process (N >= world size 2)" in err
    assert "N=1" in err and not (tmp_path / "metrics.json").exists()


def test_limited_smoke_runs_adapt_on_what_they_saw(tiny_clip, image_folder, tmp_path, capsys):
    quiet = ["--trainer.enable_progress_bar", "false", "--report.print_table", "false"]
    for flags, seen in (
        (["--trainer.limit_predict_batches", "2"], 8),
        (["--trainer.fast_dev_run", "true"], 4),
    ):
        out = tmp_path / flags[0].split(".")[-1]
        with pytest.warns(UserWarning, match=f"Frolic adapted on the {seen} of {N} samples"):
            main(tiny_args(tiny_clip, image_folder, out, *quiet, *flags))
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["num_samples"] == seen and metrics["dataset_length"] == N
        assert metrics["notes"][0].startswith("partial run") and metrics["num_evaluated"] == seen
        with (out / "predictions.csv").open() as f:
            assert [int(r["index"]) for r in csv.DictReader(f)] == list(range(seen))
        assert "Frolic on" not in capsys.readouterr().out  # --report.print_table false
    err = one_error_line(
        tiny_args(tiny_clip, image_folder, tmp_path, "--trainer.limit_predict_batches", "0"), capsys
    )
    assert "Expected --trainer.limit_predict_batches > 0, but got 0" in err


def test_head_file_scores_new_images_without_adapting(tiny_clip, image_folder, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    quiet = ["--trainer.enable_progress_bar", "false"]
    main(tiny_args(tiny_clip, image_folder, first, *quiet))
    head = str(first / "head.pt")
    main(tiny_args(tiny_clip, image_folder, second, *quiet, "--model.head_file", head))
    assert "scored with a stored head" in capsys.readouterr().out
    adapted = torch.load(first / "logits.pt", weights_only=True)
    scored = torch.load(second / "logits.pt", weights_only=True)
    torch.testing.assert_close(scored["logits"], adapted["logits"], rtol=1e-5, atol=1e-4)
    metrics = json.loads((second / "metrics.json").read_text())
    assert not metrics["adapted"] and metrics["tau_g"] == pytest.approx(
        json.loads((first / "metrics.json").read_text())["tau_g"]
    )
    # unlabelled new images: the class names come from the head file
    unlabeled = ["--data.labeled", "false", "--model.head_file", head]
    main(tiny_args(tiny_clip, image_folder, tmp_path / "third", *quiet, *unlabeled))
    assert json.loads((tmp_path / "third" / "metrics.json").read_text())["num_samples"] == N
    err = one_error_line(
        tiny_args(tiny_clip, image_folder, tmp_path, "--model.reuse_head", "true"), capsys
    )
    assert "--model.head_file outputs/<run>/head.pt" in err
    err = one_error_line(tiny_args(tiny_clip, image_folder, tmp_path, "--ckpt_path", head), capsys)
    assert "is not one; to score with the head.pt of a run pass it as --model.head_file" in err


def test_a_logger_alone_writes_under_the_outputs_and_config_yaml_stays_there(
    tiny_clip, image_folder, tmp_path, one_thread
):
    out = tmp_path / "out"
    main(tiny_args(tiny_clip, image_folder, out, "--trainer.logger", "CSVLogger"))
    assert (out / "config.yaml").is_file() and (out / "metrics.json").is_file()
    assert list(out.glob("lightning_logs/version_*/metrics.csv"))  # the logger's save_dir
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["trainer"]["logger"]["init_args"]["save_dir"] == str(out)


def test_logger_save_dir_comes_from_output_dir_or_the_config(tmp_path):
    from frolic_tta.lightning.cli import with_logger_save_dir

    argv = ["predict", "--trainer.logger", "CSVLogger", "--output_dir", "o"]
    assert with_logger_save_dir(argv)[1:5] == [
        "--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", "o"
    ]  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text("output_dir: from_config\n")
    argv = ["predict", "--config", str(config), "--trainer.logger=TensorBoardLogger"]
    assert with_logger_save_dir(argv)[-2:] == ["--trainer.logger.save_dir", "from_config"]
    for same in (
        ["predict", "--trainer.logger", "false"],
        ["predict", "--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", "x"],
    ):
        assert with_logger_save_dir(same) == same  # fmt: skip
