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
Every result is judged against a floor (an unbounded cache) and a bound (Belady
over HBM + DRAM + SSD as one tier). With no --trace, replays an embedded
coding-agent workload over four HBM capacities.
Full reference (policies, workloads, judging, fleets, codecs): docs/replay.md
"""

USAGE = "%(prog)s [-h] [--trace PATH] [--policies LIST] [options]"

DEFAULT_HBM_SCALES = (0.6, 0.8, 1.0, 1.5)  # embedded workload, no capacity given: fractions of the profile's HBM

# --surface additions, in a few words each (docs/replay.md and kvtier.placement.surface.ADDITIONS say it in full)
_SURFACE_ADDITIONS_SHORT = {
    "exclusive": "exclusive DRAM",
    "order": "policy's HBM order",
    "drop": "free idle HBM copies",
    "prefetch": "prefetch into HBM",
    "defer": "defer behind copies down",
    "requeue": "next-use order in vLLM's free queue",
}


def _surface_help() -> str:
    """``--surface`` in brief: the bases, then every addition (MODELLED ONLY) with a few words."""
    from ..placement.surface import ADDITIONS, ALL

    adds = ", ".join(f"+{n}: {_SURFACE_ADDITIONS_SHORT.get(n, a.means)}" for n, a in ADDITIONS.items())
    return (f"BASE[+ADDITION...]: full (default), vllm or vllm-write-through; additions, MODELLED ONLY: {adds}, "
            f"+{ALL}: all but requeue")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``kvtier replay`` flag, one line of help each; docs/replay.md explains them."""
    from ..cliargs import (
        listed,
        nonnegative_float,
        nonnegative_int,
        positive_float,
        positive_int,
        writable_file,
    )
    from .profiles import DEFAULT_PROFILE, HARDWARE, MODELS
    from .run import DEFAULT_POLICIES
    from ..placement.loadrule import LOAD_RULES
    from .sim import SCHEDULERS, TOOL_WAITS

    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), metavar="LIST",
                   help=f"comma-separated policies to compare (default: {', '.join(DEFAULT_POLICIES)})")
    p.add_argument("--config", metavar="FILE", help="also replay a config file's policy, as 'config'")
    p.add_argument("--profile", default=None, metavar="HW:MODEL[:CHIPS]",
                   help=f"hardware and model (default {DEFAULT_PROFILE}); hardware: {', '.join(HARDWARE)}; "
                        f"models: {', '.join(MODELS)}")
    p.add_argument("--profile-file", metavar="YAML", help="override profile fields from a YAML file")
    p.add_argument("--conc", type=positive_int, default=8, metavar="N",
                   help="live session trees, closed loop (default 8)")
    p.add_argument("--sweep-conc", type=listed(positive_int), metavar="1,2,4,...", help="replay every listed conc")
    p.add_argument("--slo-ttft-p99", type=positive_float, metavar="S",
                   help="SLO search: largest conc with later-turn TTFT p99 <= S")
    p.add_argument("--slo-interactivity", type=positive_float, metavar="TOK_S",
                   help="SLO search: p50 interactivity floor (tokens/s/user)")
    p.add_argument("--no-references", action="store_true", help="skip the floor and bound runs (faster)")
    p.add_argument("--skip-oversized", action="store_true",
                   help="skip requests larger than HBM (default: stop, rc 2)")
    p.add_argument("--jobs", type=positive_int, metavar="N",
                   help="worker processes (default: usable CPUs, at most 8)")
    p.add_argument("--full", action="store_true", help="print the full table of every figure after the summary")
    p.add_argument("--json", metavar="PATH", type=writable_file, help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH.png", type=writable_file,
                   help="write a PNG of computed/bound and TTFT p99")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")

    w = p.add_argument_group("workload")
    w.add_argument("--trace", metavar="PATH",
                   help="trace file, directory or tarball (default: embedded)")
    w.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed traces instead of failing")
    w.add_argument("--shared-prefix", choices=("none", "declared"), default=None,
                   help="share declared prefixes across sessions? (default: none; embedded workload: declared)")
    w.add_argument("--sessions", type=positive_int, metavar="N",
                   help="embedded: sessions (default 30); traces: first N")
    w.add_argument("--split", default="all", choices=["all", "tune", "eval"],
                   help="traces: the tuning or evaluation half (default all)")
    w.add_argument("--seed", type=nonnegative_int, default=0, metavar="N",
                   help="seed of the generated workloads (default 0)")
    w.add_argument("--block-size", type=positive_int, metavar="TOKENS",
                   help="re-block the workload to this block size")
    w.add_argument("--warmup", type=nonnegative_float, default=0.0, metavar="S",
                   help="leave requests ready before S seconds out (default 0)")
    w.add_argument("--gap-cap", type=nonnegative_float, metavar="S",
                   help="cap tool/user gaps at S seconds (default: no cap)")
    w.add_argument("--time-scale", type=positive_float, default=1.0, metavar="X",
                   help="open-loop traces: scale arrival times (default 1)")

    c = p.add_argument_group("capacity and engine model")
    cap = c.add_mutually_exclusive_group()
    cap.add_argument("--hbm-blocks", type=listed(positive_int), metavar="N[,N...]",
                     help="HBM KV capacity in blocks (default: the profile's)")
    cap.add_argument("--hbm-fraction", type=listed(positive_float), metavar="F[,F...]",
                     help="HBM capacity as a fraction of the working set")
    c.add_argument("--dram-blocks", type=nonnegative_int, metavar="N",
                   help="DRAM capacity in blocks (default 2x HBM)")
    c.add_argument("--ssd-blocks", type=nonnegative_int, default=0, metavar="N",
                   help="SSD capacity in blocks (default 0: none)")
    c.add_argument("--max-batch-tokens", type=positive_int, default=8192, metavar="N",
                   help="token budget per engine step (default 8192)")
    c.add_argument("--admission", default="fcfs", metavar="ORDER",
                   help="fcfs (default), critical-first or oldest-app")
    c.add_argument("--scheduler", default="vllm", choices=list(SCHEDULERS),
                   help="engine admission per step: vllm (default) or plain")
    c.add_argument("--load-rule", default="surface", choices=list(LOAD_RULES),
                   help="load or recompute a DRAM / SSD hit, per request: surface (default: the policy decides on "
                        "full, every hit loads on the vLLM surfaces), always, never, cost (the policy's cost model "
                        "on any surface; live: recompute_when_cheaper) or llm-d (the llm-d router's selective "
                        "load, modelled; kvtier.placement.loadrule)")
    c.add_argument("--max-running", type=positive_int, default=256, metavar="N",
                   help="requests the engine runs at once, vLLM's --max-num-seqs (default 256)")
    c.add_argument("--recorded-starts", action="store_true",
                   help="start each session at its recorded start (a recording of kvtier's record_path), "
                        "not --conc at once: the traffic as it was served")
    c.add_argument("--surface", default="full", metavar="NAME", help=_surface_help())
    c.add_argument("--agent-ends", default="reported", choices=["reported", "unknown"],
                   help="told when an agent ends? (default reported)")
    c.add_argument("--tool-waits", default="predicted", choices=list(TOOL_WAITS),
                   help="what tool waits policies see (default predicted)")
    add_codec_arguments(p)
    add_fleet_arguments(p)
    add_rounds_arguments(p)


