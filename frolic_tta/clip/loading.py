r"""Loading a frozen open_clip model, with errors that say how to fix them.

**Names.** :func:`load_open_clip` takes every model name open_clip's
``create_model_and_transforms`` takes, plus a config file:

* a registered architecture (``open_clip.list_models()``, e.g. ``"ViT-B-16"``; ``"ViT-B/16"``
  is read as ``"ViT-B-16"``, as open_clip does), with ``pretrained`` an open_clip tag
  (``open_clip.list_pretrained()``), a checkpoint file or ``None`` (random weights);
* ``"hf-hub:org/name"``: config and weights of a Hugging Face Hub repository;
* ``"local-dir:/path"``: a folder with ``open_clip_config.json`` (``{"model_cfg": ...,
  "preprocess_cfg": ...}``) and a weight file (``*.safetensors``, ``*.bin`` or ``*.pth``; e.g.
  ``open_clip_model.safetensors``), the layout of open_clip's Hub repositories;
* the path of a model-config JSON (registered with open_clip under its file stem).

With ``hf-hub:`` and ``local-dir:`` the weights come with the name and ``pretrained`` is ignored.

**Offline.** The Hugging Face cache first, then one fast probe of the Hub, then one line
(:mod:`frolic_tta.clip.hub`).

**Temperature.** :func:`model_temperature` is the model's own zero-shot temperature
:math:`\tau_c = 1/\exp(\text{logit\_scale})` (0.01 for OpenAI CLIP, the paper's value).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import open_clip
import torch
from open_clip.constants import HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

from frolic_tta.clip.hub import (
    HF_HUB,
    LOCAL_DIR,
    WEIGHT_SUFFIXES,
    WeightsNotFoundError,
    cached_file,
    check_dependencies,
    fix_hint,
    hub_files,
    model_config,
    quiet_hub,
    require_hub,
    weight_files,
)
from frolic_tta.options import check_positive


def suggest(value: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the closest of ``choices`` (case-insensitive), or ``""``."""
    by_lower = {choice.lower(): choice for choice in choices}
    match = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.75)
    return f"; did you mean {by_lower[match[0]]!r}?" if match else ""


def resolve_model_name(model_name: str) -> str:
    """The name to give open_clip for any accepted ``model_name`` (see the module docstring).

    Raises:
        FileNotFoundError: a ``.json`` path, or a ``local-dir:`` folder or its config, missing.
        ValueError: an unknown architecture (with the closest name), a malformed ``hf-hub:``
            name, or a config file that open_clip cannot read.
    """
    if not isinstance(model_name, str) or not model_name:
        raise TypeError(f"Expected `model_name` to be a non-empty string, but got {model_name!r}")
    if model_name.startswith(LOCAL_DIR):
        folder = Path(model_name[len(LOCAL_DIR) :]).expanduser()
        config = folder / HF_CONFIG_NAME
        if not config.is_file():
            what = "does not exist" if not folder.is_dir() else f"has no {HF_CONFIG_NAME}"
            raise FileNotFoundError(
                f"'local-dir:' folder {str(folder)!r} {what}; expected a folder with "
                f"{HF_CONFIG_NAME} and a weight file ({', '.join(WEIGHT_SUFFIXES)})"
            )
        keys = list(json.loads(config.read_text()))
        if "model_cfg" not in keys:
            raise ValueError(
                f"Expected {str(config)!r} to hold 'model_cfg' (and 'preprocess_cfg'), as "
                f"open_clip writes it, but it has the keys {keys}"
            )
        return LOCAL_DIR + str(folder)
    if model_name.startswith(HF_HUB):
        parts = model_name[len(HF_HUB) :].split("/")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"Expected `model_name` 'hf-hub:org/name', but got {model_name!r}")
        return model_name
    if model_name.endswith(".json"):
        path = Path(model_name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"open_clip model config {str(path)!r} does not exist; pass an open_clip model "
                "name (e.g. --model.model_name ViT-B-16) or the path of a model-config JSON"
            )
        open_clip.add_model_config(path)
        if path.stem not in open_clip.list_models():
            raise ValueError(
                f"Expected {str(path)!r} to be an open_clip model config with 'embed_dim', "
                "'vision_cfg' and 'text_cfg'"
            )
        return path.stem
    name = model_name.replace("/", "-")  # open_clip's own reading of "ViT-B/16"
    if name in open_clip.list_models():
        return name
    raise ValueError(
        "Expected `model_name` to be an open_clip model (open_clip.list_models()), "
        "'hf-hub:org/name', 'local-dir:/path/to/folder' or a model-config JSON path, but got "
        f"{model_name!r}{suggest(name, open_clip.list_models())}"
    )


