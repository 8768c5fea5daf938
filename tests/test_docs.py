"""Docs as tests: every ``kvtier ...`` command the README, a page under ``docs/``
or any ``--help`` shows parses with the real parser and names real policies; the
README's SDK snippet runs (against no server), the store snippet compiles and its
config file validates. A renamed flag or a stale example fails here; so does a
README over 300 lines (issue 43: the rest lives under ``docs/``)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {"README.md": README, "integrations/vllm_ascend/README.md":
        (ROOT / "integrations" / "vllm_ascend" / "README.md").read_text(),
        **{f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}}
TIERS_DOC = DOCS["docs/tiers.md"]


def _help_texts() -> str:
    """Every description and flag help of every command, unwrapped (as written)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    texts = []
    for p in [parser, *sub.choices.values()]:
        texts += [p.description or "", p.epilog or ""]
        texts += [a.help or "" for a in p._actions]
    return "\n".join(texts)


def _commands(text: str) -> list[str]:
    """``kvtier <command> ...`` lines of bash blocks and backticked spans."""
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang in ("bash", "sh", ""):
            for line in body.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith(".venv/bin/kvtier "):
                    line = line[len(".venv/bin/"):]
                if line.startswith("kvtier "):
                    found.append(line.split(" && ")[0].split(" | ")[0])
    found += [c for c in re.findall(r"`(kvtier (?:replay|serve|bench|inspect|route)[^`]*)`", text)
              if "..." not in c and "DIR" not in c.split()[2:3]]
    return sorted(set(found))


DOC_COMMANDS = sorted({(name, c) for name, text in [*DOCS.items(), ("--help", _help_texts())]
                       for c in _commands(text)})


def test_the_docs_show_commands() -> None:
    assert len(DOC_COMMANDS) >= 10, DOC_COMMANDS


@pytest.mark.parametrize("where,command", DOC_COMMANDS)
def test_every_documented_command_parses(where: str, command: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # --json / --plot paths are relative to the checkout (their directory must exist)
    argv = shlex.split(command)[1:]
    if argv[0] == "inspect":
        argv = ["inspect", str(tmp_path)]  # a placeholder directory
    if "--help" in argv:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(argv)
        assert done.value.code == 0
        return
    args = build_parser().parse_args(argv)
    if args.command == "replay":
        from kvtier.placement import make_placement
        from kvtier.placement.surface import surface
        from kvtier.replay.admission import admission_order

        for name in args.policies.split(","):
            if name:
                make_placement(name)
        admission_order(args.admission)
        surface(args.surface)


def test_the_readme_sdk_snippet_runs_with_no_server() -> None:
    """The quickstart's SDK lines, with nothing listening at the hint server's address: they must not raise,
    and the request they send carries the session and agent ids (``client`` records it: no engine here;
    examples/agent_to_engine.py runs the same against one)."""
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if 'HintClient("127.0.0.1:50071")' in b]
    code = ("import types\nsent = []\ndef run_tool():\n    pass\n"
            "client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=types.SimpleNamespace(\n"
            "    create=lambda *a, **kw: sent.append(kw))))\n"
            + snippet.replace("127.0.0.1:50071", "127.0.0.1:1")  # nothing listens
            + "params = sent[0]['extra_body']['kv_transfer_params']\n"
              "assert params['kvtier_session_id'] == 's1' and params['kvtier_agent_id'].startswith('coder'), params\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_the_store_snippet_compiles_and_its_config_validates(tmp_path) -> None:
    from kvtier.config import load_config

    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", TIERS_DOC, re.S) if "TieredStore" in b]
    compile(snippet, "docs/tiers.md", "exec")
    (yaml_block,) = re.findall(r"```yaml\n(.*?)```", TIERS_DOC, re.S)
    path = tmp_path / "kvtier.yaml"
    path.write_text(textwrap.dedent(yaml_block).replace("/mnt/nvme/kvtier", str(tmp_path / "ssd")))
    load_config(str(path), env={})


def test_the_readme_is_a_guide_of_at_most_300_lines_linking_pages_that_exist() -> None:
    assert README.count("\n") <= 300, f"README.md has {README.count(chr(10))} lines: move detail to docs/"
    links = re.findall(r"\]\(((?:docs|integrations|examples|deploy)/[^)#]+)", README)
    assert len(links) >= 8 and all((ROOT / link).is_file() for link in links), links


@pytest.mark.parametrize("page", sorted(DOCS))
def test_relative_links_of_every_page_resolve(page: str) -> None:
    base = (ROOT / page).parent
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", DOCS[page]):
        assert (base / target).exists(), f"{page}: link to {target} leads nowhere"
