"""Loading open_clip models: every accepted name, τ_c from the model, fast offline, families."""

from __future__ import annotations

import inspect
import json
import math
import re
import socket
import sys
import time
from pathlib import Path

import lightning as L
import open_clip
import pytest
import torch
import yaml
from huggingface_hub import constants as hub_constants
from safetensors.torch import save_file

import frolic_tta
from frolic_tta import FrolicModule
from frolic_tta.clip import hub
from frolic_tta.clip.loading import (
    WeightsNotFoundError,
    load_open_clip,
    model_temperature,
    resolve_model_name,
)
from frolic_tta.data import ImageFolderDataModule
from frolic_tta.lightning.cli import main
from tests.conftest import IMAGE_FOLDER_CLASSES, IMAGES_PER_CLASS, TINY_CLIP_CONFIG
from tests.towers import TOWERS, tiny_config, tower_type

ROOT = Path(__file__).resolve().parents[1]
FAMILY_CONFIGS = sorted((ROOT / "configs" / "families").glob("*.yaml"))
TEMPLATES = ["a photo of a {}."]


def module_for(model_name: str, pretrained: str | None, **kwargs) -> FrolicModule:
    names = [name.replace("_", " ") for name in IMAGE_FOLDER_CLASSES]
    return FrolicModule(model_name, pretrained, names, TEMPLATES, **kwargs)


def state_equal(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return state.keys() == checkpoint.keys() and all(
        torch.equal(state[key], value) for key, value in checkpoint.items()
    )


@pytest.fixture
def no_network(monkeypatch):
    """Offline as on a machine without internet: the Hub endpoint is a closed local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_REACHABLE", {})
    return endpoint


@pytest.fixture
def no_probe(monkeypatch):
    def probe(url, timeout=None):
        raise AssertionError(f"the Hub was probed ({url}) although nothing needs it")

    monkeypatch.setattr(hub, "can_reach", probe)


def hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """A Hugging Face cache entry for ``repo_id`` at revision ``main`` holding ``files``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)


