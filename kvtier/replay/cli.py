"""``kvtier replay``: arguments and the command (wiring only; the work is in ``run``/``report``).

Owns: the replay flags, turning them into a :class:`~kvtier.replay.run.ReplaySpec`,
progress on stderr, the terminal table, ``--json`` and ``--plot``. Must not
simulate or compute metrics itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


DESCRIPTION = """\
Replay agent traces closed-loop against a modelled engine and compare KV-cache
placement policies on TTFT, interactivity, throughput per chip and prefill work.
With no --trace, replays the embedded workload: deterministic AgentX-shaped
coding-agent sessions (see kvtier.replay.generator) over four HBM capacities;
--workload apps replays generated TokenCake-style applications. Policies: lru
(vLLM prefix caching, HBM only), lru-dram (LMCache-style write-through to
DRAM/SSD), arc, s3fifo, ttl (Continuum), minwaste (InferCept), tokencake
(TokenCake), kvflow (KVFlow), kvtier (agent-aware: DRAM exclusive of HBM,
every tier ordered by predicted next use, critical-path reserve, tool-wait
prefetch, dead-KV retirement; ablations kvtier-space-only, kvtier-time-only,
kvtier-inclusive, kvtier-lru-order, kvtier-no-dead), belady-hbm (offline
optimum of HBM eviction, HBM only).

Every result is judged against two references computed in the same run on the
same requests: the floor (an unbounded cache) and the bound (Belady over HBM +
DRAM + SSD as one tier: no placement over those tiers computes less; exact at
conc 1 for sessions without parallel agents, else an estimate). Every policy is
offered the same tiers and capacities; the "tiers used" column says which it
uses. Admission order (--admission) is the engine scheduler's, applied alike
to every policy. A request larger than HBM stops the run (rc 2) unless
--skip-oversized.

--engines N (with --routing, --remote-blocks, --remote-gbps) replays a fleet
of N modelled engines sharing the sessions, optionally with a remote tier
they share, to size a fleet: MODELLED figures per policy (prefill computed,
TTFT, bytes on the remote links); no floor/bound references there.

