"""Frolic from the command line: ``python train.py predict --config configs/vit_b16.yaml
--config configs/datasets/eurosat.yaml``.

A thin entry to :class:`frolic_tta.lightning.cli.FrolicCLI` (a LightningCLI); see ``--help``.
A bare ``predict --help`` prints the parser's stored help without importing torch or Lightning
(seconds faster; :mod:`frolic_tta.lightning.cli_help` keeps it current).
"""

import sys
from pathlib import Path

HELP = Path(__file__).resolve().parent / "frolic_tta" / "lightning" / "predict_help.txt"

if __name__ == "__main__":
    if sys.argv[1:] in (["predict", "--help"], ["predict", "-h"]) and HELP.is_file():
        sys.stdout.write(HELP.read_text(encoding="utf-8"))
        sys.exit(0)
    from frolic_tta.lightning.cli import main

    main()
