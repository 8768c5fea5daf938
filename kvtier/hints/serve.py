"""``kvtier serve``: build a :class:`~kvtier.hints.server.HintServer` from the
command line and a kvtier config, then serve until SIGINT / SIGTERM.

Owns: turning flags into server parts — the config (``kvtier.config.load_config``),
the optional :class:`~kvtier.store.TieredStore` that commands act on
(``--store``; imports torch only then), tokens, TLS files, the recorder and
the metrics port. Must not hold server logic. A bad flag raises
:class:`~kvtier.errors.ConfigError` naming it (the CLI prints one line, exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from . import DEFAULT_ADDRESS


def listen_address(text: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) with a port in 0..65535."""
    from ..cliargs import port

    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (e.g. 127.0.0.1:50051), got {text!r}")
    port(port_text)
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve`` flags (the CLI calls this on its sub-parser)."""
    from ..cliargs import nonnegative_int, port, positive_float, positive_int
    p.add_argument("--config", metavar="PATH", help="kvtier config file (.yaml/.toml); KVTIER_* variables apply too")
    p.add_argument("--listen", metavar="HOST:PORT", default=None, type=listen_address,
                   help=f"TCP address to bind (default {DEFAULT_ADDRESS}; port 0 picks a free port). A non-loopback "
                        "address needs --token/--token-file or --allow-unauthenticated-remote")
    p.add_argument("--unix", metavar="PATH", help="serve on a unix socket at PATH instead of TCP")
    p.add_argument("--token", metavar="TOKEN",
                   help="require 'authorization: Bearer TOKEN' (tenant 'default'); prefer --token-file, "
                        "command lines are visible to other users")
    p.add_argument("--token-file", metavar="PATH",
                   help="file of 'TENANT TOKEN' lines (or bare 'TOKEN' for tenant 'default'); each token "
                        "names the tenant its caller acts as")
    p.add_argument("--tls-cert", metavar="PEM", help="server certificate chain (PEM); enables TLS with --tls-key")
    p.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert (PEM)")
    p.add_argument("--metrics-port", type=port, metavar="PORT",
                   help="serve Prometheus /metrics on this port (0: any free port; default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--store", action="store_true",
                   help="open a TieredStore from the config so pin/unpin/prefetch commands act on it "
                        "(default: commands are validated and counted only)")
    p.add_argument("--record", metavar="DIR",
                   help="record applied hints to DIR/hints.jsonl and one AgentX trace per session to "
                        "DIR/traces/ (replay with `kvtier replay --trace DIR/traces`)")
    p.add_argument("--session-ttl-s", type=positive_float, default=600.0, metavar="S",
                   help="expire sessions idle for S seconds (default 600)")
    p.add_argument("--max-sessions", type=positive_int, default=10_000, metavar="N",
                   help="live sessions over all tenants (default 10000)")
    p.add_argument("--max-events-per-s-per-tenant", type=positive_float, default=None, metavar="R",
                   help="each tenant may publish R events/s (bursts of one second's worth); more are refused "
                        "(RESOURCE_EXHAUSTED, or counted as rate_limited in a stream); one tenant over its "
                        "limit never slows another (HintLimits.max_events_per_s_per_tenant; default: no limit)")
    p.add_argument("--max-pinned-blocks-per-tenant", type=nonnegative_int, default=65_536, metavar="N",
                   help="blocks one tenant may hold pinned through hint commands at once; a pin over it is "
                        "refused (pin_refused_tenant_budget). A tenant's unpin releases only its own pins "
                        "(HintLimits.max_pinned_blocks_per_tenant; default 65536)")
    p.add_argument("--allow-unauthenticated-remote", action="store_true",
                   help="allow a non-loopback --listen without a token (not recommended)")


def build_server(args: argparse.Namespace) -> tuple[Any, str, Any]:
    """``(server, address, store)`` from parsed flags (the store is ``None`` unless ``--store``)."""
    from ..agents.graph import GraphLimits
    from ..config import load_config
    from ..errors import ConfigError
    from .apply import HintLimits
    from .server import HintServer, TLSFiles, load_tokens

    if args.listen and args.unix:
        raise ConfigError("--unix", args.unix, "give --listen or --unix, not both")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert" if args.tls_cert else "--tls-key", args.tls_cert or args.tls_key,
                          "--tls-cert and --tls-key go together")
    try:
        hint_limits = HintLimits(max_events_per_s_per_tenant=args.max_events_per_s_per_tenant,
                                 max_pinned_blocks_per_tenant=args.max_pinned_blocks_per_tenant)
    except ValueError as err:
        flag = "--max-pinned-blocks-per-tenant" if "pinned" in str(err) else "--max-events-per-s-per-tenant"
        raise ConfigError(flag, getattr(args, flag[2:].replace("-", "_")), str(err)) from None
    if args.metrics_port is not None:
        import socket

        try:
            socket.getaddrinfo(args.metrics_host, args.metrics_port)
        except OSError as err:
            raise ConfigError("--metrics-host", args.metrics_host, f"not an address to bind: {err}") from None
    cfg = load_config(args.config)
    tokens: dict[str, str] = {}
    if args.token_file:
        try:
            tokens.update(load_tokens(args.token_file))
        except (OSError, ValueError) as err:
            raise ConfigError("--token-file", args.token_file, str(err)) from None
    if args.token:
        tokens[args.token] = "default"
    tls = None
    if args.tls_cert:
        pems = []
        for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            try:
                pems.append(Path(path).read_bytes())
            except OSError as err:
                raise ConfigError(flag, path, f"cannot read: {err.strerror or err}") from None
        tls = TLSFiles(*pems)
    store = None
    if args.store:
        from ..store import TieredStore

        store = TieredStore(cfg)
    recorder = None
    if args.record:
        from ..recording.hints import HintRecorder

        try:
            recorder = HintRecorder(args.record, block_size=cfg.layout.block_size, model=cfg.namespace.model)
        except (OSError, ValueError) as err:
            raise ConfigError("--record", args.record, f"cannot record there: {err}") from None
    try:
        base = GraphLimits()
        limits = GraphLimits(session_ttl_s=args.session_ttl_s, max_sessions=args.max_sessions,
                             max_sessions_per_tenant=min(args.max_sessions, base.max_sessions_per_tenant),
                             max_sessions_per_client=min(args.max_sessions, base.max_sessions_per_client))
    except ValueError as err:
        raise ConfigError("--session-ttl-s / --max-sessions", (args.session_ttl_s, args.max_sessions),
                          str(err)) from None
    server = HintServer(graph_limits=limits, limits=hint_limits, store=store, recorder=recorder, tokens=tokens,
                        tls=tls, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                        allow_unauthenticated_remote=args.allow_unauthenticated_remote)
    address = f"unix:{args.unix}" if args.unix else (args.listen or DEFAULT_ADDRESS)
    return server, address, store


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; prints the bound address (and metrics port) to stdout."""
    from .server import serve_forever, tune_gc_for_serving

    server, address, store = build_server(args)
    tune_gc_for_serving()

    def ready(bound: str) -> None:
        extra = f", metrics on http://{args.metrics_host}:{server.metrics_port}/metrics" if server.metrics_port else ""
        auth = "bearer tokens" if server.auth_enabled else "no auth"
        tls = "TLS" if server.tls else "plaintext"
        print(f"kvtier hints server on {bound} ({tls}, {auth}){extra}", flush=True)

    try:
        asyncio.run(serve_forever(server, address, ready=ready))
    except (ValueError, RuntimeError, OSError) as err:
        print(f"kvtier serve: error: {err}", file=sys.stderr)
        return 2
    finally:
        if store is not None:
            store.close()
    return 0
