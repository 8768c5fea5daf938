"""A tiny Gemma-3-shaped model (sliding-window layers beside a full-attention one) with seeded random weights.

Owns: :data:`TINY_GEMMA3` (the ``config.json``) and :func:`make_hybrid_model`
(writes it and ``model.safetensors``). Must not import vllm.

Shape: 3 layers, ``layer_types`` sliding, sliding, full (Gemma 3 has five
sliding layers per full one; two keep the test small while still giving
vLLM's hybrid KV cache manager three KV cache groups, two of them sliding),
a 64-token window (two 32-token blocks), hidden 128, 4 query heads, 2 KV
heads of 32: 8 KiB of KV per layer and 32-token block. Matrices are
N(0, 1) * 0.15 as in the tests' Llama, with an output head of its own (tied
to the embeddings, the last token's own row wins and the model repeats it),
so the output depends on the context; Gemma's norms scale by ``1 + weight``,
so their weights are zeros.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

WINDOW = 64

TINY_GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 2048, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 1000, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
}


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the model loads."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
                                          "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + n: (h,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                         "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")}
        shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    return shapes


def make_hybrid_model(directory: Path, config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` (default :data:`TINY_GEMMA3`) and seeded random
    ``model.safetensors`` into ``directory``; return ``directory``."""
    from .engine_support import write_seeded_model

    cfg = TINY_GEMMA3 if config is None else config
    return write_seeded_model(directory, cfg, weight_shapes(cfg), norm_value=0.0)  # Gemma scales by 1 + weight
