"""Dataset wrappers, the dataset registry and the datamodules, on generated folders."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from urllib.error import URLError

import pytest
import torch
import torchvision.datasets.eurosat as eurosat_module
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder

from frolic_tta.data import (
    DatasetNotFoundError,
    FrolicDataModule,
    ImageFolderDataModule,
    IndexedDataset,
    UnlabeledImageFolder,
    build_dataset,
    build_split_file_dataset,
    canonical_dataset_name,
    clean_class_name,
    imagenet_class_names,
    imagenet_wnids,
)
from frolic_tta.data.datamodules import default_num_workers
from frolic_tta.errors import FrolicInputError

TO_TENSOR = transforms.Compose([transforms.Resize(32), transforms.ToTensor()])


def _tiny_png(path: Path, value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (value % 256, 0, 0)).save(path)


# ---------------------------------------------------------------- wrappers


def test_indexed_dataset_dicts() -> None:
    labeled = IndexedDataset([("a", 3), ("b", torch.tensor(1))], transform=str.upper)
    assert labeled[1] == {"image": "B", "index": 1, "label": 1, "error": ""}
    assert isinstance(labeled[1]["label"], int) and len(labeled) == 2
    unlabeled = IndexedDataset(["x", "y"])
    assert unlabeled[0] == {"image": "x", "index": 0, "error": ""}
    # a pair without a label: target -1 (a batch of pairs with and without labels collates)
    assert IndexedDataset([("z", None)])[0] == {"image": "z", "index": 0, "error": "", "label": -1}
    with pytest.raises(TypeError, match="got a tuple of length 3 at index 0"):
        IndexedDataset([("a", 1, 2)])[0]


def test_unlabeled_image_folder(image_folder: Path, tmp_path: Path) -> None:
    ds = UnlabeledImageFolder(image_folder)
    assert len(ds) == 21 and ds.paths == sorted(ds.paths)
    assert all(p.endswith(".png") for p in ds.paths)  # notes.txt skipped
    image = ds[0]
    assert isinstance(image, Image.Image) and image.size == (40, 40) and image.mode == "RGB"
    with pytest.raises(DatasetNotFoundError, match="no folder at"):
        UnlabeledImageFolder(tmp_path / "nowhere")
    with pytest.raises(DatasetNotFoundError, match="no files ending in"):
        UnlabeledImageFolder(tmp_path)


def test_clean_class_name() -> None:
    assert clean_class_name("apple_pie") == "apple pie"
    assert clean_class_name("apartment_building/outdoor") == "apartment building outdoor"
    assert clean_class_name("ApplyEyeMakeup") == "Apply Eye Makeup"
    assert clean_class_name("Apply_Eye_Makeup") == "Apply Eye Makeup"


# ---------------------------------------------------------------- ImageNet label spaces


def test_imagenet_metadata() -> None:
    wnids = imagenet_wnids()
    assert len(wnids) == 1000 == len(set(wnids)) == len(imagenet_class_names())
    assert wnids == sorted(wnids)
    assert (wnids[0], wnids[1], wnids[-1]) == ("n01440764", "n01443537", "n15075141")


@pytest.mark.parametrize("name", ["imagenet_a", "ImageNet-R"])
def test_imagenet_subset_folders(tmp_path: Path, name: str) -> None:
    wnids, names = imagenet_wnids(), imagenet_class_names()
    chosen = random.Random(0).sample(wnids, 200)
    folder = tmp_path / ("imagenet-a" if name == "imagenet_a" else "imagenet-r")
    for i, wnid in enumerate(chosen):
        _tiny_png(folder / wnid / "x.png", i)
    with pytest.warns(UserWarning, match="no official 'test' split"):
        ds, class_names = build_dataset(name, tmp_path)
    in_order = sorted(chosen)
    assert len(class_names) == 200 and set(class_names) <= set(names)
    assert class_names == [names[wnids.index(w)] for w in in_order]
    label_of = {Path(p).parent.name: label for p, label in ds.samples}
    assert [label_of[w] for w in in_order] == list(range(200))


def test_imagenet_sketch_uses_imagenet_indices(tmp_path: Path) -> None:
    wnids = imagenet_wnids()
    for wnid in (wnids[5], wnids[900]):
        _tiny_png(tmp_path / "imagenet-sketch" / "images" / wnid / "x.png")
    ds, class_names = build_dataset("imagenet_sketch", tmp_path, split="all")
    assert class_names == imagenet_class_names()
    assert sorted(label for _, label in ds.samples) == [5, 900]


def test_imagenet_v2_numeric_folders(tmp_path: Path) -> None:
    root = tmp_path / "imagenetv2-matched-frequency-format-val"
    for c in (0, 1, 2, 9, 10, 11, 100):
        _tiny_png(root / str(c) / "x.png", c)
    ds, class_names = build_dataset("imagenetv2", tmp_path, split="all")
    assert ds.classes == ["0", "1", "2", "9", "10", "11", "100"]  # "10" after "9"
    assert all(int(Path(p).parent.name) == label for p, label in ds.samples)
    assert class_names == imagenet_class_names()
    (root / "n01440764").mkdir()
    with pytest.raises(ValueError, match=r"expected class folders named 0\.\.999"):
        build_dataset("imagenet_v2", tmp_path, split="all")


# ---------------------------------------------------------------- torchvision layouts


def _fake_layout(root: Path, name: str) -> list[str]:
    """Write a minimal on-disk layout torchvision accepts; return the expected class names."""
    if name == "eurosat":
        for folder in ("AnnualCrop", "HerbaceousVegetation", "SeaLake"):
            _tiny_png(root / "eurosat" / "2750" / folder / "a.png")
        return ["annual crop land", "brushland or shrubland", "lake or sea"]
    if name == "dtd":
        base = root / "dtd" / "dtd"
        for cls in ("banded", "zigzagged"):
            _tiny_png(base / "images" / cls / f"{cls}_0001.jpg")
        (base / "labels").mkdir()
        lines = "banded/banded_0001.jpg\nzigzagged/zigzagged_0001.jpg\n"
        (base / "labels" / "test1.txt").write_text(lines)
        return ["banded", "zigzagged"]
    if name == "caltech101":
        for cls in ("BACKGROUND_Google", "Faces", "airplanes", "inline_skate"):
            _tiny_png(root / "caltech101" / "101_ObjectCategories" / cls / "image_0001.jpg")
        return ["off-center face", "airplane", "inline skate"]
    base = root / "SUN397"
    (base / "ClassName.txt").parent.mkdir(parents=True)
    (base / "ClassName.txt").write_text("/a/abbey\n/a/apartment_building/outdoor\n")
    _tiny_png(base / "a" / "abbey" / "sun_a.jpg")
    _tiny_png(base / "a" / "apartment_building" / "outdoor" / "sun_b.jpg")
    return ["abbey", "apartment building outdoor"]


@pytest.mark.parametrize("name", ["eurosat", "dtd", "caltech101", "sun397"])
def test_torchvision_layouts(tmp_path: Path, name: str) -> None:
    expected = _fake_layout(tmp_path, name)
    dm = FrolicDataModule(
        name,
        root=str(tmp_path),
        split="all" if name != "dtd" else "test",
        num_workers=0,
        preprocess=TO_TENSOR,
    )
    assert dm.class_names == expected
    paths = dm.paths
    assert paths is not None and len(paths) == len(expected)
    assert all(Path(p).is_file() for p in paths)
    batch = next(iter(dm.predict_dataloader()))
    assert sorted(batch["label"].tolist()) == list(range(len(expected)))


# ---------------------------------------------------------------- registry errors


def test_missing_dataset_message(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        build_dataset("dtd", tmp_path)
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "dtd" / "dtd") in message
    assert "--data.root" in message and "--data.download true" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(DatasetNotFoundError, match="ImageNet-A .* not found.*cannot be downloaded"):
        build_dataset("imagenet-a", tmp_path)


def test_registry_name_and_split_errors(tmp_path: Path) -> None:
    assert canonical_dataset_name("Oxford-IIIT-Pet") == "oxford_pets"
    assert canonical_dataset_name("FGVCAircraft") == "fgvc_aircraft"
    assert canonical_dataset_name("nope", strict=False) is None
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'; expected one of \["):
        build_dataset("nope", tmp_path)
    with pytest.raises(ValueError, match=r"split for 'food101' must be one of \['train', 'test'\]"):
        build_dataset("food101", tmp_path, split="val")


def test_split_file(image_folder: Path, tmp_path: Path) -> None:
    entry = lambda cls, i, label, name: [f"{cls}/img_{i:02d}.png", label, name]  # noqa: E731
    split = {
        "train": [entry("red_square", 0, 0, "red_square"), entry("blue_stripes", 0, 2, "blue")],
        "val": [],
        "test": [
            entry("green_circle", 1, 1, "green circle"),
            entry("red_square", 2, 0, "red_square"),
        ],
    }
    path = tmp_path / "split.json"
    path.write_text(json.dumps(split))
    ds, names = build_split_file_dataset(path, image_dir=image_folder)
    assert names == ["red square", "green circle", "blue"]
    assert len(ds) == 2 and [label for _, label in (ds[0], ds[1])] == [1, 0]
    assert ds.samples[0][0] == str(image_folder / "green_circle" / "img_01.png")
    with pytest.raises(DatasetNotFoundError, match="--data.image_dir"):
        build_split_file_dataset(path)  # paths are not relative to the split file's folder
    split["val"] = [entry("red_square", 3, 0, "other")]
    path.write_text(json.dumps(split))
    with pytest.raises(ValueError, match="label 0 has two class names"):
        build_split_file_dataset(path, image_dir=image_folder)


# ---------------------------------------------------------------- datamodules


def test_image_folder_datamodule_batches(image_folder: Path) -> None:
    dm = ImageFolderDataModule(str(image_folder), batch_size=8, num_workers=0, preprocess=TO_TENSOR)
    assert dm.class_names == ["blue stripes", "green circle", "red square"] and dm.labeled
    batches = list(dm.predict_dataloader())
    assert [b["image"].shape[0] for b in batches] == [8, 8, 5]
    assert batches[0]["image"].shape[1:] == (3, 32, 32)
    assert batches[0]["image"].dtype == torch.float32
    index = torch.cat([b["index"] for b in batches])
    labels = torch.cat([b["label"] for b in batches])
    assert index.tolist() == list(range(21))
    assert labels.tolist() == [0] * 7 + [1] * 7 + [2] * 7
    paths = dm.paths
    assert paths is not None and Path(paths[7]).parent.name == "green_circle"


def test_unlabeled_datamodule_and_limit(image_folder: Path) -> None:
    dm = FrolicDataModule(
        "unlabeled",
        root=str(image_folder),
        batch_size=4,
        num_workers=0,
        limit=6,
        preprocess=TO_TENSOR,
        class_names=["a", "b", "c"],
    )
    assert dm.class_names == ["a", "b", "c"] and not dm.labeled
    batches = list(dm.predict_dataloader())
    assert all(set(b) == {"image", "index", "error"} for b in batches)
    assert torch.cat([b["index"] for b in batches]).tolist() == list(range(6))
    assert len(dm.paths) == 6 and dm.paths == sorted(dm.paths)  # seeded subset, in order
    again = FrolicDataModule("unlabeled", root=str(image_folder), limit=6, preprocess=TO_TENSOR)
    assert again.paths == dm.paths and again.class_names is None


def test_transform_comes_from_the_module(image_folder: Path) -> None:
    dm = ImageFolderDataModule(str(image_folder), num_workers=0)
    with pytest.raises(ValueError, match="expected `preprocess=` on the datamodule"):
        dm.setup("predict")
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(preprocess=TO_TENSOR))
    batch = next(iter(dm.predict_dataloader()))
    assert batch["image"].shape == (21, 3, 32, 32)


def test_frolic_datamodule_errors(image_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="--data.root"):
        FrolicDataModule("eurosat", root=str(tmp_path))
    with pytest.raises(
        ValueError, match="Expected 3 class_names for the class folders of .*, but got 2"
    ):
        ImageFolderDataModule(str(image_folder), class_names=["a", "b"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        ImageFolderDataModule(str(image_folder), batch_size=0)
    with pytest.raises(DatasetNotFoundError, match="one sub-folder per class"):
        ImageFolderDataModule(str(tmp_path))


# ---------------------------------------------------------------- bad input


def test_unreadable_file_becomes_a_flagged_placeholder(image_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    shutil.copytree(image_folder, folder)
    corrupt = folder / "green_circle" / "img_03.png"
    corrupt.write_bytes(b"not an image")
    dataset = IndexedDataset(ImageFolder(str(folder)), transform=TO_TENSOR)
    index = [p for p, _ in dataset.dataset.samples].index(str(corrupt))
    item = dataset[index]
    assert item["label"] == -1 and item["index"] == index
    assert item["error"].startswith("unreadable image: UnidentifiedImageError: cannot identify")
    assert str(corrupt) in item["error"]
    assert item["image"].shape == (3, 32, 32) and not bool(item["image"].any())
    batch = next(iter(DataLoader(dataset, batch_size=21)))  # collates with the good ones
    assert batch["error"][index] == item["error"] and batch["label"][index] == -1
    assert sum(bool(e) for e in batch["error"]) == 1
    with pytest.raises(UnidentifiedImageError):
        IndexedDataset(ImageFolder(str(folder)), TO_TENSOR, skip_unreadable=False)[index]


def test_class_names_must_be_a_list_of_strings(image_folder: Path) -> None:
    with pytest.raises(TypeError, match=r"Expected `class_names` to be a list .* got str 'catdog'"):
        ImageFolderDataModule(str(image_folder), labeled=False, class_names="catdog")
    with pytest.raises(TypeError, match=r"Expected `class_names` to be a list .* got str 'abc'"):
        ImageFolderDataModule(str(image_folder), class_names="abc")  # 3 letters, 3 folders


def test_fewer_samples_than_processes_fails_before_the_sampler(image_folder: Path) -> None:
    dm = ImageFolderDataModule(str(image_folder), limit=1, num_workers=0, preprocess=TO_TENSOR)
    dm.trainer = SimpleNamespace(world_size=2, num_devices=2)
    with pytest.raises(FrolicInputError, match=r"N >= world size 2\), but the dataset has N=1"):
        dm.predict_dataloader()


def test_num_workers_default_to_what_the_machine_has(image_folder: Path) -> None:
    dm = ImageFolderDataModule(str(image_folder), preprocess=TO_TENSOR)
    cpus = len(os.sched_getaffinity(0))
    assert dm.num_workers is None
    assert dm.predict_dataloader().num_workers == default_num_workers() == min(8, max(1, cpus - 1))
    assert default_num_workers(devices_per_node=cpus) == 1
    configs = Path(__file__).resolve().parents[1] / "configs"
    plain = [*configs.glob("*.yaml"), *configs.glob("datasets/*.yaml")]  # not paper/, families/
    assert not any("num_workers" in path.read_text() for path in plain)


def test_failed_download_names_the_root_and_leaves_no_empty_folder(
    tmp_path: Path, monkeypatch
) -> None:
    def offline(*args, **kwargs):
        raise URLError("no internet")

    monkeypatch.setattr(eurosat_module, "download_and_extract_archive", offline)
    root = tmp_path / "data"
    with pytest.raises(DatasetNotFoundError) as info:
        build_dataset("eurosat", root, download=True)
    message = str(info.value)
    assert f"pass --data.root '{root}'" in message and str(root / "eurosat" / "2750") in message
    assert "parent" not in message
    assert not root.exists()  # the attempt created data/eurosat/ and removed it again
    (root / "keep.txt").parent.mkdir()
    (root / "keep.txt").write_text("mine")
    with pytest.raises(DatasetNotFoundError):
        build_dataset("eurosat", root, download=True)
    assert sorted(p.name for p in root.iterdir()) == ["keep.txt"]  # the user's folder stays
