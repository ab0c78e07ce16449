"""The package's shape: a core that imports with torch alone, one registry of rows, one options
vocabulary, one centred scoring path, raw docstrings, files that fit in one reading."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import frolic_tta
from frolic_tta.logits import AffineMap
from frolic_tta.metrics import ROW_METRICS, metric_key, row_accuracies, row_metrics
from frolic_tta.options import SOLVER_FIELDS, FrolicOptions, SolverOptions
from frolic_tta.rows import ROWS, available_rows
from frolic_tta.synthetic import clip_world

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "frolic_tta"
HEAVY = ("lightning", "open_clip", "torchmetrics", "torchvision", "pytorch_lightning")


def test_estimators_import_with_torch_alone():
    code = (
        "import sys, torch, frolic_tta\n"
        "g = torch.Generator().manual_seed(0)\n"
        "z = torch.randn(3, 8, generator=g)\n"
        "x = z[torch.arange(60) % 3] + 0.5 * torch.randn(60, 8, generator=g)\n"
        "res = frolic_tta.frolic(x, z, normalize=False)\n"
        "res.ablations(torch.arange(60) % 3)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_lightning_names_load_lazily_from_the_package():
    from frolic_tta.lightning import FrolicModule

    assert frolic_tta.FrolicModule is FrolicModule
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = frolic_tta.nope


def test_one_registry_of_rows_drives_results_metrics_and_reports():
    world = clip_world(num_samples=600, seed=1)
    result = frolic_tta.frolic(world.features, world.prototypes)
    assert list(result.ablations(world.labels)) == list(ROWS)
    assert list(result.ablations()) == [key for key in ROWS if key != "oracle"]
    metrics = row_accuracies(num_classes=20)
    assert set(metrics.keys()) == {metric_key(key) for key in ROWS}
    every = {metric_key(key, kind) for key in ROWS for kind in (*ROW_METRICS, "class_acc")}
    assert set(row_metrics(num_classes=20).keys()) == every
    assert available_rows(5000, labelled=True) == list(ROWS)  # no K x K system, no class cap
    uniform = FrolicOptions(test_prior="uniform")
    assert "f_d balanced" not in available_rows(20, labelled=True, options=uniform)
    assert all(row.label and row.table in ("3", "4", "extra") for row in ROWS.values())


def test_one_options_vocabulary_for_functions_and_module():
    from frolic_tta.lightning import FrolicModule

    names = {f.name for f in fields(FrolicOptions)} | set(SOLVER_FIELDS)
    for function in (frolic_tta.frolic, frolic_tta.fit_frolic, FrolicModule.__init__):
        params = set(inspect.signature(function).parameters)
        assert "options" in params and not names & params, function.__qualname__
    x, z = torch.randn(40, 4), torch.randn(3, 4)
    result = frolic_tta.frolic(x, z, bias="paper", solver={"eps": 0.05}, normalize=False)
    assert result.options == FrolicOptions(bias="paper", solver=SolverOptions(eps=0.05))
    with pytest.raises(TypeError, match=r"FrolicOptions fields"):
        frolic_tta.frolic(torch.randn(5, 4), torch.randn(3, 4), covariance_type="soft")


def test_every_row_is_scored_by_the_centred_path():
    world = clip_world(num_samples=800, seed=3)
    result = frolic_tta.frolic(world.features, world.prototypes)
    head = result.head
    torch.testing.assert_close(head.score(world.features), result.logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(head.to_module()(world.features), result.logits, rtol=0, atol=1e-4)
    final = head.debiased()
    shifted = AffineMap(final.weight, final.bias, final.center + 100.0)  # a far centre
    uncentred = (final.weight.float(), final.uncentred()[1].float())
    far = world.features + 100.0
    exact = shifted.logits(far.double()).float()
    assert float((shifted.logits(far) - exact).abs().max()) < 1e-3 * float(exact.abs().max())
    assert uncentred[0].dtype == torch.float32  # the plain nn.Linear export stays available


def _docstrings(path: Path):
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for index, statement in enumerate(body):
            is_first = index == 0 and isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            )
            after_assignment = index > 0 and isinstance(body[index - 1], ast.Assign | ast.AnnAssign)
            if not (is_first or after_assignment) or not isinstance(statement, ast.Expr):
                continue
            value = statement.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                start = lines[statement.lineno - 1][statement.col_offset :]
                yield statement.lineno, value.value, start


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_docstrings_with_math_are_raw_and_files_are_short(path):
    for line, text, start in _docstrings(path):
        assert not any(c in text for c in "\t\f\b\a\v\r"), f"{path.name}:{line} control char"
        if "\\" in text:
            assert start[:1] in "rR", f"{path.name}:{line} has a backslash but is not raw"
    assert len(path.read_text().splitlines()) <= 400, f"{path.name} is over 400 lines"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return names | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_no_import_runs_back_up_and_no_callback_reads_the_module_with_getattr():
    for path in (PACKAGE / "data").glob("*.py"):  # data does not know the model's callbacks
        assert not any(m.startswith("frolic_tta.lightning") for m in _imports(path)), path.name
    seen = ("module", "pl_module", "trainer", "datamodule")
    callbacks = ("report.py", "writer.py", "store.py", "online.py", "adaptation.py", "batch.py",
                 "finalize.py", "outcome.py", "store_sums.py")  # fmt: skip
    for name in callbacks:  # they read the adaptation, never the module's type
        assert "frolic_tta.lightning.module" not in _imports(PACKAGE / "lightning" / name), name
    for name in callbacks:  # public names only
        tree = ast.parse((PACKAGE / "lightning" / name).read_text(encoding="utf-8"))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        read = [
            ast.unparse(c)
            for c in calls
            if isinstance(c.func, ast.Name) and c.func.id in ("getattr", "hasattr")
            and isinstance(c.args[0], ast.Name) and c.args[0].id in seen
        ]  # fmt: skip
        private = [
            ast.unparse(n)
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and not n.attr.startswith("__")
            and isinstance(n.value, ast.Name) and n.value.id in seen
        ]  # fmt: skip
        assert read == [] and private == [], (name, read, private)


def _runtime_imports(path: Path) -> set[str]:
    """The frolic_tta modules ``path`` imports when it runs (inside functions too; not the
    ``if TYPE_CHECKING:`` blocks, which only annotate)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for statement in block.body
        for n in ast.walk(statement)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("frolic_tta"):
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("frolic_tta")}
    return names


def test_no_import_circle_not_even_inside_functions():
    # issue 37: gda -> released -> gda and lightning/module <-> lightning/store were held
    # together by imports inside functions
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str:  # "frolic_tta.gda.MomentSums" -> "frolic_tta.gda"
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {
        name: {resolve(t) for t in _runtime_imports(path)} - {name, "frolic_tta"}
        for name, path in modules.items()
    }  # (the package's __init__ loads the Lightning names lazily, on first use)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []
