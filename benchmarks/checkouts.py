"""``fit_frolic`` on finalize.py's ImageNet-size worlds, timed for two checkouts in turn.

Run: ``python benchmarks/checkouts.py OLD_ROOT [NEW_ROOT ...]`` (about 2 minutes for the
benchmark's world; writes ``benchmarks/results/checkouts.json``). A root is a source tree, e.g.
``mkdir /tmp/old && git archive 3b8fd27 | tar -x -C /tmp/old``; this checkout when none is
given after the first. ``--geometry confident`` for the confident world (the code issue 35 was
filed against takes minutes a fit there: ``--repeats 1``).

``--labels 3b8fd27`` names a tree that is not a git checkout. ``--options`` gives each root's fits
keyword overrides of ``fit_frolic`` (JSON, ``{}`` for none), so one root can be timed twice:
``python benchmarks/checkouts.py OLD_ROOT . . --labels 3b8fd27 default decisions-off --options
'{}' '{}' '{"bias_test": "off", "fusion": "pooled", "head_means": "sample"}'`` times issue 35's
three decisions (the label-bias test, the fusion choice, the tested means) against the same
fit without them.

``benchmarks/finalize.py`` times one checkout; its medians move by up to 15 % within an hour on
this VM, more than many changes cost. Here every root's fits run in its own process (a package
is imported once per process), on the same world (built by this checkout's
``common.clip_like``, the same moments and zero-shot logits as finalize.py's case), in rounds
A B B A, so that a drift of the machine falls on both. Each process times ``fit_frolic`` alone
(``solver={"eps": 0.01}``, the moments given, as finalize.py does), ``--repeats`` times after
one untimed fit, and reports its accuracy, so that what is timed is seen to be the same fit.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import common


def child(
    root: str, geometry: str, size: tuple[int, int, int], repeats: int, overrides: dict[str, Any]
) -> None:
    """Fit ``repeats`` times with ``root``'s package and ``overrides``; print one JSON line."""
    sys.path.insert(0, root)
    import frolic_tta  # noqa: PLC0415 (the root's, not this checkout's)

    if not frolic_tta.__file__.startswith(str(Path(root).resolve())):
        raise SystemExit(f"expected frolic_tta from {root}, got {frolic_tta.__file__}")
    from frolic_tta.metrics import FrolicMoments  # noqa: PLC0415
    from frolic_tta.pipeline import fit_frolic  # noqa: PLC0415

    warnings.simplefilter("ignore")
    n, k, d = size
    x, z, labels = common.clip_like(n, k, d, geometry)
    moments = FrolicMoments(z, 0.01, keep_logits=True)
    for start in range(0, n, 256):
        moments.update(x[start : start + 256])
    sums, kept = moments.compute(), moments.zero_shot_logits()
    walls, fit = [], None
    for run in range(repeats + 1):  # the first is not timed
        scratch = kept.clone()  # fit_frolic overwrites the zero-shot logits it is given
        start = common.now()
        options = {"solver": {"eps": 0.01}, "sums": sums, "zero_shot_logits": scratch}
        fit = fit_frolic(x, z, tau_c=0.01, **options, **overrides)
        if run:
            walls.append(common.now() - start)
    accuracy = float((fit.logits.argmax(1) == labels).float().mean())
    print(json.dumps({"walls": walls, "accuracy": accuracy}))


def label(root: str) -> str:
    """``root``'s git commit (``+dirty`` with changes), else its path."""
    git = ["git", "-C", root, "describe", "--always", "--dirty=+dirty"]
    out = subprocess.run(git, capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("roots", nargs="+", help="source trees; this checkout if one is given")
    parser.add_argument("--geometry", default="imagenet-like", help="common.clip_like's")
    parser.add_argument("--size", type=int, nargs=3, default=(50_000, 1_000, 512))
    parser.add_argument("--rounds", type=int, default=2, help="rounds, every other one reversed")
    parser.add_argument("--repeats", type=int, default=4, help="timed fits per process")
    parser.add_argument("--labels", nargs="+", help="the first roots' names (else git commits)")
    parser.add_argument("--options", nargs="+", help="each root's fit_frolic overrides, JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        overrides = json.loads(args.options[0]) if args.options else {}
        child(args.child, args.geometry, tuple(args.size), args.repeats, overrides)
        return
    roots = args.roots if len(args.roots) > 1 else [args.roots[0], str(common.ROOT)]
    roots = [str(Path(root).resolve()) for root in roots]  # the workers run from the repo root
    labels = list(args.labels or [])
    if len(labels) > len(roots):
        raise SystemExit(f"expected at most {len(roots)} labels, one a root; got {len(labels)}")
    labels += [label(root) for root in roots[len(labels) :]]
    options = list(args.options or ["{}"] * len(roots))
    if len(options) != len(roots):
        raise SystemExit(f"expected one --options per root ({len(roots)}); got {len(options)}")
    overrides = [json.loads(text) for text in options]
    if not all(isinstance(given, dict) for given in overrides):
        raise SystemExit(f"expected --options to be JSON objects, got {options}")
    info = common.machine_info()  # the load before the runs
    walls: list[list[float]] = [[] for _ in roots]
    accuracy: list[float] = [math.nan for _ in roots]
    for turn in range(args.rounds):
        order = range(len(roots)) if turn % 2 == 0 else reversed(range(len(roots)))  # A B, B A
        for at in order:
            root = roots[at]
            command = ["benchmarks/checkouts.py", root, "--child", root, "--options", options[at]]
            command += ["--geometry", args.geometry, "--repeats", str(args.repeats)]
            result = common.run_json_worker([*command, "--size", *map(str, args.size)], 7200)
            walls[at] += result["walls"]
            accuracy[at] = result["accuracy"]
            print(labels[at], [round(w, 3) for w in result["walls"]], flush=True)
    rows = []
    for name, given, times, correct in zip(labels, overrides, walls, accuracy, strict=True):
        median = statistics.median(times)
        row = {"checkout": name, "median_s": median, "walls": times, "accuracy": correct}
        rows.append({**row, "options": given} if given else row)
        print(
            f"{name}: fit_frolic median {median:.3f} s of {len(times)}, "
            f"range {min(times):.3f}-{max(times):.3f}; accuracy {correct:.4f}"
        )
    record = {"machine": common.finish_info(info), "size": args.size, "rows": rows}
    results = common.read_result("checkouts") or {}
    results[args.geometry] = record
    print("wrote", common.write_result("checkouts", results))


if __name__ == "__main__":
    main()
