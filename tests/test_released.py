"""The released preset against a float64 transcription of the authors' script.

``reference_released`` re-types the computation of ``run()`` in ``main_zeroshot.py``
(github.com/zhuhsingyuu/Frolic) with one text classifier standing for both of its (CLIP
templates and LLM descriptions, ``clip_weights`` and ``llm_weights_ave``). The script's
``utils.py`` was never released; where it is called, the test fills it from InMaP's ``main.py``
(github.com/idstcv/InMaP):

* ``sinkhorn(M, tau_t=0.01, gamma=0, iter=20)``: InMaP's, called with ``gamma=1``;
* ``image_opt(feat, init, plabel, labels, alpha=0.6)``: InMaP's ``image_opt`` with the
  script's fourth argument (the test labels) taken as unused, so ``lr=10, iter=2000,
  tau_i=0.04`` are InMaP's defaults;
* ``cls_acc`` and the feature loaders only report or load, and are not needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import frolic_tta
from frolic_tta.logits import TensorLogits
from frolic_tta.options import FrolicOptions, SolverOptions, released_options
from frolic_tta.released import released_label_bias
from frolic_tta.synthetic import clip_like_world, shifted_prior
from tests.sharding import run_sharded


def _sinkhorn(m, tau_t=0.01, gamma=0.0, iters=20):  # InMaP main.py
    row, col = m.shape
    p = F.softmax(m / tau_t, dim=1) / row
    if gamma > 0:
        q = p.sum(0, keepdim=True) ** gamma
        q = q / q.sum()
    for _ in range(iters):
        p = p / p.sum(0, keepdim=True)
        p = p * q if gamma > 0 else p / col
        p = p / p.sum(1, keepdim=True) / row
    return p * row


def _image_opt(feat, init, plabel, labels, lr=10.0, iters=2000, tau_i=0.04, alpha=0.6):
    del labels  # the script passes the test labels here (logging, presumably)
    ins = feat.shape[0]
    val, idx = plabel.max(1)
    mask = val > alpha
    plabel = plabel.clone()
    plabel[mask, :] = 0
    plabel[mask, idx[mask]] = 1
    base = feat.T @ plabel
    classifier = init.clone()
    pre_norm = float("inf")
    for _ in range(iters):
        grad = feat.T @ F.softmax(feat @ classifier / tau_i, dim=1) - base
        norm = float(torch.norm(grad))
        if norm > pre_norm:
            lr /= 2.0
        pre_norm = norm
        classifier = F.normalize(classifier - (lr / (ins * tau_i)) * grad, dim=0)
    return classifier


def _power_iteration(a, tol=1e-3, max_iter=100):  # the script's
    x = torch.full((a.shape[0],), 1 / a.shape[0], dtype=a.dtype)
    for _ in range(max_iter):
        x_next = torch.mv(a, x)
        x_next = torch.clamp(x_next / torch.norm(x_next, p=1), min=0)
        if torch.norm(x_next - x, p=1) < tol:
            break
        x = x_next
    return x


def _pp_estimate_eigen(logits, labels):  # the script's
    probs = F.softmax(logits, dim=-1)
    k = probs.shape[1]
    p = torch.zeros(k, k, dtype=logits.dtype)
    for c in range(k):
        rows = (labels == c).nonzero(as_tuple=True)[0]
        p[c] = probs[rows].mean(0) if len(rows) > 0 else torch.zeros(k, dtype=logits.dtype)
    return _power_iteration(p.t())


def reference_released(test_features, text):
    """The script's ``run()``: the debiased ensemble logits ``(N, K)``."""
    clip_weights = text.T  # (d, K)
    llm_weights = text  # one description per class: llm_fea.reshape(-1, d)
    llm_weights_ave = text
    fea_dim, cls_num = clip_weights.shape
    clip_logits = 100.0 * test_features @ clip_weights
    llm_ave_logits = 100.0 * test_features @ llm_weights_ave.T
    lamda = 0.9
    used = torch.cat((test_features, llm_weights), dim=0)
    eye = torch.eye(fea_dim, dtype=used.dtype)
    cov_inv = torch.linalg.inv((1 - lamda) * used.T.cov() * eye + lamda * eye)
    x_part = (test_features @ cov_inv @ test_features.T).diag() / 2
    mu_part = (llm_weights_ave @ cov_inv @ llm_weights_ave.T).diag() / 2
    crs_part = llm_weights_ave @ cov_inv @ test_features.T
    lda_logits = (crs_part - mu_part[:, None] - x_part[None, :]).T
    labels = None
    v1 = test_features @ _image_opt(
        test_features, clip_weights, _sinkhorn(llm_ave_logits / 100, gamma=1), labels
    )
    v3 = test_features @ _image_opt(
        test_features, clip_weights, _sinkhorn(lda_logits, gamma=1), labels
    )
    del clip_logits  # the script's InMap_logits (v0) and v2, v4 are printed only
    ensemble = 100 * v3 + 100 * v1
    used_logits = ensemble.clone()
    for _ in range(11):  # n = 0, ..., 10
        values, _ = used_logits.topk(2, dim=-1)
        index = torch.where(torch.abs(values[:, 0] - values[:, 1]) > 1 / cls_num)[0]
        used_logits = used_logits[index]
        pp = _pp_estimate_eigen(used_logits, used_logits.argmax(dim=-1))
        ensemble = ensemble - torch.log(pp + 1e-12)
        used_logits = ensemble.clone()
    return ensemble


