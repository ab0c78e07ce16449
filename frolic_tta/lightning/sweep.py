r"""Sweeps: models x datasets x prompts x Frolic options, each (model, dataset) encoded once.

``python sweep.py --config configs/sweeps/paper_vit_b16.yaml`` (or
``python -m frolic_tta.lightning.sweep ...``) runs every combination through ``train.py``'s
CLI (:mod:`frolic_tta.lightning.cli`, so a run may be DDP), each into
``<output_dir>/runs/<model>/<dataset>/<prompts>/<options>``, all runs of a (model, dataset)
sharing one feature store, ``<feature_store>/<model>/<dataset>``: the first run encodes the
images and writes it, the others refit from it. A run whose folder holds ``metrics.json`` and a
``sweep_run.json`` with the same arguments is skipped. Then :mod:`frolic_tta.lightning.tables`
writes ``results.csv`` and ``tables.md`` (the paper's Tables 1-4 beside ours).

The config (YAML)::

    output_dir: outputs/sweeps/paper_vit_b16
    config: [configs/vit_b16.yaml, "configs/paper/{dataset}.yaml"]  # train.py configs (optional)
    args: {trainer: {devices: 1}}                 # optional train.py options for every run
    feature_store: null                           # default <output_dir>/features
    feature_store_dtype: float32                  # or float16
    runner: subprocess                            # or inprocess (one device, one process)
    launcher: null                                # e.g. "srun --ntasks-per-node 8" (subprocess)
    models: {vit_b16: {model_name: ViT-B-16-quickgelu, pretrained: openai}}
    datasets: [eurosat, dtd]                      # or {name: {data: {...}, model: {...}}}
    prompts: {descriptions: {}, templates: {prompts_file: null}}   # --model.* options
    options: {default: {}, paper: {covariance: paper, bias: paper}}  # FrolicOptions fields

**Files and processes.** ``sweep_run.json`` and the tables are written atomically (a temporary
file renamed over the old one); a run whose marker or ``metrics.json`` cannot be read counts as
not finished (it runs again), never as an error. A run's process stops with the sweep: on
SIGTERM or Ctrl-C the sweep terminates it, and on Linux it also gets SIGTERM when the sweep
process dies (``PR_SET_PDEATHSIG``). A config that is not a YAML mapping of the keys below, or
with an entry of the wrong type, is refused in one line naming the problem.

``{dataset}`` and ``{model}`` in any string are replaced by the names. A model may set
``paper_backbone`` (``"ViT-B/16"``) when its name does not say which of the paper's backbones it
is. ``--dry_run`` prints the commands instead (the encoding runs first: submit them, then the
rest, e.g. as a job array); ``--tables_only`` rewrites the tables from the finished runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frolic_tta.data.paper_results import backbone_name
from frolic_tta.data.store import DTYPES, FeatureStoreError
from frolic_tta.lightning.sweep_files import (
    TYPES,
    SweepError,
    duration,
    read_config,
    read_json,
    result_line,
    run_child,
    terminated,
)
from frolic_tta.lightning.tables import collect_results, write_atomically, write_results
from frolic_tta.options import resolve_options

__all__ = [
    "Run", "SweepError", "cli_args", "dry_run", "load_sweep", "main", "plan_runs", "run_sweep",
]  # fmt: skip

KEYS = {
    "output_dir", "config", "args", "feature_store", "feature_store_dtype", "runner",
    "launcher", "models", "datasets", "prompts", "options",
}  # fmt: skip
RUNNERS = ("subprocess", "inprocess")
DONE = "sweep_run.json"


@dataclass(frozen=True)
class Run:
    """One run of a sweep.

    Attributes:
        model, dataset, prompts, options: its names in the sweep config.
        args: its ``train.py`` arguments (``predict`` first).
        run_dir: its ``--output_dir``; ``store``: the feature store of its (model, dataset).
        encodes: the first run of its (model, dataset): it encodes and writes the store.
        backbone: the paper's backbone (``"ViT-B/16"``) or ``None``.
        details: the option values and ``--model.*`` arguments, for the tables' headings.
    """

    model: str
    dataset: str
    prompts: str
    options: str
    args: list[str]
    run_dir: Path
    store: Path
    encodes: bool
    backbone: str | None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.model} · {self.dataset} · {self.prompts} · {self.options}"

    @property
    def metrics_file(self) -> Path:
        return self.run_dir / "metrics.json"

    def done(self) -> bool:
        """Finished earlier with the same arguments (a marker or ``metrics.json`` that cannot
        be read, e.g. truncated by a killed sweep, means not finished)."""
        marker = read_json(self.run_dir / DONE)
        if not isinstance(marker, dict) or marker.get("args") != self.args:
            return False
        return isinstance(read_json(self.metrics_file), dict)


# ------------------------------------------------------------------ config
def _named(value: Any, what: str) -> dict[str, dict[str, Any]]:
    if value is None:
        return {"default": {}}
    if isinstance(value, list):
        value = {str(name): {} for name in value}
    if not isinstance(value, dict) or not value:
        raise SweepError(f"Expected `{what}` to be a non-empty mapping or list, but got {value!r}")
    bad = [k for k, v in value.items() if not isinstance(v, dict | type(None))]
    if bad:
        raise SweepError(f"Expected every entry of `{what}` to be a mapping, but {bad} are not")
    return {str(k): dict(v or {}) for k, v in value.items()}


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and check a sweep config (options are validated as :class:`FrolicOptions`, the
    solver's under ``solver:``).

    Raises:
        SweepError: a missing file, an unknown key, or an invalid entry.
    """
    file = Path(path)
    if not file.is_file():
        raise SweepError(f"Expected a sweep config file, but '{file}' does not exist")
    config = read_config(file, KEYS, TYPES)
    if "output_dir" not in config or not config.get("models") or not config.get("datasets"):
        raise SweepError(f"Expected `output_dir`, `models` and `datasets` in '{file}'")
    config["models"] = _named(config["models"], "models")
    for name, model in config["models"].items():
        if "model_name" not in model:
            raise SweepError(f"Expected `model_name` in model {name!r}, but got {model!r}")
    config["datasets"] = _named(config["datasets"], "datasets")
    config["prompts"] = _named(config.get("prompts"), "prompts")
    config["options"] = _named(config.get("options"), "options")
    for name, options in config["options"].items():
        try:
            resolve_options(None, **options)  # a flat solver key says how to nest it
        except (TypeError, ValueError) as error:
            raise SweepError(f"options {name!r}: {error}") from None
    config.setdefault("runner", "subprocess")
    if config["runner"] not in RUNNERS:
        raise SweepError(f"Expected `runner` in {RUNNERS}, but got {config['runner']!r}")
    if config.get("feature_store_dtype", "float32") not in DTYPES:
        raise SweepError(
            f"Expected `feature_store_dtype` in {list(DTYPES)}, but got "
            f"{config['feature_store_dtype']!r}"
        )
    return config


