"""Frolic from the command line: ``python train.py predict --config configs/vit_b16.yaml
--config configs/datasets/eurosat.yaml``.

A thin entry to :class:`frolic_tta.lightning.cli.FrolicCLI` (a LightningCLI); see ``--help``.
"""

from frolic_tta.lightning.cli import main

if __name__ == "__main__":
    main()
