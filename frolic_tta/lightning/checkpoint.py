"""Files that carry an adapted head: the report's ``head.pt`` and Lightning checkpoints.

* :func:`read_head_file` reads either one (both hold a top-level ``"frolic_head"``), for
  ``FrolicModule(head_file=...)`` / ``--model.head_file``: score new images without adapting.
* :class:`CheckpointHooks` (mixed into ``FrolicModule``): the head in every checkpoint; the
  CLIP weights too (``save_clip_weights=True``: ``load_from_checkpoint`` builds the architecture
  and reads no weight file, offline) or not (*head-only*, loaded from ``pretrained`` again).
* :func:`peek_checkpoint` tells a Lightning checkpoint from a head file without reading the
  tensors (memory-mapped), for the command line's early checks.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from frolic_tta.clip.hub import WeightsNotFoundError
from frolic_tta.clip.loading import (
    check_tau_c,
    load_open_clip,
    load_open_clip_architecture,
    model_temperature,
)
from frolic_tta.data.class_names import class_key, same_classes
from frolic_tta.data.store_key import weights_fingerprint
from frolic_tta.errors import FrolicInputError, warn
from frolic_tta.head import FrolicHead
from frolic_tta.lightning.provenance import KEY as PROVENANCE
from frolic_tta.lightning.provenance import check_provenance, encoder_identity, prompts_sha256

CLIP_PREFIX = "clip."
"""State-dict prefix of the frozen open_clip model inside ``FrolicModule``."""
_LOADING: ContextVar[bool] = ContextVar("frolic_loading_checkpoint", default=False)


def loading_checkpoint() -> bool:
    """Whether ``FrolicModule.load_from_checkpoint`` is building the module right now."""
    return _LOADING.get()


def peek_checkpoint(path: str | Path) -> dict[str, Any]:
    """The top-level dict of a ``torch.save`` file, memory-mapped (tensors are not read).

    Raises:
        FileNotFoundError: no such file.
        FrolicInputError: not a ``torch.save`` dict.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no file at '{file}'")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a pickle that is not plain data, a truncated file, not torch
        raise FrolicInputError(
            f"Expected '{file}' to be a torch.save file of plain tensors, but reading it failed: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from None
    if not isinstance(state, dict):
        raise FrolicInputError(f"Expected '{file}' to hold a dict, but got {type(state).__name__}")
    return state


@dataclass(frozen=True)
class StoredHead:
    """What a head file holds: the ``head``, its ``class_names`` and ``provenance`` (``None``
    where not recorded), and for a checkpoint with CLIP weights their ``clip_state`` (without
    the ``clip.`` prefix) and the ``model_name`` and ``pretrained`` it was built with."""

    path: str
    head: FrolicHead
    class_names: list[str] | None
    provenance: dict[str, Any] | None
    clip_state: dict[str, Tensor] | None = None
    model_name: str | None = None
    pretrained: str | None = None


def read_stored_head(path: str | Path) -> StoredHead:
    """The adapted head stored in ``path`` with what it remembers (:class:`StoredHead`).

    ``path`` is the ``head.pt`` of a finished run or a checkpoint saved after predict
    (``--save_checkpoint``, ``trainer.save_checkpoint``).

    Raises:
        FileNotFoundError: no such file.
        FrolicInputError: the file holds no Frolic head.
    """
    try:
        state = peek_checkpoint(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"head file '{path}' does not exist; pass the head.pt of a finished run "
            "(outputs/<run>/head.pt) or a checkpoint saved after predict as --model.head_file"
        ) from None
    if "frolic_head" not in state:
        raise FrolicInputError(
            f"Expected `head_file` '{path}' to hold an adapted head (key 'frolic_head': the "
            f"head.pt of a run or a checkpoint saved after predict), but it has keys "
            f"{sorted(map(str, state))[:8]}"
        )
    head = FrolicHead.from_state_dict(
        {k: v.clone() if isinstance(v, Tensor) else v for k, v in state["frolic_head"].items()}
    )
    hparams = state.get("hyper_parameters") or state.get("encoder_options") or {}
    names = state.get("class_names") or hparams.get("class_names")
    weights = state.get("state_dict") or {}
    clip_state = {k[len(CLIP_PREFIX) :]: v for k, v in weights.items() if k.startswith(CLIP_PREFIX)}
    return StoredHead(
        path=str(path),
        head=head,
        class_names=list(names) if names is not None else None,
        provenance=state.get(PROVENANCE),
        clip_state=clip_state or None,
        model_name=hparams.get("model_name"),
        pretrained=hparams.get("pretrained"),
    )


def read_head_file(path: str | Path) -> tuple[FrolicHead, list[str] | None]:
    """The adapted head stored in ``path`` and its class names (``None`` if not stored)."""
    stored = read_stored_head(path)
    return stored.head, stored.class_names


class _NoRandomInitNotice(logging.Filter):
    """Drops open_clip's "Model initialized randomly" (the checkpoint's weights follow)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "initialized randomly" not in str(record.msg)


def architecture(model_name: str, pretrained: str | None) -> tuple[torch.nn.Module, Any, Any]:
    """:func:`~frolic_tta.clip.loading.load_open_clip_architecture` without open_clip's notice
    that the model is initialised randomly: a checkpoint's weights are loaded into it next."""
    quiet, root = _NoRandomInitNotice(), logging.getLogger()
    root.addFilter(quiet)
    try:
        return load_open_clip_architecture(model_name, pretrained)
    finally:
        root.removeFilter(quiet)


def clip_from_checkpoint(stored: StoredHead, model_name: str) -> tuple[torch.nn.Module, Any, Any]:
    """The CLIP model a checkpoint carries: its architecture and preprocessing, its weights.

    Raises:
        FrolicInputError: ``model_name`` is not the checkpoint's, or its weights do not fit.
    """
    if stored.model_name is not None and model_name != stored.model_name:
        raise FrolicInputError(
            f"Expected `model_name` {stored.model_name!r}, the encoder whose weights the "
            f"checkpoint '{stored.path}' carries, but got {model_name!r}: pass "
            f"--model.model_name {stored.model_name} (its CLIP weights are used; `pretrained` "
            "is not read)"
        )
    clip, preprocess, tokenizer = architecture(model_name, stored.pretrained)
    try:
        clip.load_state_dict(stored.clip_state or {}, strict=True)
    except RuntimeError as error:
        raise FrolicInputError(
            f"Expected the CLIP weights in '{stored.path}' to fit {model_name!r}, but loading "
            f"them failed: {str(error).splitlines()[0]}"
        ) from None
    clip.eval().requires_grad_(False)
    return clip, preprocess, tokenizer


def load_clip(
    model_name: str, pretrained: str | None, stored: StoredHead | None, weights_follow: bool
) -> tuple[torch.nn.Module, Any, Any, dict[str, Any] | None]:
    """``(clip, preprocess, tokenizer, encoder identity)`` of a ``FrolicModule``.

    The CLIP weights a ``head_file`` checkpoint carries; the architecture alone when
    ``weights_follow`` (``load_from_checkpoint`` of a self-contained checkpoint: weights and
    identity come with ``on_load_checkpoint``); else ``pretrained``'s weights.
    """
    if stored is not None and stored.clip_state is not None:
        identity = (stored.provenance or {}).get("encoder")
        return (*clip_from_checkpoint(stored, model_name), identity)
    if weights_follow:
        return (*architecture(model_name, pretrained), None)
    try:
        clip, preprocess, tokenizer = load_open_clip(model_name, pretrained)
    except WeightsNotFoundError:  # a head knows its encoder: say so, not only this
        missing = ", whose weights are not here either"
        other = None if stored is None else other_encoder(stored, model_name, pretrained, missing)
        if other is not None:
            raise FrolicInputError(other) from None  # the CLI prints the root cause
        raise
    return clip, preprocess, tokenizer, encoder_identity(model_name, pretrained, clip, preprocess)


def other_encoder(
    stored: StoredHead, model_name: str, pretrained: str | None, also: str = ""
) -> str | None:
    """A sentence when ``stored`` was fitted with another encoder than ``model_name`` and
    ``pretrained`` (by the model and weights its provenance records), naming the options it
    was fitted with where the file records them; ``None`` when it is the same or not known."""
    recorded = (stored.provenance or {}).get("encoder") or {}
    mine = weights_fingerprint(model_name, pretrained)
    keys = ("model_name", "model_config") + (("weights",) if mine["weights"] else ())
    if not recorded or all(recorded.get(key) == mine.get(key) for key in keys):
        return None
    if stored.model_name is not None:
        fix = f"--model.model_name {stored.model_name}"
        fix += f" --model.pretrained {stored.pretrained}" if stored.pretrained else ""
    else:
        fix = f"the model {recorded.get('model_name')!r} with weights {recorded.get('weights')}"
    return (
        f"Expected the encoder the head file '{stored.path}' was fitted with ({fix}), but this "
        f"run names --model.model_name {model_name} --model.pretrained {pretrained}{also}: pass "
        "the head's encoder options (the config.yaml of the run that wrote the head names them)"
    )


def drop_clip_weights(checkpoint: dict[str, Any]) -> None:
    """Remove the frozen CLIP weights from a checkpoint's ``state_dict`` (in place)."""
    state = checkpoint.get("state_dict", {})
    for key in [k for k in state if k.startswith(CLIP_PREFIX)]:
        del state[key]


def restore_clip_weights(checkpoint: dict[str, Any], clip: torch.nn.Module) -> None:
    """Put the weights of ``clip`` into a head-only checkpoint's ``state_dict`` (in place), so
    that a strict ``load_state_dict`` finds every key."""
    state = checkpoint.setdefault("state_dict", {})
    if not any(k.startswith(CLIP_PREFIX) for k in state):
        state.update({CLIP_PREFIX + k: v for k, v in clip.state_dict().items()})


PER_CLASS = ("prototypes", "weight", "bias", "class_means", "class_weights", "beta",
             "test_prior", "zero_shot_beta")  # fmt: skip
"""The entries of ``FrolicHead.state_dict()`` with one row per class (the rest is shared)."""


def permute_head(head: FrolicHead, order: list[int]) -> FrolicHead:
    """``head`` with its classes in ``order`` (class ``j`` of the result is class ``order[j]``
    of ``head``): logits ``head.score(x)[:, order]``, exactly."""
    index = torch.tensor(order, dtype=torch.long)
    state = head.state_dict()
    for key in PER_CLASS:
        if isinstance(state.get(key), Tensor):
            state[key] = state[key].index_select(0, index.to(state[key].device))
    return FrolicHead.from_state_dict(state)


def _difference(given: list[str], stored: list[str]) -> str:
    keys = {class_key(name) for name in stored}
    extra = [name for name in given if class_key(name) not in keys]
    keys = {class_key(name) for name in given}
    missing = [name for name in stored if class_key(name) not in keys]
    parts = [f"not in the head: {', '.join(extra[:8])}"] if extra else []
    parts += [f"not in the data: {', '.join(missing[:8])}"] if missing else []
    return "; ".join(parts) or "a class named twice"


def head_class_names(
    head: FrolicHead, given: list[str] | None, stored: list[str] | None, source: str = "head file"
) -> tuple[FrolicHead, list[str], list[str] | None]:
    """The stored head for the classes ``given`` (the data's): ``(head, class names, the given
    names in the head's order)``.

    ``given`` names the head's classes in any order (matched by name, as
    :func:`~frolic_tta.data.class_names.same_classes`): the head is permuted into the given
    order, with a warning. Without ``given``, the stored names; a head that records none is used
    by position.

    Raises:
        FrolicInputError: no names known, a count other than the head's K, or the given names
            are not the head's classes.
    """
    k = head.prototypes.shape[0]
    if given is None or stored is None:
        names = given if given is not None else stored
        if names is None or len(names) != k:
            raise FrolicInputError(
                f"Expected {k} class names for the {k} classes of the {source}, but got "
                f"{names!r:.200}"
            )
        return head, list(names), None
    if given == stored:
        return head, list(given), None
    order = same_classes(given, stored)
    if order is None:
        raise FrolicInputError(
            f"Expected `class_names` to be the {k} classes of the {source} "
            f"({', '.join(stored[:8])}{', ...' if k > 8 else ''}) in any order, but the data's "
            f"{len(given)} classes are others ({_difference(given, stored)}): score data of "
            "the head's classes, or adapt to these data without --model.head_file"
        )
    inverse = [0] * k
    for j, i in enumerate(order):
        inverse[i] = j
    if order != list(range(k)):
        warn(
            f"The {source}'s classes ({', '.join(stored[:8])}{', ...' if k > 8 else ''}) are "
            "matched to the data's classes by name and put in the data's order"
        )
    return permute_head(head, order), list(given), [given[inverse[i]] for i in range(k)]


def check_head_dim(head: FrolicHead | None, clip: torch.nn.Module, model_name: str) -> None:
    """Raise ``FrolicInputError`` when a stored head does not fit the model's feature dim."""
    dim = getattr(getattr(clip, "visual", None), "output_dim", None)
    if head is not None and isinstance(dim, int) and head.prototypes.shape[1] != dim:
        raise FrolicInputError(
            f"Expected a head for the {dim}-dim features of `model_name` {model_name!r}, but "
            f"the head file's is for {head.prototypes.shape[1]}-dim features"
        )


class CheckpointHooks:
    """``FrolicModule``'s checkpoint hooks (a mixin before ``LightningModule``)."""

    hparams: Any
    head: FrolicHead | None
    clip: torch.nn.Module
    reuse_head: bool
    class_names: list[str] | None
    encoder_: dict[str, Any] | None

    def provenance(self, class_names: list[str] | None = None) -> dict[str, Any]:
        """What the head is fitted with (:mod:`.provenance`): ``encoder``, ``class_names``,
        ``prompts_sha256`` (of ``class_names`` if given: a stored head's own order)."""
        names, hp = class_names or self.class_names, self.hparams
        digest = prompts_sha256(names, hp.templates, hp.prompts_file) if names else None
        return {"encoder": self.encoder_, "class_names": names, "prompts_sha256": digest}

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``; a self-contained checkpoint (saved with
        ``save_clip_weights=True``) builds the CLIP architecture without reading weights.

        ``tau_c="model"`` is read again once the checkpoint's weights are restored (``__init__``
        saw the architecture's freshly initialised ``logit_scale``)."""
        token = _LOADING.set(True)
        try:
            module = super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        finally:
            _LOADING.reset(token)
        if check_tau_c(module.hparams.get("tau_c", "model")) is None:
            module.tau_c = model_temperature(module.clip)
        return module

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.head is not None:
            checkpoint["frolic_head"] = self.head.state_dict()
        checkpoint[PROVENANCE] = self.provenance()
        hparams = checkpoint.get("hyper_parameters", {})
        hparams.update(head_file=None, reuse_head=self.reuse_head, class_names=self.class_names)
        if not self.hparams.save_clip_weights:
            drop_clip_weights(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "frolic_head" in checkpoint:
            self.head = FrolicHead.from_state_dict(checkpoint["frolic_head"])
        stored = checkpoint.get(PROVENANCE)
        if self.encoder_ is None:  # the weights are the checkpoint's own: so is their identity
            self.encoder_ = (stored or {}).get("encoder")
        elif "frolic_head" in checkpoint:  # head-only: weights loaded from `pretrained` again
            check_provenance(
                stored,
                self.provenance(),
                "the checkpoint's head",
                allow_mismatch=bool(self.hparams.get("allow_head_mismatch", False)),
            )
        restore_clip_weights(checkpoint, self.clip)