def add_codec_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of compressed cold tiers (kvtier.replay.codec)."""
    from ..cliargs import positive_int
    from .codec import TIER_CHOICES

    c = p.add_argument_group("compressed cold tiers",
                             "A tier holds floor(capacity x ratio) blocks; each block is encoded once on\n"
                             "its way down and decoded on each load.")
    c.add_argument("--cold-codec", metavar="NAME",
                   help="codec of DRAM and SSD, e.g. rq4 (needs --codec-profile)")
    c.add_argument("--codec-profile", metavar="FILE.json",
                   help="the JSON that kvtier bench codecs writes (--json)")
    c.add_argument("--cold-codec-tiers", choices=tuple(TIER_CHOICES), default=None,
                   help="tiers compressed: dram,ssd (default) or ssd")
    c.add_argument("--codec-cores", type=positive_int, default=None, metavar="N",
                   help="cores encoding, N more decoding (default 1)")


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

    f = p.add_argument_group("a fleet of engines (modelled; no floor or bound)")
    f.add_argument("--engines", type=positive_int, default=1, metavar="N",
                   help="engines serving the sessions (default 1)")
    f.add_argument("--routing", choices=ROUTINGS, default="round-robin",
                   help="which engine a request goes to (default round-robin)")
    f.add_argument("--remote-blocks", type=nonnegative_int, default=0, metavar="B",
                   help="shared remote tier, in blocks (default 0: none)")
    f.add_argument("--remote-gbps", type=positive_float, default=DEFAULT_REMOTE_GBPS, metavar="GB_S",
                   help=f"each engine's remote link, GB/s (default {DEFAULT_REMOTE_GBPS:g})")


def add_rounds_arguments(p: argparse.ArgumentParser) -> None:
    """``--workload`` and the flags of its generated workloads: ``apps`` (kvtier.replay.appgen)
    and ``rounds`` (all-gather rounds, kvtier.replay.rounds)."""
    from ..cliargs import nonnegative_int, positive_float, positive_int
    from .rounds import DEFAULT_SLO_ROUND_S, ROUND_LATENCIES, RoundsWorkload

    d = RoundsWorkload()
    g = p.add_argument_group("generated workloads (--workload apps, --workload rounds)",
                             "rounds compares lru, lru-dram, layout (exact sharing, kvtier.sdk.rounds.RoundLayout), "
                             "diff (master + lossless diff) and approx (APPROXIMATE reuse, keys re-rotated)")
    g.add_argument("--workload", choices=["traces", "apps", "rounds"], default="traces",
                   help="traces (default: --trace or embedded), apps or rounds")
    g.add_argument("--app", choices=["code-writer", "deep-research", "mixed"], default="code-writer",
                   help="apps: application shape (default code-writer)")
    g.add_argument("--rate", type=positive_float, default=0.5, metavar="APPS_PER_S",
                   help="apps: Poisson arrival rate (default 0.5)")
    g.add_argument("--apps", type=positive_int, default=40, metavar="N", help="apps: applications (default 40)")
    g.add_argument("--round-slo-ms", type=positive_float, default=DEFAULT_SLO_ROUND_S * 1e3, metavar="MS",
                   help=f"rounds: round latency SLO (default {DEFAULT_SLO_ROUND_S * 1e3:.0f})")
    g.add_argument("--round-latency", choices=list(ROUND_LATENCIES), default="full",
                   help="rounds: full round or ttft (default full)")
    g.add_argument("--rounds", type=positive_int, default=d.num_rounds, metavar="N",
                   help=f"rounds: rounds per run (default {d.num_rounds})")
    g.add_argument("--private-tokens", type=nonnegative_int, default=d.private_tokens, metavar="N",
                   help=f"rounds: private history per agent (default {d.private_tokens})")
    g.add_argument("--observe-tokens", type=nonnegative_int, default=d.observe_tokens, metavar="N",
                   help=f"rounds: new input per agent per round (default {d.observe_tokens})")
    g.add_argument("--output-tokens", type=positive_int, default=d.output_tokens, metavar="N",
                   help=f"rounds: output per agent per round (default {d.output_tokens})")


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
    if args.recorded_starts and fleet:
        from ..errors import ConfigError

        raise ConfigError("--recorded-starts", True, "replays one engine; leave out --engines / --remote-blocks")
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
        load_rule=args.load_rule, max_running=args.max_running, recorded_starts=args.recorded_starts,
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
