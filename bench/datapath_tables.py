"""README tables of the byte paths: the vLLM connector's and the remote tier's.

Owns: the renderer of table ``connector-path`` (``bench/connector_path.py``:
the connector worker's DRAM and SSD functions against memcpy and raw file I/O,
and its whole store / load path against memcpy), of table ``byte-path-callers``
(``TieredStore`` and the connector's worker through one function,
``kvtier.benchmarks.bytepath.measure``, the worker's whole path marked against
its targets), of table ``loads-behind-writes`` (a load's latency with and
without SSD writes queued; both from the same ``bench/connector_path.py`` run)
and of table ``remote``
(``kvtier bench remote``: the Mooncake remote tier against Mooncake's own
batch calls). Every figure is read from the JSON; ratios are computed there,
in the same run as their baselines.

Must not: run anything or write any file (``bench/readme_tables.py`` imports
this module and rewrites the documents).
"""

from __future__ import annotations

from typing import Any

from readme_tables import md_table, table


def _cell(r: dict[str, Any], gbps: str, ratio: str, target: float | None, digits: int) -> str:
    """``GB/s (ratio x)``, marked met or missed where ``target`` is given."""
    mark = "" if target is None else (" ✓" if r[ratio] >= target else " ✗")
    return f"{r[gbps]:.{digits}f} GB/s ({r[ratio]:.2f}x{mark})"


@table("connector-path", "connector-path.json")
def connector_path(data: dict[str, Any]) -> str:
    t = data["targets"]
    commit = (data.get("commit") or "unknown")[:7] + (" (modified)" if data.get("code_dirty") else "")

    def cell(r: dict[str, Any], gbps: str, ratio: str) -> str:
        return _cell(r, gbps, ratio, t.get(ratio), 1)

    rows = [[f"{r['block_kib']} KiB", f"{r['memcpy_gbps']:.1f}",
             cell(r, "dram_store_gbps", "dram_put_vs_memcpy"), cell(r, "dram_load_gbps", "dram_get_vs_memcpy"),
             f"{r['raw_file_write_gbps']:.2f}", cell(r, "ssd_store_gbps", "ssd_put_vs_raw_write"),
             f"{r['raw_file_read_gbps']:.1f}", cell(r, "ssd_load_gbps", "ssd_get_vs_raw_read"),
             f"{r['end_to_end_store_vs_memcpy']:.2f}x / {r['end_to_end_load_vs_memcpy']:.2f}x"]
            for r in data["results"]]
    verified = "every loaded byte verified" if all(r["verified"] for r in data["results"]) else "LOADED BYTES WRONG"
    caption = (f"`bench/connector_path.py` ({data['total_mib']} MiB per measurement, best of {data['repeats']} "
               f"interleaved rounds, {data.get('cpu_count', '?')} CPUs, {verified}; commit {commit}). Targets: DRAM "
               f">= {t['dram_put_vs_memcpy']}x memcpy, SSD put >= {t['ssd_put_vs_raw_write']}x write + fsync, SSD get "
               f">= {t['ssd_get_vs_raw_read']}x warm read:\n\n")
    header = ["block", "memcpy GB/s", "DRAM store", "DRAM load", "write + fsync GB/s", "SSD store",
              "warm read GB/s", "SSD load", "whole store / load path vs memcpy"]
    return caption + md_table(header, rows)


def _commit(data: dict[str, Any]) -> str:
    return (data.get("commit") or "unknown")[:7] + (" (modified)" if data.get("code_dirty") else "")


@table("byte-path-callers", "connector-path.json")
def byte_path_callers(data: dict[str, Any]) -> str:
    t = data["worker_targets"]

    def cell(r: dict[str, Any], gbps: str, ratio: str, digits: int) -> str:
        return _cell(r, gbps, ratio, t[ratio] if r["caller"] == "connector worker" else None, digits)

    rows = [[r["caller"], f"{r['block_kib']} KiB", f"{r['memcpy_gbps']:.1f}",
             cell(r, "dram_put_gbps", "dram_put_vs_memcpy", 1), cell(r, "dram_get_gbps", "dram_get_vs_memcpy", 1),
             f"{r['raw_file_write_gbps']:.2f}", cell(r, "ssd_put_gbps", "ssd_put_vs_raw_write", 2),
             f"{r['raw_file_read_gbps']:.1f}", cell(r, "ssd_get_gbps", "ssd_get_vs_raw_read", 1)]
            for r in data["callers"]]
    verified = "every byte read back verified" if all(r["verified"] for r in data["callers"]) else "BYTES WRONG"
    caption = (f"Both callers of the data plane through one function (`kvtier.benchmarks.bytepath.measure`; "
               f"`bench/connector_path.py --json bench/out/connector-path.json`: {data['total_mib']} MiB per "
               f"measurement, best of {data['repeats']} interleaved rounds, {verified}; commit {_commit(data)}). "
               "`TieredStore` puts and gets the caller's buffers; the connector's worker, driven as vLLM steps it, "
               "gathers the engine's blocks straight into the DRAM pool's slots and scatters loads straight from "
               "them (one pass each way); SSD stores gather into staging and the writer copies it; SSD loads are "
               "verified in the LMDB map, then copied straight into the engine's blocks (a compressed value "
               "through staging). Targets of the worker's whole path"
               f": DRAM >= {t['dram_put_vs_memcpy']}x memcpy, SSD store >= {t['ssd_put_vs_raw_write']}x "
               f"write + fsync, SSD load >= {t['ssd_get_vs_raw_read']}x warm read:\n\n")
    header = ["caller", "block", "memcpy GB/s", "DRAM put", "DRAM get", "write + fsync GB/s", "SSD put",
              "warm read GB/s", "SSD get"]
    return caption + md_table(header, rows)


