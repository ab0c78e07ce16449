r"""FrolicAdaptation: Frolic as a Lightning callback on any module that yields image features.

Add it to the Trainer and let ``predict_step`` return the batch's image features::

    trainer = L.Trainer(callbacks=[FrolicAdaptation(prototypes=text_features, tau_c=0.01)])
    outputs = trainer.predict(my_module, loader)   # each output: {"features": (n, d), ...}

**Per batch** (``on_predict_batch_end``): the features are read from the output
(:mod:`.batch`), checked (width d of the prototypes; non-finite rows are skipped by the policy
of :mod:`.samples`), added to this rank's float64 :class:`~frolic_tta.metrics.FrolicMoments`
sums and cached once; the output dict gets CPU placeholders (``index``, ``valid``, ``target``
with labels, ``logits`` NaN, ``prediction`` -1, ``confidence`` NaN, ``prediction/<row>`` for
the requested ``rows``). Callbacks that subclass :class:`AdaptationListener` (the online
answers, the feature store writer) are then handed the batch, in the Trainer's order.

**Finalize**, once per rank after its own last batch (``trainer.num_predict_batches``, known in
advance): the sums and counts are all-reduced, :func:`~frolic_tta.fit_frolic` fits the head
with every dataset-wide sum through ``trainer.strategy.reduce``, and every placeholder is filled
in place (:mod:`.finalize`), so ``trainer.predict`` returns, and an *epoch*-interval writer
writes, the final values. **DDP contract:** Lightning's predict sampler does not pad, so ranks
may differ by one batch; nothing in a batch hook is a collective, every collective of finalize
is decided on all-reduced values, and every rank calls the same ones in the same order. The
global count of samples (used + skipped) must equal the dataset length unless the Trainer
limits the batches. At predict start the ranks' prototypes and :math:`\tau_c` are compared
(one all-reduce): they must agree.

**After predict** the callback's public state is what other callbacks read (never the module's
type): ``outcome`` (one frozen :class:`~.outcome.PredictOutcome`), ``head``, ``prototypes_``,
``tau_c_``, ``options``, ``class_names``, ``reduce_sum`` and, during predict, ``batch_features``.
:class:`~frolic_tta.FrolicModule` is a frozen open_clip model, its prompts and this callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from frolic_tta.data.indexed import check_class_names
from frolic_tta.errors import FrolicInputError
from frolic_tta.head import FrolicHead
from frolic_tta.lightning import samples
from frolic_tta.lightning.batch import (
    FeatureSource,
    FrolicBatch,
    batch_samples,
    check_free,
    host_samples,
    row_key,
    take_features,
)
from frolic_tta.lightning.finalize import (
    FinalizeSettings,
    PredictRun,
    check_same_on_every_rank,
)
from frolic_tta.lightning.finalize import finalize as fit_and_fill
from frolic_tta.lightning.outcome import (
    PredictOutcome,
    blank_outputs,
    fill_output,
    placeholders,
    predict_loader,
)
from frolic_tta.lightning.store_sums import stored_sums
from frolic_tta.metrics import FrolicMoments
from frolic_tta.options import FrolicOptions, check_positive, options_from_dict
from frolic_tta.precision import full_precision
from frolic_tta.rows import ROWS
from frolic_tta.validation import check_prototypes

PrototypeSource = Tensor | Callable[[L.LightningModule], Tensor]
TemperatureSource = float | Literal["module"] | Callable[[L.LightningModule], float]


@runtime_checkable
class HasTemperature(Protocol):
    r"""A LightningModule with a public :math:`\tau_c` (``tau_c="module"`` reads it)."""

    tau_c: float


class AdaptationListener:
    """A callback that :class:`FrolicAdaptation` hands every batch it has read, before it
    finalizes (so an online answer or a store shard sees the batch, and a rank's last
    collectives come before finalize's, whatever the order of the Trainer's callbacks)."""

    def on_adaptation_batch(
        self, trainer: L.Trainer, adaptation: FrolicAdaptation, batch: FrolicBatch
    ) -> None:
        """Called on every rank for every predict batch, after the adaptation read it."""


def find_adaptation(trainer: L.Trainer) -> FrolicAdaptation:
    """The Trainer's one :class:`FrolicAdaptation` (a ``FrolicModule`` brings its own).

    Raises:
        ValueError: none, or more than one.
    """
    found = [c for c in trainer.callbacks if isinstance(c, FrolicAdaptation)]  # type: ignore[attr-defined]
    if len(found) != 1:
        raise ValueError(
            "Expected one FrolicAdaptation among the Trainer's callbacks (a FrolicModule "
            f"brings its own), but found {len(found)}"
        )
    return found[0]


class FrolicAdaptation(Callback):
    r"""Adapt any LightningModule's zero-shot classifier with Frolic at predict time.

    Args:
        prototypes: ``(K, d)`` class prototypes (text features), or a callable
            ``module -> (K, d)`` run at each predict start (build them on ``module.device``).
            The same on every rank (checked).
        tau_c: zero-shot temperature :math:`\tau_c`: a number (0.01 is OpenAI CLIP's),
            ``"module"`` (the module's public ``tau_c``), or a callable ``module -> float``.
        features: where ``predict_step``'s output dict holds the batch's ``(n, d)`` image
            features (a key, taken out of the output), or a callable ``(output, batch) ->
            features``.
        options: the estimator's :class:`~frolic_tta.options.FrolicOptions`.
        class_names: the K class names (reports); ``None``: ``"0"``, ``"1"``, ...
        rows: Table 3/4 rows (:data:`frolic_tta.rows.ROWS` keys, e.g. ``["f_c", "f_g"]``)
            whose per-sample prediction each output gets as ``prediction/<row>`` (``f_d`` is
            ``prediction``); the Oracle, fitted on labels, is only in the metrics.
        ablations: with labels, the metrics of every row (else of ``f_d`` only).
        return_logits: each output gets ``(n, K)`` ``logits``; ``False`` also keeps finalize
            free of any ``(N, K)`` tensor (for very large K).
        normalize: L2-normalise features and prototypes (CLIP's zero-shot classifier is on
            the unit sphere); ``False``: they already are.
        max_skipped_fraction: largest share of samples that may be skipped (unreadable file
            or non-finite features) before the run stops with an error.
        chunk_size: rows per chunk in finalize (``None``: about 2M logits per chunk).

    Attributes:
        head: the adapted :class:`~frolic_tta.head.FrolicHead` (after predict), or a stored
            one to score with when ``reuse_head``.
        reuse_head: score every batch with ``head`` instead of adapting.
    """

    def __init__(
        self,
        prototypes: PrototypeSource,
        tau_c: TemperatureSource = "module",
        features: FeatureSource = "features",
        options: FrolicOptions = FrolicOptions(),  # noqa: B008 (frozen, immutable)
        class_names: list[str] | None = None,
        rows: Sequence[str] = (),
        ablations: bool = True,
        return_logits: bool = True,
        normalize: bool = True,
        max_skipped_fraction: float = 0.05,
        chunk_size: int | None = None,
    ) -> None:
        if not (isinstance(prototypes, Tensor) or callable(prototypes)):
            raise TypeError(
                "Expected `prototypes` to be a (K, d) tensor or a callable module -> (K, d), "
                f"but got {type(prototypes).__name__}"
            )
        if isinstance(prototypes, Tensor):
            check_prototypes(prototypes)
        if isinstance(tau_c, str) and tau_c != "module":
            raise ValueError(
                "Expected `tau_c` to be a number > 0, 'module' or a callable module -> float, "
                f"but got {tau_c!r}"
            )
        if not (isinstance(tau_c, str) or callable(tau_c)):
            check_positive("tau_c", tau_c)
        self.options = options if isinstance(options, FrolicOptions) else options_from_dict(options)
        self.class_names = check_class_names(class_names)
        samples.check_fraction(max_skipped_fraction)
        samples.check_sizes(1, chunk_size, self.class_names)  # (no text batches here)
        self.rows = tuple(check_rows(rows, self.options))
        self.prototypes, self.tau_c, self.features = prototypes, tau_c, features
        self.ablations, self.return_logits, self.normalize = ablations, return_logits, normalize
        self.max_skipped_fraction, self.chunk_size = max_skipped_fraction, chunk_size
        self.head: FrolicHead | None = None
        self.reuse_head = False
        #: The last predict's outcome (``None`` until its last batch; see :attr:`outcome`).
        self.last_outcome: PredictOutcome | None = None
        #: ``(K, d)`` this predict's prototypes and its :math:`\tau_c` (``None`` before).
        self.prototypes_: Tensor | None = None
        self.tau_c_: float | None = None
        #: The latest batch's features ``(n, d)``, as used.
        self.batch_features: Tensor | None = None
        self.samples_seen = 0  #: samples this rank has read in this predict
        self._run: PredictRun | None = None
        self._skipped = samples.SkippedSamples(max_skipped_fraction, 1)
        self._partial = False
        self._last_batch = -1
        self._strategy: Any = None
        self._world = 0  # the predict's world size

    @property
    def outcome(self) -> PredictOutcome:
        """The last predict's :class:`~.outcome.PredictOutcome` (what callbacks read)."""
        if self.last_outcome is None:
            raise RuntimeError("FrolicAdaptation has no predict outcome yet: run trainer.predict")
        return self.last_outcome

    @property
    def moments(self) -> FrolicMoments | None:
        """This predict's moment sums (``None`` before predict or with a stored head)."""
        return None if self._run is None else self._run.moments

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over ranks through ``trainer.strategy`` (the one collective of
        the adaptation and its listeners); a copy of ``tensor`` in a one-process run (no
        round trip of the solvers' host sums to the device and back)."""
        if self._world == 1:
            return tensor.clone()
        device = self.prototypes_.device if self.prototypes_ is not None else tensor.device
        reduced = self._strategy.reduce(tensor.to(device).clone(), reduce_op="sum")
        return reduced.to(tensor.device)

    # ------------------------------------------------------------------ hooks
    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last_outcome, self._run, self.prototypes_, self.tau_c_ = None, None, None, None
        self.batch_features, self.samples_seen, self._strategy = None, 0, trainer.strategy
        self._world = trainer.world_size
        if self.reuse_head and self.head is None:
            raise FrolicInputError(
                "Expected a stored head with `reuse_head`=True, but this module has none (a "
                "fresh process re-adapts otherwise): pass --model.head_file outputs/<run>/head.pt"
                ", or set --model.reuse_head false to adapt"
            )
        loader = predict_loader(trainer)
        num_batches = trainer.num_predict_batches[0]
        if num_batches == float("inf"):
            raise ValueError("Expected a predict dataloader with a length (map-style dataset)")
        length, world = len(loader.dataset), trainer.world_size
        partial = int(num_batches) < len(loader)  # limit_predict_batches, fast_dev_run
        expected = samples.expected_local_samples(length, world, int(num_batches),
                                                  loader.batch_size)  # fmt: skip
        self._skipped = skipped = samples.SkippedSamples(self.max_skipped_fraction, expected)
        self._partial, self._last_batch = partial, int(num_batches) - 1
        if self.reuse_head:
            return
        if length < world:
            raise FrolicInputError(
                f"Expected at least one sample per rank (N >= world size {world}), but the "
                f"dataset has N={length}"
            )
        prototypes = self._build_prototypes(pl_module)
        tau_c = self._temperature(pl_module)
        check_same_on_every_rank(prototypes, tau_c, trainer.strategy)
        self.prototypes_, self.tau_c_ = prototypes, tau_c
        keep = self.return_logits  # f_c / tau_c of the products, finalize's buffer
        stored = stored_sums(loader.dataset, prototypes, tau_c)  # a feature store's
        soft = stored is None  # else N and sum x only, checked in finalize
        moments = FrolicMoments(prototypes, tau_c, keep, soft, rows=expected).to(pl_module.device)
        self._run = PredictRun(prototypes, tau_c, moments, stored, skipped, length, partial)
        self._run.features.capacity = self._run.labels.capacity = expected  # allocated once

    @override
    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        read = self._read(trainer, outputs, batch, batch_idx)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, AdaptationListener):
                callback.on_adaptation_batch(trainer, self, read)
        if read.last:
            self.finalize(trainer)

    def finalize(self, trainer: L.Trainer) -> None:
        r"""After this rank's last batch: all-reduce, fit the head, :math:`\tau_g`,
        :math:`\beta`, fill the outputs and set :attr:`outcome` (:mod:`.finalize`); a stored
        head only sets the outcome."""
        if self.reuse_head:  # a stored head scored every batch: nothing to fit
            head = self.head
            assert head is not None  # checked at predict start
            self.last_outcome = PredictOutcome.stored(head, self._partial, self._skipped.records)
        elif self._run is not None and self._run.outputs:
            settings = FinalizeSettings(self.options, self.ablations, self.return_logits,
                                        self.chunk_size, self.rows)  # fmt: skip
            with full_precision(self._run.prototypes.device.type):
                self.last_outcome = fit_and_fill(self._run, settings, trainer, self.reduce_sum)
            self.head = self.last_outcome.head

    @override
    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.batch_features = None

    # ------------------------------------------------------------------ one batch
    def _read(self, trainer: L.Trainer, output: Any, batch: Any, batch_idx: int) -> FrolicBatch:
        """Read one batch's features into the run and give its output the placeholders.

        On a GPU this waits for the device once (:func:`~.batch.host_samples`: which rows are
        finite, the index and labels in one copy); a batch whose samples are all usable is
        added without a mask, and its labels are kept on the host until finalize."""
        features = take_features(output, batch, self.features).float()
        if self.normalize:
            features = features / features.norm(dim=1, keepdim=True)
        reference = self.head.prototypes if self.reuse_head else self.prototypes_
        assert reference is not None  # set at predict start
        k, d = reference.shape
        if features.shape[1] != d:
            raise FrolicInputError(
                f"Expected image features of width d={d}, the prototypes' (K={k}, d={d}), but "
                f"predict_step gave {tuple(features.shape)}"
            )
        n = features.shape[0]
        index, labels, errors = batch_samples(output, batch, trainer, batch_idx, n)
        check_free(output, self.rows)
        blank = blank_outputs(n, k, self.return_logits)  # host work while the device computes
        finite, index, labels = host_samples(features, index, labels)  # the one device read
        valid, reasons = samples.batch_validity(finite, errors)
        self._skipped.add(index, reasons)
        output.update(placeholders(index, valid, labels, k, self.return_logits, blank))
        for row in self.rows:
            output[row_key(row)] = torch.full((n,), -1, dtype=torch.long)
        self.batch_features, self.samples_seen = features, self.samples_seen + n
        last = batch_idx == self._last_batch
        read = FrolicBatch(output, features, index, valid, labels, errors, last)
        every = reasons is None  # every sample usable: no mask, no copy of the features
        used = features if every else features[valid.to(features.device)]
        if self.reuse_head:
            fill_output(output, self.head.score(used))  # type: ignore[union-attr]
            return read
        run = self._run
        assert run is not None  # set at predict start
        with full_precision(features.device.type):
            run.moments.update(used, check_finite=False)  # finite: checked on the host
        run.features.append(used)
        given = labels if labels is not None else torch.full((n,), -1, dtype=torch.long)
        run.labels.append(given if every else given[valid])  # host; to the device in finalize
        run.outputs.append(output)
        return read

    def _build_prototypes(self, pl_module: L.LightningModule) -> Tensor:
        source = self.prototypes
        built = source if isinstance(source, Tensor) else source(pl_module)
        if not isinstance(built, Tensor):
            raise TypeError(
                f"Expected the prototypes callable to return a (K, d) tensor, but it returned "
                f"{type(built).__name__}"
            )
        prototypes = built.detach().to(pl_module.device).float()
        check_prototypes(prototypes)
        if self.normalize:
            prototypes = prototypes / prototypes.norm(dim=1, keepdim=True)
        if self.class_names is not None and len(self.class_names) != prototypes.shape[0]:
            raise FrolicInputError(
                f"Expected one prototype per class name ({len(self.class_names)}), but got "
                f"prototypes of shape {tuple(prototypes.shape)}"
            )
        return prototypes

    def _temperature(self, pl_module: L.LightningModule) -> float:
        if self.tau_c == "module":
            if not isinstance(pl_module, HasTemperature):
                raise FrolicInputError(
                    "Expected the LightningModule to have a `tau_c` attribute for "
                    f"FrolicAdaptation(tau_c='module'), but {type(pl_module).__name__} has "
                    "none: pass tau_c=<number> (0.01 for OpenAI CLIP) or a callable"
                )
            value: Any = pl_module.tau_c
        else:
            value = self.tau_c(pl_module) if callable(self.tau_c) else self.tau_c
        return check_positive("tau_c", float(value) if isinstance(value, Tensor) else value)


def check_rows(rows: Sequence[str], options: FrolicOptions) -> list[str]:
    """The requested per-sample rows, checked.

    Raises:
        ValueError: an unknown row, the Oracle (fitted on labels), ``f_d`` (that is
            ``prediction``), or a row these ``options`` do not build.
    """
    if isinstance(rows, str):
        raise ValueError(f"Expected `rows` to be a list of row keys, but got the string {rows!r}")
    rows = list(rows)
    unknown = [r for r in rows if r not in ROWS or r in ("oracle", "f_d")]
    unavailable = [r for r in rows if r not in unknown and not ROWS[r].available(2, False, options)]
    if unknown or unavailable:
        allowed = [r for r in ROWS if r not in ("oracle", "f_d")]
        raise ValueError(
            f"Expected `rows` among {allowed} (f_d is `prediction`; the Oracle, fitted on the "
            f"labels, is only in the metrics) and built under these options, but got "
            f"{unknown + unavailable}"
        )
    return rows
