"""A tiny Granite-4.0-H-shaped hybrid model (one Mamba2 layer, one attention layer) with seeded random weights.

Owns: :data:`TINY_GRANITE4H` (the ``config.json``) and :func:`make_ssm_model`
(writes it and ``model.safetensors``). Must not import vllm: the weights are
written with torch and safetensors only, as ``mla_model.make_mla_model`` does.

Shape: ``GraniteMoeHybridForCausalLM`` with no experts (``num_local_experts``
0: a dense shared MLP per layer, as Granite-4.0-H-Micro), 2 layers: a Mamba2
mixer (8 heads of 32, state 16, one group, conv width 4), then full attention
(4 query heads, 2 KV heads of 32), hidden 128, bf16. vLLM gives it two KV
cache groups: ``FullAttentionSpec`` for the attention layer and ``MambaSpec``
for the Mamba2 layer's conv + SSM state (one state per request, not KV per
token). Run with ``LLM(model=..., load_format="safetensors", skip_tokenizer_init=True)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_GRANITE4H: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "hidden_size": 128, "intermediate_size": 256, "shared_intermediate_size": 256, "num_local_experts": 0,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
    "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 64, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "position_embedding_type": "rope", "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "embedding_multiplier": 1.0, "attention_multiplier": 1.0 / 32, "residual_multiplier": 1.0,
    "logits_scaling": 1.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "vocab_size": 1000,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
"""Layer 0 Mamba2 (inner width 256 = 8 heads x 32), layer 1 attention (2 KV heads of 32)."""


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the model loads, by its Hugging Face name."""
    h, inter, heads = cfg["hidden_size"], cfg["shared_intermediate_size"], cfg["num_attention_heads"]
    head_dim = h // heads
    kv = cfg["num_key_value_heads"] * head_dim
    m_heads, m_inner = cfg["mamba_n_heads"], cfg["mamba_n_heads"] * cfg["mamba_d_head"]
    groups_state = cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    conv_dim = m_inner + 2 * groups_state  # x, B, C go through the convolution
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
                                          "model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "shared_mlp.input_linear.weight": (2 * inter, h),
                   p + "shared_mlp.output_linear.weight": (h, inter)}
        if kind == "mamba":
            shapes |= {p + "mamba.in_proj.weight": (m_inner + conv_dim + m_heads, h),  # z, xBC, dt
                       p + "mamba.conv1d.weight": (conv_dim, 1, cfg["mamba_d_conv"]),
                       p + "mamba.conv1d.bias": (conv_dim,),
                       p + "mamba.dt_bias": (m_heads,), p + "mamba.A_log": (m_heads,), p + "mamba.D": (m_heads,),
                       p + "mamba.norm.weight": (m_inner,), p + "mamba.out_proj.weight": (h, m_inner)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h)}
    return shapes


def make_ssm_model(directory: Path, config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` (default :data:`TINY_GRANITE4H`) and seeded random
    ``model.safetensors`` into ``directory``; return ``directory``. Matrices and
    per-head Mamba parameters are N(0, 1) * 0.15 (as the tests' Llama; ``A_log``
    near 0 gives a decay near ``exp(-1)`` per step scaled by ``dt``), norm
    weights are ones; the same seed gives the same bytes."""
    from .engine_support import write_seeded_model

    cfg = TINY_GRANITE4H if config is None else config
    return write_seeded_model(directory, cfg, weight_shapes(cfg), is_norm=lambda name, shape: name.endswith("norm.weight"))
