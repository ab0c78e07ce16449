r"""What a predict of :class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` leaves for the
other callbacks, and how it fills its outputs.

The contract between the adaptation and the callbacks that read it (:class:`FrolicReport`, the
prediction writer): the adaptation sets one frozen :class:`PredictOutcome` once per predict, at
the end of finalize (a stored head: after its last batch), before any ``on_predict_epoch_end``;
the callbacks read ``adaptation.outcome`` and nothing else of the run. Per batch, a callback
gets what it needs through its hook's arguments (``outputs``) or, as an
:class:`~frolic_tta.lightning.adaptation.AdaptationListener`, the batch the adaptation read. A
module may describe itself to the report (:class:`DescribesModel`).

Also here, so that the module and the benchmarks share them: :func:`predict_loader` (the one
predict DataLoader), :class:`RunCounts` (the counts all-reduced in one call) and
:func:`fill_outputs` (the placeholders filled in place from the fitted logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from frolic_tta.gda import MomentSums
from frolic_tta.head import FrolicHead
from frolic_tta.logits import ReduceFn
from frolic_tta.metrics import evaluate_rows
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import FrolicFit
from frolic_tta.prior import Priors
from frolic_tta.rows import RowContext, build_rows

__all__ = [
    "DescribesModel",
    "ModelDescription",
    "PredictOutcome",
    "RunCounts",
    "blank_outputs",
    "evaluate_fit",
    "fill_output",
    "fill_outputs",
    "placeholders",
    "predict_loader",
    "stored_priors",
]


@dataclass(frozen=True)
class PredictOutcome:
    r"""One predict run of a :class:`~frolic_tta.FrolicModule` (the module's ``outcome``).

    Attributes:
        head: the head that scored the run (fitted now, or stored).
        priors: the estimated priors, or a stored head's (:func:`stored_priors`).
        adapted: the head was fitted in this run (``False``: a stored head scored it).
        partial: the Trainer limited the batches on some rank (``limit_predict_batches``,
            ``fast_dev_run``); decided over all ranks when adapting.
        samples: counts over all ranks (``dataset_length``, ``used``, ``skipped``,
            ``labelled``, ``seen``); empty for a stored head.
        skipped: this rank's skipped samples (``index``, ``reason``).
        metrics: with labels, every row's metrics (``acc/f_d``, ...), :math:`\tau_g` and the
            test prior's diagnostics; else empty.
        class_accuracy: with labels, ``(K,)`` per-class accuracy per row.
        class_probability: ``(K,)`` mean predicted probability ``before`` and ``after``
            debiasing (Fig. 1c/d); empty for a stored head.
        finalize: seconds and ``reduce_fn`` passes per finalize phase.
        moments: the reduced moment sums of the run's features under its prototypes
            (what a feature store written from the run keeps); ``None`` when they came from
            a feature store (``moments_from_store``) or a stored head scored.
        moments_from_store: the moment sums were a feature store's
            (:mod:`frolic_tta.data.store_moments`): their pass was skipped.
    """

    head: FrolicHead
    priors: Priors
    adapted: bool
    partial: bool
    samples: dict[str, int] = field(default_factory=dict)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    class_accuracy: dict[str, Tensor] = field(default_factory=dict)
    class_probability: dict[str, Tensor] = field(default_factory=dict)
    finalize: dict[str, dict[str, float]] = field(default_factory=dict)
    moments: MomentSums | None = None
    moments_from_store: bool = False

    @classmethod
    def stored(cls, head: FrolicHead, partial: bool, skipped: list[dict[str, Any]]) -> Any:
        """The outcome of a run scored with a stored ``head`` (no adaptation, no metrics)."""
        return cls(head, stored_priors(head), False, partial, skipped=skipped)


@dataclass(frozen=True)
class ModelDescription:
    """What the report says about the model (:class:`DescribesModel`).

    Attributes:
        model_name: the encoder's name (``None``: the module's class name is used).
        pretrained: its weights (a tag or a path), if any.
        provenance: what a stored head remembers of encoder and prompts (:mod:`.provenance`).
        images_encoded: images this rank's encoder ran on in the last predict (``None``: every
            sample the adaptation read).
    """

    model_name: str | None = None
    pretrained: str | None = None
    provenance: dict[str, Any] | None = None
    images_encoded: int | None = None


@runtime_checkable
class DescribesModel(Protocol):
    """A LightningModule that tells the report about its model (``FrolicModule`` does)."""

    def describe_model(self) -> ModelDescription: ...


_EMPTY: dict[str, Any] = {"priors": None, "adapted": False, "partial": False, "skipped": []}


def outcome_field(name: str) -> Any:
    """A read-only attribute of the module: ``adaptation.last_outcome.<name>``, empty until
    predict ends."""

    def read(module: Any) -> Any:
        outcome = module.adaptation.last_outcome
        if outcome is None:
            empty = _EMPTY.get(name, {})
            return type(empty)(empty) if isinstance(empty, list | dict) else empty
        return getattr(outcome, name)

    return property(read, doc=f"``outcome.{name}`` (:class:`PredictOutcome`).")


def stored_priors(head: FrolicHead) -> Priors:
    """The priors a stored head carries (no diagnostics: nothing was estimated in this run)."""
    k = head.beta.shape[0]
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    unknown = torch.zeros(k, dtype=torch.bool)
    zero_shot = head.zero_shot_beta if head.zero_shot_beta is not None else uniform
    test = head.test_prior if head.test_prior is not None else uniform
    return Priors(
        test_prior=test,
        raw_test_prior=None,
        shift_weight=0.0,
        likelihood_ratio=None,
        beta=head.beta,
        beta_undetermined=unknown,
        zero_shot_beta=zero_shot,
        zero_shot_beta_undetermined=unknown,
    )


def predict_loader(trainer: L.Trainer) -> DataLoader:
    """The one predict DataLoader of ``trainer`` (Lightning holds a loader or a list of them).

    Raises:
        ValueError: more than one predict DataLoader.
    """
    loaders = trainer.predict_dataloaders
    loaders = loaders if isinstance(loaders, list | tuple) else [loaders]
    if len(loaders) != 1:
        raise ValueError(f"Expected exactly one predict dataloader, but got {len(loaders)}")
    return loaders[0]


@dataclass(frozen=True)
class RunCounts:
    """Sample counts of a rank (or, reduced, of all ranks), packed for one all-reduce."""

    skipped: int
    labelled: int
    partial: bool  # reduced: on some rank
    seen: int

    def pack(self) -> Tensor:
        values = [self.skipped, self.labelled, int(self.partial), self.seen]
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def unpack(cls, packed: Tensor) -> RunCounts:
        skipped, labelled, partial, seen = packed.round().long().tolist()
        return cls(skipped, labelled, bool(partial), seen)

    def reduce(self, reduce_fn: ReduceFn) -> RunCounts:
        """The counts over all ranks: one ``reduce_fn`` call."""
        return RunCounts.unpack(reduce_fn(self.pack()))


def placeholders(
    index: Tensor,
    valid: Tensor,
    labels: Tensor | None,
    num_classes: int,
    logits: bool,
    blank: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """One batch's predict output before finalize: ``index``, ``valid``, ``target`` (with
    labels), NaN ``logits`` ``(n, K)`` (if ``logits``), ``prediction`` -1, NaN ``confidence``
    (CPU; filled in place by :func:`fill_output`). ``blank``: the last three, made already
    (:func:`blank_outputs`)."""
    output: dict[str, Tensor] = {"index": index.detach().cpu(), "valid": valid}
    if labels is not None:
        output["target"] = labels.detach().cpu()
    output.update(blank or blank_outputs(index.shape[0], num_classes, logits))
    return output


def blank_outputs(n: int, num_classes: int, logits: bool) -> dict[str, Tensor]:
    """What finalize fills: NaN ``logits`` ``(n, K)`` (if ``logits``), ``prediction`` -1, NaN
    ``confidence`` (CPU); they need nothing of the batch's values, so the adaptation makes them
    while the device still computes the batch."""
    output: dict[str, Tensor] = {}
    if logits:
        output["logits"] = torch.full((n, num_classes), float("nan"), dtype=torch.float32)
    output["prediction"] = torch.full((n,), -1, dtype=torch.long)
    output["confidence"] = torch.full((n,), float("nan"), dtype=torch.float32)
    return output


def fill_output(
    output: dict[str, Tensor], logits: Tensor, probability: Tensor | None = None
) -> dict[str, Tensor]:
    """Write ``logits`` ``(n_valid, K)`` of the valid rows of one batch's ``output`` (and their
    prediction, confidence) in place; returns ``output``. ``probability``: their softmax, if
    at hand."""
    if probability is None:
        probability = torch.softmax(logits.float(), dim=1)
    confidence, prediction = probability.max(1)
    _write(output, {"prediction": prediction, "confidence": confidence, "logits": logits})
    return output


def fill_outputs(
    outputs: Sequence[dict[str, Tensor]],
    logits: Tensor | None,
    head: FrolicHead,
    features: Tensor,
    reduce_fn: ReduceFn,
    num_samples: float,
) -> dict[str, Tensor]:
    r"""Fill every batch's placeholders in place with :math:`f_d`, batch by batch.

    Every batch's softmax, prediction, confidence and probability sums are queued on the
    device first; the copies to the host follow (on a GPU: the first copy waits for the
    device once, instead of a round trip per batch), the predictions and confidences in one
    copy each.

    Args:
        outputs: the batches' output dicts, in the order their valid rows are in ``features``.
        logits: ``(N_valid, K)`` :math:`f_d` of the valid rows, or ``None``: scored from
            ``features`` one batch at a time (no ``(N, K)`` tensor).
        head: the fitted head.
        features: ``(N_valid, d)`` the cached features of the valid rows.
        reduce_fn: sums a tensor over ranks (called once).
        num_samples: valid rows over all ranks.

    Returns:
        ``{"before", "after"}``: ``(K,)`` float64 mean predicted probability over all ranks
        before (:math:`f_d` without :meth:`~frolic_tta.FrolicHead.log_offset`) and after
        debiasing (the paper's Fig. 1c/d).
    """
    device = features.device
    offset = head.log_offset().to(device=device, dtype=torch.float32)
    probability = torch.zeros(2, offset.shape[0], dtype=torch.float64, device=device)
    sizes = [int(output["valid"].sum()) for output in outputs]  # host flags: no device read
    scored, confidences, predictions = [], [], []
    start = 0
    for n in sizes:
        if logits is not None:
            batch = logits[start : start + n]
        else:
            batch = head.score(features[start : start + n])
        after = torch.softmax(batch.float(), 1)
        confidence, prediction = after.max(1)
        confidences.append(confidence)
        predictions.append(prediction)
        probability[0] += torch.softmax(batch - offset, 1).sum(0).double()
        probability[1] += after.sum(0).double()
        scored.append(batch if logits is not None else None)
        start += n
    confidence = torch.cat(confidences).cpu() if outputs else None
    prediction = torch.cat(predictions).cpu() if outputs else None
    start = 0
    for output, n, batch in zip(outputs, sizes, scored, strict=True):
        values = {"prediction": prediction[start : start + n],  # type: ignore[index]
                  "confidence": confidence[start : start + n]}  # type: ignore[index]  # fmt: skip
        if batch is not None:
            values["logits"] = batch
        _write(output, values)
        start += n
    before, after = (reduce_fn(probability.cpu()) / num_samples).unbind()
    return {"before": before, "after": after}


def _write(output: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    """Copy ``values`` (of the valid rows) into the output's placeholders, in place."""
    valid = output["valid"]
    every = bool(valid.all())  # the usual batch: plain copies, no masked index_put
    for key, value in values.items():
        if key in output:
            if every:
                output[key].copy_(value.detach())
            else:
                output[key][valid] = value.detach().to(device="cpu", dtype=output[key].dtype)


def evaluate_fit(
    fit: FrolicFit,
    features: Tensor,
    labels: Tensor,
    num_labelled: int,
    options: FrolicOptions,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    rows: list[str] | None = None,
) -> tuple[dict[str, float], dict[str, Tensor]]:
    r"""Every row's (``rows``, default all) metrics over all ranks on the labelled samples
    (``labels`` ``>= 0``; ``num_labelled`` of them over all ranks), with :math:`\tau_g` and the
    test prior's diagnostics, and the per-class accuracy ``(K,)`` of each row
    (:func:`frolic_tta.metrics.evaluate_rows`)."""
    keep = labels >= 0
    given = None if fit.logits is None else {"f_d": fit.logits}  # f_d's buffer, not recomputed
    if not bool(keep.all()):
        features, labels = features[keep], labels[keep]
        given = None if given is None else {"f_d": given["f_d"][keep]}
    ctx = RowContext(fit.head, fit.sums, features, options, labels, reduce_fn, chunk_size)
    metrics, class_accuracy = evaluate_rows(  # synced over the process group
        build_rows(ctx, rows),
        fit.head,
        features,
        labels,
        num_labelled=num_labelled,
        chunk_size=chunk_size,
        given=given,
    )
    prior = fit.priors
    metrics.update({"tau_g": fit.head.tau_g, "test_prior/shift_weight": prior.shift_weight})
    metrics.update({"test_prior/passes": prior.passes, "test_prior/converged": prior.converged})
    return metrics, class_accuracy
