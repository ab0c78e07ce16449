"""The offline demo: ``python -m frolic_tta.demo``.

It pre-trains a tiny open_clip model on scikit-learn's handwritten digits with a long-tailed class
frequency (:mod:`frolic_tta.demo.digits`; cached after the first time), writes the 300 held-out
digits as an image folder, and runs ``train.py predict`` on them with that model: the same
``FrolicModule`` in ``trainer.predict``, the same printed table and outputs as any run. A demo of
the package on data this machine can build, not a benchmark.
"""

from frolic_tta.demo.run import main

__all__ = ["main"]
