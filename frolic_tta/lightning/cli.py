"""The command line: ``python train.py predict --config configs/vit_b16.yaml --config
configs/datasets/<dataset>.yaml`` (a model's base file, then a dataset's).

:class:`FrolicCLI` is a :class:`~lightning.pytorch.cli.LightningCLI` with one subcommand,
``predict`` (Frolic adapts at test time; there is nothing to fit). It

* takes :class:`~frolic_tta.FrolicModule` as ``model`` and any ``LightningDataModule`` with a
  ``class_names`` attribute as ``data`` (default :class:`~frolic_tta.data.FrolicDataModule`, so
  ``--data.dataset eurosat`` works without ``--data FrolicDataModule``);
* links ``data.class_names`` to ``model.class_names`` when the datamodule is instantiated (or
  takes them from ``--model.head_file``);
* adds ``--output_dir`` (also the Trainer's ``default_root_dir``, where ``config.yaml`` is saved
  and overwritten on a re-run) and always registers :class:`~frolic_tta.report.FrolicReport`
  there (options under ``--report.*``);
* checks what is cheap to check (options, templates, prompts file, head file, ``ckpt_path``,
  ``limit_predict_batches``, samples per process) before data, weights or DDP processes;
* reads ``--ckpt_path`` as ``--model.head_file``: the **command line wins** (Lightning's own
  re-parsing of the checkpoint's hyperparameters over the command line is switched off); the
  checkpoint gives the head, its class names and its CLIP weights, and is refused when it was
  fitted with another encoder or other prompts;
* ``--save_checkpoint PATH`` writes a self-contained checkpoint of the adapted model after
  predict (CLIP weights and head: ``--model.head_file PATH`` scores with it later);
* turns user errors (and a feature store that does not fit the run) into one error line and
  exit status 2 (:func:`main`), whichever DDP rank raised.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import (
    ArgsType,
    LightningArgumentParser,
    LightningCLI,
    SaveConfigCallback,
)
from typing_extensions import override

from frolic_tta.clip.loading import WeightsNotFoundError, check_tau_c
from frolic_tta.clip.prompts import load_descriptions, resolve_templates
from frolic_tta.data import FrolicDataModule, ImageFolderDataModule  # noqa: F401 (CLI short names)
from frolic_tta.data.datamodules import check_samples_per_rank
from frolic_tta.errors import FrolicInputError, write_error
from frolic_tta.lightning.checkpoint import peek_checkpoint, read_head_file
from frolic_tta.lightning.cli_args import with_logger_save_dir
from frolic_tta.lightning.cli_errors import FrolicArgumentParser
from frolic_tta.lightning.cli_help import PREDICT_DESCRIPTION, FrolicHelpFormatter
from frolic_tta.lightning.entry import (
    RUN,
    close_process_group,
    error_folder,
    error_of_another_rank,
    leave_error,
    quiet_libraries,
    report_error,
    short_warnings,
    unwritable_message,
)
from frolic_tta.lightning.module import FrolicModule
from frolic_tta.lightning.progress import LineProgressBar
from frolic_tta.lightning.report import FrolicReport
from frolic_tta.options import FrolicOptions

__all__ = ["FrolicCLI", "FrolicCLIError", "main", "quiet_libraries", "with_logger_save_dir"]

DESCRIPTION = (
    "Frolic (NeurIPS 2024): label-free test-time adaptation of a frozen open_clip model. "
    "Run `predict --config configs/vit_b16.yaml --config configs/datasets/<dataset>.yaml` "
    "(a model's base, then a dataset's file); outputs go to --output_dir."
)


class FrolicCLIError(RuntimeError):
    """A configuration problem the user can fix (missing data or weights, bad option)."""


def require_class_names(class_names: list[str] | None) -> list[str]:
    """Link function ``data.class_names -> model.class_names``: fail early without names.

    Raises:
        ValueError: ``class_names`` is ``None`` or has fewer than 2 entries.
    """
    if class_names is None or len(class_names) < 2:
        raise ValueError(
            "Expected the datamodule to provide at least 2 class names, but got "
            f"{class_names!r}. An unlabeled folder has none: pass them with "
            "--data.class_names '[cat, dog, bird]', or, if the folder has one sub-folder per "
            "class, use --data.labeled true (names and labels from the sub-folders)"
        )
    return list(class_names)


USER_ERRORS = (WeightsNotFoundError, FileNotFoundError, ValueError)
"""Errors raised while building the datamodule or the model that the user fixes by an option."""


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain, as a traceback would show it.

    Follows ``__cause__`` (``raise ... from``) and unsuppressed ``__context__``; stops at
    ``raise ... from None``.
    """
    seen = {id(error)}
    while True:
        inner = error.__cause__
        if inner is None and not error.__suppress_context__:
            inner = error.__context__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner


