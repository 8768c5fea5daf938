"""The validated kvtier configuration: one frozen object built from defaults,
a YAML/TOML file, ``KVTIER_*`` environment variables and explicit overrides.

Owns: parsing and validation of every setting. No I/O besides reading the
config file and, when the SSD tier is enabled, checking that its directory
exists or can be created (a directory made for the check is removed again).
Every error is a :class:`~kvtier.errors.ConfigError` naming the dotted
setting (or the file, or the environment variable) and the bad value.

Precedence, lowest first: dataclass defaults < file < environment < overrides.
Environment variables are ``KVTIER_<SECTION>__<KEY>`` (double underscore
nests): ``KVTIER_TIERS__SSD__PATH=/mnt/nvme/kv``, ``KVTIER_PIN_BUDGET_BLOCKS=10``.

The defaults describe Llama-3-8B (32 layers, 8 KV heads, head_dim 128,
bfloat16) with vLLM's default block_size of 16 tokens: 2 MiB per block.
HBM (512 blocks, 1 GiB) and DRAM (4096 blocks, 8 GiB) are on; SSD is off.

Example ``kvtier.yaml``::

    layout:
      num_layers: 32
      num_kv_heads: 8
      head_dim: 128
      dtype: bfloat16
      block_size: 16
      arrangement: fused          # fused | split | mla
    namespace:
      model: meta-llama/Llama-3.1-8B-Instruct
      tenant: team-a              # cache salt: tenants never share blocks
    tiers:
      hbm:  {capacity_blocks: 512, device: auto}
      dram: {capacity_blocks: 4096, policy: lru, pin_memory: auto}
      ssd:
        enabled: true
        capacity_blocks: 65536
        path: /mnt/nvme/kvtier
        codec: bplane-zstd
    pin_budget_blocks: 256
    put_tier: hbm

>>> cfg = load_config(env={}, overrides={"tiers": {"dram": {"capacity_blocks": 8}}})
>>> cfg.dram.capacity_blocks, cfg.layout.to_layout().bytes_per_block
(8, 2097152)
>>> load_config(env={}, overrides=cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Mapping, Union

from .errors import ConfigError, UnknownPolicyError
from .keys import Namespace
from .layout import KVLayout
from .policies import policy_names

PinMemory = Union[bool, Literal["auto"]]
"""``True``/``False``, or ``"auto"``: pin host memory when an accelerator is present."""

TIER_NAMES: tuple[str, ...] = ("hbm", "dram", "ssd")
"""Tiers from fastest to slowest; also the valid values of ``put_tier``."""

SSD_CODECS: tuple[str, ...] = ("auto", "raw", "zstd", "bplane-zstd", "rq4", "rq3")
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "npu", "xpu", "mps", "hpu")
ENV_PREFIX = "KVTIER_"
SCRIPT_ENV = frozenset({"KVTIER_VENV", "KVTIER_PIP_TRIES"})
"""Variables the project's own scripts read (``scripts/test.sh``: which venv, how often pip retries); not
settings, so the strict check below lets them pass."""

_DEVICE_RE = re.compile(r"^(?P<type>[a-z]+)(?::(?P<index>\d+))?$")
_LMDB_ENTRY_OVERHEAD_BYTES = 2 * 4096  # key leaf + overflow-page header, rounded up
_MAP_SIZE_SLACK_BYTES = 64 << 20  # B-tree pages, freelist, meta pages


def auto_map_size_bytes(capacity_blocks: int, bytes_per_block: int) -> int:
    """LMDB map size used when ``tiers.ssd.map_size_bytes`` is unset: the blocks
    plus per-entry overhead, 25% headroom for copy-on-write, rounded to 4 KiB.

    >>> auto_map_size_bytes(0, 2097152) == 64 << 20
    True
    """
    need = capacity_blocks * (bytes_per_block + _LMDB_ENTRY_OVERHEAD_BYTES) * 5 // 4
    return -(-(need + _MAP_SIZE_SLACK_BYTES) // 4096) * 4096


# Field types: per annotation string, a strict checker (files, overrides,
# constructors) and a text parser (environment variables); see _KINDS.


def _check_int(setting: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(setting, value, "must be an integer")
    return value


def _check_float(setting: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(setting, value, "must be a number")
    return float(value)


def _check_bool(setting: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(setting, value, "must be true or false")
    return value


def _check_str(setting: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(setting, value, "must be a string")
    return value


def _check_opt_int(setting: str, value: object) -> int | None:
    return None if value is None else _check_int(setting, value)


def _check_opt_float(setting: str, value: object) -> float | None:
    return None if value is None else _check_float(setting, value)


def _check_pin_memory(setting: str, value: object) -> PinMemory:
    if value == "auto" or isinstance(value, bool):
        return value  # type: ignore[return-value]
    raise ConfigError(setting, value, 'must be "auto", true or false')


_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def _parse_int(setting: str, text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise ConfigError(setting, text, "must be an integer") from None


def _parse_float(setting: str, text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ConfigError(setting, text, "must be a number") from None


def _parse_bool(setting: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ConfigError(setting, text, f"must be one of {', '.join(_TRUE_WORDS + _FALSE_WORDS)}")


def _parse_opt_int(setting: str, text: str) -> int | None:
    return None if text.strip().lower() in ("", "auto", "none", "null") else _parse_int(setting, text)


def _parse_opt_float(setting: str, text: str) -> float | None:
    return None if text.strip().lower() in ("", "none", "null") else _parse_float(setting, text)


def _parse_pin_memory(setting: str, text: str) -> PinMemory:
    return "auto" if text.strip().lower() == "auto" else _parse_bool(setting, text)


_Kind = tuple[Callable[[str, object], Any], Callable[[str, str], Any]]
_KINDS: dict[str, _Kind] = {
    "int": (_check_int, _parse_int),
    "float": (_check_float, _parse_float),
    "bool": (_check_bool, _parse_bool),
    "str": (_check_str, lambda setting, text: text),
    "int | None": (_check_opt_int, _parse_opt_int),
    "float | None": (_check_opt_float, _parse_opt_float),
    "PinMemory": (_check_pin_memory, _parse_pin_memory),
}


def _check_fields(obj: Any, section: str, skip: tuple[str, ...] = ()) -> None:
    """Type-check (and normalize, e.g. int → float) every scalar field of ``obj``."""
    for f in fields(obj):
        if f.name not in skip:
            value = _KINDS[f.type][0](f"{section}{f.name}", getattr(obj, f.name))
            object.__setattr__(obj, f.name, value)


def _check_min(setting: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(setting, value, f"must be >= {minimum}")


def _check_choice(setting: str, value: str, valid: tuple[str, ...] | list[str]) -> None:
    if value not in valid:
        raise ConfigError(setting, value, f"valid: {', '.join(valid)}")


@dataclass(frozen=True, slots=True)
class LayoutConfig:
    """Shape of one block of KV (see :class:`~kvtier.layout.KVLayout`)."""

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    arrangement: str = "fused"
    SECTION: ClassVar[str] = "layout"

    def __post_init__(self) -> None:
        _check_fields(self, "layout.")
        self.to_layout()  # KVLayout validates and names "layout.<field>"

    def to_layout(self) -> KVLayout:
        """The :class:`KVLayout` these settings describe."""
        return KVLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.block_size, self.arrangement  # type: ignore[arg-type]
        )


@dataclass(frozen=True, slots=True)
class NamespaceConfig:
    """Identity of the KV beyond the layout: blocks of different namespaces never match."""

    model: str = "default"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    tenant: str = ""
    SECTION: ClassVar[str] = "namespace"

    def __post_init__(self) -> None:
        _check_fields(self, "namespace.")
        _check_min("namespace.tp_size", self.tp_size, 1)
        _check_min("namespace.pp_rank", self.pp_rank, 0)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("namespace.tp_rank", self.tp_rank, f"must be in [0, namespace.tp_size={self.tp_size})")

    def to_namespace(self, layout: KVLayout) -> Namespace:
        """The key :class:`Namespace`; dtype, block size and layout text come from ``layout``."""
        return Namespace(
            model=self.model,
            dtype=layout.dtype,
            layout=layout.describe(),
            block_size=layout.block_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            tenant=self.tenant,
        )


def _check_tier(tier: Any) -> None:
    """Checks shared by every tier: types, capacity, policy name."""
    section = f"{tier.SECTION}."
    _check_fields(tier, section)
    _check_min(f"{section}capacity_blocks", tier.capacity_blocks, 0)
    if tier.enabled and tier.capacity_blocks == 0:
        raise ConfigError(
            f"{section}capacity_blocks", 0, f"must be > 0 while {section}enabled is true (disable the tier instead)"
        )
    valid = policy_names()
    if tier.policy not in valid:
        raise UnknownPolicyError(f"{section}policy", tier.policy, f"unknown policy; valid: {', '.join(valid)}")


@dataclass(frozen=True, slots=True)
class HBMTierConfig:
    """Accelerator-memory tier. ``device``: ``"auto"`` (the engine's device) or
    ``<type>[:<index>]`` with a type from :data:`DEVICE_TYPES`."""

    enabled: bool = True
    capacity_blocks: int = 512
    policy: str = "lru"
    device: str = "auto"
    SECTION: ClassVar[str] = "tiers.hbm"

    def __post_init__(self) -> None:
        _check_tier(self)
        match = _DEVICE_RE.match(self.device)
        if self.device != "auto" and (match is None or match["type"] not in DEVICE_TYPES):
            raise ConfigError(
                "tiers.hbm.device", self.device, f'must be "auto" or <type>[:<index>], type one of {", ".join(DEVICE_TYPES)}'
            )


@dataclass(frozen=True, slots=True)
class DRAMTierConfig:
    """Host-memory tier. ``pin_memory="auto"`` pins when an accelerator is present."""

    enabled: bool = True
    capacity_blocks: int = 4096
    policy: str = "lru"
    pin_memory: PinMemory = "auto"
    SECTION: ClassVar[str] = "tiers.dram"

    def __post_init__(self) -> None:
        _check_tier(self)


@dataclass(frozen=True, slots=True)
class SSDTierConfig:
    """LMDB-backed SSD tier. ``map_size_bytes=None`` is resolved by
    :class:`KVTierConfig` to :func:`auto_map_size_bytes`. When enabled, ``path``
    (``~`` expanded, symlinks resolved: it may be a symlink to, say, an NVMe
    mount) must be a writable directory or creatable as one, and its LMDB files
    must not be symlinks (see :func:`lmdb_dir_problem`)."""

    enabled: bool = False
    capacity_blocks: int = 16384
    policy: str = "lru"
    path: str = "~/.cache/kvtier/ssd"
    map_size_bytes: int | None = None
    codec: str = "raw"  # "auto" stores bf16 KV 1.5x smaller but decodes at ~1 GB/s on 2 cores (docs/tiers.md)
    zstd_level: int = 1
    sync: bool = False
    # threads that copy and verify the blocks of one large read (the caller's included)
    read_threads: int = 2
    # threads that encode and write one put (the caller's included): the next
    # groups encode while the caller copies the last into the transaction
    write_threads: int = 2
    SECTION: ClassVar[str] = "tiers.ssd"

    def __post_init__(self) -> None:
        _check_tier(self)
        if self.map_size_bytes is not None:
            _check_min("tiers.ssd.map_size_bytes", self.map_size_bytes, 1)
        _check_choice("tiers.ssd.codec", self.codec, SSD_CODECS)
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError("tiers.ssd.zstd_level", self.zstd_level, "must be in 1..22")
        _check_min("tiers.ssd.read_threads", self.read_threads, 1)
        _check_min("tiers.ssd.write_threads", self.write_threads, 1)
        if self.enabled:
            if not self.path:
                raise ConfigError("tiers.ssd.path", self.path, "required when tiers.ssd.enabled is true")
            _check_dir_creatable("tiers.ssd.path", self.path)

    def resolved_path(self) -> Path:
        """``path`` with ``~`` expanded and symlinks resolved: the directory kvtier opens."""
        return Path(self.path).expanduser().resolve()


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """A store several engines share (Mooncake Store): read after the other
    tiers miss, written through on every put. Not a tier of the manager (no
    capacity of its own: the store evicts on its own). ``master`` is the
    master's ``host:port``; ``metadata_server`` its HTTP metadata URL (default
    ``http://<master host>:8080/metadata``). This client contributes
    ``segment_bytes`` of its memory to the store."""

    enabled: bool = False
    master: str = ""
    metadata_server: str = ""
    segment_bytes: int = 512 << 20
    buffer_bytes: int = 128 << 20
    codec: str = "raw"
    zstd_level: int = 1
    SECTION: ClassVar[str] = "tiers.remote"

    def __post_init__(self) -> None:
        _check_fields(self, "tiers.remote.")
        _check_min("tiers.remote.segment_bytes", self.segment_bytes, 1 << 20)
        _check_min("tiers.remote.buffer_bytes", self.buffer_bytes, 1 << 20)
        _check_choice("tiers.remote.codec", self.codec, SSD_CODECS)
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError("tiers.remote.zstd_level", self.zstd_level, "must be in 1..22")
        if self.enabled:
            host, sep, port = self.master.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError("tiers.remote.master", self.master, "required host:port when tiers.remote.enabled")
            if self.metadata_server and not self.metadata_server.startswith(("http://", "https://")):
                raise ConfigError("tiers.remote.metadata_server", self.metadata_server,
                                  "must be an http://host:port/metadata URL")

    def resolved_metadata_server(self) -> str:
        """``metadata_server``, or Mooncake's default port on the master's host."""
        return self.metadata_server or f"http://{self.master.rpartition(':')[0]}:8080/metadata"


def _check_dir_creatable(setting: str, path: str) -> None:
    """Raise unless ``path`` is a writable directory or can be created as one."""
    try:
        problem = _dir_problem(Path(path).expanduser().resolve())
    # ValueError: an embedded NUL byte; RuntimeError: "~user" of an unknown user, a symlink loop.
    except (OSError, ValueError, RuntimeError) as err:
        problem = f"cannot create directory: {err}"
    if problem is not None:
        raise ConfigError(setting, path, problem)


LMDB_FILES: tuple[str, ...] = ("data.mdb", "lock.mdb")


def lmdb_dir_problem(target: Path) -> str | None:
    """Why the SSD directory ``target`` could make kvtier write outside it, or ``None``:
    one of its LMDB files is a symlink or not a regular file (LMDB would follow
    it and write wherever it points). ``target`` itself, or an ancestor, may be
    a symlink: that is where the user chose to put the data (callers open the
    resolved directory)."""
    for name in LMDB_FILES:
        f = target / name
        if f.is_symlink() or (f.exists() and not f.is_file()):
            return f"{str(f)!r} is a symlink or not a regular file; LMDB would write outside tiers.ssd.path"
    return None


def _dir_problem(target: Path) -> str | None:
    """Why ``target`` cannot be used as a directory, or ``None``.
    Directories made to prove it are removed again, deepest first."""
    problem = lmdb_dir_problem(target)
    if problem is not None:
        return problem
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return "exists and is not a directory" if existing == target else f"ancestor {str(existing)!r} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"directory {str(existing)!r} is not writable"
    created = [p for p in (target, *target.parents) if existing in p.parents]
    target.mkdir(parents=True, exist_ok=True)
    for made in created:
        try:
            made.rmdir()
        except OSError:
            pass  # no longer empty: someone else uses it now
    return None


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """The placement policy the vLLM connector runs (unless its
    ``kv_connector_extra_config.placement`` names another) and ``kvtier replay
    --config`` replays, with its tunable constants (``None``: the policy's own;
    meanings and ranges in :data:`kvtier.placement.params.KNOBS`). ``kvtier
    tune`` writes this section."""

    policy: str = "kvtier"
    next_use_trust: float | None = None
    rho_min: float | None = None
    rho_max: float | None = None
    critical_at: float | None = None
    demote_after_s: float | None = None
    prefetch_lead_factor: float | None = None
    user_wait_s: float | None = None
    SECTION: ClassVar[str] = "placement"

    def __post_init__(self) -> None:
        _check_fields(self, "placement.")
        from .placement import make_placement

        make_placement(self.policy, "placement.policy", self.params())  # names the bad setting, if any

    def params(self) -> dict[str, float]:
        """The constants set here (the rest stay the policy's own)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "policy" and getattr(self, f.name) is not None}


@dataclass(frozen=True, slots=True)
class TunedConfig:
    """Where a config written by ``kvtier tune`` came from: the recording, the
    objective, the date and the held-out result. Read by people; nothing acts on it."""

    trace: str = ""
    objective: str = ""
    date: str = ""
    holdout: str = ""
    SECTION: ClassVar[str] = "tuned"

    def __post_init__(self) -> None:
        _check_fields(self, "tuned.")


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The fully validated configuration. Build it with :func:`load_config`.

    ``put_tier`` is where ``TieredStore.put`` writes first; with
    ``write_through`` it also stores to every lower enabled tier.
    ``kv_events`` makes the store record a ``BlockStored`` / ``BlockLoaded``
    event per block for ``TieredStore.take_events()`` (a KV-event feed to a
    router or indexer); off by default, as vLLM's KV-cache events are, since
    every stored and loaded block then costs an event object.
    """

    layout: LayoutConfig = field(default_factory=LayoutConfig)
    namespace: NamespaceConfig = field(default_factory=NamespaceConfig)
    hbm: HBMTierConfig = field(default_factory=HBMTierConfig)
    dram: DRAMTierConfig = field(default_factory=DRAMTierConfig)
    ssd: SSDTierConfig = field(default_factory=SSDTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    tuned: TunedConfig = field(default_factory=TunedConfig)
    pin_budget_blocks: int = 256
    default_pin_ttl_s: float = 30.0
    mover_threads: int = 2
    put_tier: str = "hbm"
    write_through: bool = False
    kv_events: bool = False

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(_section_path(name), getattr(self, name), f"must be a {cls.__name__}")
        _check_fields(self, "", skip=tuple(_SECTIONS))
        _check_min("pin_budget_blocks", self.pin_budget_blocks, 0)
        _check_min("mover_threads", self.mover_threads, 1)
        if not (math.isfinite(self.default_pin_ttl_s) and self.default_pin_ttl_s > 0):
            raise ConfigError("default_pin_ttl_s", self.default_pin_ttl_s, "must be a finite number > 0")
        self._check_tiers()
        self._resolve_map_size()

    def _check_tiers(self) -> None:
        enabled = self.enabled_tiers
        if not enabled:
            raise ConfigError("tiers.*.enabled", False, "at least one of tiers.hbm/dram/ssd must be enabled")
        _check_choice("put_tier", self.put_tier, TIER_NAMES)
        if self.put_tier not in enabled:
            raise ConfigError(
                "put_tier", self.put_tier, f"tiers.{self.put_tier}.enabled is false; enable it or use one of: {', '.join(enabled)}"
            )

        from .tiers.rq import RQ_BITS, layout_problem  # numpy only; kept out of config's import time

        for tier in (self.ssd, self.remote):
            if tier.enabled and tier.codec in RQ_BITS:
                problem = layout_problem(self.layout.to_layout())
                if problem is not None:
                    raise ConfigError(f"{tier.SECTION}.codec", tier.codec, f"cannot store this layout: {problem}")

    def _resolve_map_size(self) -> None:
        ssd, bytes_per_block = self.ssd, self.layout.to_layout().bytes_per_block
        if ssd.map_size_bytes is None:
            resolved = auto_map_size_bytes(ssd.capacity_blocks, bytes_per_block)
            object.__setattr__(self, "ssd", replace(ssd, map_size_bytes=resolved))
        elif ssd.enabled and ssd.map_size_bytes < ssd.capacity_blocks * bytes_per_block:
            need = ssd.capacity_blocks * bytes_per_block
            raise ConfigError(
                "tiers.ssd.map_size_bytes",
                ssd.map_size_bytes,
                f"smaller than tiers.ssd.capacity_blocks * bytes_per_block = {ssd.capacity_blocks} * "
                f"{bytes_per_block} = {need}; use at least "
                f"{auto_map_size_bytes(ssd.capacity_blocks, bytes_per_block)} or leave it unset",
            )

    @property
    def enabled_tiers(self) -> tuple[str, ...]:
        """Names of the enabled tiers, fastest first."""
        return tuple(name for name in TIER_NAMES if getattr(self, name).enabled)

    def to_dict(self) -> dict[str, Any]:
        """Every resolved setting as a nested dict in the file's layout
        (``tiers`` holds ``hbm``/``dram``/``ssd``/``remote``; placement constants left to
        the policy are omitted); ``load_config(overrides=...)`` of it gives
        back an equal config."""
        data = asdict(self)
        data["tiers"] = {name: data.pop(name) for name in (*TIER_NAMES, "remote")}
        data["placement"] = {k: v for k, v in data["placement"].items() if v is not None}  # unset: the policy's own
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTierConfig:
        """Defaults overridden by the nested ``data`` (no file, no environment)."""
        return load_config(env={}, overrides=data)


_SECTIONS: dict[str, type] = {
    "layout": LayoutConfig,
    "namespace": NamespaceConfig,
    "hbm": HBMTierConfig,
    "dram": DRAMTierConfig,
    "ssd": SSDTierConfig,
    "remote": RemoteTierConfig,
    "placement": PlacementConfig,
    "tuned": TunedConfig,
}


def _section_path(name: str) -> tuple[str, ...]:
    return ("tiers", name) if name in (*TIER_NAMES, "remote") else (name,)


def _build_schema() -> tuple[dict[tuple[str, ...], str], set[tuple[str, ...]]]:
    """Leaf path → annotation string, and the set of section paths."""
    leaves: dict[tuple[str, ...], str] = {}
    for f in fields(KVTierConfig):
        if f.name not in _SECTIONS:
            leaves[(f.name,)] = f.type  # type: ignore[assignment]
    for name, cls in _SECTIONS.items():
        for f in fields(cls):
            leaves[(*_section_path(name), f.name)] = f.type  # type: ignore[assignment]
    assert set(leaves.values()) <= set(_KINDS), "a config field has an annotation without a kind"
    sections = {(), ("tiers",)} | {_section_path(name) for name in _SECTIONS}
    return leaves, sections


_LEAVES, _SECTION_PATHS = _build_schema()


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _children(prefix: tuple[str, ...]) -> list[str]:
    n = len(prefix)
    return sorted({p[n] for p in (*_LEAVES, *_SECTION_PATHS) if len(p) == n + 1 and p[:n] == prefix})


def _flatten(data: object, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """Nested mapping → {leaf path: value}; unknown keys and non-mapping sections raise."""
    where = _dotted(prefix) or "the top level"
    if data is None and prefix:
        return {}  # an empty YAML section ("layout:" with every key commented out)
    if not isinstance(data, Mapping):
        raise ConfigError(where, data, "must be a mapping (section) of settings")
    flat: dict[tuple[str, ...], object] = {}
    for key, value in data.items():
        path = (*prefix, str(key))
        if path in _SECTION_PATHS:
            flat.update(_flatten(value, path))
        elif path in _LEAVES:
            flat[path] = value
        else:
            raise ConfigError(_dotted(path), value, _unknown_key_problem(str(key), prefix))
    return flat


def _unknown_key_problem(key: str, prefix: tuple[str, ...]) -> str:
    valid = _children(prefix)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    section = f"of {_dotted(prefix)}" if prefix else "at the top level"
    return f"unknown key{hint}; valid keys {section}: {', '.join(valid)}"


def env_var_name(path: tuple[str, ...]) -> str:
    """Environment variable of a setting path: ``("tiers", "ssd", "path")`` → ``KVTIER_TIERS__SSD__PATH``."""
    return ENV_PREFIX + "__".join(path).upper()


def _from_env(env: Mapping[str, str]) -> dict[tuple[str, ...], object]:
    by_name = {env_var_name(path): path for path in _LEAVES}
    flat: dict[tuple[str, ...], object] = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = by_name.get(name)
        if path is None and name in SCRIPT_ENV:
            continue
        if path is None:
            close = difflib.get_close_matches(name, list(by_name), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(name, text, f"unknown kvtier environment variable{hint} (every setting has one: "
                                          f"KVTIER_ + its path in the config file, sections joined by __, as "
                                          f"KVTIER_TIERS__DRAM__CAPACITY_BLOCKS; docs/tiers.md)")
        try:
            flat[path] = _KINDS[_LEAVES[path]][1](_dotted(path), text)
        except ConfigError as err:
            raise ConfigError(err.setting, err.value, f"{_problem(err)} (from environment variable {name})") from None
    return flat


def _problem(err: ConfigError) -> str:
    return str(err).removeprefix(f"{err.setting}={err.value!r}: ")


def _read_file(path: str | os.PathLike[str]) -> dict[tuple[str, ...], object]:
    """Parse a ``.yaml``/``.yml``/``.toml`` file into {leaf path: value}."""
    name = os.fspath(path)
    suffix = Path(name).suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError("config file", name, "unknown format: the name must end in .yaml, .yml or .toml")
    try:
        text = Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("config file", name, f"cannot read: {err}") from None
    data = _parse_toml(name, text) if suffix == ".toml" else _parse_yaml(name, text)
    if data is None:
        return {}  # an empty YAML file
    if not isinstance(data, Mapping):
        raise ConfigError("config file", name, f"top level must be a mapping of settings, got {type(data).__name__}")
    try:
        return _flatten(data)
    except ConfigError as err:
        raise type(err)(err.setting, err.value, f"{_problem(err)} (in {name})") from None


def _parse_yaml(name: str, text: str) -> object:
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigError("config file", name, "reading YAML needs the 'pyyaml' package") from None
    try:
        return yaml.safe_load(text)
    # ValueError/TypeError: PyYAML constructors (e.g. an impossible date) raise them.
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as err:
        raise ConfigError("config file", name, f"invalid YAML: {err}") from None


def _parse_toml(name: str, text: str) -> object:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("config file", name, "reading TOML on Python < 3.11 needs the 'tomli' package") from None
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as err:
        raise ConfigError("config file", name, f"invalid TOML: {err}") from None


def _build(flat: Mapping[tuple[str, ...], object]) -> KVTierConfig:
    sections = {
        name: cls(**{p[-1]: v for p, v in flat.items() if p[:-1] == _section_path(name)})
        for name, cls in _SECTIONS.items()
    }
    scalars = {p[0]: v for p, v in flat.items() if len(p) == 1}
    return KVTierConfig(**sections, **scalars)


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> KVTierConfig:
    """Build and validate the configuration.

    Precedence, lowest first: defaults < the file at ``path`` < ``KVTIER_*``
    variables of ``env`` (``os.environ`` when ``None``; pass ``{}`` to ignore
    the environment) < ``overrides`` (a nested dict in the file's layout).
    Raises :class:`ConfigError` (or its subclass :class:`UnknownPolicyError`)
    naming the setting, variable or file; an error in a setting that came
    from the file or the environment says so.
    """
    layers: list[tuple[Callable[[tuple[str, ...]], str], dict[tuple[str, ...], object]]] = []
    if path is not None:
        layers.append((lambda _: f"set in {os.fspath(path)}", _read_file(path)))
    layers.append((lambda p: f"from environment variable {env_var_name(p)}", _from_env(os.environ if env is None else env)))
    if overrides is not None:
        layers.append((lambda _: "set by overrides", _flatten(overrides)))
    flat: dict[tuple[str, ...], object] = {}
    source: dict[str, str] = {}
    for origin, layer in layers:
        flat.update(layer)
        source.update({_dotted(p): origin(p) for p in layer})
    try:
        return _build(flat)
    except ConfigError as err:
        if err.setting not in source:
            raise
        raise type(err)(err.setting, err.value, f"{_problem(err)} ({source[err.setting]})") from None
