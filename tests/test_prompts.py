"""Prompt templates, class prompts and CLIP prompt ensembling."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

from frolic_tta.clip.prompts import (
    DATASET_TEMPLATES,
    build_class_prompts,
    encode_prototypes,
    load_descriptions,
    resolve_templates,
)
from frolic_tta.data.datasets import DATASETS

# ---------------------------------------------------------------- templates


def test_openai_and_simple_templates() -> None:
    openai = resolve_templates("openai")
    assert len(openai) == 80 and len(set(openai)) == 80
    assert openai[0] == "a bad photo of a {}."
    assert [t.format("dog") for t in openai] == [t("dog") for t in OPENAI_IMAGENET_TEMPLATES]
    simple = resolve_templates("Simple")
    assert len(simple) == 7 and all("{}" in t for t in simple)


def test_dataset_templates() -> None:
    assert set(DATASETS) == set(DATASET_TEMPLATES)
    assert resolve_templates("oxford_pets") == ["a photo of a {}, a type of pet."]
    assert resolve_templates("OxfordPets") == resolve_templates("pets")
    assert resolve_templates("food101") == ["a photo of {}, a type of food."]
    assert len(resolve_templates("ucf101")) == 48
    assert len(resolve_templates("caltech101")) == 34
    assert resolve_templates("ImageNet-A") == resolve_templates("openai")
    for key, templates in DATASET_TEMPLATES.items():
        assert templates and all(t.count("{}") == 1 for t in templates), key
    # a returned list is a copy: mutating it does not change the registry
    resolve_templates("dtd").append("x {}")
    assert len(DATASET_TEMPLATES["dtd"]) == 8


def test_custom_templates() -> None:
    assert resolve_templates(["a {}.", "the {}!"]) == ["a {}.", "the {}!"]
    assert resolve_templates("a photo of a {}.") == ["a photo of a {}."]
    assert resolve_templates((lambda c: f"art of {c}",)) == ["art of {}"]


@pytest.mark.parametrize(
    ("templates", "message"),
    [
        ("no-such-set", "templates must be 'openai', 'simple', a dataset key"),
        (["a photo of a {}.", "a photo"], "each template must be a string containing '{}'"),
        ([], "non-empty list of strings"),
        (42, "non-empty list of strings"),
    ],
)
def test_bad_templates(templates: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_templates(templates)  # type: ignore[arg-type]


# ---------------------------------------------------------------- class prompts


def test_prompts_by_index_and_duplicates_warn() -> None:
    names = ["cat", "dog", "cat"]
    with pytest.warns(UserWarning, match=r"duplicate class names \['cat'\]"):
        prompts = build_class_prompts(names, templates=["a {}.", "the {}."])
    assert prompts == [["a cat.", "the cat."], ["a dog.", "the dog."], ["a cat.", "the cat."]]


def test_descriptions_with_fallback(tmp_path) -> None:
    descriptions = {"cat": ["A cat has whiskers.", "Cats purr."], "Sea_Lion": ["It barks."]}
    path = tmp_path / "cupl.json"
    path.write_text(json.dumps(descriptions))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prompts = build_class_prompts(["cat", "dog", "sea lion"], "a {}.", descriptions=path)
    assert prompts == [
        ["A cat has whiskers.", "Cats purr.", "a cat."],
        ["a dog."],
        ["It barks.", "a sea lion."],
    ]
    only = build_class_prompts(["cat"], descriptions=descriptions)
    assert only == [["A cat has whiskers.", "Cats purr."]]
    with pytest.raises(
        ValueError,
        match=r"no descriptions and no templates for 1 class\(es\), "
        r"e\.g\. \['dog'\]",
    ):
        build_class_prompts(["cat", "dog"], descriptions=descriptions)
    with pytest.raises(ValueError, match="needs templates or descriptions; got neither"):
        build_class_prompts(["cat"])
    with pytest.raises(ValueError, match="class_names must be a non-empty list"):
        build_class_prompts([], templates="openai")
    with pytest.raises(ValueError, match=r"empty at indices \[1\]"):
        build_class_prompts(["cat", " "], templates="openai")


def test_load_descriptions_validates(tmp_path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"a": ["x", "y"]}))
    assert load_descriptions(good) == {"a": ["x", "y"]}
    cases = {
        "list.json": ([["x"]], "must hold a non-empty JSON object"),
        "str.json": ({"a": "x"}, "class 'a': expected a non-empty list of non-empty strings"),
        "empty.json": ({"a": []}, "class 'a': expected a non-empty list"),
        "nums.json": ({"a": ["ok", 3]}, "class 'a': expected a non-empty list"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(json.dumps(content))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_descriptions(tmp_path / name)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_descriptions(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="descriptions file not found"):
        load_descriptions(tmp_path / "missing.json")


# ---------------------------------------------------------------- prototypes


class _TableModel(torch.nn.Module):
    """encode_text returns a fixed row per token id: exact arithmetic for the ensembling."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table[tokens[:, 0]]


def test_ensembling_is_normalise_mean_normalise() -> None:
    table = torch.tensor([[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0], [5.0, 5.0]])
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3}

    def tokenizer(texts: list[str]) -> torch.Tensor:
        return torch.tensor([[vocab[t]] for t in texts])

    model = _TableModel(table).train()
    got = encode_prototypes(model, tokenizer, [["a", "b"], ["c"], ["d", "a", "b"]], batch_size=2)
    unit = F.normalize(table, dim=-1)
    expected = F.normalize(
        torch.stack([unit[[0, 1]].mean(0), unit[2], unit[[3, 0, 1]].mean(0)]), dim=-1
    )
    torch.testing.assert_close(got, expected)
    assert got.dtype == torch.float32 and model.training  # mode restored
    with pytest.raises(ValueError, match=r"classes \[1\] have none"):
        encode_prototypes(model, tokenizer, [["a"], []])
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        encode_prototypes(model, tokenizer, [["a"]], batch_size=0)


def test_prototypes_on_tiny_clip(tiny_clip_loaded) -> None:
    model, _, tokenizer = tiny_clip_loaded
    prompts = build_class_prompts(["cat", "dog", "bird"], templates=["a {}.", "the {}!", "my {}"])
    prompts[1] = prompts[1][:1]  # uneven prompt counts across classes
    got = encode_prototypes(model, tokenizer, prompts, batch_size=3)
    assert got.shape == (3, 32) and got.device.type == "cpu"
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(3))
    with torch.no_grad():
        hand = []
        for class_prompts in prompts:
            emb = model.encode_text(tokenizer(class_prompts)).float()
            emb = emb / emb.norm(dim=-1, keepdim=True)
            mean = emb.mean(dim=0)
            hand.append(mean / mean.norm())
    torch.testing.assert_close(got, torch.stack(hand), atol=1e-5, rtol=1e-5)
    again = encode_prototypes(model, tokenizer, prompts, batch_size=3)
    assert torch.equal(got, again)  # deterministic
    one_by_one = encode_prototypes(model, tokenizer, prompts, batch_size=1)
    torch.testing.assert_close(got, one_by_one, atol=1e-5, rtol=1e-5)
