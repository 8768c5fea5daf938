"""A replay profile fitted to a served engine's measured timings (issue 57: the replay in seconds).

Owns: turning timings measured at a served engine into the figures of a
:class:`~kvtier.replay.profiles.Profile`, and the YAML file that
``kvtier replay --profile-file`` reads back. The timings
(:class:`Timing`) are of two kinds, each a whole engine step as the
profile's cost model prices it:

* ``prefill``: a prompt of ``new_tokens`` sent alone to an idle engine, no
  prefix cached, answering one token: its TTFT at the client is
  ``request_overhead_s + step_time_s(new_tokens, context_tokens, 0, 0)``
  (the prompt fits one step's token budget);
* ``decode``: the interval between two tokens of ``batch`` streams decoding
  together with ``context_tokens`` tokens cached between them:
  ``step_time_s(0, 0, batch, context_tokens)``.

The fit keeps the cost model and fits its figures: the efficiency factors
are 1 and the fitted rates are the effective ones (``peak_flops`` is the
FLOP rate a prefill reaches, ``hbm_bw_bytes_s`` the bandwidth a decode
step's weight and KV reads reach), with the fixed cost of a step
(``step_overhead_s``) and the API's per-request overhead
(``request_overhead_s``). Host engines run attention below their matmul
rate, so the fit also scales the attention width the model prices (one of
``_ATTENTION_SCALES``; reported as ``attention_scale``). For each scale it
searches the two rates on a log grid, twice refined; for each point the
step cost is the median of the decode residuals and the request overhead
the median of what the prefills leave (neither below 0), and the point with
the least summed absolute relative error wins (robust to one bad timing).
The host link (``dram->hbm`` both ways) and the SSD are given by the
caller, from the byte-path bench.

Must not run an engine, send a request or time anything (the bench that
measures, ``bench/replay_seconds.py``, does), and must not change the cost
model it fits (:mod:`kvtier.replay.profiles` owns it).

>>> from kvtier.replay.profiles import parse_profile
>>> true = model_profile("m", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=1000,
...                      dtype="float32")
>>> truth = fitted_profile(true, flops=2e11, hbm_bw=2e10, step_s=0.004, request_s=0.01, hbm_blocks=100,
...                        block_size=16)
>>> timings = [Timing("prefill", n, 0, 1, truth.hardware.request_overhead_s
...                   + truth.step_time_s(n, 0, 0, 0)) for n in (64, 256, 1024, 2048)]
>>> timings += [Timing("decode", 0, 512 * b, b, truth.step_time_s(0, 0, b, 512 * b)) for b in (1, 4, 16, 64)]
>>> fit = fit_profile(true, timings, hbm_blocks=100, block_size=16)
>>> round(fit.profile.hardware.peak_flops / 2e11, 2), round(fit.profile.hardware.step_overhead_s * 1e3, 1)
(1.0, 4.0)
>>> fit.max_relative_error < 0.01
True
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from .profiles import HARDWARE, ModelProfile, Profile

KINDS = ("prefill", "decode")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ACTIVATION_RESERVE = 256 << 20  # a small model's activations on a host engine (only sizes hbm_bytes)
_GRID = (1e6, 1e16)  # rates searched (FLOP/s and bytes/s): any host or accelerator
_POINTS = 41
# The attention term's cost against the matmuls': a host engine's attention kernels run below its matmul rate,
# which the fit folds into the attention width it prices (x this); 1 is the model's own width.
_ATTENTION_SCALES = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)


@dataclass(frozen=True, slots=True)
class Timing:
    """One measured engine timing (see the module docstring for ``kind``)."""

    kind: str
    new_tokens: int
    context_tokens: int
    batch: int
    seconds: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("timing.kind", self.kind, f"valid: {', '.join(KINDS)}")
        if self.seconds <= 0 or not math.isfinite(self.seconds):
            raise ConfigError("timing.seconds", self.seconds, "must be a finite number > 0")
        if self.kind == "prefill" and self.new_tokens <= 0:
            raise ConfigError("timing.new_tokens", self.new_tokens, "a prefill timing needs new tokens")
        if self.kind == "decode" and self.batch <= 0:
            raise ConfigError("timing.batch", self.batch, "a decode timing needs a batch of at least 1")


@dataclass(frozen=True, slots=True)
class Fit:
    """A fitted profile, the timings it was fitted to and how well it predicts each."""

    profile: Profile
    timings: tuple[Timing, ...]
    predicted_s: tuple[float, ...]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def max_relative_error(self) -> float:
        return max(abs(p - t.seconds) / t.seconds for p, t in zip(self.predicted_s, self.timings))


def model_profile(name: str, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                  vocab: int, dtype: str, tied_embeddings: bool = False) -> ModelProfile:
    """A dense Llama-shaped model (the shape of a Hugging Face ``LlamaForCausalLM`` / Qwen2 config):
    its parameters counted from the shape, weights and KV in ``dtype``."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", dtype, f"valid: {', '.join(DTYPE_BYTES)}")
    head_dim = hidden // heads
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * intermediate \
        + 2 * hidden
    params = layers * per_layer + vocab * hidden * (1 if tied_embeddings else 2) + hidden
    return ModelProfile(name=name, num_params=params, num_active_params=params, num_layers=layers, hidden_size=hidden,
                        attention_width=hidden, num_kv_heads=kv_heads, head_dim=head_dim,
                        weight_bytes=params * DTYPE_BYTES[dtype], default_chips=1, kv_dtype=dtype,
                        activation_reserve_bytes_per_chip=_ACTIVATION_RESERVE)


