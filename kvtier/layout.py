"""KV layout descriptor: how one block of KV is laid out, and its size.

Owns: the shape arithmetic of a block (bytes per block, per layer, per token)
for the three tensor arrangements kvtier supports. Must not import torch;
dtypes are named by string.

* ``fused``  — vLLM: one tensor per layer, ``[2, num_blocks, block_size, heads, dim]``.
* ``split``  — vLLM-Ascend: a tuple ``(K, V)`` per layer, each ``[num_blocks, block_size, heads, dim]``.
* ``mla``    — DeepSeek MLA: one latent tensor per layer, ``[num_blocks, block_size, latent_dim]``.

>>> KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16).bytes_per_block
2097152
>>> KVLayout(61, 1, 576, "bfloat16", 64, arrangement="mla").bytes_per_token
70272
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError

Arrangement = Literal["fused", "split", "mla"]
ARRANGEMENTS: tuple[str, ...] = ("fused", "split", "mla")

DTYPE_TO_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the KV of one block. For ``mla``, ``head_dim`` is the latent width
    (``kv_lora_rank + qk_rope_head_dim``) and ``num_kv_heads`` must be 1."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    arrangement: Arrangement = "fused"
    bytes_per_block: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"layout.{name}", value, "must be a positive integer")
        if self.dtype not in DTYPE_TO_BYTES:
            raise ConfigError("layout.dtype", self.dtype, f"unknown dtype; valid: {sorted(DTYPE_TO_BYTES)}")
        if self.arrangement not in ARRANGEMENTS:
            raise ConfigError("layout.arrangement", self.arrangement, f"valid: {list(ARRANGEMENTS)}")
        if self.arrangement == "mla" and self.num_kv_heads != 1:
            raise ConfigError("layout.num_kv_heads", self.num_kv_heads, "MLA stores one latent: must be 1")
        object.__setattr__(self, "bytes_per_block", self.block_size * self.bytes_per_token)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_TO_BYTES[self.dtype]

    @property
    def num_kv_tensors(self) -> int:
        """Tensors per layer holding one token's KV: 2 (K and V) or 1 (MLA latent)."""
        return 1 if self.arrangement == "mla" else 2

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.num_kv_tensors * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block_per_layer(self) -> int:
        return self.block_size * self.bytes_per_token_per_layer

    def describe(self) -> str:
        """Stable one-line text of the layout (used in namespaces and SSD headers)."""
        return (
            f"{self.arrangement}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":{self.dtype}:B{self.block_size}"
        )
