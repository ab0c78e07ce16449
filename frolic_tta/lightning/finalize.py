r"""Finalize: what :class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` does after a
rank's last predict batch.

The moment sums are all-reduced (torchmetrics' sync of
:class:`~frolic_tta.metrics.FrolicMoments`), the counts too (one :class:`~.outcome.RunCounts`
call), the head, the test prior, :math:`\tau_g` and :math:`\beta` are fitted by
:func:`frolic_tta.fit_frolic` (every dataset-wide sum through ``reduce_fn``, i.e.
``trainer.strategy.reduce``), the cached features are scored into every batch's placeholders
in place, and with labels every Table 3/4 row is evaluated. Every collective is decided on
all-reduced values, so every rank calls the same ones in the same order.

Also here: :func:`check_same_on_every_rank`, the start-of-predict check that every rank holds
the same prototypes and :math:`\tau_c`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from frolic_tta.errors import FrolicInputError
from frolic_tta.lightning import samples
from frolic_tta.lightning.batch import row_key
from frolic_tta.lightning.outcome import PredictOutcome, RunCounts, evaluate_fit, fill_outputs
from frolic_tta.lightning.progress import FinalizeProgress
from frolic_tta.lightning.store_sums import checked_sums
from frolic_tta.logits import ReduceFn, RowBuffer
from frolic_tta.metrics import FrolicMoments
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import FrolicFit, fit_frolic
from frolic_tta.rows import RowContext, build_rows

FINGERPRINT = 16
"""Numbers per rank that :func:`check_same_on_every_rank` compares (fixed: any K and d)."""


@dataclass
class PredictRun:
    """One rank's state of one predict run (what finalize reads).

    Attributes:
        prototypes: ``(K, d)`` this run's prototypes (on the module's device).
        tau_c: the zero-shot temperature used.
        moments: the float64 moment sums of this rank's usable features.
        stored: a feature store's sums for these prototypes (checked in finalize), or ``None``.
        skipped: this rank's skipped samples and the early stop.
        dataset_length: samples in the predict dataset (all ranks).
        partial: the Trainer limited this rank's batches.
        features: this rank's usable features, cached once (``N_rank x d``).
        labels: their labels (-1: none).
        outputs: the batches' output dicts, in the order of the cached rows.
    """

    prototypes: Tensor
    tau_c: float
    moments: FrolicMoments
    stored: dict[str, Tensor] | None
    skipped: samples.SkippedSamples
    dataset_length: int
    partial: bool
    features: RowBuffer = field(default_factory=RowBuffer)
    labels: RowBuffer = field(default_factory=RowBuffer)
    outputs: list[dict[str, Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class FinalizeSettings:
    """The callback's choices finalize follows (see :class:`~.adaptation.FrolicAdaptation`)."""

    options: FrolicOptions
    ablations: bool
    return_logits: bool
    chunk_size: int | None
    rows: tuple[str, ...]


def finalize(
    run: PredictRun, settings: FinalizeSettings, trainer: L.Trainer, reduce_fn: ReduceFn
) -> PredictOutcome:
    r"""All-reduce, fit the head, :math:`\tau_g`, :math:`\beta`, fill the outputs; the outcome."""
    computed = run.moments.compute()  # synced over the process group
    counts = _count(run, computed.count, reduce_fn)
    samples.check_counts(counts, run.dataset_length, run.skipped)
    used = counts["used"]
    features = run.features.rows()
    k = run.prototypes.shape[0]  # the phases: [i/n], in order
    progress = FinalizeProgress(trainer, reduce_fn, used, k, options=settings.options)
    sums = checked_sums(computed, run.stored, progress.say)  # None: fit_frolic's own
    fit = fit_frolic(
        features,
        run.prototypes,
        settings.options,
        tau_c=run.tau_c,
        sums=sums,
        reduce_fn=progress.reduce,
        keep_logits=settings.return_logits,  # else no (N, K) tensor: rescored batch by batch
        chunk_size=settings.chunk_size,
        progress=progress,
        zero_shot_logits=run.moments.zero_shot_logits(),
    )
    timings = progress.finish(fit.head.tau_g, fit.priors)
    probability = fill_outputs(
        run.outputs, fit.logits, fit.head, features, reduce_fn, computed.count.cpu()
    )
    if settings.rows:
        fill_rows(run.outputs, fit, features, settings, reduce_fn)
    metrics: dict[str, float] = {}
    class_accuracy: dict[str, Tensor] = {}
    if counts["labelled"]:
        if counts["labelled"] < used:
            rank_zero_warn(
                f"{used - counts['labelled']} of the {used} usable samples carry no label: "
                f"accuracy is computed on the {counts['labelled']} that do"
            )
        labels = run.labels.rows().to(features.device)  # kept on the host while encoding
        rows = None if settings.ablations else ["f_d"]
        args = (settings.options, reduce_fn, settings.chunk_size, rows)
        metrics, class_accuracy = evaluate_fit(fit, features, labels, counts["labelled"], *args)
        if trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=0)
    run.features, run.labels = RowBuffer(), RowBuffer()
    return PredictOutcome(
        head=fit.head,
        priors=fit.priors,
        adapted=True,
        partial=bool(counts["partial"]),
        samples={"dataset_length": run.dataset_length, "used": used, **counts},
        skipped=run.skipped.records,
        metrics=metrics,
        class_accuracy=class_accuracy,
        class_probability=probability,
        finalize=timings,
        moments=computed if run.stored is None else None,
        moments_from_store=sums is not None and sums is not computed,
    )