--cold-codec NAME --codec-profile FILE.json stores the cold tiers (host DRAM
and SSD; HBM stays exact) with a KV codec as kvtier bench codecs measured
it: the same DRAM/SSD bytes hold ratio x more blocks, their links carry
compressed bytes, and the codec's CPU time (encode once per block written
down, decode per block loaded) is modelled as more stages of each transfer
(see kvtier.replay.codec). The report states the codec, its ratio and the
blocks each tier holds.
"""


DEFAULT_HBM_SCALES = (0.6, 0.8, 1.0, 1.5)  # embedded workload, no capacity given: fractions of the profile's HBM


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cliargs import (
        listed,
        nonnegative_float,
        nonnegative_int,
        positive_float,
        positive_int,
        writable_file,
    )
    from ..placement.surface import surfaces_help
    from .profiles import HARDWARE, MODELS
    from .run import DEFAULT_POLICIES
    from .sim import SCHEDULERS, TOOL_WAITS

    p.add_argument("--trace", metavar="PATH",
                   help="AgentX/Weka JSON, Mooncake JSONL, or a directory or tarball of them "
                        "(default: the embedded workload)")
    p.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed traces instead of failing")
    p.add_argument("--shared-prefix", choices=("none", "declared"), default=None,
                   help="none: each trace's block ids are its own (hash_id_scope local, as aiperf replays it); "
                        "declared: the tools + system prefix traces declare (tool_tokens, system_tokens) is "
                        "shared across sessions that declare the same sizes (default: none for --trace, "
                        "declared for the embedded workload)")
    p.add_argument("--sessions", type=positive_int, metavar="N",
                   help="embedded workload: number of sessions (default 30); traces: replay only the first N")
    p.add_argument("--config", metavar="FILE",
                   help="a kvtier config file (e.g. one kvtier tune wrote): its placement section (policy and "
                        "constants) is replayed as the policy named 'config', added to --policies")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated policies to compare (default: {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--profile", default=None, metavar="HW:MODEL[:CHIPS]",
                   help="hardware and model profile, e.g. h100-80gb:llama-3.1-8b (the default), "
                        "b200:llama-3.1-70b:4, ascend-910c:deepseek-r1 (MLA: a 576-wide latent per layer, no "
                        "heads), h100-80gb:gemma-3-27b (sliding-window hybrid: 52 of 62 layers see only the last "
                        "1024 tokens, so a block keeps their KV only within a window before a reuse point; the "
                        "report's sliding_window gives that share and the block bytes with and without it). "
                        f"Hardware: {', '.join(HARDWARE)}; models: {', '.join(MODELS)}")
    p.add_argument("--profile-file", metavar="YAML", help="override profile fields from a YAML file")
    p.add_argument("--block-size", type=positive_int, metavar="TOKENS",
                   help="engine block size: re-block the trace (merge exactly, split with derived ids)")
    p.add_argument("--conc", type=positive_int, default=8, help="live session trees (closed loop; default 8)")
    p.add_argument("--sweep-conc", type=listed(positive_int), metavar="1,2,4,...", help="replay every listed conc")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--hbm-blocks", type=listed(positive_int), metavar="N[,N...]",
                     help="HBM KV capacity in blocks (default: what the profile's HBM holds after weights; "
                          "the embedded workload with no capacity given: 0.6, 0.8, 1.0 and 1.5 of that)")
    cap.add_argument("--hbm-fraction", type=listed(positive_float), metavar="F[,F...]",
                     help="HBM capacity as a fraction of the working set: conc sessions of mean footprint live at once, "
                          "capped by the distinct blocks (several: capacity sweep)")
    p.add_argument("--dram-blocks", type=nonnegative_int,
                   help="DRAM tier capacity in blocks (default 2x HBM; raw blocks: with --cold-codec, a byte budget "
                        "that holds ratio x as many)")
    p.add_argument("--ssd-blocks", type=nonnegative_int, default=0,
                   help="SSD tier capacity in blocks (default 0: off; raw blocks, as --dram-blocks)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the embedded workload (default 0)")
    p.add_argument("--warmup", type=nonnegative_float, default=0.0, metavar="S",
                   help="exclude requests ready before S simulated seconds from the figures")
    p.add_argument("--gap-cap", type=nonnegative_float, metavar="S", help="cap tool/user gaps at S seconds (AgentX uses 10)")
    p.add_argument("--time-scale", type=positive_float, default=1.0, metavar="X",
                   help="open-loop traces (Mooncake): multiply arrival times by X (0.5 = twice the rate)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=8192, help="token budget per engine step (default 8192)")
    p.add_argument("--slo-ttft-p99", type=positive_float, metavar="S",
                   help="SLO capacity search: the largest conc (doubling, then bisecting) at which the later-turn "
                        "TTFT p99 is at most S seconds, per policy, at the first HBM capacity")
    p.add_argument("--slo-interactivity", type=positive_float, metavar="TOK_S",
                   help="SLO capacity search: p50 interactivity floor (tokens/s/user)")
    p.add_argument("--skip-oversized", action="store_true",
                   help="skip (and count) requests that need more HBM than given, alike for every policy, the floor "
                        "and the bound (default: refuse to run, naming the largest and the capacity it needs)")
    p.add_argument("--admission", default="fcfs", metavar="ORDER",
                   help="engine admission order, alike for every policy: fcfs (default, vLLM's), critical-first "
                        "(TokenCake's), oldest-app (oldest session first, critical agents ahead)")
    p.add_argument("--surface", default="full", metavar="NAME",
                   help="what the engine lets placement do: " + surfaces_help())
    p.add_argument("--agent-ends", default="reported", choices=["reported", "unknown"],
                   help="whether the policy learns when an agent is done: reported (default; live, the SDK's agent "
                        "ends through a hint server) or unknown (hints in kv_transfer_params only, or from the "
                        "request-stream middleware, which reports no ends: a turn without a tool call, a user's "
                        "turn or the agent's last, is a turn_end wait of TURN_END_GAP_S, as the live connector then "
                        "has it; the references do not depend on it)")
    p.add_argument("--tool-waits", default="predicted", choices=list(TOOL_WAITS),
                   help="what a policy is told of a tool wait: predicted (default: the hint plane's prediction "
                        "from the waits seen so far, per agent type as the SDK names it, then per tool), "
                        "predicted-stream (the chain of hints derived from the request stream, which name no agent "
                        "type: per session and tool, then per tool, then over all tools) or announced (its true "
                        "length, as an agent that announces exactly how long its tool takes: an oracle, to measure "
                        "what prediction error costs)")
    p.add_argument("--scheduler", default="plain", choices=list(SCHEDULERS),
                   help="how the engine admits requests each step: plain (default: up to the running limit, "
                        "whatever the step's token budget; a block is a prefix hit once computed) or vllm (vLLM "
                        "0.32's scheduler: admitted only while the step has tokens left, a block scheduled "
                        "earlier in the step is a prefix hit, as vLLM caches a block when it allocates it, and a "
                        "request loading from DRAM or SSD takes no running slot until its load is done)")
    p.add_argument("--split", default="all", choices=["all", "tune", "eval"],
                   help="traces: replay the tuning half (1st, 3rd, ... session by sorted id), the evaluation half "
                        "(2nd, 4th, ...) or all (default)")
    p.add_argument("--no-references", action="store_true",
                   help="skip the floor and bound runs (faster; no computed/bound figures)")
    p.add_argument("--jobs", type=positive_int, metavar="N",
                   help="replay points in N worker processes (default: the CPUs this process may use, at most 8)")
    p.add_argument("--full", action="store_true", help="print the full table of every figure after the summary")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH.png", type=writable_file,
                   help="write a PNG: prefill computed / bound and later-turn TTFT p99 per policy over the swept "
                        "HBM capacity or conc (bars when nothing is swept)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_codec_arguments(p)
    add_fleet_arguments(p)
    add_rounds_arguments(p)


def add_codec_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of compressed cold tiers (kvtier.replay.codec)."""
    from ..cliargs import positive_int
    from .codec import TIER_CHOICES

    c = p.add_argument_group("compressed cold tiers (kvtier.replay.codec)")
    c.add_argument("--cold-codec", metavar="NAME",
                   help="KV codec of the cold tiers (host DRAM and SSD; HBM stays exact), as --codec-profile "
                        "measured it: e.g. rq4, rq3 (lossy: rotation + 4/3-bit quantization), zstd, bplane-zstd "
                        "(lossless), raw (stored as is: the same results as without this flag). --dram-blocks and "
                        "--ssd-blocks stay byte budgets in raw blocks: a compressed tier holds floor(capacity x "
                        "ratio) blocks; its links carry raw bytes / ratio; each block written down from HBM is "
                        "encoded once (a compressed DRAM copy goes on to the SSD as is), each loaded to HBM is "
                        "decoded; encode and decode are FIFO stages of the transfer at the profile's GB/s per core "
                        "x --codec-cores, and the policies' load-or-recompute estimates include them. Needs "
                        "--codec-profile")
    c.add_argument("--codec-profile", metavar="FILE.json",
                   help="the codec profile that kvtier bench codecs writes (its --json FILE.json; e.g. "
                        "bench/out/codecs.json): {\"codecs\": [{\"codec\", \"ratio\" (raw bytes / stored bytes), "
                        "\"encode_gbps\", \"decode_gbps\" (GB/s of raw bytes per CPU core)}, ...]}; needs --cold-codec")
    c.add_argument("--cold-codec-tiers", choices=tuple(TIER_CHOICES), default=None,
                   help="which cold tiers --cold-codec compresses: dram,ssd (default) or ssd (DRAM holds raw "
                        "blocks: an SSD block is decoded into DRAM when staged there, encoded on its way to the SSD)")
    c.add_argument("--codec-cores", type=positive_int, default=None, metavar="N",
                   help="CPU cores encoding, and N more decoding, the cold tiers' blocks (default 1: the profile's "
                        "per-core GB/s as measured)")


