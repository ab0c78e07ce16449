"""The paper's class descriptions: fetched from their public source, checked, mapped to our names.

Frolic (Section 4.1) uses "the same text descriptions as SuS-X and CuPL": GPT-3 sentences per
class in CuPL's style, which SuS-X (Udandarao et al., ICCV 2023) published for every dataset of
the paper except ObjectNet (``gpt3_prompts/CuPL_prompts_<dataset>.json``; DMN ships the same
files and uses the ImageNet one for the ImageNet variants, as we do). No description text is
stored in this repository: :func:`fetch_descriptions` downloads the files from a pinned commit,
refuses any whose SHA-256 differs from the one recorded here, and writes
``<out>/<dataset key>.json`` (``{class name: [sentences]}``, what ``--model.prompts_file``
reads) plus ``<out>/sources.json`` (URL and checksum of each file). Command line::

    python -m frolic_tta.clip.descriptions fetch --out descriptions

Published names that differ from ours are mapped: :func:`~frolic_tta.clip.lookup_descriptions`
matches case, underscores and word order (CoOp's ``"2000 AM General Hummer SUV"`` is
torchvision's ``"AM General Hummer SUV 2000"``); :data:`ALIASES` adds CLIP's renamed
EuroSAT/Caltech101 classes under our names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from frolic_tta.clip.prompts import check_descriptions, lookup_descriptions
from frolic_tta.data.datasets import DATASETS, canonical_dataset_name
from frolic_tta.data.imagenet import imagenet_class_names, metadata

__all__ = [
    "ALIASES",
    "DEFAULT_BASE_URL",
    "PUBLISHED",
    "DescriptionsError",
    "PublishedFile",
    "fetch_descriptions",
    "main",
    "map_descriptions",
    "reference_class_names",
]

SUSX_COMMIT = "d7d4d37881408884999fe276faacdd61b511067f"
DEFAULT_BASE_URL = f"https://raw.githubusercontent.com/vishaal27/SuS-X/{SUSX_COMMIT}/"
"""SuS-X's repository at the pinned commit; file paths are appended."""


@dataclass(frozen=True)
class PublishedFile:
    """One published description file.

    Attributes:
        path: Path inside the repository (appended to the base URL).
        sha256: SHA-256 of its bytes at the pinned commit.
    """

    path: str
    sha256: str


def _susx(name: str, sha256: str) -> PublishedFile:
    return PublishedFile(f"gpt3_prompts/CuPL_prompts_{name}.json", sha256)


_IMAGENET = _susx("imagenet", "ab8edaa47cb8050ee48c673e38022cbc5522f404bd16a74debb5c7e260869e77")
#: The file of each dataset key (ObjectNet has none: its runs use the templates alone).
PUBLISHED: dict[str, PublishedFile] = {
    "caltech101": _susx(
        "caltech101", "b5c3f52be95a1e450c4ebbac1fd0d2644a5d2efc2bac15e1a82cad587fdd09f6"
    ),
    "dtd": _susx("dtd", "b5d2ae76c1e8e5ded0df87d70aa60ce78730060ae65d7b36c30034457b8cfbe8"),
    "eurosat": _susx("eurosat", "c1831f13dff8f8f2b6e3121b122b4e40582ccc1274537c3f9023641d35d07234"),
    "fgvc_aircraft": _susx(
        "fgvcaircraft", "3d0733867fa1e30a229639df9528d9da3fe11b9cf56c0cd6eda11688d9a31393"
    ),
    "flowers102": _susx(
        "flowers102", "904c8850eafeaa1cc60a0f55fab7bdc168af4b2d1e5cb5bd06c5d32cbbc9d676"
    ),
    "food101": _susx("food101", "0aed280ca518c37abec6b1c85a6093b8f9993988df1581bda59805b541694735"),
    "oxford_pets": _susx(
        "oxfordpets", "f393a01f911ceed70458d1b7fa3b8f2df2148732210b3783488f2efecc672c95"
    ),
    "stanford_cars": _susx(
        "stanfordcars", "8b84424728b57442cbe190b0d996fda7a16fbb8ac42617911c61fea8f1496a53"
    ),
    "sun397": _susx("sun397", "b6e2c68f1cfaad78a725de1aea337cea8f5481402708225bcecbe8ce8b436967"),
    "ucf101": _susx("ucf101", "f685a1d6e8b1316a4f70554d2913c9fb58050af80c96004e6c7b40515488f9e4"),
    **dict.fromkeys(
        ("imagenet", "imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r"), _IMAGENET
    ),
}