class OutputDirConfig(SaveConfigCallback):
    """Lightning's ``config.yaml`` writer that also writes it to ``--output_dir`` when a logger
    moves Lightning's copy into the logger's folder (``--trainer.logger CSVLogger``)."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        first = not self.already_saved
        log_dir = trainer.log_dir  # a broadcast: every rank calls it
        super().setup(trainer, pl_module, stage)
        output_dir = Path(trainer.default_root_dir)
        if first and trainer.is_global_zero and Path(log_dir or output_dir) != output_dir:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(output_dir / self.config_filename),
                             skip_none=False, overwrite=True, multifile=self.multifile)  # fmt: skip


class FrolicCLI(LightningCLI):
    """LightningCLI for Frolic: ``predict`` only, report callback and output folder built in.

    Args:
        args: Command line arguments (default ``sys.argv[1:]``), a list, or a dict config.
        run: ``False``: parse and instantiate only, without the ``predict`` subcommand.
        **kwargs: Passed to :class:`~lightning.pytorch.cli.LightningCLI` (defaults here: the
            Frolic model and datamodule classes, no logger, no seeding, config overwrite).
    """

    def __init__(self, args: ArgsType = None, run: bool = True, **kwargs: Any) -> None:
        defaults: dict[str, Any] = {
            "model_class": FrolicModule,
            "parser_class": FrolicArgumentParser,  # an option mistake is one error line
            "datamodule_class": L.LightningDataModule,
            "subclass_mode_data": True,
            "save_config_callback": OutputDirConfig,
            "save_config_kwargs": {"overwrite": True},
            "trainer_defaults": {"logger": False},
            "seed_everything_default": False,
            "auto_configure_optimizers": False,
            "parser_kwargs": {
                "description": DESCRIPTION,
                "predict": {"description": PREDICT_DESCRIPTION},
            },
        }
        super().__init__(args=args, run=run, **{**defaults, **kwargs})

    @override
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"predict": {"model", "dataloaders", "datamodule"}}

    @override
    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """``predict --help`` with :class:`~frolic_tta.lightning.cli_help.FrolicHelpFormatter`
        (a subcommand parser takes its parent's formatter when it is added)."""
        super()._add_subcommands(parser, **kwargs)
        self._subcommand_parsers["predict"].formatter_class = FrolicHelpFormatter

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--output_dir",
            type=str,
            default="outputs",
            help="Folder for metrics.json, predictions, head and plots (and config.yaml).",
        )
        parser.add_argument(
            "--save_checkpoint",
            type=str | None,
            default=None,
            help="After predict, write a self-contained checkpoint of the adapted model "
            "(CLIP weights and head) to this path; use it as --model.head_file.",
        )
        parser.add_lightning_class_args(FrolicReport, "report")
        parser.link_arguments("output_dir", "report.output_dir")
        parser.link_arguments("output_dir", "trainer.default_root_dir")
        parser.link_arguments(
            "data.class_names",
            "model.class_names",
            compute_fn=self._model_class_names,
            apply_on="instantiate",
        )
        parser.set_defaults({"data": {"class_path": "frolic_tta.data.FrolicDataModule"}})

    def _model_class_names(self, class_names: list[str] | None) -> list[str]:
        """The link's compute function: the data's class names, else the head file's."""
        if class_names is None and getattr(self, "_head_class_names", None):
            return list(self._head_class_names)
        return require_class_names(class_names)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse, giving a logger named on the command line without a ``save_dir`` the run's
        ``--output_dir`` (``--trainer.logger CSVLogger`` alone writes under the outputs)."""
        if args is None or isinstance(args, list):  # parsed here: Lightning warns about a list
            self.config = parser.parse_args(
                with_logger_save_dir(list(sys.argv[1:] if args is None else args))
            )
        else:
            super().parse_arguments(parser, args)

    @override
    def before_instantiate_classes(self) -> None:
        """Validate what is cheap to check before any data or weights are touched."""
        config = (
            self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        )
        try:
            self._check_config(config)
        except (TypeError, ValueError, FileNotFoundError) as error:
            raise FrolicCLIError(str(error)) from error

    @override
    def _parse_ckpt_path(self) -> None:
        """The command line wins: the checkpoint's hyperparameters are not re-applied over it
        (``--ckpt_path`` is read as ``--model.head_file``, see :meth:`_check_config`)."""

    def _check_config(self, config: Any) -> None:
        model = config.get("model") or {}
        ckpt_path = config.get("ckpt_path")
        if ckpt_path:
            self._check_ckpt_path(str(ckpt_path))
            head_file = model.get("head_file")
            if head_file and str(head_file) != str(ckpt_path):
                raise FrolicInputError(
                    f"Expected one head to score with, but got --ckpt_path '{ckpt_path}' and "
                    f"--model.head_file '{head_file}': pass one of them"
                )
            config["model"]["head_file"], config["ckpt_path"] = str(ckpt_path), None
        options = model.get("options")
        if options is not None:  # a Namespace, its `solver` group a nested one
            FrolicOptions(**(options.as_dict() if hasattr(options, "as_dict") else options))
        check_tau_c(model.get("tau_c", "model"))
        resolve_templates(model.get("templates", "openai"))
        if model.get("prompts_file"):
            load_descriptions(model["prompts_file"])
        self._head_class_names = None
        if model.get("head_file"):
            self._head_class_names = read_head_file(model["head_file"])[1]
        if model.get("reuse_head") and not model.get("head_file"):
            raise FrolicInputError(
                "Expected a stored head with --model.reuse_head true, but none is given (a new "
                "process has no head): pass --model.head_file outputs/<run>/head.pt"
            )
        trainer = config.get("trainer") or {}
        limit = trainer.get("limit_predict_batches")
        if limit is not None and not isinstance(limit, bool) and limit <= 0:
            raise FrolicInputError(
                f"Expected --trainer.limit_predict_batches > 0, but got {limit}: nothing would "
                "be predicted (for a smaller run use --data.limit N)"
            )

    @staticmethod
    def _check_ckpt_path(ckpt_path: str) -> None:
        try:
            keys = peek_checkpoint(ckpt_path)
        except FileNotFoundError:
            raise FrolicInputError(
                f"Expected --ckpt_path to be a Lightning checkpoint, but there is no file at "
                f"'{ckpt_path}'"
            ) from None
        except FrolicInputError:  # not plain tensors: let Lightning read it
            return
        if "pytorch-lightning_version" not in keys:
            raise FrolicInputError(
                f"Expected --ckpt_path to be a Lightning checkpoint, but '{ckpt_path}' is not "
                "one; to score with the head.pt of a run pass it as --model.head_file"
            )

    @override
    def before_predict(self) -> None:
        """Fewer samples than processes: stop before any process is launched."""
        RUN["world_size"] = self.trainer.world_size
        source = getattr(self.datamodule, "source", None)
        if source is not None:
            try:
                check_samples_per_rank(len(source), self.trainer.world_size)
            except FrolicInputError as error:
                raise FrolicCLIError(str(error)) from error

    def after_predict(self) -> None:
        """``--save_checkpoint``: write the adapted model (CLIP weights and head)."""
        config = self.config.get(str(self.subcommand), self.config)
        path = config.get("save_checkpoint")
        if not path:
            return
        self.model.hparams.save_clip_weights = True
        try:
            self.trainer.save_checkpoint(path)
        except OSError as error:
            raise FrolicCLIError(write_error(path, error)) from None
        if self.trainer.is_global_zero:
            print(f"Checkpoint: {path} (--model.head_file scores with it)", flush=True)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The configured Trainer; when stdout is not a terminal (a log file), with
        :class:`~frolic_tta.lightning.progress.LineProgressBar` instead of tqdm's bar."""
        config = self._get(self.config_init, "trainer", default={}) or {}
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if (
            not sys.stdout.isatty()
            and config.get("enable_progress_bar", True) is not False
            and not any(isinstance(callback, ProgressBar) for callback in callbacks)
        ):  # not saved in config.yaml: the run's configuration is the same at a terminal
            self.trainer_defaults = {**self.trainer_defaults, "callbacks": [LineProgressBar()]}
        try:
            return super().instantiate_trainer(**kwargs)
        except (TypeError, MisconfigurationException) as error:  # a --trainer.* value
            raise FrolicCLIError(f"--trainer: {' '.join(str(error).split())}") from error

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except USER_ERRORS as error:
            cause = root_cause(error)  # jsonargparse wraps errors of subclass-mode classes
            if isinstance(cause, USER_ERRORS):
                raise FrolicCLIError(str(cause)) from error
            raise


