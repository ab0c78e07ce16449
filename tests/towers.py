"""Tiny open_clip models, one per tower type of the model families in configs/ (offline, seconds).

Each tiny config is *derived from a real open_clip config* (same tower classes and switches:
timm trunk and pooling, SigLIP-style text without causal mask, logit bias, ...) with tiny
dimensions, so a family config is exercised by the tiny model of the same :func:`tower_type`:

* ``frolic-tiny-vit`` (tests/conftest.py): open_clip's own ViT (OpenAI CLIP, MetaCLIP, DFN);
* ``frolic-tiny-sigmoid``: SigLIP/SigLIP2 (``ViT-B-16-SigLIP2``): timm ``VisionTransformer`` with
  attention-pool (``timm_pool: map``) and a text tower without causal mask, last-token pooling
  and an initial ``logit_bias``;
* ``frolic-tiny-eva02``: EVA02 (``EVA02-B-16``): timm ``Eva`` trunk (rotary embeddings, SwiGLU);
* ``frolic-tiny-resnet``: OpenAI's modified ResNet (``RN50``).

timm builds a trunk from its own registry only, so the tiny trunks are registered with timm as
the real architectures with tiny keyword arguments (:data:`TINY_TIMM`). Tokenizers: the real
SigLIP configs name a Hugging Face tokenizer (downloaded, and it needs ``transformers``); the tiny
configs drop it and use open_clip's default BPE tokenizer, which ships with open_clip. None of
the tiny names contains "siglip", which would make ``open_clip.get_tokenizer`` fetch one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import timm
import torch
from timm.models import register_model

TIMM_TRUNKS = {  # tiny name registered with timm -> the real timm architecture
    "frolic_tiny_siglip_vit": "vit_base_patch16_siglip_224",
    "frolic_tiny_eva02": "eva02_base_patch16_clip_224",
}
TINY_TIMM: dict[str, Any] = {
    "img_size": 32,
    "patch_size": 8,
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 2,
}
TOWERS = {  # tiny open_clip name -> (real open_clip config it is derived from, its tau_c)
    "frolic-tiny-sigmoid": ("ViT-B-16-SigLIP2", 0.03),
    "frolic-tiny-eva02": ("EVA02-B-16", 0.02),
    "frolic-tiny-resnet": ("RN50", 0.05),
}


@dataclass(frozen=True)
class Tower:
    """A tiny open_clip model registered with open_clip, and its seeded checkpoint."""

    model_name: str
    real_name: str
    checkpoint_path: Path
    tau_c: float


def register_timm_trunks() -> None:
    """Register :data:`TIMM_TRUNKS` with timm (idempotent)."""
    for name, base in TIMM_TRUNKS.items():
        if timm.is_model(name):
            continue

        def create(pretrained: bool = False, *, _base: str = base, **kwargs: Any) -> Any:
            for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
                kwargs.pop(key, None)
            return timm.create_model(_base, pretrained=False, **{**TINY_TIMM, **kwargs})

        create.__name__ = create.__qualname__ = name
        create.__module__ = __name__
        register_model(create)


def tiny_config(real_name: str) -> dict[str, Any]:
    """``real_name``'s open_clip config with tiny dimensions and open_clip's default tokenizer."""
    config = open_clip.get_model_config(real_name)
    config["embed_dim"] = 32
    vision, text = config["vision_cfg"], config["text_cfg"]
    vision["image_size"] = 32
    if "timm_model_name" in vision:
        tiny = {base: name for name, base in TIMM_TRUNKS.items()}
        vision["timm_model_name"] = tiny[vision["timm_model_name"]]
    elif isinstance(vision.get("layers"), list):  # modified ResNet
        vision.update(layers=[1, 1, 1, 1], width=8)
    else:
        vision.update(layers=2, width=64, patch_size=8, head_width=32)
    for key in ("hf_tokenizer_name", "tokenizer_kwargs"):
        text.pop(key, None)
    text.update(vocab_size=49408, width=32, heads=2, layers=2)
    return config


def tower_type(config: dict[str, Any]) -> tuple[Any, ...]:
    """What makes towers different code paths: trunk class and pooling, text switches."""
    vision, text = config["vision_cfg"], config["text_cfg"]
    if "timm_model_name" in vision:
        trunk = TIMM_TRUNKS.get(vision["timm_model_name"], vision["timm_model_name"])
        image = ("timm", trunk, vision.get("timm_pool"), vision.get("timm_proj"))
    else:
        image = ("resnet",) if isinstance(vision.get("layers"), list) else ("vit",)
    switches = ("no_causal_mask", "pool_type", "proj_bias", "act_kwargs", "norm_kwargs")
    text_type = json.dumps({key: text.get(key) for key in switches}, sort_keys=True)
    return image, text_type, bool(config.get("custom_text")), config.get("init_logit_bias")


def build_tower(folder: Path, name: str) -> Tower:
    """Register tiny model ``name`` (a :data:`TOWERS` key) and save seeded weights."""
    real_name, tau_c = TOWERS[name]
    register_timm_trunks()
    config_path = folder / f"{name}.json"  # open_clip registers configs by file stem
    config_path.write_text(json.dumps(tiny_config(real_name), indent=2))
    open_clip.add_model_config(config_path)
    torch.manual_seed(0)
    model = open_clip.create_model(name)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(1.0 / tau_c))
    checkpoint_path = folder / f"{name}.pt"
    torch.save(model.state_dict(), checkpoint_path)
    return Tower(name, real_name, checkpoint_path, tau_c)