def cold_codec_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~kvtier.replay.codec.ColdCodec` the codec flags ask for (``None``: none
    given); :class:`~kvtier.errors.ConfigError` naming the flag, file or field at fault."""
    from ..errors import ConfigError
    from .codec import TIER_CHOICES, cold_codec

    name, path = getattr(args, "cold_codec", None), getattr(args, "codec_profile", None)
    tiers, cores = getattr(args, "cold_codec_tiers", None), getattr(args, "codec_cores", None)
    if name is None:
        for flag, value in (("--codec-profile", path), ("--cold-codec-tiers", tiers), ("--codec-cores", cores)):
            if value is not None:
                raise ConfigError(flag, value, "configures the cold tiers' codec: give --cold-codec NAME as well")
        return None
    if not name:
        raise ConfigError("--cold-codec", name, "must name a codec of the --codec-profile (e.g. rq4)")
    if path is None:
        raise ConfigError("--cold-codec", name, "needs --codec-profile FILE.json (the codec profile "
                                                "`kvtier bench codecs --json FILE.json` writes)")
    return cold_codec(name, path, TIER_CHOICES[tiers or "dram,ssd"], cores or 1)


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of a fleet of engines (kvtier.replay.fleet): results are MODELLED, for sizing a fleet."""
    from ..cliargs import nonnegative_int, positive_float, positive_int
    from .fleet import DEFAULT_REMOTE_GBPS, ROUTINGS

    f = p.add_argument_group("a fleet of engines (kvtier.replay.fleet; every figure is modelled)")
    f.add_argument("--engines", type=positive_int, default=1, metavar="N",
                   help="engines serving the sessions (default 1: one engine, as without this flag); HBM, DRAM and "
                        "SSD flags are per engine (--hbm-fraction: of one engine's share, conc/N sessions), --conc "
                        "counts the live sessions of the whole fleet; with N > 1 or a remote tier no floor/bound "
                        "references are run, and belady-hbm is left out of the default --policies")
    f.add_argument("--routing", choices=ROUTINGS, default="round-robin",
                   help="which engine a ready request goes to: round-robin (the next engine in turn, per request; "
                        "default), session (sticky: every request of a session to the engine of its first, sessions "
                        "assigned round-robin), kv-aware (the engine the live router, kvtier.routing, would pick: "
                        "over the longest prefix it can read, each block weighs its fastest tier's weight, HBM 1.0, "
                        "DRAM 0.8, SSD 0.5, remote tier 0.3; ties: least running+waiting requests, then lowest "
                        "index)")
    f.add_argument("--remote-blocks", type=nonnegative_int, default=0, metavar="B",
                   help="capacity in blocks of a remote tier shared by all engines (LRU; default 0: none): every "
                        "computed block is written through to it, and a request's blocks missing from its engine "
                        "but held there are loaded instead of recomputed")
    f.add_argument("--remote-gbps", type=positive_float, default=DEFAULT_REMOTE_GBPS, metavar="GB_S",
                   help=f"bandwidth of each engine's link to the remote tier, GB/s each way (default "
                        f"{DEFAULT_REMOTE_GBPS:g}: an assumed 100 Gb/s NIC per engine; transfer time = bytes / "
                        "bandwidth, no latency term)")


def add_rounds_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``--workload rounds`` (all-gather rounds; see kvtier.replay.rounds)."""
    import textwrap

    from ..cliargs import nonnegative_int, positive_float, positive_int
    from .rounds import DEFAULT_SLO_ROUND_S, DIFF_MEASURED, ROUND_LATENCIES, ROUND_POLICIES, RoundsWorkload

    d = RoundsWorkload()
    strategies = [
        "A per-round cost model over the profile: the largest number of agents whose slowest round meets "
        "--round-slo-ms, per KV strategy (default: all of " + ", ".join(ROUND_POLICIES) + "; --policies picks "
        "some). Overflow beyond HBM is swapped through host DRAM for every strategy but lru.",
        "lru: vLLM prefix caching; each agent receives the others' outputs in its own order after its private "
        "history, so it prefills them all; what HBM cannot hold is recomputed.",
        "lru-dram: the same, the overflow swapped through host DRAM.",
        "layout: exact sharing through the SDK's round-aware prompt layout (kvtier.sdk.rounds.RoundLayout: the "
        "shared outputs first, in agent-id order, then each agent's private part). A round's new shared tokens "
        "are prefilled once for all agents, but every agent's private part follows a longer prefix each round "
        "and is recomputed: with a long private history the layout can lose to lru.",
        "diff: prompts as lru's; each received segment stored as master + lossless diff at "
        f"{DIFF_MEASURED['diff_over_raw']:.3f} of its raw bytes (measured: {DIFF_MEASURED['source']}). Exact, so "
        "no recompute is saved.",
        "approx: APPROXIMATE reuse; each received segment served from its producer's KV re-rotated to the "
        "agent's offset (only observations prefilled). Its quality is measured on a live engine and reported "
        "with it.",
    ]
    g = p.add_argument_group("all-gather rounds (--workload rounds: kvtier.replay.rounds)",
                             "\n".join(textwrap.fill(t, 76, subsequent_indent="  " if i else "")
                                       for i, t in enumerate(strategies)))
    g.add_argument("--workload", choices=["traces", "apps", "rounds"], default="traces",
                   help="traces: agent traces / the embedded workload (default); apps: generated TokenCake-style "
                        "applications (agent DAGs with tool calls, Poisson arrivals; see --app, --rate); rounds: "
                        "generated all-gather rounds, SLO capacity search over the number of agents")
    a = p.add_argument_group("applications (--workload apps: kvtier.replay.appgen)")
    a.add_argument("--app", choices=["code-writer", "deep-research", "mixed"], default="code-writer",
                   help="application shape (default code-writer)")
    a.add_argument("--rate", type=positive_float, default=0.5, metavar="APPS_PER_S",
                   help="Poisson arrival rate of applications (default 0.5)")
    a.add_argument("--apps", type=positive_int, default=40, metavar="N", help="applications to replay (default 40)")
    g.add_argument("--round-slo-ms", type=positive_float, default=DEFAULT_SLO_ROUND_S * 1e3,
                   help=f"round latency SLO in ms (default {DEFAULT_SLO_ROUND_S * 1e3:.0f})")
    g.add_argument("--round-latency", choices=list(ROUND_LATENCIES), default="full",
                   help="full: prefill + every output token of the round (default); ttft: until every agent "
                        "has its first output token")
    g.add_argument("--rounds", type=positive_int, default=d.num_rounds, help=f"rounds per run (default {d.num_rounds})")
    g.add_argument("--private-tokens", type=nonnegative_int, default=d.private_tokens,
                   help=f"private history per agent (default {d.private_tokens})")
    g.add_argument("--observe-tokens", type=nonnegative_int, default=d.observe_tokens,
                   help=f"new private input per agent per round (default {d.observe_tokens})")
    g.add_argument("--output-tokens", type=positive_int, default=d.output_tokens,
                   help=f"output per agent per round, the shared segment (default {d.output_tokens})")


def build_spec(args: argparse.Namespace, progress=None) -> Any:
    """The replay the arguments describe, every flag checked (a ``ConfigError`` names the first
    one wrong) before any replay runs."""
    from .profiles import DEFAULT_PROFILE, load_profile_overrides, parse_profile
    from .run import ReplaySpec, default_jobs

    profile = parse_profile(args.profile or DEFAULT_PROFILE)
    if args.profile_file:
        profile = load_profile_overrides(args.profile_file, base=profile)
    workload, trace_name, extra = _workload_from_args(args, progress)
    policies, config_policy, config_params = _policies_from_args(args)
    policies, codec, fleet = _check_settings(args, workload, policies)
    hbm_blocks = args.hbm_blocks
    if not (args.trace or hbm_blocks or args.hbm_fraction or getattr(args, "workload", "traces") == "apps"):
        # the embedded workload: a capacity sweep around what the profile's HBM holds
        full = profile.fitted_to(workload).hbm_kv_capacity_blocks(workload.block_size)
        hbm_blocks = tuple(max(1, int(full * f)) for f in DEFAULT_HBM_SCALES)
    return ReplaySpec(
        workload=workload, profile=profile, policies=policies,
        concs=args.sweep_conc or (args.conc,),
        hbm_blocks=hbm_blocks, hbm_fractions=args.hbm_fraction,
        dram_blocks=args.dram_blocks, ssd_blocks=args.ssd_blocks, seed=args.seed,
        warmup_s=args.warmup, gap_cap_s=args.gap_cap, max_batch_tokens=args.max_batch_tokens,
        time_scale=args.time_scale,
        trace_name=trace_name, extra=extra,
        skip_oversized=args.skip_oversized, admission=args.admission, surface=args.surface,
        agent_ends=args.agent_ends == "reported", tool_waits=args.tool_waits, scheduler=args.scheduler,
        references=not args.no_references and not fleet,
        jobs=args.jobs or default_jobs(),
        slo_ttft_p99_s=args.slo_ttft_p99, slo_interactivity=args.slo_interactivity,
        config_policy=config_policy, config_params=config_params,
        engines=args.engines, routing=args.routing, remote_blocks=args.remote_blocks, remote_gbps=args.remote_gbps,
        cold_codec=codec,
    )


def _workload_from_args(args: argparse.Namespace, progress) -> tuple[Any, str, dict[str, Any]]:
    """The workload to replay (generated apps, trace files, or the embedded one), split,
    cut and re-blocked as asked; its name; extra report fields. Refuses an empty one."""
    from ..errors import ConfigError
    from .readers import load_trace_with_report

    extra: dict[str, Any] = {}
    if getattr(args, "workload", "traces") == "apps":
        from .appgen import AppGenConfig, app_workload

        workload = app_workload(AppGenConfig(app=args.app, num_apps=args.apps, rate_per_s=args.rate, seed=args.seed))
        trace_name = f"apps({args.app}, {args.apps} apps at {args.rate}/s, seed={args.seed})"
    elif args.trace:
        workload, report = load_trace_with_report(args.trace, skip_bad=args.skip_bad,
                                                  shared_prefix=args.shared_prefix or "none")
        extra["skipped_traces"] = report.num_skipped
        if report.num_skipped and progress:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.skipped_by_kind().items()))
            progress(f"[replay] skipped {report.num_skipped} bad trace(s) ({kinds}):\n{report.describe_skipped()}")
        trace_name = str(args.trace)
    else:
        from .generator import default_workload

        workload = default_workload(seed=args.seed, num_sessions=args.sessions or 30,
                                    shared_prefix=args.shared_prefix or "declared")
        trace_name = f"embedded(seed={args.seed}, sessions={len(workload.sessions)})"
    if args.shared_prefix and getattr(args, "workload", "traces") != "apps":
        trace_name += f" (shared prefix: {args.shared_prefix})"
    if args.trace:
        from .run import split_workload

        workload = split_workload(workload, args.split)
        if args.split != "all":
            trace_name += f" ({args.split} half)"
    if args.trace and args.sessions:
        workload = replace(workload, sessions=workload.sessions[: args.sessions])
    if args.block_size and args.block_size != workload.block_size:
        a, b = sorted((args.block_size, workload.block_size))
        if b % a:
            raise ConfigError("--block-size", args.block_size,
                              f"the workload has blocks of {workload.block_size} tokens; re-blocking needs one "
                              "to be a multiple of the other")
        workload = workload.reblock(args.block_size)
    if not workload.num_requests():
        where = f"trace {args.trace!r}" if args.trace else "the workload"
        skipped = extra.get("skipped_traces")
        raise ConfigError("--trace" if args.trace else "--sessions", args.trace or args.sessions,
                          f"{where} holds no requests" + (f" ({skipped} trace file(s) skipped as bad)" if skipped
                                                          else "") + ": nothing to replay")
    return workload, trace_name, extra


def _policies_from_args(args: argparse.Namespace) -> tuple[tuple[str, ...], str | None, dict[str, float]]:
    """``--policies`` (each name checked), with ``config`` (a config file's policy and its
    constants) added where ``--config`` gives one."""
    from ..errors import ConfigError
    from ..placement import make_placement
    from .run import CONFIG

    policies = tuple(p for p in args.policies.split(",") if p)
    config_policy, config_params = None, {}
    if getattr(args, "config", None):
        from ..config import load_config

        placement = load_config(args.config, env={}).placement
        config_policy, config_params = placement.policy, placement.params()
        if CONFIG not in policies:
            policies = (*policies, CONFIG)
    elif CONFIG in policies:
        raise ConfigError("--policies", args.policies, "'config' replays a config file's policy: give --config FILE")
    for name in policies:
        if name != CONFIG:
            make_placement(name)  # unknown names fail before any work
    return policies, config_policy, config_params


def _check_settings(args: argparse.Namespace, workload: Any,
                    policies: tuple[str, ...]) -> tuple[tuple[str, ...], Any, bool]:
    """Admission, surface, cold codec and fleet flags checked together: the policies (a fleet
    refuses some), the cold codec, and whether this is a fleet replay."""
    from ..errors import ConfigError
    from ..placement.surface import surface
    from .admission import admission_order
    from .fleet import DEFAULT_REMOTE_GBPS

    admission_order(args.admission)
    surface(args.surface)
    codec = cold_codec_from_args(args)
    if codec is not None and codec.tiers == ("ssd",) and not args.ssd_blocks:
        raise ConfigError("--cold-codec-tiers", "ssd", "compresses the SSD only, and there is none: give "
                                                       "--ssd-blocks B > 0")
    fleet = args.engines > 1 or args.remote_blocks > 0
    if args.routing != "round-robin" and args.engines == 1:
        raise ConfigError("--routing", args.routing, "routes requests over a fleet: give --engines N > 1 as well")
    if args.remote_gbps != DEFAULT_REMOTE_GBPS and not args.remote_blocks:
        raise ConfigError("--remote-gbps", args.remote_gbps,
                          "is the link to a remote tier: give --remote-blocks B > 0 as well")
    if fleet:
        policies = _check_fleet(args, policies, workload)
    if args.split != "all" and not args.trace:
        raise ConfigError("--split", args.split, "splits a trace set; give --trace (the embedded workload is not split)")
    return policies, codec, fleet


def _check_fleet(args: argparse.Namespace, policies: tuple[str, ...], workload: Any) -> tuple[str, ...]:
    """Refuse what a fleet replay does not model, naming the flag; returns the
    policies to run (the default list without the offline ones, belady-hbm)."""
    from ..errors import ConfigError
    from ..placement import make_placement
    from .run import CONFIG

    flag = "--engines" if args.engines > 1 else "--remote-blocks"
    value = args.engines if args.engines > 1 else args.remote_blocks
    if getattr(args, "workload", "traces") != "traces":
        raise ConfigError(flag, value, f"a fleet replays --workload traces only, not {args.workload}")
    if workload.open_loop:
        raise ConfigError(flag, value, "a fleet replays closed-loop agent sessions only, not an open-loop trace")
    if args.slo_ttft_p99 is not None or args.slo_interactivity is not None:
        raise ConfigError(flag, value, "the SLO capacity search (--slo-ttft-p99, --slo-interactivity) runs on one "
                                       "engine; give --engines 1 and no --remote-blocks, or no SLO flags")
    oracle = [name for name in policies if name != CONFIG and make_placement(name).needs_oracle]
    if oracle and args.policies == _default_policies():
        return tuple(name for name in policies if name not in oracle)
    if oracle:
        raise ConfigError("--policies", ",".join(policies),
                          f"{', '.join(oracle)} need(s) one engine's recorded future; a fleet replay "
                          f"({flag} {value}) cannot run it: leave it out of --policies")
    return policies


class ProgressBar:
    """Runs done of total, with the rate and an ETA, as tqdm's bar on stderr: one
    rewritten line on a terminal; on a pipe or file, a line at most every 30 s."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None

    def __call__(self, done: int, total: int, elapsed_s: float) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="[replay]", unit="run", file=sys.stderr, dynamic_ncols=True,
                             mininterval=0.5 if sys.stderr.isatty() else 30.0)
            self._bar.start_t -= elapsed_s  # the runs started before the first one finished
        self._bar.update(done - self._bar.n)
        if done >= total:
            self._bar.close()


def command(args: argparse.Namespace) -> int:
    from ..errors import KVTierError
    from .report import format_summary, format_table, plot
    from .run import OversizedRequestsError, check_capacity, report_header, run_replay, slo_capacities

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    if getattr(args, "workload", "traces") == "rounds":
        if args.cold_codec is not None:
            print(f"kvtier replay: error: --cold-codec={args.cold_codec!r}: --workload rounds models no cold tiers",
                  file=sys.stderr)
            return 2
        if args.engines > 1 or args.remote_blocks > 0:
            print(f"kvtier replay: error: {'--engines' if args.engines > 1 else '--remote-blocks'}: a fleet replays "
                  "--workload traces only, not rounds", file=sys.stderr)
            return 2
        return _command_rounds(args, progress)
    try:
        spec = build_spec(args, progress)
    except (KVTierError, FileNotFoundError) as e:  # a bad flag or trace: the message names it, no traceback
        print(f"kvtier replay: error: {e}", file=sys.stderr)
        return 2
    w = spec.workload
    progress(f"[replay] {spec.trace_name}: {len(w.sessions)} sessions, {w.num_requests()} requests, "
             f"{w.num_distinct_blocks()} distinct blocks of {w.block_size} tokens; profile {spec.profile.spec}; "
             f"{spec.jobs} worker process(es)")
    m = spec.profile.model
    if m.num_sliding_layers:
        progress(f"[replay] {m.name}: {m.num_sliding_layers} of {m.num_layers} layers attend to the last "
                 f"{m.sliding_window_tokens} tokens; {spec.profile.window_share:.1%} of the blocks lie within a "
                 f"window before a reuse point: {spec.profile.kv_bytes_per_block(w.block_size) / 1e6:.2f} MB per "
                 f"block ({m.kv_bytes_per_token * w.block_size / 1e6:.2f} MB as full attention)")
    try:
        if args.slo_ttft_p99 is not None or args.slo_interactivity is not None:
            report = report_header(spec) | {"skipped": check_capacity(spec)}
            report["slo"] = slo_capacities(spec, spec.capacities()[0], on_point=ProgressBar(not args.quiet))
            print(f"SLO capacity at HBM {spec.capacities()[0]:,} blocks (largest conc with p99 TTFT of later "
                  f"turns <= {args.slo_ttft_p99} s and p50 interactivity >= {args.slo_interactivity} tok/s/user):")
            for row in report["slo"]:
                print(f"  {row['policy']:>10}: conc {row['max_conc']}")
            report["results"] = [pt for row in report["slo"] for pt in row["points"]]
            rows = report["results"]
        else:
            report = run_replay(spec, progress, on_point=ProgressBar(not args.quiet))
            rows = report["results"]
            print(format_summary(rows))
            distinct = w.num_distinct_blocks()
            roomy = sorted({r["hbm_blocks"] for r in rows if r["hbm_blocks"] >= distinct})
            if roomy:
                print(f"note: HBM of {', '.join(f'{c:,}' for c in roomy)} blocks holds every distinct block of the "
                      f"workload ({distinct:,}): no placement can differ there; give a smaller --hbm-blocks or "
                      "--hbm-fraction to compare policies")
    except OversizedRequestsError as e:
        print(f"kvtier replay: error: {e}", file=sys.stderr)
        return 2
    for cap, what in (report.get("skipped") or {}).items():
        print(f"skipped (--skip-oversized): {what['message']}")
    if args.full:
        print(format_table(rows))
    report["wall_s"] = time.perf_counter() - start
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float) + "\n")
        progress(f"[replay] wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, f"{spec.trace_name} on {spec.profile.spec}")
        progress(f"[replay] wrote {args.plot}")
    progress(f"[replay] finished in {report['wall_s']:.1f}s")
    return 0


def _command_rounds(args: argparse.Namespace, progress) -> int:
    """``--workload rounds``: SLO capacity of lru, lru-dram, layout, diff and approx; table, --json, --plot."""
    from .profiles import DEFAULT_PROFILE, load_profile_overrides, parse_profile
    from .rounds import ROUND_POLICIES, RoundsConfig, RoundsWorkload, format_rounds_table, plot_rounds, run_rounds

    profile = parse_profile(args.profile or DEFAULT_PROFILE)
    if args.profile_file:
        profile = load_profile_overrides(args.profile_file, base=profile)
    workload = RoundsWorkload(num_rounds=args.rounds, private_tokens=args.private_tokens,
                              observe_tokens=args.observe_tokens, output_tokens=args.output_tokens,
                              block_size=args.block_size or 16, seed=args.seed)
    if args.hbm_fraction or (args.hbm_blocks and len(args.hbm_blocks) > 1):
        from ..errors import ConfigError

        raise ConfigError("--hbm-fraction" if args.hbm_fraction else "--hbm-blocks",
                          args.hbm_fraction or args.hbm_blocks,
                          "--workload rounds takes one --hbm-blocks N (no --hbm-fraction): the rounds replay "
                          "searches the number of agents at one HBM capacity")
    config = RoundsConfig(slo_round_s=args.round_slo_ms / 1e3, max_batch_tokens=args.max_batch_tokens,
                          latency=args.round_latency, hbm_blocks=args.hbm_blocks[0] if args.hbm_blocks else None)
    policies = ROUND_POLICIES if args.policies == _default_policies() else tuple(
        x for x in args.policies.split(",") if x)
    report = run_rounds(workload, profile, policies, config, progress)
    print(format_rounds_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float) + "\n")
        progress(f"[replay rounds] wrote {args.json}")
    if args.plot:
        plot_rounds(report, args.plot)
        progress(f"[replay rounds] wrote {args.plot}")
    return 0


def _default_policies() -> str:
    from .run import DEFAULT_POLICIES

    return ",".join(DEFAULT_POLICIES)