def resolve_pretrained(name: str, pretrained: str | None) -> str | None:
    """Check ``pretrained`` for registered architecture ``name``: a tag, a file or ``None``.

    Raises:
        WeightsNotFoundError: a checkpoint path that does not exist.
        ValueError: an unknown tag (with the model's tags and the closest one).
    """
    if pretrained is None or open_clip.get_pretrained_cfg(name, pretrained):
        return pretrained
    path = Path(pretrained).expanduser()
    if path.is_file():
        return str(path)
    if path.is_dir():
        raise WeightsNotFoundError(
            f"checkpoint {pretrained!r} for {name!r} is a folder; for a folder with "
            f"{HF_CONFIG_NAME} pass model_name='local-dir:{pretrained}' (--model.model_name "
            f"local-dir:{pretrained})"
        )
    if "/" in pretrained or os.sep in pretrained or pretrained.endswith((*WEIGHT_SUFFIXES, ".pt")):
        raise WeightsNotFoundError(
            f"checkpoint {pretrained!r} for {name!r} does not exist; pass an existing file, "
            "pretrained='/path/to.ckpt' (--model.pretrained /path/to.ckpt), or an open_clip tag "
            "such as 'openai'"
        )
    tags = open_clip.list_pretrained_tags_by_model(name)
    if not tags:
        raise ValueError(
            f"Expected `pretrained` to be a checkpoint file or None for {name!r} (open_clip has "
            f"no tags for it), but got {pretrained!r}"
        )
    raise ValueError(
        f"Expected `pretrained` to be one of open_clip's tags for {name!r} {tags}, a checkpoint "
        f"file or None, but got {pretrained!r}{suggest(pretrained, tags)}"
    )


def check_tau_c(tau_c: float | str) -> float | None:
    r"""``None`` for ``"model"`` (take :math:`\tau_c` from the model), else the checked float.

    Raises:
        TypeError: not a real number or a string.
        ValueError: a string other than ``"model"``, or a float that is not finite and > 0.
    """
    if isinstance(tau_c, str):
        if tau_c != "model":
            raise ValueError(
                f"Expected `tau_c` to be a finite number > 0 or 'model', but got {tau_c!r}"
            )
        return None
    return check_positive("tau_c", tau_c)


def model_temperature(model: torch.nn.Module) -> float:
    r"""The zero-shot temperature the model learned: :math:`\tau_c = 1/\exp(\text{logit\_scale})`.

    open_clip's ``logit_scale`` is the log of the scale of the cosine logits; OpenAI CLIP's is
    :math:`\ln 100`, so :math:`\tau_c = 0.01`, the paper's value. SigLIP models also learn a
    ``logit_bias`` :math:`b` (logits :math:`s \cos + b`): the same shift for every class, which a
    softmax over classes ignores, so only the scale enters Frolic.

    Raises:
        ValueError: the model has no scalar ``logit_scale``, or it gives no finite
            :math:`\tau_c > 0`; pass a float ``tau_c`` instead.
    """
    scale = getattr(model, "logit_scale", None)
    fix = "; pass a float instead, e.g. tau_c=0.01 (--model.tau_c 0.01)"
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(
            f"Expected the model to have a scalar learned `logit_scale` for tau_c='model', but "
            f"{type(model).__name__} has {scale!r}{fix}"
        )
    log_scale = float(scale.detach().float().reshape(()))
    if not (math.isfinite(log_scale) and abs(log_scale) < 700):
        raise ValueError(
            f"Expected the model's `logit_scale` to give a finite tau_c > 0, but it is "
            f"{log_scale!r}{fix}"
        )
    return math.exp(-log_scale)


def _activation_options(name: str, tag_cfg: dict[str, Any]) -> dict[str, Any]:
    """OpenAI weights were trained with QuickGELU; open_clip's plain ``"ViT-B-16"`` config uses
    GELU and only warns. Build the activation the tag was trained with."""
    model_cfg = open_clip.get_model_config(name) or {}
    if tag_cfg.get("quick_gelu", False) and not model_cfg.get("quick_gelu", False):
        return {"force_quick_gelu": True}
    return {}


