"""CoOp's standard split files: picked up where they sit, reported in the datamodule and metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from frolic_tta.data import (
    STANDARD_SPLITS,
    DatasetNotFoundError,
    FrolicDataModule,
    find_standard_split,
    load_dataset,
)
from frolic_tta.lightning.cli import main

# EuroSAT folders and CoOp's names for them; 4 images each: test 0, 1; train 2; val 3
EUROSAT = {"AnnualCrop": "Annual Crop Land", "Forest": "Forest", "SeaLake": "Sea or Lake"}
NO_SPLIT = "all images (no standard split found)"


def _png(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 40), (60 * value % 256, 90, 30 * value % 256)).save(path)


def eurosat_tree(root: Path, image_dir: str = "eurosat/2750") -> Path:
    """Write 3 EuroSAT class folders x 4 images under ``root/image_dir``."""
    for label, folder in enumerate(EUROSAT):
        for i in range(4):
            _png(root / image_dir / folder / f"{folder}_{i}.png", 4 * label + i)
    return root / image_dir


def coop_split(images: dict[str, str], test: tuple[int, ...] = (0, 1)) -> dict[str, list]:
    """A CoOp split JSON over ``{folder: class name}`` (image i of each class)."""

    def entries(ids: tuple[int, ...]) -> list[list]:
        return [
            [f"{folder}/{folder}_{i}.png", label, name]
            for label, (folder, name) in enumerate(images.items())
            for i in ids
        ]

    return {"train": entries((2,)), "val": entries((3,)), "test": entries(test)}


def write_split(folder: Path, name: str = "split_zhou_EuroSAT.json", **kwargs) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(coop_split(EUROSAT, **kwargs)))
    return folder / name


def test_split_file_in_the_dataset_folder_is_used(tmp_path: Path) -> None:
    images = eurosat_tree(tmp_path)
    split_file = write_split(tmp_path / "eurosat")
    assert find_standard_split("EuroSAT", tmp_path) == (split_file, images)
    loaded = load_dataset("eurosat", tmp_path)
    assert loaded.split_source == "split_zhou_EuroSAT.json (test)"
    assert loaded.class_names == list(EUROSAT.values())
    assert len(loaded.dataset) == 6 and [label for _, label in loaded.dataset] == [0, 0, 1, 1, 2, 2]
    assert load_dataset("eurosat", tmp_path, split="train").split_source.endswith("(train)")
    everything = load_dataset("eurosat", tmp_path, split="all")  # opt out: every image
    assert everything.split_source == "all images" and len(everything.dataset) == 12
    assert everything.class_names == ["annual crop land", "forest", "lake or sea"]


def test_no_split_file_uses_all_images_and_says_where_to_put_it(tmp_path: Path) -> None:
    eurosat_tree(tmp_path)
    message = r"no standard 'test' split found \(looked for split_zhou_EuroSAT.json in '.*eurosat'"
    with pytest.warns(UserWarning, match=message):
        loaded = load_dataset("eurosat", tmp_path)
    assert loaded.split_source == NO_SPLIT and len(loaded.dataset) == 12
    assert find_standard_split("eurosat", tmp_path) is None
    assert find_standard_split("imagenet_a", tmp_path) is None  # no CoOp file for it


def test_coop_layout_and_torchvision_layout_mixed(tmp_path: Path) -> None:
    """CoOp puts the DTD file in dtd/, torchvision the images in dtd/dtd/images/: found."""
    images = eurosat_tree(tmp_path, "dtd/dtd/images")
    name = STANDARD_SPLITS["dtd"].file
    split_file = write_split(tmp_path / "dtd", name)
    assert find_standard_split("dtd", tmp_path) == (split_file, images)
    dm = FrolicDataModule("dtd", root=str(tmp_path), num_workers=0)
    assert dm.split_source == f"{name} (test)" and dm.num_classes == 3
    assert dm.paths[0] == str(images / "AnnualCrop" / "AnnualCrop_0.png")


def test_official_split_without_split_file_says_so(tmp_path: Path) -> None:
    base = tmp_path / "dtd" / "dtd"
    for cls in ("banded", "zigzagged"):
        _png(base / "images" / cls / f"{cls}_0001.jpg", 1)
    (base / "labels").mkdir()
    (base / "labels" / "test1.txt").write_text(
        "banded/banded_0001.jpg\nzigzagged/zigzagged_0001.jpg\n"
    )
    loaded = load_dataset("dtd", tmp_path)
    assert (
        loaded.split_source == "official test split (split_zhou_DescribableTextures.json not found)"
    )


def test_split_file_without_its_images_is_one_clear_error(tmp_path: Path) -> None:
    eurosat_tree(tmp_path, "elsewhere")
    write_split(tmp_path / "eurosat")
    with pytest.raises(DatasetNotFoundError, match=r"lists 'AnnualCrop/AnnualCrop_2.png', which"):
        load_dataset("eurosat", tmp_path)
    with pytest.raises(DatasetNotFoundError, match="--data.image_dir"):
        FrolicDataModule("eurosat", root=str(tmp_path))


def test_explicit_split_file_still_wins(tmp_path: Path) -> None:
    images = eurosat_tree(tmp_path)
    write_split(tmp_path / "eurosat", test=(0, 1, 2))  # the standard one: 9 test images
    mine = write_split(tmp_path / "mine", "my_split.json", test=(3,))
    dm = FrolicDataModule(
        "eurosat", root=str(tmp_path), split_file=str(mine), image_dir=str(images), num_workers=0
    )
    assert dm.split_source == "my_split.json (test, --data.split_file)"
    assert len(dm.source) == 3 and dm.paths[0].endswith("AnnualCrop_3.png")
    assert FrolicDataModule("eurosat", root=str(tmp_path)).split_source.endswith("(test)")


# ---------------------------------------------------------------- train.py predict


def predict(tiny_clip, root: Path, out: Path, *extra: str) -> dict:
    """``train.py predict`` in process on EuroSAT under ``root``; the report's metrics.json."""
    args = ["predict", "--data.dataset", "eurosat", "--data.root", str(root)]
    args += ["--model.model_name", str(tiny_clip.config_path)]
    args += ["--model.pretrained", str(tiny_clip.checkpoint_path)]
    args += ["--model.templates", "[a photo of a {}.]", "--data.batch_size", "4"]
    args += ["--data.num_workers", "0", "--trainer.accelerator", "cpu", "--output_dir", str(out)]
    args += ["--trainer.enable_progress_bar", "false", "--report.plots", "false", *extra]
    main(args)
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture
def bare_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])


