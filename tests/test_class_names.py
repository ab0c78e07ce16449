"""Class names given for labelled data name its classes; they never renumber them (issue 38,
items 1 and 2): a list in another order is matched by name, other names are refused in one line,
and a stored head's classes are matched to the data's by name."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from frolic_tta.data import ImageFolderDataModule
from frolic_tta.lightning.cli import main
from tests.test_cli import one_error_line, tiny_args

FOLDER_ORDER = ["blue stripes", "green circle", "red square"]  # sorted sub-folders


@pytest.fixture(autouse=True)
def bare_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])


def labels(dm: ImageFolderDataModule) -> list[int]:
    return [label for _, label in dm.source]


def test_names_in_another_order_keep_the_folder_order_and_labels(image_folder: Path):
    plain = ImageFolderDataModule(str(image_folder), num_workers=0)
    with pytest.warns(UserWarning, match="in another order; each name is matched to its class"):
        shuffled = ImageFolderDataModule(
            str(image_folder), class_names=["red square", "blue stripes", "green circle"]
        )
    assert plain.class_names == shuffled.class_names == FOLDER_ORDER
    assert labels(shuffled) == labels(plain)
    # the raw folder names, or another case, name the same classes; the user's spelling stays
    raw = ImageFolderDataModule(str(image_folder), class_names=["Blue_Stripes", "green_circle",
                                                                "red square"])  # fmt: skip
    assert raw.class_names == ["Blue_Stripes", "green_circle", "red square"]


@pytest.mark.parametrize(
    "names, problem",
    [
        (["cat", "dog", "bird"], "'cat', 'dog', 'bird' are not among them"),
        (["red square", "blue stripes", "circle"], "'circle' is not among them"),
        (["red square", "red_square", "blue stripes"], "they name a class twice"),
    ],
)
def test_names_of_other_classes_are_refused_in_one_line(image_folder: Path, names, problem):
    with pytest.raises(ValueError) as error:
        ImageFolderDataModule(str(image_folder), class_names=names)
    message = str(error.value)
    assert message.startswith(
        "Expected --data.class_names to name the 3 classes of the class folders of "
        f"'{image_folder}' (blue stripes, green circle, red square) in any order, but "
    )
    assert problem in message and "\n" not in message
    assert "--data.class_names '{blue stripes: <words>, ...}'" in message


def test_a_mapping_gives_each_folder_its_words(image_folder: Path):
    from frolic_tta.data.class_names import labelled_class_names

    mapping = {"red_square": "a red box", "blue stripes": "stripes", "Green Circle": "a disc"}
    dm = ImageFolderDataModule(str(image_folder), class_names=mapping)
    assert dm.class_names == ["stripes", "a disc", "a red box"]  # the folder order
    with pytest.raises(ValueError, match=r"but got 'cat' not among them; no words for red square"):
        labelled_class_names(
            {"blue stripes": "s", "green circle": "c", "cat": "x"}, FOLDER_ORDER, "the folders"
        )
    with pytest.raises(TypeError, match="Expected --data.class_names as a mapping of class names"):
        labelled_class_names({"blue stripes": 3}, FOLDER_ORDER, "the folders")
    with pytest.raises(TypeError, match="Expected `class_names` to be a list of class names"):
        ImageFolderDataModule(str(image_folder), labeled=False, class_names={"a": "b"})


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_the_issue_case_scores_against_the_true_classes(tiny_clip, image_folder, tmp_path, capsys):
    """Issue 38's run: names given in another order than the folders gave 7.50 % instead of
    26.25 %, and predictions.csv gave star images the target 'triangle'."""
    quiet = ["--trainer.enable_progress_bar", "false", "--report.print_table", "false"]
    main(tiny_args(tiny_clip, image_folder, tmp_path / "plain", *quiet))
    names = "[red square, blue stripes, green circle]"
    with pytest.warns(UserWarning, match="in another order"):
        main(tiny_args(tiny_clip, image_folder, tmp_path / "named", *quiet,
                       "--data.class_names", names))  # fmt: skip
    plain, named = (json.loads((tmp_path / d / "metrics.json").read_text())
                    for d in ("plain", "named"))  # fmt: skip
    assert named["accuracy"] == plain["accuracy"]
    rows = _csv(tmp_path / "named" / "predictions.csv")
    assert [(r["path"], r["target"]) for r in rows] == [
        (r["path"], r["target"]) for r in _csv(tmp_path / "plain" / "predictions.csv")
    ]
    assert all(Path(r["path"]).parent.name == r["target"].replace(" ", "_") for r in rows)
    err = one_error_line(
        tiny_args(tiny_clip, image_folder, tmp_path, "--data.class_names", "[cat, dog, bird]"),
        capsys,
    )
    assert "'cat', 'dog', 'bird' are not among them" in err


# ---------------------------------------------------------------- item 2: a stored head


@pytest.fixture(scope="module")
def fitted_head(tiny_clip, image_folder, tmp_path_factory) -> Path:
    """The head of an unlabelled run whose names are given in another order than the folders'."""
    out = tmp_path_factory.mktemp("unlabelled_run")
    names = "[red square, green circle, blue stripes]"
    quiet = ["--trainer.enable_progress_bar", "false", "--report.print_table", "false"]
    sys.argv = ["train.py"]
    main(tiny_args(tiny_clip, image_folder, out, *quiet, "--data.labeled", "false",
                   "--data.class_names", names))  # fmt: skip
    return out


