"""The Hugging Face Hub side of loading open_clip: the cache first, one fast probe, one line.

Weights (and a Hub tokenizer) already in the Hugging Face cache are loaded without contacting
the Hub. Otherwise ``HF_HUB_OFFLINE`` is honoured and the Hub is probed once, with a
:data:`PROBE_TIMEOUT_S` timeout, before open_clip downloads anything: a machine without internet
gets one line within seconds instead of a minute of retry warnings.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import open_clip
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from open_clip.constants import HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

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
def quiet_hub(offline: bool) -> Iterator[None]:
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


def cached_file(file: HubFile, cache_dir: str | None) -> str | None:
    repo_id, filenames = file
    for filename in filenames:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
        if isinstance(found, str):
            return found
    return None


def weight_files(repo_id: str, filename: str = HF_WEIGHTS_NAME) -> HubFile:
    """open_clip tries the ``.safetensors`` twin of a weight file first."""
    if filename == HF_WEIGHTS_NAME:
        return repo_id, (HF_SAFE_WEIGHTS_NAME, filename)
    if filename.endswith((".bin", ".pth")):
        return repo_id, (filename[:-4] + ".safetensors", filename)
    return repo_id, (filename,)


def model_config(name: str, cache_dir: str | None) -> dict[str, Any] | None:
    """The model config, without any download (``None`` for an uncached ``hf-hub:`` name)."""
    if name.startswith(HF_HUB):
        path = cached_file((name[len(HF_HUB) :], (HF_CONFIG_NAME,)), cache_dir)
        return json.loads(Path(path).read_text()).get("model_cfg") if path else None
    return open_clip.get_model_config(name)


def hub_files(name: str, tag_cfg: dict[str, Any], config: dict[str, Any] | None) -> list[HubFile]:
    """Every Hub file open_clip (and a Hub tokenizer) will fetch for this model."""
    files: list[HubFile] = []
    if name.startswith(HF_HUB):
        repo_id = name[len(HF_HUB) :]
        files += [(repo_id, (HF_CONFIG_NAME,)), weight_files(repo_id)]
    elif tag_cfg.get("hf_hub") and "file" not in tag_cfg:
        repo_id, filename = os.path.split(tag_cfg["hf_hub"])
        files.append(weight_files(repo_id, filename or HF_WEIGHTS_NAME))
    tokenizer = (config or {}).get("text_cfg", {}).get("hf_tokenizer_name")
    if tokenizer and not name.startswith(LOCAL_DIR):  # local-dir: tokenizer files in the folder
        files.append((tokenizer, ("tokenizer_config.json",)))
    return files


def check_dependencies(name: str, config: dict[str, Any] | None) -> None:
    text_cfg = (config or {}).get("text_cfg", {})
    needs = text_cfg.get("hf_tokenizer_name") or text_cfg.get("hf_model_name")
    if needs and importlib.util.find_spec("transformers") is None:
        raise WeightsNotFoundError(
            f"open_clip model {name!r} needs the `transformers` package for its Hugging Face "
            f"tokenizer or text tower ({needs!r}): pip install transformers"
        )


def require_hub(name: str, pretrained: str | None, cache_dir: str | None) -> None:
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
        f"cache is then used offline), or {fix_hint(name)}"
    )


def fix_hint(name: str) -> str:
    """The fix, for a Python caller and on the command line."""
    if name.startswith(HF_HUB):
        return (
            "copy the repository into a folder: model_name='local-dir:/path/to/folder' "
            "(--model.model_name local-dir:/path/to/folder)"
        )
    return "pass pretrained='/path/to.ckpt' (--model.pretrained /path/to.ckpt)"
