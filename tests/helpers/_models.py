"""Tiny random-weight recurrent causal LMs for tests: gated DeltaNet, Kimi delta attention and Mamba
(Mamba-1 / Mamba-2) mixers, mostly in hybrids with attention.

Every model is built from a config (nothing is downloaded): float32, eval mode,
vocab 128 (pad 0 / bos 1 / eos 2), hidden 32, 4 decoder layers (2 for mamba,
falcon_mamba, mamba2 and falcon_h1).
``build(family, seed)`` seeds torch and builds; ``FAMILIES`` maps a family name
to its zero-argument builder (unseeded: prefer ``build``).
``build`` and ``random_ids`` put the model and the ids on ``DEVICE`` (the CPU unless
``pytest --device`` names another: tests/conftest.py sets it); the weights and the ids
are drawn on the CPU first, so they are the same numbers on every device.

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

Mamba families (same check, seeds 0-3, every Mamba layer; the cache's
``layers[i].recurrent_states[0]`` zeroed after token 4, then tokens 5..11 fed one at a
time with explicit ``position_ids`` (bamba's forward otherwise restarts positions at 0);
pure Mamba models take the cache as ``cache=``: their forward silently ignores ``past_key_values=``).
Effect at default init -> as built, with per-token decay exp(dt A) and rms |B|, |C| as built:

* mamba 1.2e-4 -> 2.1e-3: ``x_proj`` B/C rows x4 (|B|, |C| 0.12 -> 0.5).
* falcon_mamba 1.2e-2, mamba2 6.8e-4: left as they are (dt in [1e-3, 0.1], B and C
  RMS-normed in falcon_mamba, |B|, |C| ~ 0.15 in mamba2).
* jamba 6.9e-7 -> 1.3e-3: dt_proj.bias is zero-initialised, so dt = 0.69 and the decay
  is 0.05 per token (median). dt -> [0.01, 0.1] (decay median 0.89), conv1d x16, out_proj x4.
* zamba < 1e-8 (below float32 resolution of the logits) -> 2.3e-3: dt is fine (1e-3 .. 0.1), but
  ``x_proj_weight`` and conv1d ~ N(0, 0.02) give |B|, |C| ~ 2e-4. conv1d x16, ``x_proj_weight``
  B/C rows x512 (|B|, |C| ~ 2), out_proj x4.
* bamba, falcon_h1, granitemoehybrid, nemotron_h, zamba2 (Mamba-2 hybrids) <= 1.7e-7 ->
  2.2e-3, 5.5e-3, 2.7e-3, 2.8e-3, 3.7e-3: in_proj and conv1d ~ N(0, 0.02) give |B|, |C| ~ 2e-3;
  bamba, falcon_h1 and granitemoehybrid also set dt_bias = 1 (dt 1.3, decay median 0.04).
  dt_bias -> softplus^-1 of [0.01 .. 0.1] over the 4 heads (decay 0.6 .. 0.99), conv1d x16,
  in_proj B/C rows x16 (|B|, |C| ~ 0.6; x64 for falcon_h1, whose mixer output y * silu(gate) is
  not normalised when mamba_rms_norm=False), out_proj x4. For nemotron_h and zamba2 the dt
  change also keeps dt away from their dt floor (time_step_min = 1e-3): the prompt kernel clamps
  dt there but the one-token decode kernel does not, so larger B/C with dt < 1e-3 made cached
  decoding differ from a full forward by up to 1e-4.

RWKV-4 (rwkv: 2 layers, all time mixing, no attention, no Cache; same check, the WKV state of one
layer after token 4 replaced by the empty one): effect 0.35 .. 0.71 at default init (time_decay spans
[-5, 3], so per-token decays e^{-w} from 0.99 to 2e-9 over the channels); left as it is.
xlstm (hidden 64: transformers' cache rounds head dims up to multiples of 64): xLSTM's init gives the mLSTM
gates zero weights and an input gate bias of -10, so the gates are constant per head and the memory is tiny
(C, n ~ 1e-3, the denominator e^(-m) wins). ``_gate_the_mlstm`` draws gate weights ~ N(0, 0.25^2) and zeroes the input
gate bias: gates depend on the input (preactivations std ~2), C and n are O(1), and zeroing both layers'
states after token 4 moves the last logits by 1.3 .. 1.8 (seeds 0-2). Cached decoding matches the full forward within
8e-6 (the chunk-wise prompt kernel against the step kernel).

conv1d x16 and out_proj x4 bring those N(0, 0.02) weights to about PyTorch's default (kaiming)
scale, which MambaMixer and Mamba2Mixer keep. Cached one-token decoding matches the full forward
within 1e-6 in every family. Build 13-18 ms, 2x12 forward 3-8 ms, 4-token generate 8-19 ms
(after the first model of the process, which pays ~2 s of imports).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import transformers

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2

# Where `build` puts a model and `random_ids` its ids: set once, from `pytest --device`, by tests/conftest.py
# (`torch.empty(0, device=...).device`, so "cuda" reads "cuda:0" and compares equal to a tensor's device).
DEVICE = torch.device("cpu")

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


def _for_each(model: transformers.PreTrainedModel, class_name: str, change) -> transformers.PreTrainedModel:
    """``change(module)`` for every module of ``model`` whose class is named ``class_name``, without gradients."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == class_name:
                change(module)
    return model