def test_a_head_is_matched_to_the_folder_classes_by_name(tiny_clip, image_folder, fitted_head,
                                                         tmp_path, capsys):  # fmt: skip
    """Issue 38: scoring a labelled folder with a head fitted on the unlabelled run was refused
    ("in its order"), and the fix the message pointed to gave the wrong accuracy."""
    quiet = ["--trainer.enable_progress_bar", "false", "--report.print_table", "false"]
    head = ["--model.head_file", str(fitted_head / "head.pt")]
    with pytest.warns(UserWarning, match="matched to the data's classes by name"):
        main(tiny_args(tiny_clip, image_folder, tmp_path, *quiet, *head))
    fitted = torch.load(fitted_head / "logits.pt", weights_only=True)
    scored = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert fitted["class_names"] == ["red square", "green circle", "blue stripes"]
    assert scored["class_names"] == FOLDER_ORDER
    order = [fitted["class_names"].index(name) for name in FOLDER_ORDER]
    torch.testing.assert_close(scored["logits"], fitted["logits"][:, order], rtol=1e-5, atol=1e-4)
    # every target is the image's own folder, and accuracy counts the head's predictions
    rows = _csv(tmp_path / "predictions.csv")
    assert all(Path(r["path"]).parent.name == r["target"].replace(" ", "_") for r in rows)
    correct = sum(r["prediction"] == r["target"] for r in rows) / len(rows)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["accuracy"]["f_d"] == pytest.approx(correct)


def test_a_head_for_other_classes_is_one_line(tiny_clip, image_folder, fitted_head, tmp_path,
                                              capsys):  # fmt: skip
    two = tmp_path / "two"
    for name in ("blue_stripes", "green_circle", "yellow_dots"):
        shutil.copytree(image_folder / ("red_square" if name == "yellow_dots" else name),
                        two / name)  # fmt: skip
    head = ["--model.head_file", str(fitted_head / "head.pt")]
    err = one_error_line(tiny_args(tiny_clip, two, tmp_path, *head), capsys)
    assert err.startswith("error: Expected `class_names` to be the 3 classes of the head file")
    assert "not in the head: yellow dots" in err and "not in the data: red square" in err


def test_a_head_of_another_encoder_names_the_encoder_it_was_fitted_with(
    tiny_clip, image_folder, fitted_head, tmp_path, capsys, monkeypatch
):
    """Issue 38, item 6: the demo's head with the folder config's encoder (offline) failed with
    "weights 'openai' of open_clip model 'ViT-B-16-quickgelu' are not in the local cache", not
    saying that the head was fitted with another encoder, which it knows."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = tiny_args(tiny_clip, image_folder, tmp_path, "--model.head_file",
                     str(fitted_head / "head.pt"))  # fmt: skip
    args[args.index("--model.model_name") + 1] = "ViT-B-16-quickgelu"
    args[args.index("--model.pretrained") + 1] = "openai"
    err = one_error_line(args, capsys)
    assert err == (
        f"error: Expected the encoder the head file '{fitted_head / 'head.pt'}' was fitted with "
        f"(--model.model_name {tiny_clip.config_path} --model.pretrained "
        f"{tiny_clip.checkpoint_path}), but this run names --model.model_name ViT-B-16-quickgelu "
        "--model.pretrained openai, whose weights are not here either: pass the head's encoder "
        "options (the config.yaml of the run that wrote the head names them)"
    )
    # the config.yaml of that run brings them: it scores (no adaptation)
    config = ["--config", str(fitted_head / "config.yaml"), "--output_dir", str(tmp_path / "ok"),
              "--model.head_file", str(fitted_head / "head.pt"), "--data.labeled", "true",
              "--data.class_names", "null", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    with pytest.warns(UserWarning, match="matched to the data's classes by name"):
        main(["predict", *config])
    assert not json.loads((tmp_path / "ok" / "metrics.json").read_text())["adapted"]
