"""Which samples of a predict run are used, and what happens to the others.

**Policy for bad samples** (a run may have encoded for hours when one appears):

* An *unreadable file* (missing, truncated, not an image) becomes a blank placeholder in
  :class:`~frolic_tta.data.IndexedDataset` with the reason in the batch's ``"error"``.
* *Non-finite features* (NaN or inf from the encoder, or an all-zero feature vector) are found
  right after encoding.

Either sample is *skipped*: it is left out of the moments, of the fit and of the accuracy, and it
gets prediction -1, NaN logits and confidence, and ``valid = False``. Every other sample gets
its prediction as usual; nothing already encoded is thrown away. The first few are warned about
as they come; all are listed (index, path, reason) in the report's ``metrics.json``. When more
than ``max_skipped_fraction`` of the samples (and more than one) are skipped, the data (or the
model) are broken, not a few files: the run stops with one error, on a rank as soon as its own
share is exceeded, and after the last batch on the all-reduced counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from frolic_tta.errors import FrolicInputError, warn

NON_FINITE = "non-finite image features (NaN or inf from the encoder, or a zero vector)"
WARN_FIRST = 5
"""Skipped samples warned about one by one, per rank; the rest are only reported."""


def check_fraction(value: float, name: str = "max_skipped_fraction") -> float:
    """``value`` as a float in ``[0, 1]``.

    Raises:
        ValueError: not a finite number in ``[0, 1]``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"Expected `{name}` to be a number in [0, 1], but got {value!r}")
    return float(value)


FLAGS = ("ablations", "return_logits", "reuse_head", "allow_head_mismatch", "save_clip_weights",
         "online")  # fmt: skip
"""``FrolicModule``'s ``bool`` arguments."""


def check_arguments(hparams: Mapping[str, Any]) -> None:
    """``FrolicModule``'s flags are ``True`` or ``False`` (the string ``"false"`` would turn
    ``online`` on) and ``max_skipped_fraction`` a number in [0, 1] (checked when it is built).

    Raises:
        TypeError: a flag is not a ``bool``.
        ValueError: ``max_skipped_fraction`` is not a number in [0, 1].
    """
    for name in FLAGS:
        value = hparams.get(name, False)
        if not isinstance(value, bool):
            raise TypeError(
                f"Expected `{name}` to be True or False, but got {type(value).__name__} "
                f"{value!r:.40}"
            )
    check_fraction(hparams.get("max_skipped_fraction", 0.05))


def check_sizes(text_batch_size: Any, chunk_size: Any, class_names: list[str] | None) -> None:
    """``text_batch_size`` an int >= 1, ``chunk_size`` ``None`` or an int >= 1, and
    ``class_names`` ``None`` or at least 2 non-blank names (checked when the module is built,
    not after every image is encoded).

    Raises:
        ValueError: any of them is not.
    """
    if class_names is not None and (
        len(class_names) < 2 or not all(c.strip() for c in class_names)
    ):
        raise ValueError(
            "Expected `class_names` to hold at least 2 non-blank names, but got "
            f"{class_names!r:.200}"
        )
    for name, value, optional in (("text_batch_size", text_batch_size, False),
                                  ("chunk_size", chunk_size, True)):  # fmt: skip
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = "an int >= 1" + (" or None" if optional else "")
            raise ValueError(f"Expected `{name}` to be {what}, but got {value!r}")


def unpack_batch(batch: Any) -> tuple[Tensor | None, Tensor, Tensor | None, list[str] | None]:
    """``(image, index, label, error)`` of a FrolicModule batch (``None`` where absent).

    Raises:
        ValueError: not a dict with ``"image"`` (or ``"features"``) and ``"index"``.
    """
    has_input = isinstance(batch, dict) and ("image" in batch or "features" in batch)
    if not has_input or "index" not in batch:
        raise ValueError(
            "Expected each batch to be a dict with 'image' and 'index' (and optionally "
            f"'label'); wrap your dataset in frolic_tta.data.IndexedDataset. Got {type(batch)}"
        )
    return batch.get("image"), batch["index"], batch.get("label"), batch.get("error")


def sample_validity(features: Tensor, errors: list[str] | None) -> tuple[Tensor, list[str]]:
    """``(valid (n,) bool, reason per sample ('' when valid))`` of one encoded batch."""
    valid, reasons = batch_validity(torch.isfinite(features).all(dim=1).cpu(), errors)
    return valid, [""] * features.shape[0] if reasons is None else reasons


def batch_validity(finite: Tensor, errors: list[str] | None) -> tuple[Tensor, list[str] | None]:
    """``(valid (n,) bool, reason per sample ('' when valid) or None)`` of one batch from its
    rows' host ``finite`` flags (:func:`~frolic_tta.lightning.batch.host_samples`) and its
    files' ``errors``: ``None`` for the reasons when every sample is valid (the usual batch:
    no per-sample Python work)."""
    if not (errors is not None and any(errors)) and bool(finite.all()):
        return finite, None
    reasons = [str(e) for e in errors] if errors is not None else [""] * finite.shape[0]
    reasons = [
        r if r else ("" if ok else NON_FINITE)
        for r, ok in zip(reasons, finite.tolist(), strict=True)
    ]
    return torch.tensor([not r for r in reasons], dtype=torch.bool), reasons


