"""Compressed cold tiers in the replay (``kvtier replay --cold-codec``): the codec profile and what a codec changes.

Owns: reading a codec profile (the JSON ``kvtier bench codecs --json FILE.json``
writes: ``{"results": [{"sample", "codec", "ratio", "encode_gbps", "decode_gbps", ...}]}``,
whose ``engine`` sample is used when it has one; or a hand-written
``{"codecs": [{"codec", "ratio", "encode_gbps", "decode_gbps"}]}``),
:class:`ColdCodec` (one codec's ratio and CPU throughput, the tiers it
compresses, the cores it runs on), the tiers' effective capacities and the
stages of a modelled transfer (link hops with the bytes they carry, encode,
decode). Must not simulate (:mod:`kvtier.replay.sim` applies it) or read any
file but the profile.

The model:

* Cold tiers are host DRAM and SSD (``tiers``: both, or SSD only); HBM stays
  exact. ``--dram-blocks`` / ``--ssd-blocks`` stay byte budgets counted in raw
  blocks: a compressed tier holds ``floor(capacity * ratio)`` blocks (the same
  bytes, more blocks).
* Bytes: the codec runs on the host CPU (as kvtier's does: the SSD tier's
  reader and writer threads), so the accelerator link (HBM <-> DRAM) always
  carries raw bytes; a host hop into or out of a compressed tier (DRAM <->
  SSD) carries ``ceil(raw bytes per block / ratio)`` per block.
* CPU: encoding and decoding are two more resources of the link model
  (:mod:`kvtier.transfer.linkmodel`), ``codec:encode`` and ``codec:decode``,
  each a FIFO served at ``cores x`` the profile's per-core GB/s of raw bytes,
  with no latency term. They are stages of the transfer's serial pipeline,
  like its link hops: each stage starts once the previous one finished the
  whole batch and its resource is free (the replay's store-and-forward link
  model). Into a compressed DRAM: the raw bytes cross the accelerator link,
  then encode; out of it: decode, then the link. Into a compressed SSD from an
  uncompressed DRAM: encode, then the compressed bytes; out of it: those
  bytes, then decode. A move between two compressed tiers (SSD -> DRAM
  staging) carries compressed bytes and no codec stage. Encode
  and decode have their own cores, as a link has its two directions, so a
  write-down never queues a load's decode. Policies predict transfer times
  (load or recompute, swap) over the same stages, so a slow decoder makes
  recomputing win where it is faster.
* Once per block: a block written down from HBM is encoded unless another
  compressed tier already holds (or is receiving) its compressed copy, whose
  bytes go down instead: one write-through to DRAM and SSD encodes once, a
  DRAM -> SSD hop never re-encodes, an HBM victim written to DRAM whose SSD
  copy exists is not encoded again (the model still charges the link from
  HBM, not an SSD read). A block written down again after every compressed
  copy of it was dropped is encoded again: there is nothing left to copy.
* ``raw`` is the identity: no codec stage, ratio 1, whatever its profile
  entry says (the replay's results equal those without ``--cold-codec``).

Live counterpart: the vLLM connector's DRAM tier holds raw slots, so only
``--cold-codec-tiers ssd`` has one (``tiers.ssd.codec`` for every block, or
``cold_codec`` for the blocks of requests followed by a long tool wait:
:mod:`kvtier.placement.cold`); a compressed DRAM is modelled only.

Not modelled: the remote tier of a fleet stays raw; codec threads competing
with the engine's own CPU work.

>>> c = ColdCodec("rq4", ratio=3.76, encode_gbps=0.8, decode_gbps=1.6)
>>> c.capacity_blocks("dram", 1000), c.capacity_blocks("hbm", 1000)
(3760, 1000)
>>> transfer_stages(c, "dram", "hbm", 2, 4_000_000)
[('codec:decode', 8000000), ('dram->hbm', 8000000)]
>>> transfer_stages(ColdCodec("rq4", 3.76, 0.8, 1.6, tiers=("ssd",)), "ssd", "hbm", 2, 4_000_000)
[('ssd->dram', 2127660), ('codec:decode', 8000000), ('dram->hbm', 8000000)]
>>> transfer_stages(None, "ssd", "hbm", 2, 4_000_000)
[('ssd->dram', 8000000), ('dram->hbm', 8000000)]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

IDENTITY = "raw"
COLD_TIERS = ("dram", "ssd")
TIER_CHOICES = {"dram,ssd": ("dram", "ssd"), "ssd": ("ssd",)}  # --cold-codec-tiers
ENCODE = "codec:encode"  # link-model resources of the codec stages
DECODE = "codec:decode"
CODEC_STAGES = (ENCODE, DECODE)
FIELDS = ("ratio", "encode_gbps", "decode_gbps")


@dataclass(frozen=True, slots=True)
class ColdCodec:
    """The codec of the cold tiers: ``ratio`` = raw bytes / stored bytes,
    ``encode_gbps`` / ``decode_gbps`` = GB/s of raw bytes one CPU core
    encodes / decodes, ``cores`` per direction, ``tiers`` it compresses."""

    name: str
    ratio: float
    encode_gbps: float
    decode_gbps: float
    tiers: tuple[str, ...] = COLD_TIERS
    cores: int = 1
    profile_path: str = ""

    @property
    def identity(self) -> bool:
        """``raw``: stored as is, no codec stage (the replay without ``--cold-codec``)."""
        return self.name == IDENTITY

    def compresses(self, tier: str) -> bool:
        return not self.identity and tier in self.tiers

    def capacity_blocks(self, tier: str, raw_blocks: int) -> int:
        """Blocks ``tier`` holds with a byte budget of ``raw_blocks`` raw blocks."""
        if not self.compresses(tier):
            return raw_blocks
        return math.floor(raw_blocks * self.ratio + 1e-9)

    def stored_bytes(self, raw_bytes_per_block: int) -> int:
        """Bytes one block takes in a compressed tier and on a link to or from one."""
        return math.ceil(raw_bytes_per_block / self.ratio)

    def service_s(self, stage: str, raw_bytes: int) -> float:
        """Seconds ``stage`` (:data:`ENCODE` or :data:`DECODE`) takes for ``raw_bytes``."""
        gbps = self.encode_gbps if stage == ENCODE else self.decode_gbps
        return raw_bytes / (gbps * 1e9 * self.cores)

    def prior(self) -> dict[str, tuple[float, float]]:
        """(latency_s, bytes_per_s) of the codec stages, as link-model priors."""
        return {ENCODE: (0.0, self.encode_gbps * 1e9 * self.cores),
                DECODE: (0.0, self.decode_gbps * 1e9 * self.cores)}

    def describe(self) -> dict[str, Any]:
        """The codec as the JSON report states it."""
        return {"name": self.name, "ratio": 1.0 if self.identity else self.ratio,
                "encode_gbps_per_core": None if self.identity else self.encode_gbps,
                "decode_gbps_per_core": None if self.identity else self.decode_gbps,
                "cores": self.cores, "tiers": list(self.tiers), "profile": self.profile_path,
                "identity": self.identity}


def hops(src: str, dst: str) -> list[tuple[str, str]]:
    """The links a copy from ``src`` to ``dst`` crosses (SSD <-> HBM goes through DRAM)."""
    if src == "ssd" and dst == "hbm":
        return [("ssd", "dram"), ("dram", "hbm")]
    if src == "hbm" and dst == "ssd":
        return [("hbm", "dram"), ("dram", "ssd")]
    return [(src, dst)]


def transfer_stages(codec: ColdCodec | None, src: str, dst: str, num_blocks: int, raw_bytes_per_block: int,
                    num_encode: int | None = None) -> list[tuple[str, int]]:
    """The serial stages of copying ``num_blocks`` from ``src`` to ``dst``:
    (link or codec resource, bytes) in order; codec stages count raw bytes.
    ``num_encode``: how many of the blocks need encoding where they enter a
    compressed tier (default all; the others have a compressed copy to send)."""
    raw = num_blocks * raw_bytes_per_block
    if codec is None or codec.identity:
        return [(f"{a}->{b}", raw) for a, b in hops(src, dst)]
    stored = num_blocks * codec.stored_bytes(raw_bytes_per_block)
    n_enc = num_blocks if num_encode is None else num_encode
    out: list[tuple[str, int]] = []
    for a, b in hops(src, dst):
        link = f"{a}->{b}"
        ca, cb = codec.compresses(a), codec.compresses(b)
        if "hbm" in (a, b):  # the accelerator link: raw bytes; the host codes on its side of it
            if ca:
                out.append((DECODE, raw))
            out.append((link, raw))
            if cb and n_enc:
                out.append((ENCODE, n_enc * raw_bytes_per_block))
            continue
        if cb and not ca and n_enc:
            out.append((ENCODE, n_enc * raw_bytes_per_block))
        out.append((link, stored if ca or cb else raw))
        if ca and not cb:
            out.append((DECODE, raw))
    return out


def load_codec_profile(path: str | Path) -> list[dict[str, Any]]:
    """The ``codecs`` entries of a codec profile; :class:`ConfigError` naming
    ``--codec-profile``, the file and what is wrong (missing, not JSON, no
    ``codecs`` list, an entry without a ``codec`` name)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError("--codec-profile", str(path), "no such file (a codec profile is the JSON "
                                                        "kvtier bench codecs --json FILE.json writes)") from None
    except OSError as e:
        raise ConfigError("--codec-profile", str(path), f"cannot read it: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("--codec-profile", str(path), f"not valid JSON: {e}") from None
    entries = doc.get("codecs") if isinstance(doc, dict) else None
    if entries is None and isinstance(doc, dict) and isinstance(doc.get("results"), list):
        rows = [r for r in doc["results"] if isinstance(r, dict) and r.get("ratio") is not None]
        samples = [r.get("sample") for r in rows]
        sample = "engine" if "engine" in samples else (samples[0] if samples else None)
        entries = [r for r in rows if r.get("sample") == sample]
    if not isinstance(entries, list):
        raise ConfigError("--codec-profile", str(path), "field 'codecs' must be a list of {\"codec\", \"ratio\", "
                                                        "\"encode_gbps\", \"decode_gbps\"} objects")
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("codec"), str) or not e["codec"]:
            raise ConfigError("--codec-profile", str(path), f"codecs[{i}]: field 'codec' must be a non-empty string")
    return entries