def open_clip_folder(folder: Path, tiny_clip) -> dict[str, torch.Tensor]:
    """A ``local-dir:``/``hf-hub:`` layout of the tiny model; returns its weights."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": TINY_CLIP_CONFIG, "preprocess_cfg": {"interpolation": "bicubic"}}
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    weights = torch.load(tiny_clip.checkpoint_path, weights_only=True)
    save_file(weights, folder / "open_clip_model.safetensors")
    return weights


# ---------------------------------------------------------------------------- tau_c
def test_tau_c_is_the_models_own_and_a_float_overrides(tiny_clip, tiny_towers):
    module = module_for(tiny_clip.model_name, str(tiny_clip.checkpoint_path))
    assert module.hparams["tau_c"] == "model"
    assert module.tau_c == math.exp(-float(module.clip.logit_scale))
    assert module.tau_c == pytest.approx(0.01, rel=1e-6)  # ln 100, as OpenAI CLIP
    tower = tiny_towers["frolic-tiny-eva02"]
    module = module_for(tower.model_name, str(tower.checkpoint_path))
    assert module.tau_c == pytest.approx(0.02, rel=1e-6)
    module = module_for(tower.model_name, str(tower.checkpoint_path), tau_c=0.05)
    assert module.tau_c == 0.05 and module.hparams["tau_c"] == 0.05


@pytest.mark.parametrize(
    ("tau_c", "error", "message"),
    [
        (0, ValueError, "Expected `tau_c` to be a finite number > 0, but got 0.0"),
        (-0.01, ValueError, "Expected `tau_c` to be a finite number > 0, but got -0.01"),
        (math.nan, ValueError, "Expected `tau_c` to be a finite number > 0, but got nan"),
        (math.inf, ValueError, "Expected `tau_c` to be a finite number > 0, but got inf"),
        (
            "auto",
            ValueError,
            "Expected `tau_c` to be a finite number > 0 or 'model', but got 'auto'",
        ),
        (None, TypeError, "Expected `tau_c` to be a real number, but got None"),
        (True, TypeError, "Expected `tau_c` to be a real number, but got True"),
    ],
)
def test_bad_tau_c_fails_before_any_model_loads(tau_c, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        module_for("no-such-model", "no-such-tag", tau_c=tau_c)


def test_model_without_logit_scale_asks_for_a_float(monkeypatch):
    with pytest.raises(ValueError, match=r"has None; pass a float instead, e.g. tau_c=0.01"):
        model_temperature(torch.nn.Linear(2, 2))
    fake = (torch.nn.Identity(), None, None)
    monkeypatch.setattr("frolic_tta.lightning.checkpoint.load_open_clip", lambda *a: fake)
    with pytest.raises(ValueError, match=r"^Expected the model to have a scalar learned"):
        module_for("any", None)
    assert module_for("any", None, tau_c=0.01).tau_c == 0.01
    model = torch.nn.Linear(2, 2)
    model.logit_scale = torch.nn.Parameter(torch.tensor(float("nan")))
    match = r"`logit_scale` to give a finite tau_c > 0, but it is nan; pass a float instead"
    with pytest.raises(ValueError, match=match):
        model_temperature(model)


def test_functional_api_keeps_the_explicit_paper_default():
    for function in (frolic_tta.frolic, frolic_tta.fit_frolic):
        assert inspect.signature(function).parameters["tau_c"].default == 0.01


# ---------------------------------------------------------------------------- names
def test_local_dir_loads_folder_weights_and_ignores_the_tag(tiny_clip, tmp_path, no_probe):
    weights = open_clip_folder(tmp_path / "model", tiny_clip)
    module = module_for(f"local-dir:{tmp_path / 'model'}", "openai")  # the default tag: ignored
    assert state_equal(module.clip, weights)
    assert module.tau_c == pytest.approx(0.01, rel=1e-6)
    assert module.tokenizer(["a cat"]).shape == (1, 77)


def test_local_dir_errors(tiny_clip, tmp_path):
    folder = tmp_path / "model"
    with pytest.raises(FileNotFoundError, match=r"^'local-dir:' folder '.*model' does not exist;"):
        load_open_clip(f"local-dir:{folder}", None)
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"model' has no open_clip_config.json; expected"):
        load_open_clip(f"local-dir:{folder}", None)
    (folder / "open_clip_config.json").write_text(json.dumps(TINY_CLIP_CONFIG))
    with pytest.raises(ValueError, match=r"to hold 'model_cfg' \(and 'preprocess_cfg'\), as open"):
        load_open_clip(f"local-dir:{folder}", None)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP_CONFIG}))
    with pytest.raises(WeightsNotFoundError, match=r"but no weight file \(.safetensors, .bin, "):
        load_open_clip(f"local-dir:{folder}", None)
    with pytest.raises(WeightsNotFoundError, match=r"is a folder; for a folder with open_clip_co"):
        load_open_clip(tiny_clip.model_name, str(folder))  # meant: --model.model_name local-dir:


def test_hf_hub_from_the_cache_without_network(tiny_clip, tmp_path, no_network, no_probe):
    folder = tmp_path / "repo"
    weights = open_clip_folder(folder, tiny_clip)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    hub_cache(tmp_path / "cache", "frolic/tiny-vit", files)
    start = time.perf_counter()
    model, preprocess, tokenizer = load_open_clip(
        "hf-hub:frolic/tiny-vit", "openai", cache_dir=str(tmp_path / "cache")
    )
    assert time.perf_counter() - start < 5
    assert state_equal(model, weights) and tokenizer(["a cat"]).shape == (1, 77)
    assert not hub_constants.HF_HUB_OFFLINE  # the offline switch is restored


def test_hf_hub_not_cached_offline_is_one_fast_line(tmp_path, no_network):
    start = time.perf_counter()
    with pytest.raises(WeightsNotFoundError) as caught:
        load_open_clip("hf-hub:frolic/absent", None, cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 3
    assert str(caught.value) == (
        f"the files of 'hf-hub:frolic/absent' are not in the local cache ({tmp_path}) and "
        f"{no_network} cannot be reached (no internet?); run once with internet (the cache is "
        "then used offline), or copy the repository into a folder: model_name="
        "'local-dir:/path/to/folder' (--model.model_name local-dir:/path/to/folder)"
    )
    with pytest.raises(ValueError, match=r"^Expected `model_name` 'hf-hub:org/name', but got"):
        load_open_clip("hf-hub:frolic", None)


def test_registered_names_json_paths_and_near_misses(tiny_clip, tmp_path):
    assert resolve_model_name("ViT-B/16") == "ViT-B-16"  # as open_clip reads it
    assert resolve_model_name(str(tiny_clip.config_path)) == tiny_clip.model_name
    for typo in ("ViT-B16", "vit-b-16"):
        with pytest.raises(ValueError, match=r"but got '.*'; did you mean 'ViT-B-16'\?$"):
            resolve_model_name(typo)
    with pytest.raises(ValueError, match=r"or a model-config JSON path, but got 'zzz'$"):
        resolve_model_name("zzz")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"to be an open_clip model config with 'embed_dim'"):
        resolve_model_name(str(bad))


def test_typo_in_tag_lists_the_tags_without_an_offline_hint(tiny_clip, no_probe):
    with pytest.raises(ValueError) as caught:
        load_open_clip("ViT-B-16", "opena")
    message = str(caught.value)
    assert message.startswith("Expected `pretrained` to be one of open_clip's tags for 'ViT-B-16'")
    assert "'openai', 'laion400m_e31'" in message and message.endswith("did you mean 'openai'?")
    assert not re.search("internet|offline|cache|download", message)
    with pytest.raises(ValueError, match=r"for 'frolic-tiny-vit' \(open_clip has no tags for it\)"):
        load_open_clip(tiny_clip.model_name, "openai")


# ---------------------------------------------------------------------------- offline
def test_hf_hub_offline_set_fails_at_once_without_probing(tmp_path, monkeypatch, no_probe):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(open_clip, "create_model_and_transforms", None)  # never reached
    start = time.perf_counter()
    with pytest.raises(WeightsNotFoundError) as caught:
        load_open_clip("ViT-B-16", "openai", cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 1
    assert str(caught.value) == (
        f"weights 'openai' of open_clip model 'ViT-B-16' are not in the local cache ({tmp_path}) "
        "and HF_HUB_OFFLINE is set; run once with internet (the cache is then used offline), or "
        "pass pretrained='/path/to.ckpt' (--model.pretrained /path/to.ckpt)"
    )  # issue 38: a Python caller was told only the command line's --model.pretrained


def test_cached_tag_loads_offline_through_open_clip(tiny_clip, tmp_path, monkeypatch, no_network):
    """A tag whose weights are cached: open_clip's own Hub download reads the cache, no probe."""
    tag = {"hf_hub": "frolic/tiny-vit-tag/", "quick_gelu": False}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, tiny_clip.model_name, {"frolic": tag})
    weights = open_clip_folder(tmp_path / "repo", tiny_clip)
    data = (tmp_path / "repo" / "open_clip_model.safetensors").read_bytes()
    hub_cache(tmp_path / "cache", "frolic/tiny-vit-tag", {"open_clip_model.safetensors": data})
    start = time.perf_counter()
    model, _, _ = load_open_clip(tiny_clip.model_name, "frolic", cache_dir=str(tmp_path / "cache"))
    assert time.perf_counter() - start < 5 and state_equal(model, weights)
    assert hub._REACHABLE == {}  # nothing was probed
    with pytest.raises(WeightsNotFoundError, match=r"and http://127.0.0.1:\d+ cannot be reached"):
        load_open_clip(tiny_clip.model_name, "frolic", cache_dir=str(tmp_path / "empty"))