@table("loads-behind-writes", "connector-path.json")
def loads_behind_writes(data: dict[str, Any]) -> str:
    t = data["queued_targets"]

    def ratio(r: dict[str, Any], tier: str) -> str:
        x = r[f"{tier}_p99_queued_vs_idle"]
        return f"{x:.2f}x {'✓' if x <= t[tier] else '✗'}"

    rows = [[f"{r['block_kib']} KiB", f"{r['queued_mib_peak']}",
             *(f"{r[f'{tier}_{q}_p50_ms']:.1f} / {r[f'{tier}_{q}_p99_ms']:.1f}" for tier in ("dram", "ssd")
               for q in ("idle", "queued")),
             ratio(r, "dram"), ratio(r, "ssd")] for r in data["queued"]]
    verified = "every loaded byte verified" if all(r["verified"] for r in data["queued"]) else "LOADED BYTES WRONG"
    loads = data["queued"][0]["loads"] if data["queued"] else 0
    caption = (f"Loads behind writes (`bench/connector_path.py`, same run as above; commit {_commit(data)}): one "
               f"16-block load as vLLM steps it (`start_load_kv`, then `get_finished` until reported), {loads} of "
               "each tier with nothing queued and as many with the SSD writer's queue topped up before each load, "
               f"alternating; {verified}. p50 / p99 in ms. Targets: queued p99 <= {t['dram']}x (DRAM) and "
               f"<= {t['ssd']}x (SSD) of idle p99:\n\n")
    header = ["block", "SSD writes queued (MiB, peak)", "DRAM load, idle", "DRAM load, queued", "SSD load, idle",
              "SSD load, queued", "DRAM p99 queued / idle", "SSD p99 queued / idle"]
    return caption + md_table(header, rows)


@table("remote", "remote.json")
def remote(data: dict[str, Any]) -> str:
    target = data["target"]

    def cell(r: dict[str, Any], gbps: str, ratio: str, marked: bool = True) -> str:
        return _cell(r, gbps, ratio, target if marked else None, 2)

    rows = [[f"{r['block_kib']} KiB", f"{r['mooncake_put_gbps']:.2f}", cell(r, "remote_put_gbps", "put_vs_mooncake"),
             cell(r, "staged_put_gbps", "staged_put_vs_mooncake", False), f"{r['mooncake_get_gbps']:.2f}",
             cell(r, "remote_get_gbps", "get_vs_mooncake"), cell(r, "staged_get_gbps", "staged_get_vs_mooncake", False),
             f"{r['zero_copy_put_gbps']:.2f} / {r['zero_copy_get_gbps']:.2f}"]
            for r in data["results"]]
    verified = "every read verified" if all(r["verified"] for r in data["results"]) else "READ BYTES WRONG"
    caption = (f"`kvtier bench remote --repeats {data['repeats']} --json bench/out/remote.json` ({data['total_mib']} "
               f"MiB per measurement in batches of 16 blocks, best of {data['repeats']} interleaved rounds, one client "
               f"and a local `mooncake_master` over TCP on loopback, 2 CPUs, {verified}). Ratios against Mooncake's "
               f"own `upsert_batch` / `get_batch` of the same bytes in the same run; target >= {target}x on "
               "registered buffers (the connector's path); the staged path and Mooncake's zero-copy calls are "
               "context:\n\n")
    header = ["block", "Mooncake put GB/s", "kvtier put, registered", "kvtier put, staged", "Mooncake get GB/s",
              "kvtier get, registered", "kvtier get, staged", "Mooncake zero-copy put / get GB/s"]
    return caption + md_table(header, rows)
