r"""FrolicReport: the files and the terminal table a person looks at after ``train.py predict``.

After the predict epoch, rank 0 joins the per-rank prediction files (written by the inherited
:class:`~frolic_tta.lightning.writer.FrolicPredictionWriter`) and writes, in ``output_dir``:

* ``metrics.json``: dataset, split, model, N, K, the estimator's ``options``, :math:`\tau_g`,
  the estimated test prior and the label biases (:meth:`frolic_tta.prior.Priors.summary`:
  spreads and undetermined classes); with labels, per Table 3/4 row: top-1 ``accuracy``
  (exact ratios over ``num_evaluated`` samples), ``top5``, ``recall`` (mean per-class),
  ``ece``, ``nll`` (:data:`frolic_tta.metrics.ROW_METRICS`); per class: the priors,
  ``support`` (labelled samples), ``accuracy`` of every row (``null`` without support) and
  mean predicted probability before/after debiasing; the ``skipped`` samples (index, path,
  reason) and ``notes`` (a partial run, a stored head, samples without labels).
* ``predictions.csv``: ``index, path, prediction, confidence[, target], skipped`` (class names;
  a skipped sample has an empty prediction and its reason under ``skipped``).
* ``logits.pt``: the joined tensors (``index``, ``valid``, ``logits``, ``prediction``,
  ``confidence``, ``target``), ``skipped`` and ``class_names``.
* ``head.pt``: the adapted head (``frolic_head``, :meth:`frolic_tta.FrolicHead.state_dict`) and
  ``classifier`` (state dict of the :class:`~frolic_tta.FrolicClassifier`
  :math:`f_d(x) = A(x - \mu) + c` on L2-normalised image features).
* ``class_probability.png`` (the paper's Fig. 1c/d) and ``priors.png``.
* with ``FrolicModule(online=True)``: an ``online`` section in ``metrics.json``, ``online.csv``
  (answers in arrival order with the refit and count they were made with) and
  ``online_accuracy.png`` (:mod:`frolic_tta.lightning.online`).

The terminal table is printed when the predict stage has ended (``teardown``), below the closed
progress bar, not into it. What the run produced is read from the Trainer's
:class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` (``FrolicModule``'s own, or one a
module of your own is adapted with): its :class:`~frolic_tta.lightning.outcome.PredictOutcome`,
``options`` and ``class_names``; the model's name, weights and provenance from a module that
describes itself (:class:`~frolic_tta.lightning.outcome.DescribesModel`), else its class name.
"""

from __future__ import annotations

import csv
import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from frolic_tta.data.indexed import DataDescription, DescribesData, dataset_paths
from frolic_tta.lightning.adaptation import FrolicAdaptation, find_adaptation
from frolic_tta.lightning.batch import row_key
from frolic_tta.lightning.online import find_online, online_summary, plot_online, write_online_csv
from frolic_tta.lightning.outcome import DescribesModel, ModelDescription, predict_loader
from frolic_tta.lightning.plots import plot_class_probability, plot_priors
from frolic_tta.lightning.provenance import KEY as PROVENANCE
from frolic_tta.lightning.summary_table import format_outputs, format_table, short_name
from frolic_tta.lightning.writer import FrolicPredictionWriter, join_predictions, save_file
from frolic_tta.metrics import ROW_METRICS, metric_key
from frolic_tta.rows import ROWS


def _float32(value: float) -> float:
    """A float32 metric to the digits it holds: 0.79, not 0.7899999618."""
    return float(f"{value:.7g}")


def _ratio(value: float, count: int) -> float:
    """An accuracy over ``count`` samples as the exact ratio it is (float32 in, float64 out)."""
    hits = round(value * count)
    return hits / count if count and abs(value * count - hits) < 1e-2 else _float32(value)


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    """Tensors moved to the CPU (loadable without a GPU), other values as they are."""
    return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}


