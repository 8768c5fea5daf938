"""``kvtier traces fetch``: the catalogue against the shared traces, and the whole fetch
(download, verify, lay out, pack the archive) from a mirror on loopback, since this
machine cannot reach GitHub. The mirror serves ``REPO/COMMIT/PATH`` as
raw.githubusercontent.com does: small made-up files where the catalogue is replaced,
the real trace files where ``../shared/traces`` is beside the checkout."""

from __future__ import annotations

import functools
import hashlib
import http.server
import tarfile
import threading
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import FetchError
from kvtier.replay import trace_catalogue as cat
from kvtier.replay.tracefetch import SETS, fetch

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def mirror(tmp_path: Path):
    """An HTTP server on loopback over ``tmp_path / "mirror"``; yields (root dir, base URL)."""
    root = tmp_path / "mirror"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield root, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _publish(root: Path, source: tuple[str, str], path: str, data: bytes) -> None:
    f = root / source[0] / source[1] / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(data)


@pytest.fixture
def small_catalogue(monkeypatch: pytest.MonkeyPatch, mirror):
    """The catalogue replaced by three tiny traces and a license, all published on the mirror."""
    root, _ = mirror
    traces = {f"trace_000{i}.json": f'{{"id": "{i}", "requests": []}}'.encode() for i in range(3)}
    monkeypatch.setattr(cat, "WEKA_DEV_120", {n: (_sha(d), len(d)) for n, d in traces.items()})
    for n, d in traces.items():
        _publish(root, cat.WEKA, f"traces/{n}", d)
    files = {}
    for local in SETS["weka_dev_120"].files[1:]:
        data = f"made-up {local}\n".encode()
        files[local] = (cat.WEKA, f"up/{local}", _sha(data), len(data))
        _publish(root, cat.WEKA, f"up/{local}", data)
    monkeypatch.setattr(cat, "FILES", files)
    return traces


def test_fetch_downloads_verifies_and_lays_out_as_the_docs_expect(tmp_path, mirror, small_catalogue, capsys):
    _, url = mirror
    dest = tmp_path / "traces"
    rc = main(["traces", "fetch", "weka_dev_120", "--dest", str(dest), "--source-url", url])
    assert rc == 0
    printed = capsys.readouterr().out.split()
    archive = dest / "weka_claude_code" / "weka_dev_120.tar.xz"
    assert printed == [str(archive), str(dest / "weka_claude_code" / "example_trace_0277_with_subagents.json")]
    with tarfile.open(archive) as tf:
        got = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}
    assert got == {f"traces/{n}": d for n, d in small_catalogue.items()}
    assert (dest / "weka_claude_code" / "SOURCE_COMMIT.txt").read_text().strip() == cat.WEKA[1]
    assert not list(dest.rglob("*.part"))
    # again: everything verified in place, nothing downloaded (the mirror is emptied first)
    for f in (tmp_path / "mirror").rglob("*.json"):
        f.unlink()
    assert fetch(["weka_dev_120"], dest, url)[0] == archive


def test_a_wrong_byte_is_refused_and_nothing_stored_is_lost(tmp_path, mirror, small_catalogue):
    root, url = mirror
    dest = tmp_path / "traces"
    fetch(["weka_dev_120"], dest, url)
    before = (dest / "weka_claude_code" / "weka_dev_120.tar.xz").read_bytes()
    _publish(root, cat.WEKA, "traces/trace_0001.json", b'{"id": "1", "requests": [1]}')  # the source changed
    (dest / "weka_claude_code" / "weka_dev_120.tar.xz").write_bytes(before[:100])  # and the local copy is damaged
    with pytest.raises(FetchError, match=r"traces/trace_0001\.json: http://127\.0\.0\.1:\d+/.*SHA-256 .* expected"):
        fetch(["weka_dev_120"], dest, url)
    assert (dest / "weka_claude_code" / "weka_dev_120.tar.xz").read_bytes() == before[:100]  # not replaced
    assert not list(dest.rglob("*.part"))


def test_no_source_is_one_line_naming_the_url(tmp_path, small_catalogue, monkeypatch, capsys):
    monkeypatch.setattr("time.sleep", lambda s: None)
    rc = main(["traces", "fetch", "weka_dev_120", "--dest", str(tmp_path), "--source-url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("kvtier traces: error: weka_claude_code/weka_dev_120.tar.xz: "
                                          "traces/trace_0000.json: http://127.0.0.1:9/"), err
    assert "after 3 tries" in err[-1]


def test_unknown_name_is_refused_with_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["traces", "fetch", "weka_dev_999"])
    assert exc.value.code == 2 and "weka_dev_120" in capsys.readouterr().err


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces is not beside this checkout")
def test_the_catalogue_is_the_shared_traces() -> None:
    """Every hash recorded is the shared file's (which were compared with the public repositories' blobs)."""
    for local, (_, _, sha, size) in cat.FILES.items():
        data = (SHARED / local).read_bytes()
        assert (_sha(data), len(data)) == (sha, size), local
    with tarfile.open(SHARED / "weka_claude_code" / "weka_dev_120.tar.xz") as tf:
        got = {m.name.rsplit("/", 1)[-1]: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}
    assert {n: (_sha(d), len(d)) for n, d in got.items()} == cat.WEKA_DEV_120
    for name, s in SETS.items():
        folder = s.files[0].split("/", 1)[0]
        assert (SHARED / folder / "SOURCE_COMMIT.txt").read_text().strip() == s.source[1], name


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces is not beside this checkout")
def test_a_fetched_mooncake_trace_is_the_shared_one(tmp_path, mirror) -> None:
    """The real catalogue, end to end, on the real 3 MB Mooncake trace."""
    root, url = mirror
    for local in SETS["mooncake_fast25"].files:
        source, remote, _, _ = cat.FILES[local]
        _publish(root, source, remote, (SHARED / local).read_bytes())
    (path,) = fetch(["mooncake_fast25"], tmp_path, url)
    assert path.read_bytes() == (SHARED / "mooncake_fast25" / "conversation_trace.jsonl").read_bytes()


def test_a_missing_public_trace_says_how_to_fetch_it(tmp_path, capsys) -> None:
    missing = tmp_path / "elsewhere" / "weka_claude_code" / "weka_dev_120.tar.xz"
    assert main(["replay", "--trace", str(missing), "--split", "eval"]) == 2
    err = capsys.readouterr().err
    assert f"kvtier traces fetch weka_dev_120 --dest {tmp_path / 'elsewhere'}" in err, err
    assert main(["replay", "--trace", str(tmp_path / "mine.json")]) == 2  # not a public one: no hint
    assert "traces fetch" not in capsys.readouterr().err