def load_open_clip(
    model_name: str, pretrained: str | None, *, cache_dir: str | None = None
) -> tuple[torch.nn.Module, Any, Any]:
    """Create a frozen open_clip model: ``(model, eval preprocess, tokenizer)``.

    Args:
        model_name: any name open_clip accepts (``"ViT-B-16"``, ``"hf-hub:org/name"``,
            ``"local-dir:/path"``) or a model-config JSON path; see the module docstring.
        pretrained: an open_clip tag (``"openai"``), a local checkpoint path, or ``None``
            (random weights; for timing and tests); ignored for ``hf-hub:``/``local-dir:``. A
            tag trained with QuickGELU (``openai``) gets QuickGELU even under a plain model name;
            a checkpoint *path* cannot tell, so pass e.g. ``ViT-B-16-quickgelu`` for OpenAI
            weights from a file.
        cache_dir: Hugging Face cache folder (default: the Hub's, ``HF_HUB_CACHE``).

    Raises:
        WeightsNotFoundError: weights that do not exist, are not cached while the Hub cannot be
            reached (within seconds), or failed to download, with the fix.
        ValueError: an unknown model name or tag (with the closest match).
        FileNotFoundError: a missing config file or ``local-dir:`` folder.
    """
    name = resolve_model_name(model_name)
    options: dict[str, Any] = {}
    tag_cfg: dict[str, Any] = {}
    if name.startswith((HF_HUB, LOCAL_DIR)):
        pretrained = None  # the weights come with the name
    else:
        pretrained = resolve_pretrained(name, pretrained)
        tag_cfg = open_clip.get_pretrained_cfg(name, pretrained) if pretrained else {}
        options = _activation_options(name, tag_cfg)
    if name.startswith(LOCAL_DIR):
        folder = Path(name[len(LOCAL_DIR) :])
        if not any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir()):
            raise WeightsNotFoundError(
                f"'local-dir:' folder {str(folder)!r} has {HF_CONFIG_NAME} but no weight file "
                f"({', '.join(WEIGHT_SUFFIXES)}); open_clip would build random weights"
            )
    config = model_config(name, cache_dir)
    check_dependencies(name, config)
    files = hub_files(name, tag_cfg, config)
    missing = [file for file in files if cached_file(file, cache_dir) is None]
    if missing:
        require_hub(name, pretrained, cache_dir)
    extra = {"cache_dir": cache_dir} if cache_dir is not None else {}
    try:
        with quiet_hub(offline=not missing) if files else nullcontext():
            model, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=pretrained, **options, **extra
            )
            tokenizer = open_clip.get_tokenizer(name, **extra)
    except (RuntimeError, OSError, ImportError) as error:  # ImportError: a Hub tokenizer
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        tags = f", known tags: {open_clip.list_pretrained_tags_by_model(name)}" if tag_cfg else ""
        raise WeightsNotFoundError(
            f"could not load open_clip model {name!r} (weights {pretrained!r}{tags}); "
            f"{fix_hint(name)}. open_clip said: {text}"
        ) from None
    if (
        name.startswith(HF_HUB)
        and cached_file(weight_files(name[len(HF_HUB) :]), cache_dir) is None
    ):
        raise WeightsNotFoundError(
            f"{name!r} has no open_clip weights ({HF_SAFE_WEIGHTS_NAME} or {HF_WEIGHTS_NAME}); "
            "open_clip would build random weights"
        )
    model.eval().requires_grad_(False)
    return model, preprocess, tokenizer


def load_open_clip_architecture(
    model_name: str, pretrained: str | None
) -> tuple[torch.nn.Module, Any, Any]:
    """:func:`load_open_clip`'s model with *random* weights: nothing is read or downloaded.

    For a checkpoint that carries the weights itself. The architecture and the preprocessing
    are those ``pretrained`` implies (a tag's QuickGELU, mean/std, resize mode); a checkpoint
    path implies nothing beyond ``model_name``. ``hf-hub:`` names need their config in the
    Hugging Face cache, ``local-dir:`` names their folder.
    """
    name = resolve_model_name(model_name)
    tag: dict[str, Any] = {}
    if not name.startswith((HF_HUB, LOCAL_DIR)) and pretrained is not None:
        tag = open_clip.get_pretrained_cfg(name, pretrained) or {}  # {} for a file
    options = _activation_options(name, tag)
    for key in ("mean", "std", "interpolation", "resize_mode"):
        if key in tag:
            options[f"image_{key}"] = tag[key]
    with quiet_hub(offline=True):
        model, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=None, **options
        )
        tokenizer = open_clip.get_tokenizer(name)
    model.eval().requires_grad_(False)
    return model, preprocess, tokenizer