@pytest.mark.usefixtures("bare_argv")
def test_metrics_json_and_table_name_the_split(tiny_clip, tmp_path, capsys) -> None:
    images = eurosat_tree(tmp_path / "data")
    with pytest.warns(UserWarning, match="no standard 'test' split found"):
        metrics = predict(tiny_clip, tmp_path / "data", tmp_path / "all")
    assert metrics["split"] == NO_SPLIT and metrics["num_samples"] == 12
    assert f"split: {NO_SPLIT}" in capsys.readouterr().out
    write_split(tmp_path / "data" / "eurosat")
    metrics = predict(tiny_clip, tmp_path / "data", tmp_path / "standard")
    assert metrics["split"] == "split_zhou_EuroSAT.json (test)"
    assert metrics["num_samples"] == 6 and metrics["num_classes"] == 3
    assert "split: split_zhou_EuroSAT.json (test)" in capsys.readouterr().out
    explicit = write_split(tmp_path / "mine", "mine.json", test=(3,))
    extra = ("--data.split_file", str(explicit), "--data.image_dir", str(images))
    metrics = predict(tiny_clip, tmp_path / "data", tmp_path / "explicit", *extra)
    assert metrics["split"] == "mine.json (test, --data.split_file)"
    assert metrics["num_samples"] == 3