def cold_codec(name: str, profile_path: str | Path, tiers: tuple[str, ...] = COLD_TIERS,
               cores: int = 1) -> ColdCodec:
    """The codec ``name`` as the profile at ``profile_path`` measured it.
    :class:`ConfigError` naming the flag, the file or the field at fault
    (``--cold-codec`` not in the profile; ``ratio``, ``encode_gbps`` or
    ``decode_gbps`` missing, not a number or not > 0)."""
    entries = load_codec_profile(profile_path)
    entry = next((e for e in entries if e["codec"] == name), None)
    if entry is None:
        listed = ", ".join(e["codec"] for e in entries) or "none"
        raise ConfigError("--cold-codec", name, f"not in the codec profile {str(profile_path)!r} (it has: {listed})")
    if not set(tiers) <= set(COLD_TIERS) or not tiers:
        raise ConfigError("--cold-codec-tiers", ",".join(tiers), f"valid: {', '.join(TIER_CHOICES)}")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ConfigError("--codec-cores", cores, "must be an integer >= 1")
    if name == IDENTITY:  # the identity: its measured numbers (a memcpy) are not used
        return ColdCodec(name, 1.0, math.inf, math.inf, tuple(tiers), cores, str(profile_path))
    values = {}
    for field in FIELDS:
        v = entry.get(field)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        if not ok:
            raise ConfigError("--codec-profile", str(profile_path),
                              f"codec {name!r}: field {field!r} is {v!r}: must be a finite number > 0")
        values[field] = float(v)
    return ColdCodec(name, values["ratio"], values["encode_gbps"], values["decode_gbps"], tuple(tiers), cores,
                     str(profile_path))
