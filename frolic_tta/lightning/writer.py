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

KEYS = ("index", "prediction", "confidence", "logits", "target")


def concat_outputs(outputs: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate per-batch FrolicModule outputs key by key."""
    if not outputs:
        return {}
    return {key: torch.cat([o[key] for o in outputs]) for key in KEYS if key in outputs[0]}


class FrolicPredictionWriter(BasePredictionWriter):
    """Writes ``predictions_rank{r}.pt`` per rank at the end of the predict epoch.

    Each file holds the concatenated ``index`` (global dataset index), ``prediction``,
    ``confidence``, ``logits`` (if returned) and ``target`` (if labelled) of that rank.
    :func:`join_predictions` merges the files of a (multi-node) job and checks that every index
    appears exactly once.

    Epoch interval only: FrolicModule's outputs are final once the rank's last batch has been
    finalized, which is before any ``on_predict_epoch_end``; a batch-interval writer would see
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
        self.output_dir.mkdir(parents=True, exist_ok=True)
        outputs = (
            predictions[0] if predictions and isinstance(predictions[0], list) else predictions
        )
        merged = concat_outputs(list(outputs))
        merged["world_size"] = torch.tensor(trainer.world_size)
        torch.save(merged, self.output_dir / f"predictions_rank{trainer.global_rank}.pt")


def join_predictions(
    output_dir: str | Path, dataset_length: int | None = None
) -> dict[str, Tensor]:
    """Merge ``predictions_rank*.pt`` into one dict sorted by global index.

    Raises:
        ValueError: a missing rank file, an index seen twice, or (with ``dataset_length``) an
            index missing.
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
    merged = {k: torch.cat([p[k] for p in parts]) for k in KEYS if k in parts[0]}
    order = torch.argsort(merged["index"])
    merged = {k: v[order] for k, v in merged.items()}
    index = merged["index"]
    if bool((index[1:] == index[:-1]).any()):
        raise ValueError("Expected every global index exactly once, but some appear twice")
    if dataset_length is not None and not torch.equal(index, torch.arange(dataset_length)):
        raise ValueError(
            f"Expected indices 0..{dataset_length - 1} exactly once, "
            f"but got {index.numel()} indices"
        )
    return merged