def _zero_forget_gates(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A_log = 0 in every bailing_hybrid forget gate, as glm5_next initialises the same safe gate: otherwise
    alpha ~ 1 (see module docstring)."""
    return _for_each(model, "BailingHybridForgetGate", lambda gate: gate.A_log.zero_())


def _unit_key_scales(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """ZayaQKNorm's key scale ``temp`` 1 per kv head: its init of zeros makes every key 0 (see ``_zaya``)."""
    return _for_each(model, "ZayaQKNorm", lambda norm: norm.temp.fill_(1.0))


def _qwen3_next():
    return _lengthen_memory(
        _make(
            transformers.Qwen3NextConfig,
            transformers.Qwen3NextForCausalLM,
            **_COMMON,
            **_ATTENTION,
            **_GDN,
            **_MOE,
            intermediate_size=64,
            layer_types=list(_HYBRID_LAYERS),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    )


def _qwen3_5():
    return _lengthen_memory(
        _make(
            transformers.Qwen3_5TextConfig,
            transformers.Qwen3_5ForCausalLM,
            **_COMMON,
            **_ATTENTION,
            **_GDN,
            intermediate_size=64,
            layer_types=list(_HYBRID_LAYERS),
        )
    )


def _qwen3_5_moe():
    return _lengthen_memory(
        _make(
            transformers.Qwen3_5MoeTextConfig,
            transformers.Qwen3_5MoeForCausalLM,
            **_COMMON,
            **_ATTENTION,
            **_GDN,
            **_MOE,
            layer_types=list(_HYBRID_LAYERS),
        )
    )


def _olmo_hybrid():
    # OlmoHybridConfig has no head_dim field; head_dim = hidden_size // num_attention_heads = 16.
    attention = {k: v for k, v in _ATTENTION.items() if k != "head_dim"}
    return _make(
        transformers.OlmoHybridConfig,
        transformers.OlmoHybridForCausalLM,
        **_COMMON,
        **attention,
        **_GDN,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
    )


def _qwen4_exp():
    return _lengthen_memory(
        _make(
            transformers.Qwen4ExpTextConfig,
            transformers.Qwen4ExpForCausalLM,
            **_COMMON,
            **_ATTENTION,
            **_GDN,
            **_MOE,
            layer_types=["linear_attention", "indexed_attention"] * 2,
            hc_count=2,
            hc_lowrank=8,
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=8,
            indexer_compress_ratio=2,
        )
    )


def _lara_mini():
    return _lengthen_memory(
        _make(
            transformers.LaraMiniConfig,
            transformers.LaraMiniForCausalLM,
            **_COMMON,
            **_ATTENTION,
            **_GDN,
            **_MOE,
            layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
            sliding_window=8,
        )
    )


# Kimi delta attention families: MLA attention layers, DeepSeek-style MoE, KDA with 4 heads of 8
# (bailing_hybrid derives its KDA heads from the attention fields: 2 heads of 16).
_MLA = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, v_head_dim=16, qk_nope_head_dim=16)
_KDA_MOE = dict(num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32)
_KDA = dict(linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4)


def _kimi_linear():
    return _make(
        transformers.KimiLinearConfig,
        transformers.KimiLinearForCausalLM,
        **_COMMON,
        **_MLA,
        **_KDA_MOE,
        **_KDA,
        intermediate_size=64,
        layer_types=list(_HYBRID_LAYERS),
        mlp_layer_types=["dense", "sparse"] * 2,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        num_local_experts=4,
    )


def _bailing_hybrid():
    return _zero_forget_gates(
        _make(
            transformers.BailingHybridConfig,
            transformers.BailingHybridForCausalLM,
            **_COMMON,
            **_MLA,
            **_KDA_MOE,
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
    )


def _glm5_next():
    text = _config(
        transformers.Glm5NextTextConfig,
        **_COMMON,
        **_MLA,
        **_KDA_MOE,
        **_KDA,
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


# Mamba (selective SSM) families. MambaConfig-style configs take no attention fields; of the hybrids'
# configs only NemotronH has a head_dim field (elsewhere head_dim = hidden_size // num_attention_heads
# = 16 for heads 2/1; zamba and zamba2 use heads 2/2 as in the reference configs).
_TWO_LAYERS = {**_COMMON, "num_hidden_layers": 2}
_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)
_MAMBA = dict(state_size=8, expand=2, conv_kernel=4)
_HYBRID_MAMBA = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
_HYBRID_MAMBA2 = dict(**_HYBRID_MAMBA, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_chunk_size=8)
# Time steps of the Mamba-2 hybrids (and jamba) after ``_strengthen_ssm`` (see module docstring).
_DT_RANGE = (0.01, 0.1)


def _strengthen_ssm(
    model: transformers.PreTrainedModel,
    *,
    dt: tuple[float, float] | None = None,
    bc: float = 1.0,
    conv: float = 1.0,
    out: float = 1.0,
) -> transformers.PreTrainedModel:
    """Rescale every Mamba / Mamba-2 mixer so that its state shows in the logits at init (no RNG).

    ``dt=(lo, hi)`` sets the time-step bias (``dt_bias``, or ``dt_proj.bias`` for jamba) to
    softplus^-1 of a log-spaced grid from lo to hi over heads (channels); ``bc`` multiplies the
    projection rows that produce B and C (``x_proj`` for Mamba-1, the B/C rows of ``in_proj`` for
    Mamba-2); ``conv`` multiplies ``conv1d.weight``; ``out`` multiplies ``out_proj.weight``.
    """
    with torch.no_grad():
        for module in model.modules():
            if not (isinstance(getattr(module, "A_log", None), torch.nn.Parameter) and hasattr(module, "conv1d")):
                continue
            rank = getattr(module, "time_step_rank", None)
            if isinstance(getattr(module, "dt_bias", None), torch.nn.Parameter):  # Mamba-2
                dt_bias = module.dt_bias
                inner, bc_size = module.intermediate_size, module.n_groups * module.ssm_state_size
                # in_proj rows: [gate, x, B, C, dt], B and C each n_groups * ssm_state_size wide.
                module.in_proj.weight[2 * inner : 2 * inner + 2 * bc_size] *= bc
            elif hasattr(module, "x_proj"):  # Mamba-1: x_proj rows [dt, B, C]
                dt_bias = module.dt_proj.bias
                module.x_proj.weight[rank:] *= bc
            else:  # zamba: one x_proj per head, [heads, dt + B + C, head_dim]
                dt_bias = module.dt_proj_bias
                module.x_proj_weight[:, rank:] *= bc
            if dt is not None:
                steps = torch.logspace(math.log10(dt[0]), math.log10(dt[1]), dt_bias.shape[-1], dtype=torch.float64)
                dt_bias.copy_((steps + torch.log(-torch.expm1(-steps))).expand_as(dt_bias))
            module.conv1d.weight *= conv
            module.out_proj.weight *= out
    return model


def _mamba():
    # x_proj B/C rows x4: with the default init the state's effect on the logits is only ~1e-4.
    return _strengthen_ssm(
        _make(
            transformers.MambaConfig,
            transformers.MambaForCausalLM,
            **_TWO_LAYERS,
            **_MAMBA,
        ),
        bc=4.0,
    )


def _falcon_mamba():
    return _make(
        transformers.FalconMambaConfig,
        transformers.FalconMambaForCausalLM,
        **_TWO_LAYERS,
        **_MAMBA,
    )


def _jamba():
    # Default dt = softplus(0) = 0.69 (dt_proj.bias is zero-initialised): decay ~0.05 per token,
    # memoryless. dt -> [0.01, 0.1]; conv1d x16 and out_proj x4 bring the N(0, 0.02) init of
    # these weights to PyTorch's default (kaiming) scale. B and C are RMS-normed: bc has no effect.
    return _strengthen_ssm(
        _make(
            transformers.JambaConfig,
            transformers.JambaForCausalLM,
            **_COMMON,
            **_HEADS,
            **_HYBRID_MAMBA,
            intermediate_size=64,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
        ),
        dt=_DT_RANGE,
        conv=16.0,
        out=4.0,
    )


def _zamba_layers() -> dict:
    """What zamba and zamba2 share: attention heads 2/2 (as in the reference configs) and a mamba layer, then a hybrid
    one (with the shared attention block), twice."""
    return dict(
        **_COMMON,
        **_HYBRID_MAMBA,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        layers_block_type=["mamba", "hybrid"] * 2,
    )


def _zamba():
    # dt is already in [1e-3, 0.1], but B, C = x_proj(x) ~ 2e-4 (x_proj and conv1d ~ N(0, 0.02)):
    # state effect < 1e-7. conv1d x16 and out_proj x4 (kaiming scale), x_proj B/C rows x512 (|B|, |C| ~ 2).
    return _strengthen_ssm(
        _make(
            transformers.ZambaConfig,
            transformers.ZambaForCausalLM,
            **_zamba_layers(),
            n_mamba_heads=2,
        ),
        bc=512.0,
        conv=16.0,
        out=4.0,
    )


def _mamba2():
    return _make(
        transformers.Mamba2Config,
        transformers.Mamba2ForCausalLM,
        **_TWO_LAYERS,
        num_heads=4,
        head_dim=16,
        expand=2,
        state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
    )


# The Mamba-2 hybrids initialise in_proj and conv1d with N(0, 0.02), so B, C ~ 2e-3 and the state is
# invisible (effect < 2e-7); bamba, falcon_h1 and granitemoehybrid also start at dt_bias = 1
# (dt ~ 1.3, decay <= 0.3 per token). Same fix for all five (see module docstring).
_MAMBA2_HYBRID_FIX = dict(dt=_DT_RANGE, bc=16.0, conv=16.0, out=4.0)


def _bamba():
    return _strengthen_ssm(
        _make(
            transformers.BambaConfig,
            transformers.BambaForCausalLM,
            **_COMMON,
            **_HEADS,
            **_HYBRID_MAMBA2,
            intermediate_size=64,
            attn_layer_indices=[1, 3],
        ),
        **_MAMBA2_HYBRID_FIX,
    )


def _falcon_h1():
    # mamba_rms_norm=False (the default): the mixer output y * silu(gate) is not normalised and stays
    # small, so B/C rows x64 instead of x16.
    return _strengthen_ssm(
        _make(
            transformers.FalconH1Config,
            transformers.FalconH1ForCausalLM,
            **_TWO_LAYERS,
            **_HEADS,
            **_HYBRID_MAMBA2,
            intermediate_size=64,
            mamba_d_ssm=64,
            mamba_rms_norm=False,
        ),
        **{**_MAMBA2_HYBRID_FIX, "bc": 64.0},
    )


def _granitemoehybrid():
    return _strengthen_ssm(
        _make(
            transformers.GraniteMoeHybridConfig,
            transformers.GraniteMoeHybridForCausalLM,
            **_COMMON,
            **_HEADS,
            **_HYBRID_MAMBA2,
            intermediate_size=64,
            layer_types=["mamba", "attention"] * 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=32,
        ),
        **_MAMBA2_HYBRID_FIX,
    )


def _nemotron_h():
    # NemotronHConfig derives num_hidden_layers from layers_block_type (not a field).
    common = {k: v for k, v in _COMMON.items() if k != "num_hidden_layers"}
    return _strengthen_ssm(
        _make(
            transformers.NemotronHConfig,
            transformers.NemotronHForCausalLM,
            **common,
            **_HEADS,
            head_dim=16,
            intermediate_size=64,
            layers_block_type=["mamba", "attention", "mamba", "mlp"],
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            conv_kernel=4,
            expand=2,
            chunk_size=8,
            n_routed_experts=4,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
        **_MAMBA2_HYBRID_FIX,
    )


def _zamba2():
    return _strengthen_ssm(
        _make(
            transformers.Zamba2Config,
            transformers.Zamba2ForCausalLM,
            **_zamba_layers(),
            mamba_ngroups=2,
            n_mamba_heads=4,
            chunk_size=8,
            adapter_rank=8,
        ),
        **_MAMBA2_HYBRID_FIX,
    )


def _recurrent_gemma():
    # Griffin: two recurrent blocks (RG-LRU) and a local-attention block. lru_width = hidden_size, as
    # transformers 5.24 sizes a fresh conv window with hidden_size channels, not lru_width (a first cached
    # one-token forward with lru_width != hidden_size raises a size mismatch).
    common = {k: v for k, v in _COMMON.items() if k != "num_hidden_layers"}
    return _make(
        transformers.RecurrentGemmaConfig,
        transformers.RecurrentGemmaForCausalLM,
        **common,
        num_hidden_layers=3,
        block_types=["recurrent", "recurrent", "attention"],
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        lru_width=32,
        attention_window_size=16,
        conv1d_width=4,
    )


def _rwkv():
    # RWKV-4, no attention layers, no Cache (the state is a list threaded through `state=`). With 2 layers and
    # rescale_every = 6, eval mode's in-place rescaling divides by 2^0: the weights are left as they are.
    return _make(
        transformers.RwkvConfig,
        transformers.RwkvForCausalLM,
        vocab_size=VOCAB,
        bos_token_id=BOS,
        eos_token_id=EOS,  # RwkvConfig has no pad_token_id
        hidden_size=32,
        num_hidden_layers=2,
        context_length=64,
    )


def _gate_the_mlstm(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Make the mLSTM gates depend on the input (xLSTM's init gives them zero weights and an input gate bias
    of -10: constant gates, i' ~ 5e-5, so C and n stay ~1e-3 and e^(-m) dominates the denominator). Gate
    weights ~ N(0, 0.25^2) from a private generator, so preactivations have std ~2; input gate bias 0."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "xLSTMLayer":
                for gate in (module.igate_preact, module.fgate_preact):
                    gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen) * 0.25)
                module.igate_preact.bias.zero_()
    return model


def _xlstm():
    # hidden 64, since transformers' cache rounds head dims up to multiples of 64 and xLSTMLayer does not
    # (hidden * factor must be a multiple of 64, or the cache's shapes mismatch); chunk_size 8 so
    # that a 13-token prompt runs the chunk-wise kernel on 8 tokens and the sequence kernel on 5.
    return _gate_the_mlstm(
        _make(
            transformers.xLSTMConfig,
            transformers.xLSTMForCausalLM,
            vocab_size=VOCAB,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
            hidden_size=64,
            embedding_dim=64,
            num_hidden_layers=2,
            num_blocks=2,
            num_heads=2,
            qk_dim_factor=1.0,
            v_dim_factor=1.0,
            chunk_size=8,
        )
    )


# MiniMax (lightning attention): full attention at even layers, so that layer 0 is an attention layer. With
# linear attention at layer 0, transformers 5.24's MiniMaxCache reports 0 cached tokens after a prefill
# (its layer 0 is an empty attention layer) and a cached multi-token continuation is 3.7e-3 off in the
# logits (6e-8 with full attention first); `minimax(linear_first=True)` builds that pattern for the tests
# that run without a cache. Four layers, because the decay of the last layer is about 1 (the slope
# s_h = 2^(-8(h+1)/H) (1 - l/(L-1)) vanishes at l = L-1): lambda = 0.959, 0.997 at layer 1, ~1 at layer 3.
# The default init leaves the state visible: zeroing it after token 4 changes the last logits by 2e-2.
def _minimax(linear_first: bool = False):
    pattern = ["linear_attention", "full_attention"] if linear_first else ["full_attention", "linear_attention"]
    return _make(
        transformers.MiniMaxConfig,
        transformers.MiniMaxForCausalLM,
        **_COMMON,
        **_ATTENTION,
        intermediate_size=64,
        layer_types=pattern * 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        block_size=8,
    )


# Short-convolution families (Table 3 of the reference; the memory is only the conv window). Each keeps one
# attention layer: an all-conv model fails in Cache.get_seq_length under a cache (transformers 5.24).
_SHORT_CONV_COMMON = dict(
    vocab_size=VOCAB,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
)
_INKLING_ATTENTION = dict(
    swa_num_attention_heads=2,
    swa_num_key_value_heads=1,
    head_dim=16,
    swa_head_dim=16,
    sliding_window_size=8,
    d_rel=4,
    rel_extent=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
)


def _lfm2():
    return _make(
        transformers.Lfm2Config,
        transformers.Lfm2ForCausalLM,
        **_SHORT_CONV_COMMON,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
    )


def _lfm2_moe():
    return _make(
        transformers.Lfm2MoeConfig,
        transformers.Lfm2MoeForCausalLM,
        **_SHORT_CONV_COMMON,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
    )


def _lfm3():
    return _make(
        transformers.Lfm3Config,
        transformers.Lfm3ForCausalLM,
        **_SHORT_CONV_COMMON,
        intermediate_size=64,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=8,
        layer_types=["conv", "sliding_attention", "full_attention"],
    )


def _inkling():
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    return _make(
        InklingTextConfig,
        transformers.InklingForCausalLM,
        **_SHORT_CONV_COMMON,
        **_INKLING_ATTENTION,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "sparse"],
        n_shared_experts=1,
    )


def _inkling2():
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    return _make(
        Inkling2TextConfig,
        transformers.Inkling2ForCausalLM,
        **_SHORT_CONV_COMMON,
        **_INKLING_ATTENTION,
        num_hidden_layers=2,
        unpadded_vocab_size=VOCAB,
        layer_types=["hybrid_sliding", "hybrid"],
        n_layers_per_attn_res_block=1,
    )


def _inkling2_loop():
    from transformers.models.inkling2_loop.configuration_inkling2_loop import Inkling2LoopTextConfig

    # layer 1 is looped: it runs twice per forward, on cache layers 1 and 3
    return _make(
        Inkling2LoopTextConfig,
        transformers.Inkling2LoopForCausalLM,
        **_SHORT_CONV_COMMON,
        **_INKLING_ATTENTION,
        num_hidden_layers=3,
        unpadded_vocab_size=VOCAB,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=2,
        loop_num_passes=2,
        loop_gate_rank=8,
    )


def _zaya():
    # Table 3: a hybrid and a sliding layer, each with a CCA projection (K = (2 - 1) + (2 - 1) = 2 window columns).
    # ZayaQKNorm's key scale `temp` is initialised to zeros: every key is 0, the attention uniform, and the q/k conv
    # window reaches no logit (a write to it changed nothing). A scale of 1 per kv head lets it (effect of zeroing the
    # window after token 4: ~1e-4 on the next logits; the value delay's: ~8e-2).
    return _unit_key_scales(
        _make(
            transformers.ZayaConfig,
            transformers.ZayaForCausalLM,
            **_SHORT_CONV_COMMON,
            num_hidden_layers=2,
            layer_types=["hybrid", "hybrid_sliding"],
            sliding_window=8,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            router_hidden_size=16,
            cca_time0=2,
            cca_time1=2,
            attention_bias=True,
        )
    )  # biases: the delay before a prompt's first token is W_vd 0 = the bias


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
    "mamba": _mamba,
    "falcon_mamba": _falcon_mamba,
    "jamba": _jamba,
    "zamba": _zamba,
    "mamba2": _mamba2,
    "bamba": _bamba,
    "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granitemoehybrid,
    "nemotron_h": _nemotron_h,
    "zamba2": _zamba2,
    "recurrent_gemma": _recurrent_gemma,
    "rwkv": _rwkv,
    "minimax": _minimax,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "lfm3": _lfm3,
    "inkling": _inkling,
    "inkling2": _inkling2,
    "inkling2_loop": _inkling2_loop,
    "xlstm": _xlstm,
    "zaya": _zaya,
}


def build(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """Seed torch, build ``family``'s tiny CausalLM in float32 on the CPU, move it to ``DEVICE`` and return it in
    eval mode."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    return model.to(DEVICE, torch.float32).eval()


def random_ids(batch: int, seq: int, seed: int = 0) -> torch.LongTensor:
    """Token ids in [3, VOCAB) (never pad/bos/eos), from a private generator, on ``DEVICE``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=generator, dtype=torch.long).to(DEVICE)