def fitted_profile(model: ModelProfile, *, flops: float, hbm_bw: float, step_s: float, request_s: float,
                   hbm_blocks: int, block_size: int, host_link: tuple[float, float] = (10e-6, 50e9),
                   ssd: tuple[float, float, float] = (100e-6, 7e9, 5e9), name: str = "fitted") -> Profile:
    """The profile of one chip with these effective figures (efficiency factors 1). Its HBM holds
    ``hbm_blocks`` blocks of ``block_size`` tokens beside the weights, as the engine's KV cache did.
    ``host_link`` is ``(latency_s, bytes_per_s)``; ``ssd`` is ``(latency_s, read, write bytes_per_s)``."""
    base = HARDWARE["h100-80gb"]
    kv_bytes = model.kv_bytes_per_token * block_size * hbm_blocks
    hbm_bytes = math.ceil((model.weight_bytes + model.activation_reserve_bytes_per_chip + kv_bytes) / 0.9) + 1
    hw = replace(base, name=name, hbm_bytes=hbm_bytes, hbm_bw_bytes_s=hbm_bw, peak_flops=flops,
                 host_link_latency_s=host_link[0], host_link_bw_bytes_s=host_link[1],
                 ssd_latency_s=ssd[0], ssd_read_bw_bytes_s=ssd[1], ssd_write_bw_bytes_s=ssd[2],
                 mfu_prefill=1.0, mbu_decode=1.0, step_overhead_s=step_s, collective_latency_s=0.0,
                 chips_per_node=1, request_overhead_s=request_s)
    return Profile(hw, model, 1)


def _engine_s(profile: Profile, t: Timing) -> float:
    """The step cost of ``t`` without the fixed costs being fitted."""
    if t.kind == "prefill":
        return profile.prefill_time_s(t.new_tokens, t.context_tokens)
    return profile.decode_step_time_s(t.batch, t.context_tokens)


