"""The command line's arguments before they are parsed: a logger named without a ``save_dir``
writes under the run's output folder (:func:`with_logger_save_dir`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["with_logger_save_dir"]


def _option(argv: list[str], name: str) -> tuple[int, str] | None:
    """``(index, value)`` of the last ``name VALUE`` or ``name=VALUE`` in ``argv``, or None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = (i + 1, argv[i + 1])
        elif arg.startswith(name + "="):
            found = (i, arg.split("=", 1)[1])
    return found


def with_logger_save_dir(argv: list[str]) -> list[str]:
    """``argv`` plus ``--trainer.logger.save_dir <output_dir>`` where ``--trainer.logger`` names
    a logger class and no ``save_dir`` is given (the output folder: ``--output_dir``, else the
    ``--config`` file's ``output_dir``, else ``outputs``)."""
    logger = _option(argv, "--trainer.logger")
    if logger is None or logger[1].lower() in ("true", "false", "null", "none", "[]"):
        return argv
    if any(arg.startswith("--trainer.logger.save_dir") for arg in argv) or logger[1][:1] in "{[":
        return argv
    output_dir = _option(argv, "--output_dir")
    if output_dir is None and (config := _option(argv, "--config")) is not None:
        import yaml  # a light import, only where a config names the folder

        try:
            loaded = yaml.safe_load(Path(config[1]).read_text()) or {}
        except (OSError, yaml.YAMLError):
            loaded = {}
        output_dir = (0, loaded.get("output_dir")) if isinstance(loaded, dict) else None
    folder = output_dir[1] if output_dir and output_dir[1] else "outputs"
    at = logger[0] + 1
    return [*argv[:at], "--trainer.logger.save_dir", str(folder), *argv[at:]]
