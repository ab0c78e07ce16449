"""``python train.py predict --help``: a help page a person reads in a minute.

LightningCLI's help lists every Trainer option (most of them train), the Lightning docstrings'
Sphinx markup, every known subclass of every class-typed option, and the data options only
under ``--data.help CLASS``. :class:`FrolicHelpFormatter` (the ``predict`` parser's
``formatter_class``) formats the same parser differently; parsing is untouched, so a
``config.yaml`` with every Trainer key still loads:

* Trainer options a prediction does not use are not listed (:data:`TRAINER_SHOWN` are);
* the data options of ``FrolicDataModule`` (the default) are listed inline, and those
  ``ImageFolderDataModule`` adds;
* help text is plain (:func:`plain_text`), long texts are replaced by short ones (:data:`HELP`),
  defaults are given but not types, and tuning options (:data:`TUNING`) are named with their
  defaults only.

Building the parser takes seconds (torch, Lightning, open_clip are imported for the classes'
signatures: about 8 s of ``train.py predict --help`` on 2 CPU cores). ``train.py`` therefore
prints the stored text :data:`STORED_HELP` for a bare ``predict --help`` without importing them;
``python -m frolic_tta.lightning.help_file`` writes it again, and ``tests/test_cli_help.py``
checks that it is the parser's own help.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from argparse import Action
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser, DefaultHelpFormatter

__all__ = ["PREDICT_DESCRIPTION", "STORED_HELP", "FrolicHelpFormatter", "plain_text"]

STORED_HELP = Path(__file__).with_name("predict_help.txt")
"""``train.py predict --help`` as the parser prints it 80 columns wide
(:func:`~frolic_tta.lightning.help_file.write_help`)."""

PREDICT_DESCRIPTION = """\
Adapt a frozen open_clip model to a test set without labels (Frolic) and score it.
  python train.py predict --config configs/vit_b16.yaml --config configs/datasets/eurosat.yaml
  python train.py predict --config configs/folder.yaml --data.root photos/
