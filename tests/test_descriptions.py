"""The description fetcher against a local HTTP server serving files this test writes."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from frolic_tta.clip.descriptions import (
    ALIASES,
    PUBLISHED,
    DescriptionsError,
    PublishedFile,
    fetch_descriptions,
    main,
    map_descriptions,
    reference_class_names,
)
from frolic_tta.clip.prompts import build_class_prompts, load_descriptions
from frolic_tta.data import DATASETS
from tests.test_splits import eurosat_tree, write_split

ROOT = Path(__file__).resolve().parents[1]
# CoOp-style names, as the published files have them; our sentences, not the published ones
PUBLISHED_TEXT = {
    "Annual Crop Land": ["Rows of green fields seen from above."],
    "Herbaceous Vegetation Land": ["Low bushes and grass."],
    "Sea_or_Lake": ["A flat blue surface of water."],
}


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the parent's signature
        pass


@pytest.fixture
def server(tmp_path: Path):
    """A local HTTP server over ``tmp_path / "site"``; yields ``(base URL, site folder)``."""
    site = tmp_path / "site"
    site.mkdir()
    handler = functools.partial(QuietHandler, directory=str(site))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", site
    httpd.shutdown()
    httpd.server_close()


def publish(site: Path, path: str, content: object) -> PublishedFile:
    """Write ``content`` as JSON at ``site/path``; its :class:`PublishedFile` with checksum."""
    data = json.dumps(content).encode("utf-8")
    (site / path).parent.mkdir(parents=True, exist_ok=True)
    (site / path).write_bytes(data)
    return PublishedFile(path, hashlib.sha256(data).hexdigest())


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/"  # nothing listens there any more


def test_fetch_verifies_maps_and_writes(server, tmp_path: Path) -> None:
    base, site = server
    files = {"eurosat": publish(site, "p/eurosat.json", PUBLISHED_TEXT)}
    out = tmp_path / "descriptions"
    report = fetch_descriptions(out, ["EuroSAT", "objectnet"], base, files=files)
    written = load_descriptions(out / "eurosat.json")
    assert written["Sea or Lake"] == ["A flat blue surface of water."]  # underscores -> spaces
    assert written["brushland or shrubland"] == ["Low bushes and grass."]  # alias of ours
    assert not (out / "objectnet.json").exists()
    sources = json.loads((out / "sources.json").read_text())
    assert sources["eurosat"] == {
        "url": base + "p/eurosat.json",
        "sha256": files["eurosat"].sha256,
        "classes": 4,
    }
    assert report[0].startswith(f"eurosat: 4 classes -> {out / 'eurosat'}.json; 3/10 class names")
    assert "without descriptions: ['forest', 'highway or road'" in report[0]
    assert report[1] == "objectnet: no published descriptions; its runs use the templates alone"
    # our CLIP names find their sentences: alias, case, and word order ("lake or sea")
    names = ["annual crop land", "brushland or shrubland", "lake or sea", "forest"]
    prompts = build_class_prompts(names, "a photo of {}.", descriptions=out / "eurosat.json")
    assert prompts[2] == ["A flat blue surface of water.", "a photo of lake or sea."]
    assert prompts[3] == ["a photo of forest."]  # not described: templates alone


def test_checksum_mismatch_is_refused_and_nothing_written(server, tmp_path: Path) -> None:
    base, site = server
    good = publish(site, "p/eurosat.json", PUBLISHED_TEXT)
    wrong = PublishedFile(good.path, "0" * 64)
    message = (
        rf"checksum mismatch for {base}p/eurosat.json: expected SHA-256 0{{64}}, got "
        rf"{good.sha256}; this is not the published file, so it was not written"
    )
    with pytest.raises(DescriptionsError, match=message):
        fetch_descriptions(tmp_path / "out", ["eurosat"], base, files={"eurosat": wrong})
    assert not (tmp_path / "out").exists()
    # the command line with the real table: a file that is not the published one, exit 2
    publish(site, PUBLISHED["eurosat"].path, PUBLISHED_TEXT)
    argv = ["fetch", "--out", str(tmp_path / "cli"), "--datasets", "eurosat", "--base-url", base]
    assert main(argv) == 2
    assert not (tmp_path / "cli" / "eurosat.json").exists()


def test_offline_is_one_sentence_and_exit_status_2(tmp_path: Path, capsys) -> None:
    base = closed_port_url()
    url = base + PUBLISHED["dtd"].path
    argv = ["fetch", "--out", str(tmp_path / "d"), "--datasets", "dtd", "--base-url", base]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: could not download {url} (") and err.count("\n") == 1
    assert "run this command on a machine online and copy its --out folder here" in err
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "frolic_tta.clip.descriptions", *argv]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: could not download {url}")


def test_coverage_against_the_data_under_root(server, tmp_path: Path) -> None:
    base, site = server
    files = {"eurosat": publish(site, "p/eurosat.json", PUBLISHED_TEXT)}
    eurosat_tree(tmp_path / "data")
    write_split(tmp_path / "data" / "eurosat")  # CoOp's names: Annual Crop Land, Forest, ...
    root = tmp_path / "data"
    report = fetch_descriptions(tmp_path / "out", ["eurosat"], base, files=files, root=root)
    assert f"2/3 class names covered (the data under '{root}'); " in report[0]
    assert report[0].endswith("without descriptions: ['Forest']")


def test_aliases_point_at_published_names() -> None:
    mapped = map_descriptions("caltech101", {"face": ["x"], "yin_yang": ["y"]})
    assert mapped == {
        "face": ["x"],
        "yin yang": ["y"],
        "off-center face": ["x"],
        "centered face": ["x"],
        "yin and yang symbol": ["y"],
    }
    for key, aliases in ALIASES.items():
        assert set(aliases) <= set(reference_class_names(key)), key
    assert set(PUBLISHED) == set(DATASETS) - {"objectnet"}
    assert len({file.sha256 for file in PUBLISHED.values()}) == 11  # ImageNet's serves 5 keys
    assert reference_class_names("stanford_cars") is None
