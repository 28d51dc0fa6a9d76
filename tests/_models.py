"""Tiny random-weight hybrid (gated DeltaNet or Kimi delta attention + attention) causal LMs for tests.

Every model is built from a config (nothing is downloaded): float32, eval mode,
vocab 128 (pad 0 / bos 1 / eos 2), hidden 32, 4 decoder layers.
``build(family, seed)`` seeds torch and builds; ``FAMILIES`` maps a family name
to its zero-argument builder (unseeded: prefer ``build``).

Recurrent memory at init (checked with transformers 5.24.0, seeds 0-3, batch 2,
12 tokens; "effect" = max |logits[:, 11]| change when one gated DeltaNet layer's
recurrent state after token 4 is zeroed via the cache, worst layer and seed):

* The Qwen-style GatedDeltaNet init draws A = exp(A_log) ~ U(0.01, 16)
  (LaraMini: U(1, 16)) with dt_bias = 1, so the per-token decay
  alpha = exp(-A * softplus(a + dt_bias)) ~ exp(-1.3 A) is ~0 for most heads:
  the layers were nearly memoryless (effect 2e-8 .. 4e-7, far below 1e-4).
  ``_lengthen_memory`` therefore divides A by 64 (A_log -= log 64) in those five
  families, giving alpha in roughly [0.72, 1.0] at init. Effect afterwards:
  qwen3_next 4.7e-3, qwen3_5 1.4e-3, qwen3_5_moe 3.1e-3, qwen4_exp 3.7e-4,
  lara_mini 2.2e-3.
* OlmoHybrid initialises dt in [1e-3, 0.1] (inv-softplus dt_bias), so its decay
  is already long (alpha ~ 0.9): effect 2.1e-4 unmodified, left as is.
* Final recurrent-state norms after 12 tokens are O(1e-2) per layer (clearly
  non-zero; values are small because of the 0.02-std init, and the gated RMSNorm
  on the layer output removes that scale).

Kimi delta attention families (same check, state zeroed with
``recurrent_hooks``' ``set_state_after(4, zeros)``; alpha = exp(g) is the
per-key-channel decay at init, over channels and tokens):

* kimi_linear (g = -exp(A_log) softplus(f + dt_bias), A ~ U(1, 16)): alpha
  min 0.33, median 0.84 .. 0.97; effect >= 1.6e-2. Left as it is.
* glm5_next (safe gate g = -5 sigmoid(exp(A_log) (f + dt_bias)), A_log = 0):
  alpha min 0.62, median 0.89 .. 0.96; effect >= 1.5e-2. Left as it is. Built
  as ``Glm5NextForConditionalGeneration`` with a 1-block vision tower (the
  default one has 460 M parameters).
* bailing_hybrid has the same safe gate but initialises A ~ U(1, 16), so
  exp(A_log) (f + dt_bias) ~ -40 and alpha rounds to 1.0 in most channels
  (median >= 0.996): not memoryless (effect >= 5e-2), but the decay, the part KDA adds to the delta
  rule, would barely be exercised. ``_bailing_hybrid`` zeroes A_log as
  glm5_next's init does: alpha min 0.58, median 0.92 .. 0.97; effect >= 2.5e-2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import transformers

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2

_COMMON = dict(
    vocab_size=VOCAB,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    hidden_size=32,
    num_hidden_layers=4,
)
_HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
_GDN = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

# Divide the GatedDeltaNet decay rate A by this (see module docstring).
_MEMORY_FACTOR = 64.0


def _config(config_cls, **kwargs) -> transformers.PretrainedConfig:
    """``config_cls(**kwargs)``, refusing kwargs the config does not declare.

    transformers configs silently store unknown kwargs as attributes, so a typo
    (or a field another family has) would otherwise be ignored without notice.
    """
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no field(s) {unknown}")
    return config_cls(**kwargs)


def _make(config_cls, model_cls, **kwargs) -> transformers.PreTrainedModel:
    """Build ``model_cls(config_cls(**kwargs))``, refusing kwargs the config does not declare."""
    return model_cls(_config(config_cls, **kwargs))


def _lengthen_memory(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A <- A / _MEMORY_FACTOR in every GatedDeltaNet layer (deterministic, no RNG)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.sub_(math.log(_MEMORY_FACTOR))
    return model


def _qwen3_next():
    return _lengthen_memory(_make(
        transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
        **_COMMON, **_ATTENTION, **_GDN, **_MOE,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ))


def _qwen3_5():
    return _lengthen_memory(_make(
        transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
        **_COMMON, **_ATTENTION, **_GDN,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
    ))


def _qwen3_5_moe():
    return _lengthen_memory(_make(
        transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
        **_COMMON, **_ATTENTION, **_GDN, **_MOE,
        layer_types=list(_HYBRID_LAYERS),
    ))


def _olmo_hybrid():
    # OlmoHybridConfig has no head_dim field; head_dim = hidden_size // num_attention_heads = 16.
    attention = {k: v for k, v in _ATTENTION.items() if k != "head_dim"}
    return _make(
        transformers.OlmoHybridConfig, transformers.OlmoHybridForCausalLM,
        **_COMMON, **attention, **_GDN,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
    )


def _qwen4_exp():
    return _lengthen_memory(_make(
        transformers.Qwen4ExpTextConfig, transformers.Qwen4ExpForCausalLM,
        **_COMMON, **_ATTENTION, **_GDN, **_MOE,
        layer_types=["linear_attention", "indexed_attention"] * 2,
        hc_count=2,
        hc_lowrank=8,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=2,
    ))


def _lara_mini():
    return _lengthen_memory(_make(
        transformers.LaraMiniConfig, transformers.LaraMiniForCausalLM,
        **_COMMON, **_ATTENTION, **_GDN, **_MOE,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
        sliding_window=8,
    ))


# Kimi delta attention families: MLA attention layers, DeepSeek-style MoE, KDA with 4 heads of 8
# (bailing_hybrid derives its KDA heads from the attention fields: 2 heads of 16).
_MLA = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, v_head_dim=16, qk_nope_head_dim=16)
_KDA_MOE = dict(num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32)
_KDA = dict(linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4)


def _kimi_linear():
    return _make(
        transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM,
        **_COMMON, **_MLA, **_KDA_MOE, **_KDA,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
        mlp_layer_types=["dense", "sparse"] * 2,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        num_local_experts=4,
    )


def _bailing_hybrid():
    model = _make(
        transformers.BailingHybridConfig, transformers.BailingHybridForCausalLM,
        **_COMMON, **_MLA, **_KDA_MOE,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
        q_lora_rank=None,
        qk_rope_head_dim=8,
        num_local_experts=4,
        head_dim=16,
        first_k_dense_replace=1,
        short_conv_kernel_size=4,
        num_mtp_layers=0,
    )
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridForgetGate

    # A_log = 0, as glm5_next initialises the same safe gate: otherwise alpha ~ 1 (see module docstring).
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, BailingHybridForgetGate):
                module.A_log.zero_()
    return model


def _glm5_next():
    text = _config(
        transformers.Glm5NextTextConfig,
        **_COMMON, **_MLA, **_KDA_MOE, **_KDA,
        intermediate_size=64,
        layer_types=["linear_attention", "indexed_attention"] * 2,
        mlp_layer_types=["dense", "sparse"] * 2,
        n_routed_experts=4,
        q_lora_rank=16,
        qk_rope_head_dim=0,
        index_topk=16,
        index_head_dim=16,
        index_n_heads=2,
        index_kpool=4,
        hc_mult=2,
    )
    vision = _config(
        transformers.Glm5NextVisionConfig,
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=32,
        projection_intermediate_size=64,
    )
    return transformers.Glm5NextForConditionalGeneration(
        _config(transformers.Glm5NextConfig, text_config=text, vision_config=vision)
    )


FAMILIES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "olmo_hybrid": _olmo_hybrid,
    "qwen4_exp": _qwen4_exp,
    "lara_mini": _lara_mini,
    "kimi_linear": _kimi_linear,
    "bailing_hybrid": _bailing_hybrid,
    "glm5_next": _glm5_next,
}


def build(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """Seed torch, build ``family``'s tiny CausalLM in float32 and return it in eval mode."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    return model.to(torch.float32).eval()


def random_ids(batch: int, seq: int, seed: int = 0) -> torch.LongTensor:
    """Token ids in [3, VOCAB) (never pad/bos/eos), from a private generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=generator, dtype=torch.long)
