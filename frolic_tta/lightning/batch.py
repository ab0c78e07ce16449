r"""What :class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` reads of one predict batch.

The module's ``predict_step`` returns a dict; the callback reads from it (and from the batch):

* **features** ``(n, d)``: ``output["features"]`` (the key is the callback's ``features``
  argument; a callable ``(output, batch) -> Tensor`` reads them elsewhere). They are taken out
  of the output (the callback keeps them once, for finalize) and L2-normalised unless the
  callback was built with ``normalize=False``.
* **index** ``(n,)``, the samples' global dataset indices (what joins the ranks' predictions):
  ``output["index"]``, else ``batch["index"]`` (:class:`~frolic_tta.data.IndexedDataset` adds
  it), else the indices Lightning's predict sampler drew for the batch.
* **labels** ``(n,)`` (-1: no label), optional: ``output["target"]``, else ``batch["label"]``.
* **errors**, optional: ``batch["error"]``, why a sample's file could not be read (``""``: it
  was; :mod:`frolic_tta.lightning.samples`).

It writes into the same dict (:data:`WRITTEN`), so those keys must be free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor

from frolic_tta.errors import FrolicInputError
from frolic_tta.lightning.outcome import predict_loader

FeatureSource = str | Callable[[dict[str, Any], Any], Tensor]
"""Where the features are: a key of the output dict, or ``(output, batch) -> (n, d)``."""
WRITTEN = ("valid", "logits", "prediction", "confidence")
"""Keys the callback writes into every output (with ``index``, ``target``, ``prediction/<row>``)."""


@dataclass(frozen=True)
class FrolicBatch:
    """One predict batch as the adaptation read it (what its listeners get).

    Attributes:
        output: the batch's output dict, filled in place (placeholders until finalize).
        features: ``(n, d)`` float32 features of every sample, as used (normalised).
        index: ``(n,)`` CPU global dataset indices.
        valid: ``(n,)`` CPU bool: used (False: skipped, :mod:`.samples`).
        labels: ``(n,)`` CPU labels (-1: none), or ``None``: the batch has no labels.
        errors: per sample, why it could not be read (``""``: it was), or ``None``.
        last: this rank's last batch (finalize follows once the listeners have run).
    """

    output: dict[str, Any]
    features: Tensor
    index: Tensor
    valid: Tensor
    labels: Tensor | None
    errors: list[str] | None
    last: bool


def take_features(output: Any, batch: Any, source: FeatureSource) -> Tensor:
    """The batch's features ``(n, d)`` from the predict output (taken out of it).

    Raises:
        FrolicInputError: the output is not a dict, or holds no floating ``(n, d)`` features.
    """
    name = source if isinstance(source, str) else getattr(source, "__name__", "features=")
    if not isinstance(output, dict):
        raise FrolicInputError(
            "Expected predict_step to return a dict holding the batch's image features "
            f"under {name!r} for FrolicAdaptation, but it returned {type(output).__name__}"
        )
    features = output.pop(source, None) if isinstance(source, str) else source(output, batch)
    if features is None:
        raise FrolicInputError(
            "Expected predict_step's output to hold the batch's image features (n, d) under "
            f"{name!r} (FrolicAdaptation(features=...) names another key), but it has keys "
            f"{sorted(map(str, output))}"
        )
    if not isinstance(features, Tensor) or features.ndim != 2 or not features.is_floating_point():
        shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise FrolicInputError(
            f"Expected the image features under {name!r} to be a floating (n, d) tensor, but "
            f"got {shape}"
            + (f" of {features.dtype}" if isinstance(features, Tensor) else "")
        )
    return features.detach()


def batch_samples(
    output: dict[str, Any], batch: Any, trainer: L.Trainer, batch_idx: int, n: int
) -> tuple[Tensor, Tensor | None, list[str] | None]:
    """``(index (n,), labels (n,) or None, errors or None)`` of a batch of ``n`` samples, the
    tensors int64 where they are (Lightning moves the batch's to the device:
    :func:`host_samples` brings them to the host).

    Raises:
        FrolicInputError: no index anywhere, or index or labels of another length than ``n``.
    """
    given = batch if isinstance(batch, dict) else {}
    index = output.get("index", given.get("index"))
    if index is None:
        index = _sampler_indices(trainer, batch_idx)
    labels = output.get("target", given.get("label"))
    errors = given.get("error")
    index = torch.as_tensor(index).detach().long().reshape(-1)
    labels = None if labels is None else torch.as_tensor(labels).detach().long()
    for what, value in (("index", index), ("labels", labels), ("errors", errors)):
        if value is not None and len(value) != n:
            raise FrolicInputError(
                f"Expected the batch's {what} to have one entry per feature row ({n}), but "
                f"got {len(value)}"
            )
    return index, labels, None if errors is None else [str(e) for e in errors]


def host_samples(
    features: Tensor, index: Tensor, labels: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(finite (n,) bool, index (n,), labels (n,) or None)`` on the host: whether each
    feature row is finite, and the batch's index and labels, brought over in **one** copy
    with those of them that are on the features' device (on a GPU: one host synchronisation
    per batch; those already on the host stay as they are)."""
    parts = [torch.isfinite(features).all(dim=1), index]
    parts += [] if labels is None else [labels]
    host = list(parts)
    together = [i for i, part in enumerate(parts) if part.device == features.device]
    packed = torch.stack([parts[i].reshape(-1).long() for i in together]).cpu()
    for row, i in zip(packed, together, strict=True):
        host[i] = row.reshape(parts[i].shape).clone()  # its own storage, not the stack's
    for i, part in enumerate(parts):
        if i not in together and part.device.type != "cpu":  # a third device: its own copy
            host[i] = part.cpu()
    return host[0].bool(), host[1], None if labels is None else host[2]


def _sampler_indices(trainer: L.Trainer, batch_idx: int) -> Sequence[int]:
    """The dataset indices Lightning's predict batch sampler drew for batch ``batch_idx``."""
    sampler = predict_loader(trainer).batch_sampler
    seen = sampler.seen_batch_indices if hasattr(sampler, "seen_batch_indices") else []
    if batch_idx >= len(seen):
        raise FrolicInputError(
            "Expected the samples' global dataset indices in the predict output ('index') or "
            "the batch ('index', as frolic_tta.data.IndexedDataset gives), but neither has "
            "them and the predict sampler does not record them"
        )
    return seen[batch_idx]


def check_free(output: dict[str, Any], rows: Sequence[str]) -> None:
    """Raise where the output already holds a key the callback writes.

    Raises:
        FrolicInputError: one of :data:`WRITTEN` or ``prediction/<row>`` is taken.
    """
    taken = [key for key in (*WRITTEN, *(row_key(r) for r in rows)) if key in output]
    if taken:
        raise FrolicInputError(
            f"Expected predict_step's output to leave {taken} to FrolicAdaptation (it writes "
            "Frolic's results there), but the output holds them: rename yours"
        )


def row_key(row: str) -> str:
    """The output key of a Table 3/4 row's per-sample prediction: ``prediction/<row>``."""
    return f"prediction/{row}"
