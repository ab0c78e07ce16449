"""A sweep's files and processes: atomic writes, a damaged marker means "not finished", a run
stops with the sweep, and a malformed sweep YAML is one line (issue 16, found 6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from frolic_tta.lightning import tables
from frolic_tta.lightning.sweep import DONE, load_sweep, main, plan_runs
from frolic_tta.lightning.sweep_files import result_line

ROOT = Path(__file__).resolve().parents[1]


def sweep_config(tmp_path: Path, **extra) -> Path:
    config = {
        "output_dir": str(tmp_path / "sweep"),
        "models": {"tiny": {"model_name": "ViT-B-16", "pretrained": None}},
        "datasets": ["eurosat"],
        **extra,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("marker", "metrics"),
    [
        ("", '{"acc/f_d": 0.5}'),
        ('{"args": ', '{"acc/f_d": 0.5}'),
        (None, '{"acc/f_d"'),
        (None, "[]"),
    ],
)
def test_a_damaged_marker_or_metrics_file_means_not_finished(tmp_path, capsys, marker, metrics):
    config = sweep_config(tmp_path)
    run = plan_runs(load_sweep(config))[0]
    run.run_dir.mkdir(parents=True)
    good = json.dumps({"args": run.args})
    (run.run_dir / DONE).write_text(good if marker is None else marker)
    (run.run_dir / "metrics.json").write_text(metrics)
    assert not run.done()
    assert main(["--config", str(config), "--tables_only"]) == 0  # no JSONDecodeError
    assert "wrote" in capsys.readouterr().out


def test_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "results.csv"
    tables.write_atomically(target, "old\n")

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tables.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        tables.write_atomically(target, "new, but interrupted\n")
    assert target.read_text() == "old\n"
    monkeypatch.undo()
    tables.write_atomically(target, "new\n")
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("output_dir: [unclosed\n", "to be YAML, but it is not at line 2, column 1: "),
        ("just a string\n", "to hold a mapping of sweep config keys, but it holds a str"),
        ("- a\n- b\n", "to hold a mapping of sweep config keys, but it holds a list"),
        ("output_dir: x\nargs: [--trainer.devices=2]\n", "Expected `args` in"),
        ("output_dir: x\nlauncher: {srun: 8}\n", "Expected `launcher` in"),
    ],
)
def test_a_malformed_sweep_yaml_is_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["--config", str(path), "--tables_only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: Expected ") and message in err, err
    if "args" in text:
        assert "to be a dict, but got list ['--trainer.devices=2']" in err


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has stopped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_run_stops_with_the_sweep(tmp_path, how):
    pid_file = tmp_path / "child.pid"
    stand_in = (
        "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    )
    launcher = f'{sys.executable} -c "{stand_in}" {pid_file}'  # a run that takes a minute
    config = sweep_config(tmp_path, launcher=launcher)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "frolic_tta.lightning.sweep", "--config", str(config)]
    sweep = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()):
        assert time.monotonic() < deadline and sweep.poll() is None, "the run never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    sweep.send_signal(how)
    sweep.wait(timeout=30)
    deadline = time.monotonic() + 15
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), f"the run (pid {child}) outlived the sweep ({how.name})"


def test_a_finished_run_is_one_line():
    found = {"accuracy": {"f_c": 0.82, "f_d": 0.92667, "f_g": 0.5}}
    assert result_line(found, 12.34) == "f_c 82.0% → f_d 92.7% (12.3 s)"
    assert result_line({"accuracy": {}, "tau_g": 2.0}, 75) == "no labels (1 min 15 s)"
    assert result_line({"accuracy": {"f_d": {"top1": 0.5}}}) == "f_d 50.0%"  # a stored head
    assert result_line(None, 7300) == "metrics.json unreadable (2 h 01 min)"
