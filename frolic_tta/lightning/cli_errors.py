"""Option mistakes on the command line as one ``error:`` line (exit status 2).

jsonargparse reports a bad option as a usage line, a tip and an error that can run to 18 lines
(``Does not validate against any of the Union subtypes ... NestedArg(key='labled', ...)``) for
an option of a class-typed group such as ``--data.*``. :class:`FrolicArgumentParser` (the
parser class of :class:`~frolic_tta.lightning.cli.FrolicCLI`) prints instead one line that names
the option, what was expected and what came, with a "did you mean" where there is a near name
or value (:func:`one_line`). Parsing itself is unchanged; only how its error is shown.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

__all__ = ["FrolicArgumentParser", "one_line"]

HELP = "python train.py predict --help lists the options"

_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS = re.compile(r"Problem with given class_path '([^']+)'")
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_GIVEN = re.compile(r"(?:Given value|Got value): (.*?)\s*$", re.M)
_SUBTYPES = re.compile(r"Subtypes: \[(.*)\]\s*$", re.M)
_EXPECTED = re.compile(r"Expected a (.+?)(?:\. Got value:.*)?\s*$", re.M)

SUBCLASS_GROUPS = {
    "data": ("lightning.pytorch", "LightningDataModule"),
    "trainer.callbacks": ("lightning.pytorch.callbacks", "Callback"),
    "trainer.logger": ("lightning.pytorch.loggers", "Logger"),
}
"""Class-typed options and their base class (a name is looked up among its subclasses)."""


class FrolicArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose error, when it exits, is one line on stderr."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:  # type: ignore[override]
        if not self.exit_on_error:  # jsonargparse's own attempts (union types): as before
            super().error(message, ex)
        parsers = [self, getattr(ex, "subcommand_parser", None), *_subparsers(self)]
        options = sorted({o for p in parsers if p is not None for o in _option_strings(p)})
        sys.stderr.write(f"error: {one_line(message, options)}\n")
        sys.stderr.flush()
        self.exit(2)


def _subparsers(parser: Any) -> list[Any]:
    action = getattr(parser, "_subcommands_action", None)
    return list(getattr(action, "_name_parser_map", {}).values()) if action else []


def _option_strings(parser: Any) -> Iterable[str]:
    for action in getattr(parser, "_actions", []):
        for option in action.option_strings:
            if option.startswith("--") and not option.endswith(".help"):
                yield option


def _near(word: str, choices: Iterable[str], cutoff: float = 0.7) -> str | None:
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return found[0] if found else None


def _near_option(option: str, options: list[str]) -> str | None:
    """The known option nearest ``option``: by its last part among the options of its group
    (``--trainer.devcies`` -> ``--trainer.devices``), else among all."""
    group, _, last = option.rpartition(".")
    siblings = {o.rpartition(".")[2]: o for o in options if o.rpartition(".")[0] == group}
    near = _near(last, siblings) if group else None
    return siblings[near] if near else _near(option, options, cutoff=0.8)


def _mean(near: str | None) -> str:
    return f"; did you mean {near}?" if near else ""


def one_line(message: str, options: Iterable[str] = ()) -> str:
    """jsonargparse's error ``message`` as one sentence: the option, what it expected, what
    came, and a near option or value (``options``: the parser's ``--option`` strings)."""
    options = list(options)
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    if unknown:
        option = unknown.group(1).split("=", 1)[0]
        near = _near_option(option, options)
        return f"unknown option {option}{_mean(near)} ({HELP})"
    linked = re.search(r"--> (\S+?): invalid", message)
    if linked:  # a link target such as model.class_names
        source = re.search(r"\(([\w.]+)\) -->", message)
        via = f"; pass --{source.group(1)}" if source else ""
        return f"--{linked.group(1)} is set from the data{via}"
    keys = _KEY.findall(message)
    if not keys:
        return " ".join(message.split())
    key, class_path = keys[0], _CLASS.search(message)
    if class_path and len(keys) > 1:
        key = f"{keys[0]}.{keys[-1]}"
    if "File does not exist" in message:
        path = re.search(r"File does not exist: (.*)$", message, re.M)
        return f"--{key}: no file at {path.group(1).strip() if path else 'the path given'}"
    rejected = _NOT_ACCEPTED.search(message)
    if rejected and class_path:
        return _unknown_nested(key, rejected.group(1), class_path.group(1))
    given = _GIVEN.search(message)
    value = given.group(1) if given else "?"
    if "Expected a dot import path" in message or "Expected a path but" in message:
        return _unknown_class(key, value)
    block = message[message.rfind(f'Parser key "{keys[-1]}"') :]
    block = block[: given.start() - (len(message) - len(block))] if given else block
    expected, choices = _expected(block)
    near = _near(value, choices) if choices else None
    hint = f"; did you mean {near!r}?" if near else ""
    if "list" in expected and "," in value and not value.lstrip().startswith("["):
        words = ", ".join(w.strip() for w in value.split(","))
        hint = f"; did you mean '[{words}]'?"
    return f"--{key}: expected {expected}, but got {value!r}{hint}"


def _unknown_nested(group: str, option: str, class_path: str) -> str:
    """``--data.labled``: not a parameter of the group's class (its parameters are the
    options)."""
    name = class_path.rsplit(".", 1)[-1]
    near = _near(option, _parameters(class_path))
    mean = f"; did you mean --{group}.{near}?" if near else ""
    other = [c for c in DATA_CLASSES if c != class_path and option in _parameters(c)]
    if group == "data" and other and not near:  # an option of the other datamodule
        other_name = other[0].rsplit(".", 1)[-1]
        mean = f"; it is an option of --data {other_name}"
    return f"unknown option --{group}.{option} of {name}{mean} ({HELP})"


DATA_CLASSES = ("frolic_tta.data.FrolicDataModule", "frolic_tta.data.ImageFolderDataModule")


def _parameters(class_path: str) -> list[str]:
    """The ``__init__`` parameters of the class at ``class_path`` (its options)."""
    try:
        module, _, attr = class_path.rpartition(".")
        params = inspect.signature(getattr(importlib.import_module(module), attr)).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p for p in params if p not in ("self", "args", "kwargs")]


