"""Prediction writer: one file per rank, joined exactly by global index."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor
from typing_extensions import override

from frolic_tta.errors import FrolicInputError, write_error
from frolic_tta.lightning.adaptation import find_adaptation
from frolic_tta.lightning.batch import row_key
from frolic_tta.lightning.online import ONLINE_KEYS
from frolic_tta.rows import ROWS


def save_file(obj: Any, path: str | Path) -> None:
    """``torch.save`` that turns a failed write (disk full, read-only folder: PyTorch's
    ``basic_ios::clear: iostream error``) into one :class:`FrolicInputError` naming the path."""
    try:
        torch.save(obj, path)
    except (OSError, RuntimeError) as error:
        raise FrolicInputError(write_error(path, error)) from None


KEYS = ("index", "valid", "prediction", "confidence", "logits", "target", *ONLINE_KEYS,
        *(row_key(row) for row in ROWS))  # fmt: skip
FILL = {"target": -1, "valid": True}
"""Value of a per-sample key that some batches (or ranks) lack: no label, not skipped."""


def _concat(parts: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
    """Concatenate per-sample tensors key by key; a key that some parts lack is filled with
    :data:`FILL` (labels in only some batches: target -1 for the others)."""
    merged: dict[str, Tensor] = {}
    for key in KEYS:
        if not any(key in p for p in parts):
            continue
        if key not in FILL and not all(key in p for p in parts):
            raise ValueError(f"Expected every batch to carry {key!r} or none, but some lack it")
        merged[key] = torch.cat(
            [p[key] if key in p else torch.full_like(p["index"], FILL[key]) for p in parts]
        )
    if "valid" in merged:
        merged["valid"] = merged["valid"].bool()
    return merged


def concat_outputs(outputs: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate per-batch outputs of a Frolic predict key by key (``target`` -1 where a
    batch had no labels)."""
    return _concat(list(outputs)) if outputs else {}


class FrolicPredictionWriter(BasePredictionWriter):
    """Writes ``predictions_rank{r}.pt`` per rank at the end of the predict epoch.

    Each file holds the concatenated ``index`` (global dataset index), ``valid`` (False for a
    skipped sample), ``prediction``, ``confidence``, ``logits`` (if returned) and ``target`` (if
    labelled; -1 for a sample without label), the requested rows' ``prediction/<row>``, plus
    ``skipped`` (index and reason) and ``partial`` (the Trainer limited the batches), both
    from the :class:`~frolic_tta.lightning.outcome.PredictOutcome` of the Trainer's
    :class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` (``FrolicModule``'s or yours).
    :func:`join_predictions` merges the files of a (multi-node) job and checks that every index
    appears exactly once.

    Epoch interval only: the outputs are final once the rank's last batch has been finalized,
    which is before any ``on_predict_epoch_end``; a batch-interval writer would see
    placeholders (NaN logits, prediction -1).

    Args:
        output_dir: folder for the per-rank files (created if missing).
    """

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = Path(output_dir)

    @override
    def write_on_epoch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise FrolicInputError(write_error(self.output_dir, error)) from None
        outputs = (
            predictions[0] if predictions and isinstance(predictions[0], list) else predictions
        )
        merged: dict[str, Any] = concat_outputs(list(outputs))
        merged["world_size"] = torch.tensor(trainer.world_size)
        outcome = find_adaptation(trainer).outcome
        merged["skipped"], merged["partial"] = list(outcome.skipped), outcome.partial
        save_file(merged, self.output_dir / f"predictions_rank{trainer.global_rank}.pt")


def join_predictions(output_dir: str | Path, dataset_length: int | None = None) -> dict[str, Any]:
    """Merge ``predictions_rank*.pt`` into one dict sorted by global index.

    The per-sample tensors (``index``, ``valid``, ``prediction``, ...) are concatenated and
    sorted; ``skipped`` (``{"index", "reason"}`` per skipped sample) is merged, sorted by index;
    ``partial`` is True when the Trainer limited the batches of any rank (then ``dataset_length``
    is not required to be covered).

    Raises:
        ValueError: a missing rank file, an index seen twice, or (with ``dataset_length``, in a
            run that was not limited) an index missing.
    """
    files = sorted(Path(output_dir).glob("predictions_rank*.pt"))
    if not files:
        raise ValueError(f"Expected predictions_rank*.pt files in {str(output_dir)!r}, found none")
    parts = [torch.load(f, weights_only=True) for f in files]
    world_size = int(parts[0]["world_size"])
    if len(parts) != world_size:
        raise ValueError(
            f"Expected {world_size} rank files in {str(output_dir)!r}, found {len(parts)}"
        )
    merged: dict[str, Any] = _concat(parts)
    order = torch.argsort(merged["index"])
    merged = {k: v[order] for k, v in merged.items()}
    merged["skipped"] = sorted(
        (s for p in parts for s in p.get("skipped", [])), key=lambda s: s["index"]
    )
    merged["partial"] = any(bool(p.get("partial", False)) for p in parts)
    index = merged["index"]
    if bool((index[1:] == index[:-1]).any()):
        raise ValueError("Expected every global index exactly once, but some appear twice")
    complete = dataset_length is not None and not merged["partial"]
    if complete and not torch.equal(index, torch.arange(dataset_length)):
        raise ValueError(
            f"Expected indices 0..{dataset_length - 1} exactly once, "
            f"but got {index.numel()} indices"
        )
    return merged