@pytest.fixture(scope="module")
def world():
    prior = shifted_prior("long-tailed:10", 6, seed=1)
    return clip_like_world(360, 6, 16, seed=1, test_prior=prior)


def test_released_preset_equals_the_transcribed_script(world):
    x, z = world.features.double(), world.prototypes.double()
    expected = reference_released(x, z)
    result = frolic_tta.frolic(x, z, released_options(), tau_c=0.01)
    difference = result.logits - expected  # beta is normalised: one constant apart
    # 2,000 InMaP steps on each side in float64, summed in different orders: 2.3e-6 under
    # torch 2.14.1 (1e-6 held under 2.13), on logits of size 18
    assert float(difference.max() - difference.min()) < 1e-5
    # the transcription does something: the bias moved the logits, the prediction changed
    assert float((result.logits - result.fused_logits).std()) > 0.1
    assert bool((expected.argmax(1) != result.fused_logits.argmax(1)).any())


def test_released_preset_is_its_options():
    options = released_options(solver={"max_iter": 5})  # over the released solver group
    assert (options.covariance, options.zero_shot, options.fusion) == (
        "released",
        "inmap_both",
        "fixed",
    )
    assert (options.bias, options.test_prior, options.inmap_gamma) == ("released", "uniform", 1.0)
    assert options.solver == SolverOptions(
        eps=1e-3, max_iter=5, beta_ratio_bound=None, inmap_tolerance=None
    )
    fusions = r"\('matched', 'fixed', 'pooled', 'selected'\)"
    with pytest.raises(ValueError, match=rf"Expected `fusion` to be one of {fusions}"):
        FrolicOptions(fusion="x100")
    with pytest.raises(ValueError, match="Expected `shrinkage` 'auto' or None with covariance="):
        FrolicOptions(covariance="released", shrinkage=0.5)


def test_released_label_bias_two_shards_equal_one(world):
    logits = 100.0 * world.features.double() @ world.prototypes.double().T
    whole = released_label_bias(TensorLogits(logits))
    parts = run_sharded(
        lambda shard, reduce_fn: released_label_bias(TensorLogits(shard), reduce_fn=reduce_fn),
        [logits[:100], logits[100:]],
    )
    for part in parts:
        torch.testing.assert_close(part, whole, rtol=0, atol=1e-12)