#: Our class name -> the published one, where the words differ (not just case or order):
#: CLIP's cleaned names that torchvision runs use (``frolic_tta/data/metadata.json``), whereas
#: the published files follow CoOp's names (those of the standard split files).
ALIASES: dict[str, dict[str, str]] = {
    "eurosat": {
        "brushland or shrubland": "Herbaceous Vegetation Land",
        "industrial buildings or commercial buildings": "Industrial Buildings",
        "residential buildings or homes or apartments": "Residential Buildings",
    },
    "caltech101": {
        "off-center face": "face",
        "centered face": "face",
        "side of a car": "car side",
        "body of a cougar cat": "cougar body",
        "face of a cougar cat": "cougar face",
        "head of a crocodile": "crocodile head",
        "head of a flamingo": "flamingo head",
        "snoopy (cartoon beagle)": "snoopy",
        "yin and yang symbol": "yin yang",
    },
}


class DescriptionsError(RuntimeError):
    """A download failed or a file is not the published one; the message says what to do."""


def reference_class_names(dataset: str) -> list[str] | None:
    """Our class names of ``dataset`` that are known without its files, else ``None``.

    ImageNet and its variants: CLIP's 1000 names; Flowers102 and EuroSAT: CLIP's names;
    Caltech101: the classes CLIP renamed. Other datasets take their names from their files.
    """
    key = canonical_dataset_name(dataset)
    names = metadata()["class_names"]
    if key is not None and key.startswith("imagenet"):
        return imagenet_class_names()
    if key == "flowers102":
        return list(names["flowers102"])
    if key in ("eurosat", "caltech101"):
        return list(names[key].values())
    return None