class SkippedSamples:
    """This rank's skipped samples and the early stop (see the module docstring).

    Args:
        max_fraction: largest share of skipped samples a run accepts.
        expected: samples this rank is expected to see (for the early stop).
    """

    def __init__(self, max_fraction: float, expected: int) -> None:
        self.max_fraction = max_fraction
        self.expected = max(1, expected)
        self.seen = 0
        #: ``{"index": int, "reason": str}`` per skipped sample of this rank.
        self.records: list[dict[str, Any]] = []

    def add(self, index: Tensor, reasons: list[str] | None) -> None:
        """Record one batch (global ``index`` (n,), a reason per sample, ``''`` if valid;
        ``None``: every sample is valid).

        Raises:
            FrolicInputError: this rank's skipped samples exceed its share.
        """
        if reasons is None:  # nothing skipped: the count only (the limit cannot be crossed)
            self.seen += len(index)
            return
        self.seen += len(reasons)
        for i, reason in zip(index.tolist(), reasons, strict=True):
            if not reason:
                continue
            self.records.append({"index": int(i), "reason": reason})
            if len(self.records) <= WARN_FIRST:
                more = " (further ones are only listed in the report)"
                warn(
                    f"Skipping sample {i}: {reason}; it gets no prediction"
                    + (more if len(self.records) == WARN_FIRST else ""),
                    per_rank=True,
                )
        if len(self.records) > self.allowed(self.expected):
            self.stop(len(self.records), self.seen, f"about {self.expected} on this rank")

    def allowed(self, total: int) -> int:
        """Skipped samples accepted among ``total``: ``floor(fraction * total)`` computed
        exactly on the fraction's decimal value (0.29 of 100 allows 29, where the float product
        is 28.999...), but at least one (unless the fraction is 0): a single bad file never
        stops a run."""
        limit = math.floor(Fraction(repr(self.max_fraction)) * int(total))
        return max(limit, 1) if self.max_fraction > 0 else limit

    def stop(self, skipped: int, seen: int, of: str) -> None:
        """Raise the too-many-skipped error."""
        first = self.records[0] if self.records else {"index": "?", "reason": "?"}
        raise FrolicInputError(
            f"Expected at most max_skipped_fraction={self.max_fraction:g} of the samples to be "
            f"unusable, but {skipped} of {seen} seen ({of}) were skipped, e.g. sample "
            f"{first['index']}: {first['reason']}. Fix the files (or the model), or raise "
            "--model.max_skipped_fraction"
        )

    def check_total(self, skipped: int, seen: int) -> None:
        """The same limit on all-reduced counts (every rank decides alike)."""
        if skipped > self.allowed(seen):
            self.stop(skipped, seen, "all ranks")


def expected_local_samples(
    dataset_length: int, world_size: int, num_batches: int, batch_size: int | None
) -> int:
    """Samples a rank will see: its shard, or fewer when the Trainer limits the batches."""
    shard = math.ceil(dataset_length / max(1, world_size))
    return min(shard, num_batches * batch_size) if batch_size else shard


def check_counts(counts: dict[str, int], dataset_length: int, skipped: SkippedSamples) -> None:
    """Checks on the all-reduced ``counts`` (``used``, ``skipped``, ``seen``, ``partial``).

    Raises:
        RuntimeError: a complete run whose ranks together saw other than ``dataset_length``
            samples (a padding or missing distributed sampler).
        FrolicInputError: too many skipped samples, or fewer than 2 usable ones.
    """
    seen = counts["used"] + counts["skipped"]
    if not counts["partial"] and seen != dataset_length:
        raise RuntimeError(
            f"Frolic saw {seen} samples over all ranks but the dataset has {dataset_length}: "
            "the sampler duplicated or skipped samples (a DistributedSampler pads to equal "
            "shards, and use_distributed_sampler=False gives every rank all data). Let "
            "Lightning set the predict sampler."
        )
    skipped.check_total(counts["skipped"], counts["seen"])
    if counts["used"] < 2:
        raise FrolicInputError(
            f"Expected at least 2 usable samples to adapt on, but got {counts['used']} "
            f"({counts['skipped']} skipped)"
        )
    if counts["partial"]:
        rank_zero_warn(
            f"Frolic adapted on the {counts['seen']} of {dataset_length} samples the Trainer let "
            "through (limit_predict_batches / fast_dev_run): the head, tau_g and beta come from "
            "them alone and only they get predictions. For a smaller complete run use "
            "--data.limit N."
        )