def _unknown_class(key: str, value: str) -> str:
    """``--data FooDataModule``: no such class; the known subclasses of the group's base."""
    names: list[str] = []
    base = SUBCLASS_GROUPS.get(key)
    if base is not None:
        try:
            root = getattr(importlib.import_module(base[0]), base[1])
            names = sorted({c.__name__ for c in _subclasses(root)})
        except (ImportError, AttributeError):
            names = []
    near = _near(value, names)
    known = [n for n in names if n.startswith("Frolic") or n == "ImageFolderDataModule"]
    also = f" (e.g. {', '.join(known[:3])})" if known and not near else ""
    return (
        f"--{key}: expected a class name or import path{also}, but got {value!r}, which is not "
        f"one{_mean(near)}"
    )


def _subclasses(root: type) -> set[type]:
    found, todo = set(), [root]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _split_top(text: str) -> list[str]:
    """``"a[b, c], d"`` -> ``["a[b, c]", "d"]`` (commas outside brackets)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _expected(block: str) -> tuple[str, list[str]]:
    """What one option's error block expected, in words, and its literal choices."""
    subtypes = _SUBTYPES.search(block)
    kinds = _split_top(subtypes.group(1)) if subtypes else _EXPECTED.findall(block)
    words, choices = [], []
    for kind in kinds:
        text, values = _describe(kind.strip().rstrip("."))
        choices += [v for v in values if v not in choices]
        if not values and text not in words:
            words.append(text)
    if choices:  # the Literal values, once, before the other types
        words.insert(0, "one of " + ", ".join(choices))
    if len(words) > 1 and "null" in words:
        words.remove("null")
        words.append("null")
    return (" or ".join(words) if words else "another value"), choices


def _describe(kind: str) -> tuple[str, list[str]]:
    """A type as jsonargparse prints it, in words (and a Literal's values)."""
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", kind)
    if literal:
        try:
            values = ast.literal_eval(f"[{literal.group(1)}]")
        except (ValueError, SyntaxError):
            values = [literal.group(1)]
        shown = [str(v) for v in values]
        return "one of " + ", ".join(shown), shown
    name = re.sub(r"<class '([\w.]+)'>", r"\1", kind).rsplit(".", 1)[-1]
    simple = {
        "int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
        "NoneType": "null", "list": "a list such as '[a, b]'", "dict": "a mapping",
        "Path_fr": "a file", "Path_fc": "a file",
    }  # fmt: skip
    base = name.split("[", 1)[0]
    if base in ("list", "tuple", "Sequence"):
        return "a list such as '[a, b]'", []
    if base in ("dict", "Mapping"):
        return "a mapping such as '{a: b}'", []
    return simple.get(base, f"a {name}"), []