def map_descriptions(dataset: str, published: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The published descriptions under their own names plus our aliases (:data:`ALIASES`).

    An alias whose published class is not in ``published`` is left out (the fetch report
    lists our classes left without descriptions).

    Returns:
        ``{class name: [sentences]}``; names with underscores get spaces.
    """
    key = canonical_dataset_name(dataset)
    mapped = {name.replace("_", " ").strip(): list(s) for name, s in published.items()}
    for ours, theirs in ALIASES.get(str(key), {}).items():
        sentences = lookup_descriptions(published, theirs)
        if sentences is not None:
            mapped.setdefault(ours, sentences)
    return mapped


def _download(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(error, urllib.error.HTTPError):
            reason = f"HTTP {error.code} {error.reason}"
        raise DescriptionsError(
            f"could not download {url} ({reason}). Fetching the descriptions needs access to "
            f"that address: run this command on a machine online and copy its --out folder "
            f"here, or pass --base-url with a mirror of the files"
        ) from None


def _fetch(base_url: str, file: PublishedFile, timeout: float) -> dict[str, list[str]]:
    url = base_url.rstrip("/") + "/" + file.path
    data = _download(url, timeout)
    digest = hashlib.sha256(data).hexdigest()
    if digest != file.sha256:
        raise DescriptionsError(
            f"checksum mismatch for {url}: expected SHA-256 {file.sha256}, got {digest}; "
            f"this is not the published file, so it was not written"
        )
    try:
        content = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DescriptionsError(f"{url} is not UTF-8 JSON: {error}") from None
    try:
        return check_descriptions(content, url)
    except ValueError as error:
        raise DescriptionsError(str(error)) from None


def _data_class_names(key: str, root: str | os.PathLike[str]) -> list[str] | None:
    """The class names a run on ``root`` would use (standard split first), if the data are there."""
    from frolic_tta.data.splits import load_dataset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_dataset(key, root).class_names
    except (OSError, ValueError, RuntimeError):
        return None


def _coverage(
    key: str, descriptions: Mapping[str, Sequence[str]], root: str | os.PathLike[str] | None
) -> str:
    names = _data_class_names(key, root) if root is not None else None
    where = f"the data under '{root}'" if names is not None else "names known without the data"
    names = names if names is not None else reference_class_names(key)
    if names is None:
        return "class names come from the data (pass --root to check them)"
    unique = list(dict.fromkeys(names))
    missing = [n for n in unique if lookup_descriptions(descriptions, n) is None]
    text = f"{len(unique) - len(missing)}/{len(unique)} class names covered ({where})"
    return text + (f"; without descriptions: {missing}" if missing else "")


def fetch_descriptions(
    out: str | os.PathLike[str],
    datasets: Sequence[str] | None = None,
    base_url: str = DEFAULT_BASE_URL,
    timeout: float = 30.0,
    files: Mapping[str, PublishedFile] | None = None,
    root: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Download, verify and write the description files of ``datasets``.

    Every file is downloaded and checked before anything is written. ``<out>/<key>.json`` holds
    :func:`map_descriptions` of the file; ``<out>/sources.json`` its URL and SHA-256.

    Args:
        out: Output folder (created).
        datasets: Dataset keys or aliases; default: all 16 (ObjectNet has no file: reported only).
        base_url: Where the files' paths start (a mirror, or a local server in tests).
        timeout: Seconds per download.
        files: The file of each dataset key; default :data:`PUBLISHED`.
        root: A ``--data.root``: check coverage against the class names of the datasets found
            there (standard splits first) instead of the names known without the data.

    Returns:
        One report line per dataset: classes written and our names covered (or missing).

    Raises:
        DescriptionsError: A download failed (offline) or a checksum or content is wrong.
        ValueError: An unknown dataset name.
    """
    files = PUBLISHED if files is None else files
    keys = [canonical_dataset_name(d) for d in datasets] if datasets else list(DATASETS)
    fetched: dict[PublishedFile, dict[str, list[str]]] = {}
    for key in keys:
        file = files.get(str(key))
        if file is not None and file not in fetched:
            fetched[file] = _fetch(base_url, file, timeout)
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    report, sources = [], {}
    for key in map(str, keys):
        file = files.get(key)
        if file is None:
            report.append(f"{key}: no published descriptions; its runs use the templates alone")
            continue
        mapped = map_descriptions(key, fetched[file])
        (folder / f"{key}.json").write_text(
            json.dumps(mapped, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        url = base_url.rstrip("/") + "/" + file.path
        sources[key] = {"url": url, "sha256": file.sha256, "classes": len(mapped)}
        coverage = _coverage(key, mapped, root)
        report.append(f"{key}: {len(mapped)} classes -> {folder / key}.json; {coverage}")
    (folder / "sources.json").write_text(json.dumps(sources, indent=1) + "\n", encoding="utf-8")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m frolic_tta.clip.descriptions fetch --out DIR``: 0 on success; 2 and one
    ``error: ...`` line on stderr when a download or check fails."""
    parser = argparse.ArgumentParser(
        prog="python -m frolic_tta.clip.descriptions",
        description="Fetch the paper's class descriptions (SuS-X/CuPL) into a folder.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="download, verify (SHA-256) and write them")
    fetch.add_argument("--out", default="descriptions", help="output folder (default: %(default)s)")
    fetch.add_argument("--datasets", nargs="+", help="dataset keys (default: all)")
    fetch.add_argument("--base-url", default=DEFAULT_BASE_URL, help="where the files are")
    fetch.add_argument("--timeout", type=float, default=30.0, help="seconds per download")
    fetch.add_argument("--root", help="a --data.root: check class names against its datasets")
    args = parser.parse_args(argv)
    try:
        report = fetch_descriptions(
            args.out, args.datasets, args.base_url, args.timeout, root=args.root
        )
    except (DescriptionsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
