"""What an adapted head remembers about how it was fitted, and the refusal when it is reused
with something else.

A head (``head.pt``, a checkpoint) stores ``frolic_provenance``:

* ``encoder``: the model (name, and a hash of its config file when it is a path), the weights
  (the open_clip tag, the SHA-256 of the checkpoint file or ``local-dir:`` folder, or for random
  or ``hf-hub:`` weights a SHA-256 of the loaded state dict) and the image preprocessing, as
  :func:`frolic_tta.data.store_key.weights_fingerprint` and
  :func:`~frolic_tta.data.store_key.preprocess_signature` name them;
* ``class_names`` and ``prompts_sha256``: the SHA-256 of every class's prompts (templates and
  descriptions, as :func:`frolic_tta.clip.prompts.build_class_prompts` builds them).

:func:`check_provenance` compares a stored head with the module that would reuse it and raises
one sentence naming every field that differs (``allow_head_mismatch=True``: a warning instead;
never silent). A head written before provenance was recorded is refused the same way.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from frolic_tta.clip.prompts import build_class_prompts
from frolic_tta.data.store_key import preprocess_signature, weights_fingerprint
from frolic_tta.errors import FrolicInputError, warn

__all__ = [
    "check_provenance",
    "encoder_identity",
    "prompts_sha256",
    "state_dict_sha256",
]

KEY = "frolic_provenance"
"""Top-level key of the provenance in ``head.pt`` and in checkpoints."""


def state_dict_sha256(module: torch.nn.Module) -> str:
    """SHA-256 of a module's state dict (names, dtypes, shapes and bytes, in key order)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "state:" + digest.hexdigest()


def encoder_identity(
    model_name: str, pretrained: str | None, clip: torch.nn.Module, preprocess: Any
) -> dict[str, Any]:
    """What identifies the image and text encoder of a module: model, weights, preprocessing."""
    identity: dict[str, Any] = dict(weights_fingerprint(model_name, pretrained))
    if identity["weights"] is None:  # random weights, or a Hub name: hash what was loaded
        identity["weights"] = state_dict_sha256(clip)
    identity["preprocess"] = preprocess_signature(preprocess)
    return identity


def prompts_sha256(
    class_names: list[str], templates: str | list[str], prompts_file: str | None
) -> str:
    """SHA-256 of every class's prompts (what the text prototypes are encoded from)."""
    prompts = build_class_prompts(class_names, templates, prompts_file)
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()


def _short(value: Any) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


def check_provenance(
    stored: dict[str, Any] | None,
    current: dict[str, Any],
    source: str,
    *,
    allow_mismatch: bool = False,
) -> None:
    """Refuse (or with ``allow_mismatch`` warn about) a head fitted with another encoder or
    other prompts.

    Args:
        stored: the head's ``frolic_provenance`` (``None``: the file records none).
        current: the same fields for the module that would reuse it.
        source: where the head comes from, for the message (``"head_file '...'"``).
        allow_mismatch: warn instead of raising.

    Raises:
        FrolicInputError: a field differs, or ``stored`` is ``None``.
    """
    override = "or pass --model.allow_head_mismatch true to score with it anyway"
    if stored is None:
        message = (
            f"Expected {source} to record the encoder and prompts it was fitted with, but it "
            f"records none (written by an older version): run predict again to write a new "
            f"head, {override}"
        )
    else:
        fields = [("encoder", k) for k in current["encoder"]] + [("prompts_sha256", None)]
        diffs = []
        for part, key in fields:
            mine = current[part] if key is None else current[part].get(key)
            theirs = stored.get(part) if key is None else (stored.get(part) or {}).get(key)
            if mine != theirs:
                diffs.append(f"{key or 'prompts'}: head {_short(theirs)}, this run {_short(mine)}")
        if not diffs:
            return
        message = (
            f"Expected {source} to have been fitted with this run's encoder and prompts, but "
            f"they differ ({'; '.join(diffs)}): pass the model_name, pretrained, templates and "
            f"prompts_file it was fitted with, {override}"
        )
    if not allow_mismatch:
        raise FrolicInputError(message)
    warn(message.replace("Expected", "allow_head_mismatch: expected", 1))
