r"""FrolicReport: the files and the terminal table a person looks at after ``train.py predict``.

After the predict epoch, rank 0 joins the per-rank prediction files (written by the inherited
:class:`~frolic_tta.callbacks.FrolicPredictionWriter`) and writes, in ``output_dir``:

* ``metrics.json``: dataset, split, model, N, K, :math:`\tau_g`, the spread of :math:`\hat\beta`,
  accuracy of every Table 3/4 row (labelled data only), and per-class :math:`\hat\beta` and mean
  predicted probability before/after debiasing.
* ``predictions.csv``: ``index, path, prediction, confidence[, target]`` (class names).
* ``logits.pt``: the joined tensors (``index``, ``logits``, ``prediction``, ``confidence``,
  ``target``) and ``class_names``.
* ``head.pt``: the adapted head (``frolic_head``, :meth:`frolic_tta.FrolicHead.state_dict`) and
  ``classifier`` (state dict of the :class:`~frolic_tta.FrolicClassifier`
  :math:`f_d(x) = A(x - \mu) + c` on L2-normalised image features).
* ``class_probability.png`` (the paper's Fig. 1c/d) and ``beta.png``.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from tqdm import tqdm
from typing_extensions import override

from frolic_tta.data.indexed import dataset_paths
from frolic_tta.lightning.plots import plot_beta, plot_class_probability
from frolic_tta.lightning.writer import FrolicPredictionWriter, join_predictions
from frolic_tta.metrics import metric_key
from frolic_tta.rows import ROWS


def _short(value: Any) -> str:
    """A model name for titles: the file name of a path, else the value."""
    text = str(value)
    return Path(text).name if "/" in text else text


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    """Tensors moved to the CPU (loadable without a GPU), other values as they are."""
    return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}


def _loader_dataset(trainer: L.Trainer) -> Any:
    loaders = trainer.predict_dataloaders
    loader = loaders[0] if isinstance(loaders, list | tuple) else loaders
    return getattr(loader, "dataset", None)


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
        #: Images encoded over all ranks in the last predict (0 when read from a feature store).
        self.images_encoded: int | None = None

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            for stale in self.output_dir.glob("predictions_rank*.pt"):
                stale.unlink()
        trainer.strategy.barrier()

    @override
    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        encoded = torch.tensor(int(getattr(pl_module, "images_encoded", 0)))
        encoded = trainer.strategy.reduce(encoded.to(pl_module.device), reduce_op="sum")
        self.images_encoded = int(encoded.item())  # over all ranks (0: a feature store's)
        trainer.strategy.barrier()  # every rank's file is written
        if not trainer.is_global_zero:
            return
        dataset = _loader_dataset(trainer)
        length = len(dataset) if dataset is not None else None
        joined = join_predictions(self.output_dir, dataset_length=length)
        self.write(trainer, pl_module, joined)
        if not self.keep_shards:
            shutil.rmtree(self.output_dir, ignore_errors=True)

    # ------------------------------------------------------------------ writing
    def write(
        self, trainer: L.Trainer, module: L.LightningModule, joined: dict[str, Tensor]
    ) -> None:
        """Write every report file from the joined predictions and the adapted module."""
        head = getattr(module, "head", None)
        if head is None:
            raise ValueError(
                f"Expected a module adapted by predict (with a `.head`), but got "
                f"{type(module).__name__} without one"
            )
        out = self.report_dir
        out.mkdir(parents=True, exist_ok=True)
        names = list(module.class_names)
        datamodule = getattr(trainer, "datamodule", None)
        paths = getattr(datamodule, "paths", None) or dataset_paths(_loader_dataset(trainer))
        self._write_csv(out / "predictions.csv", joined, names, paths)
        torch.save({**joined, "class_names": names}, out / "logits.pt")
        torch.save(
            {
                "frolic_head": _cpu(head.state_dict()),
                "classifier": _cpu(module.adapted_classifier().state_dict()),
                "class_names": names,
            },
            out / "head.pt",
        )
        self.summary = self._summary(trainer, module, joined, names)
        encoded = self.images_encoded
        self.summary["features"] = getattr(datamodule, "feature_source", "encoded")
        self.summary["images_encoded"] = (
            getattr(module, "images_encoded", None) if encoded is None else encoded
        )
        (out / "metrics.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        probability = getattr(module, "class_probability_", {})
        if self.plots:
            title = f"{self.summary['dataset']}, {self.summary['model']}"
            if probability:
                plot_class_probability(
                    probability["before"], probability["after"], names, out, title
                )
            plot_beta(head.beta, names, out, title)
        if self.print_table:
            tqdm.write(format_table(self.summary), file=sys.stdout)  # above a live bar

    @staticmethod
    def _write_csv(
        path: Path, joined: dict[str, Tensor], names: list[str], paths: list[str] | None
    ) -> None:
        has_target = "target" in joined
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(
                ["index", "path", "prediction", "confidence"] + (["target"] if has_target else [])
            )
            rows = zip(
                joined["index"].tolist(),
                joined["prediction"].tolist(),
                joined["confidence"].tolist(),
                strict=True,
            )
            targets = joined["target"].tolist() if has_target else None
            for i, (index, prediction, confidence) in enumerate(rows):
                row = [
                    index,
                    paths[index] if paths is not None else "",
                    names[prediction],
                    f"{confidence:.6f}",
                ]
                if targets is not None:
                    row.append(names[targets[i]])
                writer.writerow(row)

    @staticmethod
    def _summary(
        trainer: L.Trainer, module: L.LightningModule, joined: dict[str, Tensor], names: list[str]
    ) -> dict[str, Any]:
        head = module.head
        beta = head.beta.double().cpu()
        hparams = getattr(module, "hparams", {})
        datamodule = getattr(trainer, "datamodule", None)
        metrics = dict(getattr(module, "metrics_", {}))
        accuracy = {row: metrics[metric_key(row)] for row in ROWS if metric_key(row) in metrics}
        if not accuracy and "target" in joined:  # ablations off: the final head only
            correct = (joined["prediction"] == joined["target"]).double().mean()
            accuracy = {"f_d": float(correct)}
        probability = getattr(module, "class_probability_", {})
        return {
            "dataset": getattr(datamodule, "dataset_name", None) or "custom",
            "split": getattr(datamodule, "split_source", None),
            "model": _short(hparams.get("model_name")),
            "model_name": hparams.get("model_name"),
            "pretrained": hparams.get("pretrained"),
            "num_samples": int(joined["index"].numel()),
            "num_classes": len(names),
            "world_size": trainer.world_size,
            "labelled": "target" in joined,
            "accuracy": accuracy,
            "tau_c": float(head.tau_c),
            "tau_g": float(head.tau_g),
            "beta": {
                "min": float(beta.min()),
                "max": float(beta.max()),
                "max_over_min": float(beta.max() / beta.min()),
                "std_log": float(beta.log().std()) if beta.numel() > 1 else 0.0,
            },
            "per_class": {
                "class_names": names,
                "beta": beta.tolist(),
                **{
                    f"probability_{key}": value.double().cpu().tolist()
                    for key, value in probability.items()
                },
            },
        }


def format_table(summary: dict[str, Any]) -> str:
    """The terminal table of a :class:`FrolicReport` summary (plain text)."""
    lines = [
        f"Frolic on {summary['dataset']} with {summary['model']} "
        f"({_short(summary['pretrained'])}): "
        f"N={summary['num_samples']} samples, K={summary['num_classes']} classes",
    ]
    if summary.get("split"):
        lines.append(f"  split: {summary['split']}")
    if summary.get("features", "encoded") != "encoded":
        lines.append(f"  features: {summary['features']}")
    accuracy = summary["accuracy"]
    if accuracy:
        width = max(len(row) for row in accuracy)
        lines.append(f"  {'row':<{width}}  {'accuracy':>8}  description")
        for row, value in accuracy.items():
            lines.append(f"  {row:<{width}}  {100 * value:>7.2f}%  {ROWS[row].label}")
    else:
        lines.append("  no labels: accuracy not computed")
    beta = summary["beta"]
    lines.append(f"  tau_c = {summary['tau_c']:.4g}, tau_g = {summary['tau_g']:.4g}")
    lines.append(
        f"  beta_hat: min {beta['min']:.4g}, max {beta['max']:.4g}, "
        f"max/min {beta['max_over_min']:.3g}, std(log beta) {beta['std_log']:.3g} "
        f"(uniform = {1 / max(summary['num_classes'], 1):.4g})"
    )
    return "\n".join(lines)