def _count(run: PredictRun, used: Tensor, reduce_fn: ReduceFn) -> dict[str, int]:
    """Counts over all ranks (one all-reduce; every rank gets the same numbers)."""
    labelled = int((run.labels.rows(torch.zeros(0)) >= 0).sum())
    seen = sum(o["index"].numel() for o in run.outputs)
    local = RunCounts(len(run.skipped.records), labelled, run.partial, seen)
    counts = asdict(local.reduce(reduce_fn))
    return {**counts, "partial": int(counts["partial"]), "used": int(round(float(used)))}


def fill_rows(
    outputs: list[dict[str, Tensor]],
    fit: FrolicFit,
    features: Tensor,
    settings: FinalizeSettings,
    reduce_fn: ReduceFn,
) -> None:
    """Write each requested row's per-sample prediction (``prediction/<row>``) in place."""
    ctx = RowContext(fit.head, fit.sums, features, settings.options, None, reduce_fn,
                     settings.chunk_size)  # fmt: skip
    maps = build_rows(ctx, settings.rows)  # collectives in registry order, on every rank
    sizes = [int(output["valid"].sum()) for output in outputs]  # host flags
    for row, classifier in maps.items():  # every batch queued, then one copy to the host
        scored = [classifier.logits(part).argmax(1) for part in features.split(sizes)]
        predictions = torch.cat(scored).cpu() if scored else None
        for output, part in zip(outputs, [] if predictions is None else predictions.split(sizes),
                                strict=True):  # fmt: skip
            output[row_key(row)][output["valid"]] = part


def fingerprint(prototypes: Tensor, tau_c: float) -> Tensor:
    r"""``(16,)`` float64 summary of ``prototypes`` ``(K, d)`` and ``tau_c``: K, d,
    :math:`\tau_c`, and 13 fixed projections (any change of an entry moves one)."""
    z = prototypes.detach().double().cpu()
    k, d = z.shape
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(d, FINGERPRINT - 3, generator=generator, dtype=torch.float64)
    weights = 1.5 + torch.cos(0.7 * torch.arange(k, dtype=torch.float64))
    projections = weights @ (z @ directions)
    return torch.cat([torch.tensor([k, d, float(tau_c)], dtype=torch.float64), projections])


def check_same_on_every_rank(
    prototypes: Tensor, tau_c: float, strategy: Any, tolerance: float = 1e-5
) -> None:
    r"""Raise on every rank if the ranks' prototypes or :math:`\tau_c` differ by more than
    ``tolerance`` of their scale (one ``max`` all-reduce of :func:`fingerprint`).

    Raises:
        FrolicInputError: they differ (decided on reduced values: every rank raises).
    """
    local = fingerprint(prototypes, tau_c)
    both = torch.cat([local, -local]).to(prototypes.device)
    reduced = strategy.reduce(both, reduce_op="max").double().cpu()
    highest, lowest = reduced[:FINGERPRINT], -reduced[FINGERPRINT:]
    spread = (highest - lowest) / highest.abs().clamp_min(1.0)
    if float(spread.max()) > tolerance:
        what = "tau_c" if float(spread[3:].max()) <= tolerance else "values"
        what = "shapes (K, d)" if bool(spread[:2].any()) else what
        raise FrolicInputError(
            f"Expected the same prototypes (K, d) and tau_c on every rank, but their {what} "
            f"differ between ranks (by {float(spread.max()):.1e} of their scale): build them "
            "from the same prompts and weights in eval mode, or pass one tensor"
        )