def _as_list(value: str | list[str] | None) -> list[str]:
    """``config``: one file or several (``--config`` each, later ones override)."""
    return [] if not value else [value] if isinstance(value, str) else list(value)


def _fill(value: Any, names: dict[str, str]) -> Any:
    """Replace ``{dataset}``/``{model}`` in every string (templates' ``{}`` stay)."""
    if isinstance(value, str):
        for key, name in names.items():
            value = value.replace("{" + key + "}", name)
        return value
    if isinstance(value, dict):
        return {k: _fill(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, names) for v in value]
    return value


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def cli_args(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Nested ``train.py`` options as ``--a.b=value`` arguments (a ``class_path`` first)."""
    args: list[str] = []
    if "class_path" in tree:
        args.append(f"--{prefix[:-1]}={tree['class_path']}")
    for key, value in tree.items():
        if key == "class_path":
            continue
        if key == "init_args" and isinstance(value, dict):
            args += cli_args(value, prefix)
        elif isinstance(value, dict):  # an empty one sets nothing
            args += cli_args(value, f"{prefix}{key}.")
        else:
            args.append(f"--{prefix}{key}={_text(value)}")
    return args


def _data_first(args: list[str]) -> list[str]:
    """``--data=Class`` before any ``--data.x`` (jsonargparse needs the class first)."""
    classes = [a for a in args if a.startswith("--data=")]
    return classes[-1:] + [a for a in args if not a.startswith("--data=")]


def plan_runs(config: dict[str, Any]) -> list[Run]:
    """Every run of the grid, model-major; the first run of each (model, dataset) encodes."""
    out = Path(config["output_dir"])
    store_root = Path(config.get("feature_store") or out / "features")
    dtype = config.get("feature_store_dtype", "float32")
    runs = []
    for model, model_entry in config["models"].items():
        model_args = {k: v for k, v in model_entry.items() if k != "paper_backbone"}
        backbone = model_entry.get("paper_backbone") or backbone_name(model_entry["model_name"])
        for dataset, dataset_entry in config["datasets"].items():
            names = {"dataset": dataset, "model": model}
            entry = _fill(dataset_entry, names)
            if "data" not in entry:
                entry["data"] = {"dataset": dataset}
            store = store_root / model / dataset
            for p, (prompts, prompt_args) in enumerate(config["prompts"].items()):
                for o, (options, option_args) in enumerate(config["options"].items()):
                    run_dir = out / "runs" / model / dataset / prompts / options
                    args = ["predict"]
                    for file in _as_list(config.get("config")):  # composed in order
                        args.append(f"--config={_fill(file, names)}")
                    args += _data_first(
                        cli_args(_fill(config.get("args") or {}, names))
                        + cli_args(entry)
                        + cli_args({"model": _fill({**model_args, **prompt_args}, names)})
                        + cli_args({"model": {"options": option_args}} if option_args else {})
                    )
                    args += [
                        f"--data.feature_store={store}",
                        f"--data.feature_store_dtype={dtype}",
                        f"--output_dir={run_dir}",
                    ]
                    details = {"options": option_args, "model": {**model_args, **prompt_args}}
                    runs.append(
                        Run(model, dataset, prompts, options, args, run_dir, store,
                            p == 0 and o == 0, backbone, details)
                    )  # fmt: skip
    return runs


# ------------------------------------------------------------------ running
def _run_inprocess(run: Run) -> str | None:
    from frolic_tta.lightning.cli import FrolicCLI, FrolicCLIError

    if any(a.startswith("--trainer.devices=") and a[18:] not in ("1", "[0]") for a in run.args):
        return "runner: inprocess runs one device; use runner: subprocess for several"
    try:
        FrolicCLI(args=[*run.args, "--trainer.devices=1"])  # over a config's devices
    except (FrolicCLIError, FeatureStoreError) as error:
        return str(error)
    except SystemExit as error:  # the argument parser's exit on a bad option
        return f"the arguments were refused (exit status {error.code}; message above)"
    except Exception as error:  # noqa: BLE001 - one failed run must not end the sweep
        traceback.print_exc()
        return f"{type(error).__name__}: {error}"
    return None


def _run_subprocess(run: Run, launcher: list[str]) -> str | None:
    command = [*launcher, sys.executable, "-m", "frolic_tta.lightning.cli", *run.args]
    run.run_dir.mkdir(parents=True, exist_ok=True)
    log = run.run_dir / "run.log"
    code = run_child(command, log)
    if code == 0:
        return None
    errors = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
    return errors[-1][7:] if errors else f"exit status {code}, see {log}"


def command_line(run: Run, launcher: list[str]) -> str:
    """The shell command of one run (as ``--dry_run`` prints it)."""
    command = [*launcher, "python", "-m", "frolic_tta.lightning.cli", *run.args]
    return " ".join(shlex.quote(part) for part in command)


def dry_run(config: dict[str, Any], force: bool = False) -> str:
    """The commands of every run, encoding runs first; a run finished earlier (that a sweep
    skips, unless ``force``) is commented out: ``# done: python -m ...``."""
    launcher = shlex.split(config.get("launcher") or "")
    runs = plan_runs(config)
    done = {run.name for run in runs if not force and run.done()}
    lines = ["# 1. encode each (model, dataset) once; each writes its feature store"]
    for encodes in (True, False):
        if not encodes:
            lines.append("# 2. then the rest (they read the stores; independent of each other)")
        lines += [
            ("# done: " if run.name in done else "") + command_line(run, launcher)
            for run in runs
            if run.encodes == encodes
        ]
    if done:
        lines.append(f"# {len(done)} of {len(runs)} runs finished earlier (# done:)")
    return "\n".join(lines)


def run_sweep(config: dict[str, Any], force: bool = False, echo: Any = print) -> dict[str, Any]:
    """Run every run that is not done; then write the tables.

    Returns:
        ``{"ran": [...], "skipped": [...], "failed": {name: message}, "tables": (csv, md)}``.
    """
    launcher = shlex.split(config.get("launcher") or "")
    runs = plan_runs(config)
    ran, skipped, failed = [], [], {}
    broken: set[tuple[str, str]] = set()
    for number, run in enumerate(runs, 1):
        head = f"[{number}/{len(runs)}] {run.name}"
        if not force and run.done():
            skipped.append(run.name)
            echo(f"{head}: done earlier, skipped: {result_line(read_json(run.metrics_file))}")
            continue
        if (run.model, run.dataset) in broken:
            failed[run.name] = "not run: the first run of this model and dataset failed"
            continue
        echo(f"{head}: running" + (" (encodes the images)" if run.encodes else ""))
        start = time.monotonic()
        if config["runner"] == "inprocess":
            error = _run_inprocess(run)
        else:
            error = _run_subprocess(run, launcher)
        seconds = time.monotonic() - start
        if error is not None:
            failed[run.name] = error
            broken.add((run.model, run.dataset))
            echo(f"{head}: failed after {duration(seconds)}: {error}")
            continue
        write_atomically(run.run_dir / DONE, json.dumps({"args": run.args}, indent=1) + "\n")
        ran.append(run.name)
        echo(f"{head}: {result_line(read_json(run.metrics_file), seconds)}")
    tables = write_results(config["output_dir"], collect_results(runs))
    echo(f"ran {len(ran)}, skipped {len(skipped)}, failed {len(failed)}; wrote {tables[0]}, "
         f"{tables[1]}")  # fmt: skip
    return {"ran": ran, "skipped": skipped, "failed": failed, "tables": tables}


def main(argv: list[str] | None = None) -> int:
    """``python sweep.py --config SWEEP.yaml [--dry_run | --tables_only] [--force]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the sweep's YAML file")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--tables_only", action="store_true", help="only rewrite the tables")
    parser.add_argument("--force", action="store_true", help="run finished runs again")
    parser.add_argument("--runner", choices=RUNNERS, help="override the config's runner")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, terminated)  # a running child is stopped (run_child)
    try:
        config = load_sweep(args.config)
    except SweepError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.runner:
        config["runner"] = args.runner
    if args.dry_run:
        print(dry_run(config, args.force))
        return 0
    if args.tables_only:
        paths = write_results(config["output_dir"], collect_results(plan_runs(config)))
        print(f"wrote {paths[0]}, {paths[1]}")
        return 0
    summary = run_sweep(config, force=args.force)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
