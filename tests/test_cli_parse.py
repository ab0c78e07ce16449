"""The command line parsed, not run: configs, the options group, the weights' tags."""

from __future__ import annotations

from pathlib import Path

import open_clip
import pytest
import yaml

from frolic_tta import FrolicOptions, SolverOptions
from frolic_tta.clip.loading import WeightsNotFoundError, load_open_clip
from frolic_tta.lightning.cli import FrolicCLI, main
from tests.test_cli import bare_argv  # noqa: F401 (autouse: no pytest arguments in sys.argv)

ROOT = Path(__file__).resolve().parents[1]


class ParseOnly(FrolicCLI):
    """Parse a config without checking files, building data or loading weights."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


def test_openai_tag_builds_quick_gelu(monkeypatch):
    calls = []

    def fake_create(name, pretrained=None, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("Failed to download weights (offline test)")

    monkeypatch.setattr(open_clip, "create_model_and_transforms", fake_create)
    monkeypatch.setattr("frolic_tta.clip.hub.can_reach", lambda url: True)  # a Hub answers
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for name in ("ViT-B-16", "ViT-B-16-quickgelu"):
        match = r"--model.pretrained /path/to.ckpt\)\. open_clip said: Failed to download weights"
        with pytest.raises(WeightsNotFoundError, match=match):
            load_open_clip(name, "openai")
    assert calls == [{"force_quick_gelu": True}, {}]


EUROSAT = ["--config", str(ROOT / "configs/vit_b16.yaml")]
EUROSAT += ["--config", str(ROOT / "configs/datasets/eurosat.yaml")]


@pytest.mark.parametrize("configs", [EUROSAT, ["--config", str(ROOT / "configs/folder.yaml")]])
def test_print_config_round_trips(configs, tmp_path, capsys):
    def printed(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["predict", *args, "--print_config"])
        assert exit_info.value.code in (0, None)
        return capsys.readouterr().out

    first = printed(*configs, "--trainer.devices", "2")
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    second = printed("--config", str(saved))
    assert second == first
    assert str(yaml.safe_load(first)["trainer"]["devices"]) == "2"


def test_frolic_options_are_one_group_validated_before_any_model_loads(tiny_clip, tmp_path, capsys):
    parser = ParseOnly(args=EUROSAT, run=False).parser
    parsed = parser.parse_args(
        [*EUROSAT, "--model.options.bias", "paper", "--model.options.solver.eps", "0.05"]
    )
    assert parsed.model.options.bias == "paper" and parsed.model.options.solver.eps == 0.05
    assert parsed.model.options.solver.max_iter == 100  # the other solver fields keep defaults
    missing = ["--model.pretrained", str(tmp_path / "missing.pt"), "--data.root", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:  # the bad option, not missing data or weights
        main(["predict", *EUROSAT, *missing, "--model.options.solver.eps", "-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Expected `eps` to be a finite number > 0, but got -1.0" in err
    assert "missing.pt" not in err and "not found" not in err


def test_solver_options_nest_on_the_command_line_and_in_a_config(tmp_path, capsys):
    config = tmp_path / "solver.yaml"
    config.write_text("model:\n  options:\n    bias: paper\n    solver: {eps: 0.001, max_iter: 11}")
    parser = ParseOnly(args=EUROSAT, run=False).parser
    parsed = parser.parse_args([*EUROSAT, "--config", str(config)])
    solver = parsed.model.options.solver
    assert (solver.eps, solver.max_iter, solver.prior_tol) == (0.001, 11, 1e-7)
    parsed = parser.parse_args([*EUROSAT, "--config", str(config),
                                "--model.options.solver.beta_ratio_bound", "null"])  # fmt: skip
    assert parsed.model.options.solver.beta_ratio_bound is None
    assert parsed.model.options.solver.eps == 0.001  # the config's, not reset by the flag
    options = FrolicOptions(**parsed.model.options.as_dict())
    assert options.solver == SolverOptions(eps=0.001, max_iter=11, beta_ratio_bound=None)
    with pytest.raises(SystemExit):  # flat, as before the solver group: not an option
        parser.parse_args([*EUROSAT, "--model.options.eps", "0.001"])
    assert "model.options.eps" in capsys.readouterr().err