Options come from --config files and the command line, later ones win (--print_config shows
the result). Outputs (metrics.json, predictions, head.pt, plots, config.yaml) go to
--output_dir. A callback's options: --trainer.callbacks.help FrolicPredictionWriter. Offline,
without weights or data: python -m frolic_tta.demo. Reference: docs/cli.md."""
"""The ``predict --help`` description: indented lines are examples (each one a command that
runs; ``tests/test_cli_help.py`` parses them with ``--print_config``), kept as they are; the
other lines are one paragraph."""

TRAINER_SHOWN = frozenset(
    {
        "accelerator",
        "strategy",
        "devices",
        "num_nodes",
        "precision",
        "logger",
        "callbacks",
        "limit_predict_batches",
        "enable_progress_bar",
    }  # fmt: skip
)
"""The Trainer options listed; the others (epochs, steps, gradients, validation, checkpointing,
...) are still accepted, in a config file or on the command line."""

HIDDEN = frozenset({"return_predictions", "weights_only"})
"""Options of ``Trainer.predict`` that the command line has no use for (the report writes the
predictions; ``--ckpt_path`` is read as ``--model.head_file``)."""

TUNING = frozenset(
    {
        "model.return_logits",
        "model.save_clip_weights",
        "model.text_batch_size",
        "model.chunk_size",
        "model.max_skipped_fraction",
        "model.allow_head_mismatch",
        "model.options.inmap_gamma",
        "model.options.solver.eps",
        "model.options.solver.max_iter",
        "model.options.solver.prior_rounds",
        "model.options.solver.prior_tol",
        "model.options.solver.shift_evidence",
        "model.options.solver.beta_ratio_bound",
        "model.options.solver.prior_floor",
        "model.options.solver.inmap_tolerance",
        "model.options.solver.temperature_tol",
        "model.options.solver.prior_cross_fit",
        "data.feature_store_dtype",
        "data.feature_store_verify",
    }  # fmt: skip
)
"""Options listed by name and default only, at the end of their group (docs/cli.md and
``--print_config`` show them; ``--<group>.help`` does not apply to the module's own)."""

HELP = {
    "print_config": "Print the configuration after all other options and exit "
    "(=skip_default: only what differs from the defaults).",
    "model.tau_c": 'Zero-shot temperature τ_c: "model" (the model\'s own 1/exp(logit_scale), '
    "0.01 for OpenAI CLIP) or a float.",
    "model.head_file": "A run's head.pt or a --save_checkpoint file: score with its head, no "
    "adaptation; refused if fitted with another encoder or other prompts.",
    "model.options.test_prior": 'The test set\'s class prior π: "em" (estimated; balanced '
    'unless the data show otherwise) or "uniform" (the paper\'s).',
    "model.options.zero_shot": 'The zero-shot classifier f_c: "text" (the text prototypes), '
    '"inmap" (InMaP\'s proxies, Tables 1-2\'s "InMaP + Frolic") or "inmap_both" (the '
    "released script).",
    "model.options.fusion": '"selected" ("pooled", or f_g/τ_g alone where its labels make the '
    'images more likely), "pooled" (f_f = 1/2(f_g/τ_g + f_c/τ_c)), "matched" (Eq. 12 as '
    'written) or "fixed" (τ_g = τ_c).',
    "model.options.head_means": 'The Gaussian head\'s class means: "tested" (on the prototypes '
    'where the images allow it) or "sample".',
    "seed_everything": "An int seeds every random generator before the classes are built; "
    "true: a random seed.",
    "trainer.accelerator": '"cpu", "gpu", "mps" or "auto".',
    "trainer.strategy": '"auto" or "ddp" (one process per device; the moments are all-reduced).',
    "trainer.devices": 'How many devices (an int, -1 for all), which ones (a list), or "auto".',
    "trainer.num_nodes": "Machines taking part (DDP).",
    "trainer.precision": 'Precision of the image encoder\'s forward pass: "32-true", '
    '"16-mixed", "bf16-mixed"; the moments are accumulated in float64 regardless.',
    "trainer.logger": "A logger class (e.g. CSVLogger, saved under --output_dir) or false.",
    "trainer.callbacks": "More callbacks, e.g. FrolicPredictionWriter (one .pt per batch); "
    "the report is always there.",
    "trainer.limit_predict_batches": "Predict only this many batches (an int) or this share of "
    "them (a float); --data.limit N takes a random subset instead.",
    "trainer.enable_progress_bar": "Show progress (a bar at a terminal, lines in a log file).",
    "ckpt_path": "A checkpoint written by --save_checkpoint: score with its head and CLIP "
    "weights, no adaptation (the same as --model.head_file).",
    "data": "FrolicDataModule (the default: a dataset by name, options below) or "
    "ImageFolderDataModule (a folder of your own).",
    "data.feature_store": "A folder of stored image features: read when it holds this run's "
    "features, else encode and write them (docs/cli.md#feature-store).",
    "data.num_workers": "DataLoader worker processes; null: what the machine's CPUs allow.",
    "model.online": "Also answer each batch as it arrives (docs/online.md).",
}
"""Short texts for options whose Lightning help is long or about training."""

TITLES = {
    "trainer": "Trainer: where and how predict runs (the training options are not listed)",
    "model": "Model: FrolicModule (--model.<name>)",
    "model.options": "Model options: the estimator's choices (--model.options.<name>)",
    "model.options.solver": "Solver options: tolerances and caps (--model.options.solver.<name>)",
    "data": "Data: FrolicDataModule, the default (--data.<name>)",
    "report": "Report: the files in --output_dir and the table",
    "predict": "Predict",
}
"""Group titles by group key (Lightning's come from the classes' docstrings)."""

_GREEK = {"tau": "τ", "beta": "β", "pi": "π", "epsilon": "ε", "gamma": "γ", "mu": "μ",
          "Sigma": "Σ", "sigma": "σ", "omega": "ω", "ge": "≥", "le": "≤", "cdot": "·",
          "sum": "Σ", "top": "ᵀ", "quad": " ", "ln": "ln", "log": "log", "exp": "exp",
          "max": "max", "min": "min", "left": "", "right": ""}  # fmt: skip


def plain_text(text: str) -> str:
    r"""``text`` without Sphinx/reST markup: roles (``:class:`~a.B``` -> ``B``), inline literals
    and links, ``.. math::``-style directives, and LaTeX in ``:math:`` (``\tau_c`` -> τ_c,
    ``\mathrm{softmax}`` -> softmax, ``\frac12`` -> 1/2)."""
    text = re.sub(r"^\s*\.\. \w+::.*$", "", text, flags=re.M)  # directives
    text = re.sub(r":math:`([^`]*)`", lambda m: _plain_math(m.group(1)), text)
    text = re.sub(r":\w+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", lambda m: _role_target(m.group(1)), text)
    text = re.sub(r"`([^`<]+?)\s*<([^>]+)>`_", r"\1 (\2)", text)  # links
    text = re.sub(r"``([^`]*)``", r"\1", text)
    text = re.sub(r"(?<![\w`])`([^`\n]+)`(?!`)", r"\1", text)
    return re.sub(r"[ \t]+\n", "\n", text).strip()


def _role_target(target: str) -> str:
    """``frolic_tta.options.FrolicOptions`` -> ``FrolicOptions``; modules keep their path."""
    target = target.strip().lstrip(".")
    if target[:1].isupper() or "." not in target:
        return target
    last = target.rsplit(".", 1)[1]
    return last if last[:1].isupper() else target


_ARG = r"(\{[^{}]*\}|\\?[A-Za-z0-9])"  # a LaTeX argument: {group}, a letter or a command


def _plain_math(latex: str) -> str:
    latex = latex.replace("\\_", "_")
    latex = re.sub(r"\\(?:text|mathrm|operatorname|mathbf|mathit)\s*\{([^}]*)\}", r"\1", latex)
    latex = re.sub(r"\\frac\s*" + _ARG + r"\s*" + _ARG,
                   lambda m: f"{_group(m.group(1))}/{_group(m.group(2))}", latex)  # fmt: skip
    latex = re.sub(r"\\(ln|log|exp)(?=\\|[A-Za-z])", r"\\\1 ", latex)  # ln β, not lnβ
    latex = re.sub(r"\\([A-Za-z]+)", lambda m: _GREEK.get(m.group(1), m.group(0)), latex)
    latex = re.sub(r"\\hat\s*(\w)", "\\1\u0302", latex)
    latex = re.sub(r"\\tilde\s*(\w)", "\\1\u0303", latex)
    latex = re.sub(r"\\(?=[A-Za-z])", "", latex).replace("{", "").replace("}", "")
    return re.sub(r"  +", " ", latex)


def _group(argument: str) -> str:
    r"""A ``\frac`` argument as text: ``{a + b}`` -> ``(a + b)``, ``{x}`` or ``x`` -> ``x``."""
    inner = argument[1:-1] if argument.startswith("{") else argument
    return f"({inner})" if re.search(r"[\s+\-*/]", inner.strip()) else inner


class FrolicHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's formatter with the choices of the module docstring: fewer Trainer options,
    the data options inline, plain and short text."""

    DATA_CLASSES = ("frolic_tta.data.FrolicDataModule", "frolic_tta.data.ImageFolderDataModule")
    """The default datamodule (its options listed in full) and the other one (its own only)."""

    def add_usage(self, usage: Any, actions: Any, *args: Any, **kwargs: Any) -> None:
        usage = "python train.py predict [--config CONFIG] [--<group>.<option> VALUE ...]"
        super().add_usage(usage, actions, *args, **kwargs)

    def start_section(self, heading: str | None) -> None:
        self._tuning: list[str] = []
        key = _group_key(heading)
        super().start_section(TITLES.get(key, plain_text(heading)) if heading else heading)

    def end_section(self) -> None:
        if getattr(self, "_tuning", None):
            self.add_text("Tuning (docs/cli.md): " + ", ".join(self._tuning) + ".")
            self._tuning = []
        super().end_section()

    def add_argument(self, action: Action) -> None:
        if _hidden(action):
            return
        if action.dest in TUNING:
            self._tuning.append(f"{action.option_strings[0]} {_default(action)}")
            return
        super().add_argument(action)
        if action.dest == "data" and not action.option_strings[0].endswith(".help"):
            self._add_data_options()

    def _add_data_options(self) -> None:
        default, other = (_class_actions(path) for path in self.DATA_CLASSES)
        for action in default:
            self.add_argument(action)
        shared = {action.dest for action in default} - {"data.root"}
        self.end_section()  # the data group's own section; format_help ends the next one
        self.start_section("Data: ImageFolderDataModule, a folder of your own "
                           "(--data ImageFolderDataModule --data.<name>)")  # fmt: skip
        for action in other:
            if action.dest not in shared:
                self.add_argument(action)
        also = [action.dest.split(".", 1)[1] for action in other if action.dest in shared]
        self.add_text("And as above: " + ", ".join(also) + ".")

    def _format_action_invocation(self, action: Action) -> str:
        if action.dest == "data":
            return "--data CLASS"
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: Action) -> str:
        if getattr(action, "_jsonargparse_preexpanded_help", False):
            return action.help or ""
        text = HELP.get(action.dest) or plain_text(action.help or "")
        if text and text[0].islower():
            text = text[0].upper() + text[1:]
        if action.help == argparse.SUPPRESS or action.dest in ("help", "config", "print_config"):
            return text
        if action.required:
            return text + " (required)"
        if action.default == argparse.SUPPRESS or action.dest == "data":
            return text
        return text + " (default: %(default)s)"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Descriptions: indented lines (the examples) as they are, one per line; the other
        lines are wrapped as one paragraph."""
        lines: list[str] = []
        prose: list[str] = []
        for line in [*plain_text(text).splitlines(), ""]:
            if line.strip() and not line.startswith(" "):
                prose.append(line.strip())
                continue
            if prose:
                lines.append(textwrap.fill(" ".join(prose), width, initial_indent=indent,
                                           subsequent_indent=indent))  # fmt: skip
                prose = []
            if line.strip():
                lines.append(indent + line)
        return "\n".join(lines)


def _group_key(heading: str | None) -> str | None:
    """The parser group key whose title is ``heading`` (``None`` if not a known group)."""
    from jsonargparse._common import parent_parser

    parser = parent_parser.get()
    for key, group in (getattr(parser, "groups", None) or {}).items():
        if group.title == heading:
            return key
    return None


def _default(action: Action) -> str:
    if action.default is None or isinstance(action.default, bool):
        return str(action.default).lower().replace("none", "null")
    return str(action.default)


def _hidden(action: Action) -> bool:
    from jsonargparse._actions import _ActionConfigLoad
    from jsonargparse._link_arguments import ActionLink

    dest = action.dest
    if isinstance(action, ActionLink | _ActionConfigLoad) or dest in HIDDEN:
        return True
    if dest.endswith(".help"):
        return True
    if dest.startswith("trainer."):
        return dest.split(".")[1] not in TRAINER_SHOWN
    return False


def _class_actions(class_path: str) -> list[Action]:
    """The ``--data.<name>`` actions of a datamodule class, as ``--data CLASS`` parses them."""
    import importlib

    module, name = class_path.rsplit(".", 1)
    parser = ArgumentParser()
    parser.add_class_arguments(
        getattr(importlib.import_module(module), name), "data", skip={"preprocess"}
    )
    return [a for a in parser._actions if a.dest.startswith("data.") and not _hidden(a)]