def _score(profile: Profile, timings: Sequence[Timing]) -> tuple[float, float, float]:
    """(summed absolute relative error, step cost, request overhead) of the rates in ``profile``."""
    cost = [_engine_s(profile, t) for t in timings]
    decode = [t.seconds - c for t, c in zip(timings, cost) if t.kind == "decode"]
    step_s = max(0.0, statistics.median(decode))
    prefill = [t.seconds - c - step_s for t, c in zip(timings, cost) if t.kind == "prefill"]
    request_s = max(0.0, statistics.median(prefill))
    err = 0.0
    for t, c in zip(timings, cost):
        pred = c + step_s + (request_s if t.kind == "prefill" else 0.0)
        err += abs(pred - t.seconds) / t.seconds
    return err, step_s, request_s


def fit_profile(model: ModelProfile, timings: Sequence[Timing], *, hbm_blocks: int, block_size: int,
                host_link: tuple[float, float] = (10e-6, 50e9),
                ssd: tuple[float, float, float] = (100e-6, 7e9, 5e9), name: str = "fitted") -> Fit:
    """The profile whose step model best predicts ``timings`` (at least two of each kind). O(grid x timings)."""
    timings = tuple(timings)
    for kind in KINDS:
        if sum(t.kind == kind for t in timings) < 2:
            raise ConfigError("timings", len(timings), f"need at least two {kind} timings to fit a profile")

    def make(flops: float, bw: float, scale: float, step_s: float = 0.0, request_s: float = 0.0) -> Profile:
        shape = replace(model, attention_width=max(1, round(model.attention_width * scale)))
        return fitted_profile(shape, flops=flops, hbm_bw=bw, step_s=step_s, request_s=request_s,
                              hbm_blocks=hbm_blocks, block_size=block_size, host_link=host_link, ssd=ssd, name=name)

    best: tuple[float, ...] | None = None
    for scale in _ATTENTION_SCALES:
        lo_f, hi_f = lo_b, hi_b = _GRID
        for _ in range(3):  # a log grid, then twice a finer one around the best point
            here: tuple[float, ...] | None = None
            for i in range(_POINTS):
                flops = lo_f * (hi_f / lo_f) ** (i / (_POINTS - 1))
                for j in range(_POINTS):
                    bw = lo_b * (hi_b / lo_b) ** (j / (_POINTS - 1))
                    err, step_s, request_s = _score(make(flops, bw, scale), timings)
                    if here is None or err < here[0]:
                        here = (err, flops, bw, scale, step_s, request_s)
            assert here is not None
            span_f, span_b = (hi_f / lo_f) ** (2 / (_POINTS - 1)), (hi_b / lo_b) ** (2 / (_POINTS - 1))
            lo_f, hi_f, lo_b, hi_b = here[1] / span_f, here[1] * span_f, here[2] / span_b, here[2] * span_b
        if best is None or here[0] < best[0]:
            best = here
    assert best is not None
    err, flops, bw, scale, step_s, request_s = best
    profile = make(flops, bw, scale, step_s, request_s)
    predicted = tuple(_engine_s(profile, t) + step_s + (request_s if t.kind == "prefill" else 0.0) for t in timings)
    summary = {"flops_per_s": flops, "hbm_bytes_per_s": bw, "attention_scale": scale, "step_overhead_s": step_s,
               "request_overhead_s": request_s,
               "host_link_latency_s": host_link[0], "host_link_bytes_per_s": host_link[1],
               "mean_relative_error": err / len(timings)}
    fit = Fit(profile, timings, predicted, summary)
    summary["max_relative_error"] = fit.max_relative_error
    return fit


def write_profile(profile: Profile, path: str | Path, comment: Mapping[str, Any] | None = None) -> Path:
    """``profile`` as the YAML override file that ``kvtier replay --profile-file`` reads (every figure, so
    that the file alone is the profile); ``comment`` lines first (how it was fitted)."""
    import yaml

    path = Path(path)
    head = "".join(f"# {k}: {v}\n" for k, v in (comment or {}).items())
    data = {"base": "h100-80gb:llama-3.1-8b:1", **profile.to_overrides()}
    path.write_text(head + yaml.safe_dump(data, sort_keys=False))
    return path
