"""Public traces a stranger can fetch: ``kvtier traces list`` and ``kvtier traces fetch NAME``.

Owns: the named sets of public traces kvtier's docs and tests use, downloading each file
from its repository at the pinned commit (:mod:`.trace_catalogue`), verifying every byte
against the SHA-256 recorded there, and laying them out as ``../shared/traces`` is laid
out (``weka_claude_code/weka_dev_120.tar.xz`` and so on), so that a command in the docs
runs as written after ``kvtier traces fetch NAME --dest ../shared/traces``. A file already
in place is verified, not downloaded again.

Must not: parse traces (:mod:`.readers` does), run anything it downloads, or leave a
partial or unverified file where a finished one belongs: files are written beside their
destination and renamed into place only once every byte verified.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..errors import ConfigError, FetchError
from . import trace_catalogue as cat

DEFAULT_SOURCE = "https://raw.githubusercontent.com"
ARCHIVE = "weka_claude_code/weka_dev_120.tar.xz"


@dataclass(frozen=True)
class TraceSet:
    name: str
    what: str
    source: tuple[str, str]  # (repository, commit)
    files: tuple[str, ...]  # local paths under the traces directory (ARCHIVE: the 120 traces packed)


SETS: dict[str, TraceSet] = {s.name: s for s in (
    TraceSet("weka_dev_120", "120 Claude Code sessions, AgentX/Weka JSON (the dev traces: replay --split dev/eval)",
             cat.WEKA,
             (ARCHIVE, "weka_claude_code/example_trace_0277_with_subagents.json", "weka_claude_code/LICENSE")),
    TraceSet("mooncake_fast25", "Kimi production requests, Mooncake JSONL (FAST'25), open loop by timestamp", cat.MOONCAKE,
             ("mooncake_fast25/conversation_trace.jsonl", "mooncake_fast25/LICENSE-APACHE")),
    TraceSet("tracelab_example", "19 rounds with per-tool latencies (TraceLab format sample)", cat.TRACELAB,
             ("tracelab_example/round_trace.sanitized.jsonl", "tracelab_example/LICENSE-DATASET.md")),
)}


def missing_hint(path: str | Path) -> str:
    """For a trace path that does not exist: how to fetch it, where it is one of the catalogued files
    (its traces directory is what the path names before the catalogued part), else ``""``."""
    text = Path(path).as_posix()
    for s in SETS.values():
        for local in s.files:
            if text == local or text.endswith("/" + local):
                dest = text[: -len(local)].rstrip("/") or "."
                return f"; it is a public trace: kvtier traces fetch {s.name} --dest {dest}"
    return ""


def default_dest() -> Path:
    """``$XDG_CACHE_HOME/kvtier/traces`` (``~/.cache/kvtier/traces`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "traces"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _url(source: str, repo_commit: tuple[str, str], path: str) -> str:
    return f"{source.rstrip('/')}/{repo_commit[0]}/{repo_commit[1]}/{path}"


def _download(url: str, want_sha: str, size: int, what: str, retries: int = 3) -> bytes:
    """The bytes at ``url``, verified; retried on network errors (not on a wrong hash: that is the source's)."""
    for attempt in range(1, retries + 1):
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - https or a mirror the user names
                data = resp.read()
            break
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if attempt == retries:
                raise FetchError(f"{what}: {url}: {getattr(exc, 'reason', exc)} (after {retries} tries; "
                                 "--source-url names a mirror)") from None
            time.sleep(attempt)
    got = _sha(data)
    if got != want_sha:
        raise FetchError(f"{what}: {url}: SHA-256 {got} ({len(data):,} bytes), expected {want_sha} ({size:,} bytes): "
                         "not the published file; nothing was written")
    return data


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _archive_ok(path: Path) -> bool:
    """Every trace of the archive there, each with its recorded hash."""
    try:
        with tarfile.open(path) as tf:
            found = {m.name.rsplit("/", 1)[-1]: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}
    except (OSError, tarfile.TarError, EOFError):
        return False
    return found.keys() == cat.WEKA_DEV_120.keys() and all(
        _sha(found[n]) == h for n, (h, _) in cat.WEKA_DEV_120.items())


def _fetch_archive(path: Path, source: str, progress: Callable[[str], None]) -> None:
    buf = io.BytesIO()
    total = len(cat.WEKA_DEV_120)
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        d = tarfile.TarInfo("traces")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(d)
        for i, (name, (sha, size)) in enumerate(cat.WEKA_DEV_120.items(), 1):
            data = _download(_url(source, cat.WEKA, f"traces/{name}"), sha, size, f"{ARCHIVE}: traces/{name}")
            info = tarfile.TarInfo(f"traces/{name}")
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
            if i % 10 == 0 or i == total:
                progress(f"{ARCHIVE}: {i}/{total} traces downloaded and verified")
    _write(path, buf.getvalue())


def fetch(names: list[str], dest: Path, source: str = DEFAULT_SOURCE,
          progress: Callable[[str], None] = lambda s: None) -> list[Path]:
    """Fetch the named trace sets into ``dest``; returns the trace files (not licenses), each verified."""
    unknown = [n for n in names if n not in SETS]
    if unknown or not names:
        raise ConfigError("NAME", unknown[0] if unknown else "", f"must be one of {', '.join(SETS)}")
    out: list[Path] = []
    for name in names:
        for local in SETS[name].files:
            path = dest / local
            if local == ARCHIVE:
                if not _archive_ok(path):
                    _fetch_archive(path, source, progress)
                    progress(f"{path} written")
                else:
                    progress(f"{path}: already there, verified")
            else:
                repo, remote, sha, size = cat.FILES[local]
                if path.is_file() and _sha(path.read_bytes()) == sha:
                    progress(f"{path}: already there, verified")
                else:
                    _write(path, _download(_url(source, repo, remote), sha, size, local))
                    progress(f"{path} written")
            if "LICENSE" not in local:
                out.append(path)
        commit = SETS[name].source[1]
        marker = dest / SETS[name].files[0].split("/", 1)[0] / "SOURCE_COMMIT.txt"
        if not (marker.is_file() and marker.read_text().strip() == commit):
            _write(marker, (commit + "\n").encode())
    return out


def command(args, out: TextIO | None = None) -> int:  # noqa: ANN001 - argparse.Namespace
    """``kvtier traces list`` / ``kvtier traces fetch``."""
    out = out or sys.stdout
    if args.traces_command == "list":
        dest = Path(args.dest)
        for s in SETS.values():
            there = all((dest / f).is_file() for f in s.files)
            out.write(f"{s.name:<17} {'fetched' if there else 'not fetched':<12} {s.what}\n")
            for f in s.files:
                if "LICENSE" not in f:
                    out.write(f"{'':<17} {dest / f}\n")
        return 0
    paths = fetch(args.names, Path(args.dest), args.source_url,
                  progress=lambda s: print(f"[traces] {s}", file=sys.stderr, flush=True))
    for p in paths:
        out.write(f"{p}\n")
    return 0


def add_arguments(p) -> None:  # noqa: ANN001 - argparse.ArgumentParser
    sub = p.add_subparsers(dest="traces_command", required=True, metavar="{list,fetch}")
    dest_help = (f"traces directory (default {default_dest()}; give ../shared/traces to run the docs' "
                 "commands as written)")
    ls = sub.add_parser("list", help="the trace sets kvtier knows and whether they are in --dest",
                        description="List the public trace sets kvtier's docs use, where they would be and "
                                    "whether they are there.")
    ls.add_argument("--dest", default=str(default_dest()), help=dest_help)
    f = sub.add_parser("fetch", help="download trace sets from their public source and verify them",
                       description="Download each named trace set from its public repository at the commit "
                                   "kvtier pins, verify every file's SHA-256, and write it under --dest in the "
                                   "layout the docs use (weka_claude_code/weka_dev_120.tar.xz, ...). Files "
                                   "already there are verified, not downloaded again. Prints the trace paths.")
    f.add_argument("names", nargs="+", metavar="NAME", choices=list(SETS),
                   help=f"one or more of: {', '.join(SETS)}")
    f.add_argument("--dest", default=str(default_dest()), help=dest_help)
    f.add_argument("--source-url", default=DEFAULT_SOURCE,
                   help=f"where REPO/COMMIT/PATH are served (default {DEFAULT_SOURCE}; a mirror with that layout)")