def _describe(module: L.LightningModule) -> ModelDescription:
    """The module's own description, else one naming its class."""
    if isinstance(module, DescribesModel):
        return module.describe_model()
    return ModelDescription(model_name=type(module).__name__)


def _class_names(adaptation: FrolicAdaptation) -> list[str]:
    """The adaptation's class names, else ``"0"``, ``"1"``, ... for its K classes."""
    if adaptation.class_names is not None:
        return list(adaptation.class_names)
    return [str(k) for k in range(adaptation.outcome.head.prototypes.shape[0])]


class FrolicReport(FrolicPredictionWriter):
    """Write the report files of a Frolic predict run and print a summary table (rank 0).

    Per-rank prediction files go to ``<output_dir>/predictions`` (stale ones from an earlier run
    are removed when predict starts); after the epoch every rank meets at a barrier and rank 0
    joins them. Epoch interval only, like its parent.

    Args:
        output_dir: Folder for the report (created if missing).
        plots: Write the PNG plots.
        keep_shards: Keep ``predictions/predictions_rank*.pt`` after joining them into
            ``logits.pt`` (removed by default: same content).
        print_table: Print the summary table to the terminal.
    """

    def __init__(
        self,
        output_dir: str = "outputs",
        plots: bool = True,
        keep_shards: bool = False,
        print_table: bool = True,
    ) -> None:
        super().__init__(str(Path(output_dir) / "predictions"))
        self.report_dir = Path(output_dir)
        self.plots = plots
        self.keep_shards = keep_shards
        self.print_table = print_table
        #: The summary written to ``metrics.json`` (rank 0, after predict).
        self.summary: dict[str, Any] = {}
        self._table_due = False
        #: The files the last predict wrote in ``output_dir`` (rank 0), in order.
        self.written: list[str] = []
        #: Images encoded over all ranks in the last predict (0 when read from a feature store).
        self.images_encoded: int | None = None

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.summary, self._table_due, self.written = {}, False, []
        if trainer.is_global_zero:
            for stale in self.output_dir.glob("predictions_rank*.pt"):
                stale.unlink()
        trainer.strategy.barrier()

    @override
    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seen = _describe(pl_module).images_encoded
        encoded = torch.tensor(find_adaptation(trainer).samples_seen if seen is None else seen)
        encoded = trainer.strategy.reduce(encoded.to(pl_module.device), reduce_op="sum")
        self.images_encoded = int(encoded.item())  # over all ranks (0: a feature store's)
        trainer.strategy.barrier()  # every rank's file is written
        if not trainer.is_global_zero:
            return
        length = len(predict_loader(trainer).dataset)
        joined = join_predictions(self.output_dir, dataset_length=length)
        self.write(trainer, pl_module, joined)
        if not self.keep_shards:
            shutil.rmtree(self.output_dir, ignore_errors=True)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._table_due:  # the progress bar has closed: the table gets lines of its own
            self._table_due = False
            print(format_table(self.summary), flush=True)
        if self.written:  # rank 0: where the files are (config.yaml: the CLI's, if there)
            config = ["config.yaml"] if (self.report_dir / "config.yaml").is_file() else []
            print(format_outputs(self.report_dir, self.written + config), flush=True)
            self.written = []

    # ------------------------------------------------------------------ writing
    def write(self, trainer: L.Trainer, module: L.LightningModule, joined: dict[str, Any]) -> None:
        """Write every report file from the joined predictions and the adaptation's outcome."""
        adaptation = find_adaptation(trainer)
        model = _describe(module)
        outcome = adaptation.outcome
        out = self.report_dir
        out.mkdir(parents=True, exist_ok=True)
        names = _class_names(adaptation)
        data = described_data(trainer)
        paths = data.paths
        self._write_csv(out / "predictions.csv", joined, names, paths, adaptation.rows)
        save_file({**joined, "class_names": names}, out / "logits.pt")
        save_file(
            {
                "frolic_head": _cpu(outcome.head.state_dict()),
                "classifier": _cpu(outcome.head.to_module().state_dict()),
                "class_names": names,
                PROVENANCE: model.provenance,
                "encoder_options": {key: module.hparams.get(key)  # what a reuse must pass
                                    for key in ("model_name", "pretrained")},  # fmt: skip
            },
            out / "head.pt",
        )
        self.summary = self._summary(trainer, adaptation, model, joined, names, data)
        encoded = self.images_encoded
        self.summary["features"] = data.feature_source
        self.summary["images_encoded"] = model.images_encoded if encoded is None else encoded
        online = "online_step" in joined  # OnlineAnswers (FrolicModule(online=True))
        if online:
            self.summary["online"] = online_summary(joined, find_online(trainer))
            write_online_csv(out / "online.csv", joined, names)
        (out / "metrics.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        probability, online_plot = outcome.class_probability, []
        if self.plots:
            title = f"{self.summary['dataset']}, {self.summary['model']}"
            if probability:
                plot_class_probability(
                    probability["before"], probability["after"], names, out, title
                )
            plot_priors(outcome.priors, names, out, title)
            if online and plot_online(joined, out, title) is not None:
                online_plot = ["online_accuracy.png"]
        self._table_due = self.print_table
        plots = ["class_probability.png"] if self.plots and probability else []
        plots += ["priors.png"] if self.plots else []
        plots += (["online.csv"] if online else []) + online_plot
        self.written = ["metrics.json", "predictions.csv", "logits.pt", "head.pt", *plots]

    @staticmethod
    def _write_csv(
        path: Path,
        joined: dict[str, Any],
        names: list[str],
        paths: list[str] | None,
        rows: tuple[str, ...] = (),
    ) -> None:
        has_target = "target" in joined
        n = joined["index"].numel()
        valid = joined.get("valid", torch.ones(n, dtype=torch.bool)).tolist()
        targets = joined["target"].tolist() if has_target else [-1] * n
        reasons = {s["index"]: s["reason"] for s in joined.get("skipped", [])}
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            header = ["index", "path", "prediction", "confidence"]
            extra = [row_key(r) for r in rows]  # the requested Table 3/4 rows' predictions
            writer.writerow(header + (["target"] if has_target else []) + ["skipped"] + extra)
            lines = zip(
                joined["index"].tolist(),
                joined["prediction"].tolist(),
                joined["confidence"].tolist(),
                valid,
                targets,
                zip(*(joined[key].tolist() for key in extra), strict=True) if extra else [()] * n,
                strict=True,
            )
            for index, prediction, confidence, ok, target, more in lines:
                row = [index, paths[index] if paths is not None else ""]
                row += [names[prediction], f"{confidence:.6f}"] if ok else ["", ""]
                if has_target:
                    row.append(names[target] if target >= 0 else "")
                row.append("" if ok else reasons.get(index, "skipped"))
                writer.writerow(row + [names[m] if ok else "" for m in more])

    @staticmethod
    def _summary(
        trainer: L.Trainer,
        adaptation: FrolicAdaptation,
        model: ModelDescription,
        joined: dict[str, Any],
        names: list[str],
        data: DataDescription,
    ) -> dict[str, Any]:
        paths = data.paths
        outcome = adaptation.outcome
        head = outcome.head
        summary = outcome.priors.summary()
        n = int(joined["index"].numel())
        valid = joined.get("valid", torch.ones(n, dtype=torch.bool))
        target = joined.get("target", torch.full((n,), -1))
        evaluated = valid & (target >= 0)
        num_evaluated = int(evaluated.sum())
        metrics = outcome.metrics
        scores = {
            kind: {
                row: _float32(metrics[metric_key(row, kind)])
                for row in ROWS
                if metric_key(row, kind) in metrics
            }
            for kind in ROW_METRICS
        }
        accuracy = {row: _ratio(v, num_evaluated) for row, v in scores.pop("accuracy").items()}
        if not accuracy and num_evaluated:  # a stored head: f_d's top-1 only
            correct = int((joined["prediction"][evaluated] == target[evaluated]).sum())
            accuracy = {"f_d": correct / num_evaluated}
        support = torch.bincount(target[evaluated].long(), minlength=len(names)).tolist()
        per_class_accuracy = {
            row: [_round(v) if n else None for v, n in zip(values.tolist(), support, strict=True)]
            for row, values in outcome.class_accuracy.items()
        }
        skipped = [
            {"index": s["index"], "path": paths[s["index"]] if paths else None} | s
            for s in joined.get("skipped", [])
        ]
        length = len(predict_loader(trainer).dataset)
        probability = outcome.class_probability
        return {
            "dataset": data.dataset_name,
            "split": data.split_source,
            "model": short_name(model.model_name),
            "model_name": model.model_name,
            "pretrained": model.pretrained,
            "num_samples": n,
            "dataset_length": length,
            "num_classes": len(names),
            "world_size": trainer.world_size,
            "labelled": num_evaluated > 0,
            "num_evaluated": num_evaluated,
            "accuracy": accuracy,
            **scores,
            "options": asdict(adaptation.options),
            "adapted": outcome.adapted,
            "moments_from_store": outcome.moments_from_store,
            "tau_c": float(head.tau_c),
            "tau_g": float(head.tau_g),
            **{key: value for key, value in summary.items() if key != "per_class"},
            "skipped": skipped,
            "notes": _notes(joined, n, length, len(skipped), num_evaluated, adaptation),
            "per_class": {
                "class_names": names,
                **summary["per_class"],
                "support": support,
                "accuracy": per_class_accuracy,
                **{
                    f"probability_{key}": [_round(v) for v in value.double().cpu().tolist()]
                    for key, value in probability.items()
                },
            },
        }


def described_data(trainer: L.Trainer) -> DataDescription:
    """The run's :class:`~frolic_tta.data.DataDescription`: from a datamodule that describes
    its data (:class:`~frolic_tta.data.DescribesData`), else ``"custom"``; paths from the
    predict dataset where the datamodule gives none."""
    datamodule = trainer.datamodule
    data = datamodule.describe() if isinstance(datamodule, DescribesData) else DataDescription()
    if not data.paths:
        data = replace(data, paths=dataset_paths(predict_loader(trainer).dataset))
    return data


def _round(value: float) -> float:
    """Six significant digits: a mean of float32 probabilities carries no more."""
    return float(f"{value:.6g}")


def _notes(
    joined: dict[str, Any],
    n: int,
    length: int,
    skipped: int,
    evaluated: int,
    adaptation: FrolicAdaptation,
) -> list[str]:
    """What a reader of the numbers must know: partial run, stored head, skipped samples."""
    notes = []
    if joined.get("partial"):
        notes.append(
            f"partial run: the Trainer stopped after some batches (limit_predict_batches / "
            f"fast_dev_run); adapted on and predicted {n} of {length} samples"
        )
    zero_shot = adaptation.options.zero_shot
    if zero_shot == "inmap":
        notes.append("zero-shot classifier: InMaP's proxies (f_c is InMaP, f_d InMaP + Frolic)")
    if zero_shot == "inmap_both":
        notes.append(
            "the released script: f_c and f_g are InMaP proxies supervised by the text and by "
            "the Gaussian head"
        )
    if not adaptation.outcome.adapted:
        notes.append("scored with a stored head (head_file / reuse_head): no adaptation")
    if skipped:
        notes.append(
            f"{skipped} sample(s) skipped (unreadable file or non-finite features): no "
            "prediction; see 'skipped' in metrics.json"
        )
    if evaluated and evaluated < n:
        notes.append(f"accuracy on the {evaluated} of {n} samples with a label and a prediction")
    return notes
