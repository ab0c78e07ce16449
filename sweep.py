"""Sweeps and the paper's tables: ``python sweep.py --config configs/sweeps/paper_vit_b16.yaml``.

A thin entry to :mod:`frolic_tta.lightning.sweep` (models x datasets x prompts x Frolic options,
each (model, dataset) encoded once through the feature store; ``results.csv`` and ``tables.md``).
"""

import sys

from frolic_tta.lightning.sweep import main

if __name__ == "__main__":
    sys.exit(main())
