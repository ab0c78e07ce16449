"""Online Frolic (``frolic_tta.online.OnlineFrolic``) on streams in three arrival orders.

Run: ``python benchmarks/online.py`` (synthetic K = 50 worlds and the digits model, a few
minutes on 2 cores); ``--imagenet`` adds the ImageNet-size world (K = 1,000, d = 512,
N = 50,000; minutes); ``--table`` prints the markdown table of the stored JSON. Writes
``benchmarks/results/online.json``.

Orders: ``shuffled``; ``class-ordered`` (all samples of class 0, then class 1, ...);
``long-tailed`` (a test prior with max/min 10, shuffled). Worlds: ``clip_like_world``
(K = 50, d = 128, N = 20,000, zero-shot about 0.59), the ImageNet-size one, and the tiny
digits CLIP of ``benchmarks/digits_clip.py`` (K = 10, N = 300 held-out, seed 0). Per stream:
zero-shot, transductive (``fit_frolic`` on all), online (each answer as it was made) and the
end-of-stream re-scoring accuracies, the largest difference between the end-of-stream state
and ``fit_frolic`` (tau_g, beta), the refits, and the cost: mean time of a step without a
refit (sums + scoring, ``O(b(d^2 + Kd))``), the time of all refits together against one
finalize, and the zero-shot scoring time of the whole stream. For the digits model also the
issue's baseline: a head adapted on the first 60 images and reused.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import common
import torch

from frolic_tta import fit_frolic
from frolic_tta.online import OnlineFrolic
from frolic_tta.synthetic import clip_like_world, shifted_prior

ORDERS = ("shuffled", "class-ordered", "long-tailed")


def arrange(x: torch.Tensor, y: torch.Tensor, order: str, seed: int = 0):
    """``(x, y)`` in arrival ``order`` (``long-tailed`` worlds are generated so; shuffled)."""
    if order == "class-ordered":
        perm = torch.argsort(y, stable=True)
    else:
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return x[perm], y[perm]


def acc(pred: torch.Tensor, y: torch.Tensor) -> float:
    return round(float((pred == y).double().mean()), 4)


def run_stream(x, z, y, tau_c: float, batch: int) -> dict[str, Any]:
    """One stream: accuracies, end-of-stream check and costs."""
    zero_shot = acc((x @ z.t()).argmax(1), y)
    start = time.perf_counter()
    ref = fit_frolic(x, z, tau_c=tau_c)
    finalize_s = time.perf_counter() - start
    online = OnlineFrolic(z, tau_c=tau_c)
    answers, plain_steps = [], []
    refit_s = 0.0
    for b in x.split(batch):
        refits = online.refits
        start = time.perf_counter()
        answers.append(online.step(b))
        spent = time.perf_counter() - start
        if online.refits > refits:
            refit_s += spent
        else:
            plain_steps.append(spent)
    start = time.perf_counter()
    fit = online.finalize()
    end_s = time.perf_counter() - start
    finalize_s = min(finalize_s, end_s)  # the same work twice: the less disturbed one
    start = time.perf_counter()
    for b in x.split(batch):
        (b @ z.t()).argmax(1)
    score_s = time.perf_counter() - start
    pred = torch.cat([a.logits.argmax(1) for a in answers])
    zs_pred = (x @ z.t()).argmax(1)
    n = len(y)
    fractions = (0.1, 0.25, 0.5, 1.0)
    curve = {f"{f:.2f}": acc(pred[: int(f * n)], y[: int(f * n)]) for f in fractions}
    zs_curve = {f"{f:.2f}": acc(zs_pred[: int(f * n)], y[: int(f * n)]) for f in fractions}
    return {
        "N": n,
        "batch": batch,
        "zero_shot": zero_shot,
        "transductive": acc(ref.logits.argmax(1), y),
        "online": acc(pred, y),
        "online_minus_zero_shot": round(acc(pred, y) - zero_shot, 4),
        "end_of_stream": acc(fit.logits.argmax(1), y),
        "online_cumulative": curve,
        "zero_shot_cumulative": zs_curve,
        "end_state_max_diff": max(
            abs(fit.head.tau_g - ref.head.tau_g),
            float((fit.head.beta - ref.head.beta).abs().max()),
        ),
        "refits": [r.seen for r in online.history],
        "step_ms_mean": round(1e3 * sum(plain_steps) / max(1, len(plain_steps)), 3),
        "refits_s": round(refit_s, 3),
        "refits_over_finalize": round(refit_s / finalize_s, 2),
        "finalize_s": round(finalize_s, 3),
        "end_of_stream_fit_s": round(end_s, 3),
        "zero_shot_scoring_s": round(score_s, 3),
    }


def synthetic(label: str, k: int, d: int, n: int, noise: float, batch: int) -> list[dict]:
    rows = []
    for order in ORDERS:
        prior = shifted_prior("long-tailed:10", k, 0) if order == "long-tailed" else None
        world = clip_like_world(n, k, d, noise=noise, seed=0, test_prior=prior)
        x, y = arrange(world.features, world.labels, order)
        row = {"world": label, "order": order, **run_stream(x, world.prototypes, y, 0.01, batch)}
        print(row, flush=True)
        rows.append(row)
    return rows


def digits(batch: int) -> list[dict]:
    import digits_clip

    model = digits_clip.pretrain(seed=0)
    x, z, y = digits_clip.encode(model)
    tau_c = 1.0 / model.logit_scale
    rows = []
    for order in ORDERS[:2]:  # the held-out set is balanced: no long-tailed stream
        xs, ys = arrange(x, y, order)
        row = {"world": "digits CLIP (K=10)", "order": order}
        row.update(run_stream(xs, z, ys, tau_c, batch))
        first = fit_frolic(xs[:60], z, tau_c=tau_c).head  # the baseline
        row["head_of_first_60_reused"] = acc(first.score(xs).argmax(1), ys)
        print(row, flush=True)
        rows.append(row)
    return rows


def table(payload: dict[str, Any]) -> str:
    headers = ["world", "order", "N", "zero-shot", "online", "online - zs", "transductive"]
    headers += ["end = fit_frolic (max diff)", "refits at n", "step ms", "refits / finalize"]
    rows = [
        [
            r["world"],
            r["order"],
            r["N"],
            common.fmt(r["zero_shot"]),
            common.fmt(r["online"]),
            f"{r['online_minus_zero_shot']:+.3f}",
            common.fmt(r["transductive"]),
            f"{r['end_state_max_diff']:.0e}",
            ", ".join(str(s) for s in r["refits"]),
            common.fmt(r["step_ms_mean"], 2),
            common.fmt(r["refits_over_finalize"], 2),
        ]
        for r in payload["rows"]
    ]
    m = payload["machine"]
    state = "busy (timings not comparable)" if m["busy_at_start"] or m["busy_at_end"] else "idle"
    caption = f"\n\n{m['cpu']}, {m['cores']} cores, {m['date']}, commit {m['commit']}: {state}."
    return common.markdown_table(headers, rows) + caption


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--imagenet", action="store_true", help="add K=1000, d=512, N=50,000")
    parser.add_argument("--no-digits", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the stored table only")
    args = parser.parse_args()
    if args.table:
        print(table(common.read_result("online")))
        return
    warnings.simplefilter("ignore", UserWarning)  # undetermined beta on prefixes is expected
    torch.manual_seed(0)
    info = common.machine_info()
    rows = synthetic("clip_like K=50, d=128", 50, 128, 20_000, 0.5, 64)
    if args.imagenet:
        rows += synthetic("clip_like K=1000, d=512", 1000, 512, 50_000, 0.8, 256)
    if not args.no_digits:
        rows += digits(16)
    payload = {"machine": common.finish_info(info), "rows": rows}
    print(common.write_result("online", payload))
    print(table(payload))


if __name__ == "__main__":
    main()