def test_quickstart_offline_is_one_error_line_within_seconds(
    image_folder, tmp_path, monkeypatch, capsys, caplog, no_network
):
    """``pretrained: openai`` without internet: one line, exit 2, no Hub retry warnings."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    args = ["predict", "--config", str(ROOT / "configs" / "folder.yaml")]
    args += ["--data.root", str(image_folder), "--data.labeled", "true", "--data.num_workers", "0"]
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--output_dir", str(tmp_path / "out")])
    assert time.perf_counter() - start < 10  # was ~60 s of retries
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: weights 'openai' of open_clip model 'ViT-B-16-quickgelu' are not in the local cache"
    )
    assert f"{no_network} cannot be reached (no internet?)" in err
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_missing_transformers_is_named_before_any_download(monkeypatch, no_probe):
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(WeightsNotFoundError, match=r"needs the `transformers` package .*: pip"):
        load_open_clip("ViT-B-16-SigLIP2", "webli")


# ---------------------------------------------------------------------------- families
def test_family_configs_parse_and_are_covered_by_a_tiny_tower():
    from tests.test_configs import composed

    tiny_types = {tower_type(tiny_config(real)) for real, _ in TOWERS.values()}
    tiny_types.add(tower_type(TINY_CLIP_CONFIG))  # the standard CLIP ViT (tests/conftest.py)
    for path in FAMILY_CONFIGS:  # a model's base, composed with each dataset run here
        for dataset in ("imagenet", "eurosat"):
            base = str(path.relative_to(ROOT))
            config = composed([base, f"configs/datasets/{dataset}.yaml"])
            model, data = config.model, config.data.init_args
            assert (model.model_name, model.pretrained) in open_clip.list_pretrained(), path.name
            assert model.tau_c == "model" and model.templates == data.dataset == dataset
            assert data.num_workers == 4 and config.output_dir == f"outputs/{dataset}"
            assert tower_type(open_clip.get_model_config(model.model_name)) in tiny_types
    assert {path.stem for path in FAMILY_CONFIGS} == {"siglip2_b16", "eva02_b16", "metaclip_b16"}
    siglip = yaml.safe_load((ROOT / "configs/families/siglip2_b16.yaml").read_text())
    tokenizer = open_clip.get_model_config(siglip["model"]["model_name"])["text_cfg"]
    assert "SigLIP" in tokenizer["hf_tokenizer_name"]


@pytest.mark.parametrize("name", [*TOWERS, "frolic-tiny-vit"])
def test_every_tower_type_predicts_end_to_end(name, tiny_towers, tiny_clip, image_folder):
    tower = tiny_towers.get(name)
    checkpoint = tower.checkpoint_path if tower else tiny_clip.checkpoint_path
    module = module_for(name, str(checkpoint))
    expected_tau = tower.tau_c if tower else 0.01
    assert module.tau_c == pytest.approx(expected_tau, rel=1e-6)
    assert module.tau_c == math.exp(-float(module.clip.logit_scale))
    datamodule = ImageFolderDataModule(str(image_folder), batch_size=8, num_workers=0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    outputs = trainer.predict(module, datamodule=datamodule)
    logits = torch.cat([out["logits"] for out in outputs])
    n = len(IMAGE_FOLDER_CLASSES) * IMAGES_PER_CLASS
    assert logits.shape == (n, len(IMAGE_FOLDER_CLASSES)) and torch.isfinite(logits).all()
    assert torch.equal(torch.cat([out["prediction"] for out in outputs]), logits.argmax(1))
    assert module.head.tau_c == module.tau_c and module.metrics_["tau_g"] > 0
    assert module.head.prototypes.shape == (len(IMAGE_FOLDER_CLASSES), 32)


def test_command_line_takes_local_dir_and_a_tau_c(tiny_clip, image_folder, tmp_path, monkeypatch):
    from tests.test_cli import tiny_args

    monkeypatch.setattr(sys, "argv", ["train.py"])
    open_clip_folder(tmp_path / "model", tiny_clip)
    args = tiny_args(tiny_clip, image_folder, tmp_path / "out", "--model.tau_c", "0.05")
    args[args.index("--model.model_name") + 1] = f"local-dir:{tmp_path / 'model'}"
    args += ["--trainer.enable_progress_bar", "false", "--model.ablations", "false"]
    main(args)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["tau_c"] == 0.05 and metrics["model_name"].startswith("local-dir:")
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--model.tau_c", "auto"])  # neither a float nor "model"
    assert exit_info.value.code == 2


def test_command_line_rejects_a_bad_tau_c_before_data_or_weights(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    configs = [ROOT / "configs/vit_b16.yaml", ROOT / "configs/datasets/eurosat.yaml"]
    args = ["predict", *(a for c in configs for a in ("--config", str(c)))]
    args += ["--data.root", str(tmp_path / "nowhere")]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--model.tau_c", "-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # not the missing data, not the weights
    assert err == "error: Expected `tau_c` to be a finite number > 0, but got -1.0\n"
