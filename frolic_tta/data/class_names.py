"""Class names given for labelled data are checked against the classes they name.

A labelled source (a folder with one sub-folder per class, one of the paper's datasets) knows
its classes and the label of every image. ``class_names`` given for it can therefore only
*name* those classes, never renumber them: a list given in another order used to rename the
classes by position, so that every ``star`` image was scored as ``triangle`` and the reported
accuracy was computed against the wrong labels, without a sign.

:func:`labelled_class_names` takes

* a **list** that names the source's classes (in any order; case, ``_`` and spaces do not
  matter): the classes keep the source's order (label ``i`` is still class ``i``), spelled as
  given; a different order is said in a warning;
* a **mapping** ``{class: words}`` from each of the source's classes to the words its prompts
  should use (``--data.class_names '{n01440764: tench, ...}'``), in the source's order;

and refuses anything else with one sentence that names the source's classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from frolic_tta.data.indexed import check_class_names
from frolic_tta.errors import warn

__all__ = ["class_key", "labelled_class_names", "same_classes"]


def class_key(name: str) -> str:
    """What identifies a class name: lower case, ``_``, ``-``, ``/`` and spaces as one space."""
    return " ".join(str(name).replace("_", " ").replace("/", " ").replace("-", " ").lower().split())


def _listing(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _position(names: Sequence[str], aliases: Sequence[Sequence[str]]) -> dict[str, int]:
    """Class index of every key of ``names`` and of its ``aliases`` (e.g. raw folder names)."""
    index: dict[str, int] = {}
    for spellings in (names, *aliases):
        for i, name in enumerate(spellings):
            index.setdefault(class_key(name), i)
    return index


def same_classes(given: Sequence[str], known: Sequence[str]) -> list[int] | None:
    """``order`` with ``given[j]`` naming ``known[order[j]]``, when ``given`` names each class
    of ``known`` once (by :func:`class_key`); else ``None``."""
    index = _position(known, ())
    order = [index.get(class_key(name), -1) for name in given]
    if len(given) != len(known) or sorted(order) != list(range(len(known))):
        return None
    return order


def labelled_class_names(
    class_names: Any,
    names: list[str],
    source: str,
    aliases: Sequence[Sequence[str]] = (),
    option: str = "--data.class_names",
) -> list[str]:
    """The class names of a labelled source: ``names`` (its classes, in label order), spelled
    as ``class_names`` gives them.

    Args:
        class_names: ``None`` (use ``names``), a list naming the classes in any order, or a
            mapping from each class to the words its prompts use.
        names: The source's class names, index ``i`` = label ``i``.
        source: The source in words, for messages (``"the class folders of 'photos/'"``).
        aliases: Other spellings of ``names``, in the same order (e.g. the raw folder names).
        option: The option to name in messages.

    Raises:
        TypeError: not a list of strings, nor a mapping of strings to strings.
        ValueError: a count other than ``len(names)``, or names that are not the source's
            classes (the message lists them).
    """
    if class_names is None:
        return list(names)
    if isinstance(class_names, Mapping):
        return _mapped(dict(class_names), names, source, aliases, option)
    given = cast(list[str], check_class_names(class_names))
    if len(given) != len(names):
        raise ValueError(
            f"Expected {len(names)} class_names for {source}, but got {len(given)}: "
            f"{option} names the classes ({_listing(names)}), in any order"
        )
    index = _position(names, aliases)
    order = [index.get(class_key(name)) for name in given]
    unknown = [name for name, i in zip(given, order, strict=True) if i is None]
    if unknown or len(set(order)) != len(order):
        problem = (
            f"{_listing([repr(n) for n in unknown])} {'is' if len(unknown) == 1 else 'are'} not "
            "among them" if unknown else "they name a class twice"
        )
        raise ValueError(
            f"Expected {option} to name the {len(names)} classes of {source} "
            f"({_listing(names)}) in any order, but {problem}. The labels come from the data, "
            f"so names cannot rename classes by position; to use other words in the prompts, "
            f"map each class to them: {option} '{{{names[0]}: <words>, ...}}'"
        )
    spelled = [""] * len(names)
    for name, i in zip(given, order, strict=True):
        spelled[i] = name  # type: ignore[index]
    if order != list(range(len(names))):
        warn(
            f"{option} names the classes of {source} in another order; each name is matched to "
            f"its class by name and the classes keep the data's order: {_listing(spelled)}"
        )
    return spelled


def _mapped(
    mapping: dict[Any, Any],
    names: list[str],
    source: str,
    aliases: Sequence[Sequence[str]],
    option: str,
) -> list[str]:
    """``{class: words}`` as the words of each class of ``names``, in its order."""
    wrong = [(k, v) for k, v in mapping.items() if not (isinstance(k, str) and isinstance(v, str))]
    if wrong or not mapping:
        raise TypeError(
            f"Expected {option} as a mapping of class names to words such as "
            f"{{'{names[0]}': 'a {names[0]}'}}, but got {mapping!r:.80}"
        )
    index = _position(names, aliases)
    words: dict[int, str] = {}
    unknown = []
    for key, value in mapping.items():
        i = index.get(class_key(key))
        if i is None or i in words:
            unknown.append(key)
        else:
            words[i] = value
    missing = [names[i] for i in range(len(names)) if i not in words]
    if unknown or missing:
        parts = [f"{_listing([repr(k) for k in unknown])} not among them"] if unknown else []
        parts += [f"no words for {_listing(missing)}"] if missing else []
        raise ValueError(
            f"Expected {option} to map each of the {len(names)} classes of {source} "
            f"({_listing(names)}) to its words, but got {'; '.join(parts)}"
        )
    return check_class_names([words[i] for i in range(len(names))], "class_names") or []
