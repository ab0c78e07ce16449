"""Loading a frozen open_clip model, with errors that say how to fix them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import open_clip
import torch


class WeightsNotFoundError(RuntimeError):
    """open_clip could not find or download the requested weights."""


def resolve_model_name(model_name: str) -> str:
    """An open_clip model name, or the path of a model-config JSON (registered under its stem).

    Raises:
        FileNotFoundError: a ``.json`` path that does not exist.
    """
    if model_name.endswith(".json"):
        path = Path(model_name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"open_clip model config {str(path)!r} does not exist; pass an open_clip model "
                "name (e.g. --model.model_name ViT-B-16) or the path of a model-config JSON"
            )
        open_clip.add_model_config(path)
        return path.stem
    return model_name


def load_open_clip(model_name: str, pretrained: str | None) -> tuple[torch.nn.Module, Any, Any]:
    """Create a frozen open_clip model: ``(model, eval preprocess, tokenizer)``.

    Args:
        model_name: any open_clip model name (``"ViT-B-16"``) or a model-config JSON path.
        pretrained: an open_clip tag (``"openai"``), a local checkpoint path, or ``None``
            (random weights; for timing and tests). A tag trained with QuickGELU (``openai``)
            gets QuickGELU even under a plain model name; a checkpoint *path* cannot tell, so
            pass e.g. ``ViT-B-16-quickgelu`` for OpenAI weights from a file.

    Raises:
        WeightsNotFoundError: a checkpoint path that does not exist, or weights that could not
            be downloaded, with the fix (``--model.pretrained /path/to.ckpt``).
        ValueError: an unknown model name.
    """
    name = resolve_model_name(model_name)
    if name not in open_clip.list_models():
        raise ValueError(
            f"Expected `model_name` to be an open_clip model or a config JSON path, but got "
            f"{model_name!r} (see open_clip.list_models())"
        )
    looks_like_path = pretrained is not None and (
        "/" in pretrained or pretrained.endswith((".pt", ".pth", ".bin", ".safetensors", ".ckpt"))
    )
    if looks_like_path and not Path(pretrained).expanduser().is_file():
        raise WeightsNotFoundError(
            f"checkpoint {pretrained!r} for {name!r} does not exist; pass an existing file with "
            "--model.pretrained /path/to.ckpt or an open_clip tag such as 'openai'"
        )
    options: dict[str, Any] = {}
    if pretrained is not None and not looks_like_path:
        # OpenAI weights were trained with QuickGELU; open_clip's plain "ViT-B-16" config uses
        # GELU and only warns. Build the activation the tag was trained with.
        tag_cfg = open_clip.get_pretrained_cfg(name, pretrained) or {}
        model_cfg = open_clip.get_model_config(name) or {}
        if tag_cfg.get("quick_gelu", False) and not model_cfg.get("quick_gelu", False):
            options["force_quick_gelu"] = True
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=pretrained, **options
        )
    except RuntimeError as error:
        text = str(error)
        if "download" in text.lower() or "not a known tag" in text:
            tags = [tag for arch, tag in open_clip.list_pretrained() if arch == name]
            raise WeightsNotFoundError(
                f"could not load weights {pretrained!r} for open_clip model {name!r} "
                f"(known tags: {tags}); without internet, download the checkpoint elsewhere and "
                f"pass --model.pretrained /path/to.ckpt. open_clip said: {text.splitlines()[0]}"
            ) from None
        raise
    model.eval().requires_grad_(False)
    return model, preprocess, open_clip.get_tokenizer(name)


def load_open_clip_architecture(
    model_name: str, pretrained: str | None
) -> tuple[torch.nn.Module, Any, Any]:
    """:func:`load_open_clip`'s model with *random* weights: nothing is read or downloaded.

    For a checkpoint that carries the weights itself. The architecture and the preprocessing
    are those ``pretrained`` implies (a tag's QuickGELU, mean/std, resize mode); a checkpoint
    path implies nothing beyond ``model_name``.
    """
    name = resolve_model_name(model_name)
    if name not in open_clip.list_models():
        raise ValueError(
            f"Expected `model_name` to be an open_clip model or a config JSON path, but got "
            f"{model_name!r} (see open_clip.list_models())"
        )
    tag: dict[str, Any] = {}
    if pretrained is not None:
        tag = open_clip.get_pretrained_cfg(name, pretrained) or {}
    options: dict[str, Any] = {}
    if tag.get("quick_gelu", False) and not (open_clip.get_model_config(name) or {}).get(
        "quick_gelu", False
    ):
        options["force_quick_gelu"] = True
    for key in ("mean", "std", "interpolation", "resize_mode"):
        if key in tag:
            options[f"image_{key}"] = tag[key]
    model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, **options)
    model.eval().requires_grad_(False)
    return model, preprocess, open_clip.get_tokenizer(name)