def user_message(error: BaseException) -> str | None:
    """The one line for an error the user fixes (``None``: a bug, shown with its traceback)."""
    if isinstance(error, FrolicCLIError | FrolicInputError):
        return str(error)
    return unwritable_message(error)


def main(args: ArgsType = None) -> None:
    """Entry point of ``train.py``: run :class:`FrolicCLI`, one line per user error.

    A :class:`FrolicCLIError` (missing dataset files, missing weights, an invalid option value,
    an output that cannot be written) or a :class:`~frolic_tta.errors.FrolicInputError` raised
    during predict (too many unreadable images, a stored head or a feature store that does not
    fit) is printed as ``error: ...`` on stderr by rank 0 and exits with status 2, without a
    traceback. Under DDP a rank that raised alone leaves its message for rank 0
    (:mod:`~frolic_tta.lightning.entry`);
    rank 0 prints that line as soon as it is left (or when its collective fails for it), and
    the other ranks exit with status 2 silently.
    """
    quiet_libraries()
    short_warnings()  # "warning: <message>", not the source line that warns
    with error_folder():
        try:
            FrolicCLI(args=args)
            close_process_group()
        except Exception as error:
            message = user_message(error)
            if message is not None:
                leave_error(message)  # on another rank: until rank 0 has printed it
            else:
                message = error_of_another_rank()
            if message is None:
                raise
            report_error(message)
            sys.exit(2)


if __name__ == "__main__":  # python -m frolic_tta.lightning.cli predict ... (as train.py)
    main()
