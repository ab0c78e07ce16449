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

**Offline.** Weights (and a Hub tokenizer) already in the Hugging Face cache are loaded without
contacting the Hub. Otherwise ``HF_HUB_OFFLINE`` is honoured and the Hub is probed once, with a
:data:`PROBE_TIMEOUT_S` timeout, before open_clip downloads anything: a machine without internet
gets one line within seconds instead of a minute of retry warnings.

**Temperature.** :func:`model_temperature` is the model's own zero-shot temperature
:math:`\tau_c = 1/\exp(\text{logit\_scale})` (0.01 for OpenAI CLIP, the paper's value).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import math
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import open_clip
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from open_clip.constants import HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

from frolic_tta.options import check_positive

HF_HUB = "hf-hub:"
LOCAL_DIR = "local-dir:"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth")
"""Weight files open_clip finds in a ``local-dir:`` folder."""
PROBE_TIMEOUT_S = 5.0
"""Seconds the one connectivity probe waits for the Hub before giving up."""
_REACHABLE: dict[str, bool] = {}
HubFile = tuple[str, tuple[str, ...]]
"""``(repo_id, filenames)``: a file open_clip fetches from the Hub (the first cached one wins)."""


class WeightsNotFoundError(RuntimeError):
    """open_clip could not find or download the requested weights (or what loads with them)."""


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
            f"{HF_CONFIG_NAME} pass --model.model_name local-dir:{pretrained}"
        )
    if "/" in pretrained or os.sep in pretrained or pretrained.endswith((*WEIGHT_SUFFIXES, ".pt")):
        raise WeightsNotFoundError(
            f"checkpoint {pretrained!r} for {name!r} does not exist; pass an existing file with "
            "--model.pretrained /path/to.ckpt or an open_clip tag such as 'openai'"
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


# ---------------------------------------------------------------------------- network
def hub_offline_requested() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (in the environment or huggingface_hub's constants)."""
    value = os.environ.get("HF_HUB_OFFLINE", "")
    return bool(hub_constants.HF_HUB_OFFLINE) or value.upper() in {"1", "ON", "YES", "TRUE"}


def can_reach(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``url`` answers a HEAD request within ``timeout`` s (any HTTP status; cached)."""
    if url not in _REACHABLE:
        request = urllib.request.Request(url, method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                pass
            reachable = True
        except urllib.error.HTTPError:
            reachable = True  # the server answered
        except urllib.error.URLError as error:
            reachable = isinstance(error.reason, ssl.SSLError)  # answered, certificate aside
        except (OSError, ValueError):
            reachable = False
        _REACHABLE[url] = reachable
    return _REACHABLE[url]


@contextmanager
def _hub(offline: bool) -> Iterator[None]:
    """Hub retry warnings silenced; with ``offline``, no request leaves (cache only)."""
    logger = logging.getLogger("huggingface_hub")
    level, flag, env = logger.level, hub_constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    logger.setLevel(logging.ERROR)
    if offline:
        hub_constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"  # for transformers (Hub tokenizers)
    try:
        yield
    finally:
        logger.setLevel(level)
        hub_constants.HF_HUB_OFFLINE = flag
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env


def _cached(file: HubFile, cache_dir: str | None) -> str | None:
    repo_id, filenames = file
    for filename in filenames:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
        if isinstance(found, str):
            return found
    return None


def _weight_files(repo_id: str, filename: str = HF_WEIGHTS_NAME) -> HubFile:
    """open_clip tries the ``.safetensors`` twin of a weight file first."""
    if filename == HF_WEIGHTS_NAME:
        return repo_id, (HF_SAFE_WEIGHTS_NAME, filename)
    if filename.endswith((".bin", ".pth")):
        return repo_id, (filename[:-4] + ".safetensors", filename)
    return repo_id, (filename,)


def _model_config(name: str, cache_dir: str | None) -> dict[str, Any] | None:
    """The model config, without any download (``None`` for an uncached ``hf-hub:`` name)."""
    if name.startswith(HF_HUB):
        path = _cached((name[len(HF_HUB) :], (HF_CONFIG_NAME,)), cache_dir)
        return json.loads(Path(path).read_text()).get("model_cfg") if path else None
    return open_clip.get_model_config(name)


def _hub_files(name: str, tag_cfg: dict[str, Any], config: dict[str, Any] | None) -> list[HubFile]:
    """Every Hub file open_clip (and a Hub tokenizer) will fetch for this model."""
    files: list[HubFile] = []
    if name.startswith(HF_HUB):
        repo_id = name[len(HF_HUB) :]
        files += [(repo_id, (HF_CONFIG_NAME,)), _weight_files(repo_id)]
    elif tag_cfg.get("hf_hub") and "file" not in tag_cfg:
        repo_id, filename = os.path.split(tag_cfg["hf_hub"])
        files.append(_weight_files(repo_id, filename or HF_WEIGHTS_NAME))
    tokenizer = (config or {}).get("text_cfg", {}).get("hf_tokenizer_name")
    if tokenizer and not name.startswith(LOCAL_DIR):  # local-dir: tokenizer files in the folder
        files.append((tokenizer, ("tokenizer_config.json",)))
    return files


def _check_dependencies(name: str, config: dict[str, Any] | None) -> None:
    text_cfg = (config or {}).get("text_cfg", {})
    needs = text_cfg.get("hf_tokenizer_name") or text_cfg.get("hf_model_name")
    if needs and importlib.util.find_spec("transformers") is None:
        raise WeightsNotFoundError(
            f"open_clip model {name!r} needs the `transformers` package for its Hugging Face "
            f"tokenizer or text tower ({needs!r}): pip install transformers"
        )


def _require_hub(name: str, pretrained: str | None, cache_dir: str | None) -> None:
    """Raise one line at once if the Hub cannot be used; else return (open_clip downloads)."""
    if hub_offline_requested():
        reason = "HF_HUB_OFFLINE is set"
    elif not can_reach(hub_constants.ENDPOINT):
        reason = f"{hub_constants.ENDPOINT} cannot be reached (no internet?)"
    else:
        return
    cache = cache_dir or hub_constants.HF_HUB_CACHE
    if pretrained is None:
        what = f"the files of {name!r} are"
    else:
        what = f"weights {pretrained!r} of open_clip model {name!r} are"
    raise WeightsNotFoundError(
        f"{what} not in the local cache ({cache}) and {reason}; run once with internet (the "
        f"cache is then used offline), or {_fix(name)}"
    )


def _fix(name: str) -> str:
    if name.startswith(HF_HUB):
        return "copy the repository into a folder: --model.model_name local-dir:/path/to/folder"
    return "pass --model.pretrained /path/to.ckpt"


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
        # OpenAI weights were trained with QuickGELU; open_clip's plain "ViT-B-16" config uses
        # GELU and only warns. Build the activation the tag was trained with.
        model_cfg = open_clip.get_model_config(name) or {}
        if tag_cfg.get("quick_gelu", False) and not model_cfg.get("quick_gelu", False):
            options["force_quick_gelu"] = True
    if name.startswith(LOCAL_DIR):
        folder = Path(name[len(LOCAL_DIR) :])
        if not any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir()):
            raise WeightsNotFoundError(
                f"'local-dir:' folder {str(folder)!r} has {HF_CONFIG_NAME} but no weight file "
                f"({', '.join(WEIGHT_SUFFIXES)}); open_clip would build random weights"
            )
    config = _model_config(name, cache_dir)
    _check_dependencies(name, config)
    files = _hub_files(name, tag_cfg, config)
    missing = [file for file in files if _cached(file, cache_dir) is None]
    if missing:
        _require_hub(name, pretrained, cache_dir)
    extra = {"cache_dir": cache_dir} if cache_dir is not None else {}
    try:
        with _hub(offline=not missing) if files else nullcontext():
            model, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=pretrained, **options, **extra
            )
            tokenizer = open_clip.get_tokenizer(name, **extra)
    except (RuntimeError, OSError, ImportError) as error:  # ImportError: a Hub tokenizer
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        tags = f", known tags: {open_clip.list_pretrained_tags_by_model(name)}" if tag_cfg else ""
        raise WeightsNotFoundError(
            f"could not load open_clip model {name!r} (weights {pretrained!r}{tags}); "
            f"{_fix(name)}. open_clip said: {text}"
        ) from None
    if name.startswith(HF_HUB) and _cached(_weight_files(name[len(HF_HUB) :]), cache_dir) is None:
        raise WeightsNotFoundError(
            f"{name!r} has no open_clip weights ({HF_SAFE_WEIGHTS_NAME} or {HF_WEIGHTS_NAME}); "
            "open_clip would build random weights"
        )
    model.eval().requires_grad_(False)
    return model, preprocess, tokenizer
