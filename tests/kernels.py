"""Run the tests that compare numbers under every CPU kernel set this machine offers.

``python tests/kernels.py`` (extra arguments go to pytest, e.g. ``-x`` or ``-k shard``).

torch picks its vectorised CPU kernels (AVX-512, AVX2, the portable ones) by the CPU, and CI
may run on any x86 machine: a tolerance that one kernel set breaks fails CI there. For each of
``avx512``, ``avx2`` and ``default`` (``sve256`` on ARM) that torch accepts here, this runs the
files of :data:`NUMERIC` with ``ATEN_CPU_CAPABILITY`` set to it, in a fresh process, and prints
one line per kernel set; the exit status is 1 if any failed. A set the CPU lacks is reported
as skipped (torch then falls back to another, which its own line covers). About 100 s per
kernel set on 2 cores (about 170 s on an Intel Xeon). The matrix library chooses its own
kernels by CPU model, which ``ATEN_CPU_CAPABILITY`` does not select: MKL takes its AVX-512 ones
on Intel CPUs. So where torch's BLAS is MKL, one more run sets ``MKL_ENABLE_INSTRUCTIONS=AVX2``
with ``ATEN_CPU_CAPABILITY=avx2``, what an Intel CPU without AVX-512 runs. On an Intel Xeon,
MKL's AVX-512 kernels put 1 and 2 shards 6.2e-6 of the largest logit apart in
``tests/test_sharded_core.py`` (its bound says why); its AVX2 kernels failed two other files
there until issue 35's fifteenth round (``tests/test_inmap.py``'s float32 shards, 2.0e-5
apart; ``tests/test_store_moments.py``'s reuse, whose prototypes' bits followed the thread
count). This covers what one machine can, not every machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = ("avx512", "avx2", "sve256", "default")
NUMERIC = (
    "tests/test_sharded_core.py",
    "tests/test_unchanged.py",
    "tests/test_numerics.py",
    "tests/test_estimators.py",
    "tests/test_test_prior.py",
    "tests/test_matching.py",
    "tests/test_matching_newton.py",
    "tests/test_label_shift.py",
    "tests/test_flushed_exp.py",
    "tests/test_kept_logits.py",
    "tests/test_confidence_sums.py",
    "tests/test_inmap.py",
    "tests/test_released.py",
    "tests/test_online.py",
    "tests/test_precision.py",
    "tests/test_metrics.py",
    "tests/test_store_moments.py",
    "tests/test_estimator_edges.py",
    "tests/test_evidence.py",
    "tests/test_no_harm.py",
    "tests/test_block_newton.py",
    "tests/test_early_certificates.py",
    "tests/test_sweeps.py",
    "tests/test_prototype_means.py",
    "tests/test_held_out.py",
    "tests/test_cross_fit.py",
    "tests/test_weight_bound.py",
)
"""Test files that compare numbers: against a float64 reference, saved values, or across
shards, chunkings and processes."""


def capability(name: str) -> str:
    """The kernel set torch uses when ``ATEN_CPU_CAPABILITY`` is ``name`` (lower case)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": name}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return done.stdout.strip().lower() if done.returncode == 0 else ""


def torch_uses_mkl() -> bool:
    """Whether torch's CPU matrix products go through MKL here."""
    code = "import torch; print(torch.backends.mkl.is_available())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() == "True"


def run_numeric(name: str, settings: dict[str, str], arguments: list[str]) -> str:
    """The :data:`NUMERIC` files in a fresh process with ``settings`` added to the environment:
    ``"passed"`` or ``"FAILED"``."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NUMERIC]
    print(f"== ATEN_CPU_CAPABILITY={name}", flush=True)
    done = subprocess.run([*command, *arguments], env={**os.environ, **settings}, cwd=ROOT)
    return "passed" if done.returncode == 0 else "FAILED"


def main(arguments: list[str]) -> int:
    results = []
    for name in CANDIDATES:
        used = capability(name)
        if used != name:
            results.append((name, f"skipped: this CPU does not offer it (torch uses {used!r})"))
            continue
        results.append((name, run_numeric(name, {"ATEN_CPU_CAPABILITY": name}, arguments)))
    if torch_uses_mkl() and capability("avx2") == "avx2":  # an Intel CPU without AVX-512
        settings = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
        name = "avx2 + MKL_ENABLE_INSTRUCTIONS=AVX2"
        results.append((name, run_numeric(name, settings, arguments)))
    print()
    for name, outcome in results:
        print(f"ATEN_CPU_CAPABILITY={name}: {outcome}")
    return 1 if any(outcome == "FAILED" for _, outcome in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
