"""Every family at a real checkpoint's per-layer sizes, for the real-size tier (tests/package/test_real_size.py).

    from _real_sizes import SIZES, build
    model = build("qwen3_5")          # Qwen3.5-0.8B's layer dims and vocabulary, one period of its layers

Each row of ``SIZES`` starts from the config class's defaults and overrides what its ``source`` says: the mixer's
dims (hidden size, heads, head dims, state size, conv kernel, chunk size, expand, groups) and the vocabulary are the
checkpoint's; the layers are one period of its layer pattern (or part of it: ``cut`` says where); MoE experts are cut to
4 (top-k 2, or 1 where the checkpoint routes to 1) and dense MLP / expert widths may be cut (``cut`` says which):
neither touches a recurrent mixer. Tied or untied embeddings as the checkpoint has them. The model class and the
oddities are tests/helpers/_models.py's (glm5_next as a ConditionalGeneration with a 1-block vision tower, the memory
fixes that make a state reach the logits at a random init).

Building: parameters are made on the meta device while buffers are computed as transformers computes them (rotary
inv_freq, RecurrentGemma's normalizer, ...), then given CPU memory. Embeddings, the LM head and every parameter of
2^20 elements or more are filled with a tiled N(0, initializer_range^2) sequence (a fixed 2^20 + 7-element block
read from a per-tensor offset: one copy per tensor at memory speed, where `normal_` takes 2.6 s for 250 M elements;
no two rows are equal); every other parameter gets the model's own `_init_weights`. float32, eval mode, no parameter
requires grad. The parameters of one model are views of one flat pool whose pages the next model reuses (``build`` keeps
only the last model built: a real vocabulary's embedding and head are up to 10 GB); ``release`` frees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import zlib
from collections.abc import Callable

import torch
import transformers
from _models import _config, _gate_the_mlstm, _lengthen_memory, _strengthen_ssm, _unit_key_scales, _zero_forget_gates

_MOE = dict(num_experts=4, num_experts_per_tok=2)  # Qwen-style MoE cut


@dataclasses.dataclass(frozen=True)
class Size:
    """One family at a checkpoint's sizes: ``config(**defaults, **fields)`` built as ``model``, then ``fix``."""

    config: type
    model: type
    source: str  # where the numbers come from
    fields: dict = dataclasses.field(default_factory=dict)  # overrides of the config class's defaults
    cut: str = ""  # what is smaller than the checkpoint (never a recurrent mixer's dims)
    fix: Callable | None = None  # tests/helpers/_models.py's memory fix, so that a state reaches the logits at init
    make: Callable | None = None  # builds the config itself (composite configs)


def _inkling(name):
    module = __import__(f"transformers.models.{name}.configuration_{name}", fromlist=["x"])
    return getattr(module, f"{name.replace('_loop', 'Loop').replace('inkling', 'Inkling')}TextConfig")


def _MAMBA2_FIX(m):
    return _strengthen_ssm(m, dt=(0.01, 0.1), bc=16.0, conv=16.0, out=4.0)


def _glm5_next_config(fields):
    text = _config(transformers.Glm5NextTextConfig, **fields)
    vision = _config(
        transformers.Glm5NextVisionConfig,
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=text.hidden_size,
        projection_intermediate_size=64,
    )
    return _config(
        transformers.Glm5NextConfig,
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=text.tie_word_embeddings,
    )


SIZES: dict[str, Size] = {
    # -- gated DeltaNet ------------------------------------------------------------------------------------------
    "qwen3_next": Size(
        transformers.Qwen3NextConfig,
        transformers.Qwen3NextForCausalLM,
        "config default = Qwen/Qwen3-Next-80B-A3B-Instruct (the only size): hidden 2048, attention 16/2 heads of 256,"
        " GDN 16 key / 32 value heads of 128, conv 4, vocab 151936 untied; 3 linear + 1 full",
        dict(
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_hidden_layers=4,
            intermediate_size=512,
            **_MOE,
        ),
        cut="512 -> 4 experts (top-10 -> 2); dense intermediate 5632 -> 512",
        fix=_lengthen_memory,
    ),
    "qwen3_5": Size(
        transformers.Qwen3_5TextConfig,
        transformers.Qwen3_5ForCausalLM,
        "Qwen/Qwen3.5-0.8B (the smallest; the config default is Qwen3.5-27B): hidden 1024, attention 8/2 heads of 256,"
        " GDN 16 key / 16 value heads of 128, conv 4, vocab 248320 tied, intermediate 3584; 3 linear + 1 full",
        dict(
            hidden_size=1024,
            num_attention_heads=8,
            num_key_value_heads=2,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            intermediate_size=3584,
            tie_word_embeddings=True,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_hidden_layers=4,
        ),
        fix=_lengthen_memory,
    ),
    "qwen3_5_moe": Size(
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        "config default = Qwen/Qwen3.5-35B-A3B: hidden 2048, attention 16/2 heads of 256, GDN 16 key / 32 value heads"
        " of 128, conv 4, vocab 248320 untied; 3 linear + 1 full",
        dict(layer_types=["linear_attention"] * 3 + ["full_attention"], num_hidden_layers=4, **_MOE),
        cut="256 -> 4 experts (top-8 -> 2)",
        fix=_lengthen_memory,
    ),
    "olmo_hybrid": Size(
        transformers.OlmoHybridConfig,
        transformers.OlmoHybridForCausalLM,
        "config default = allenai/Olmo-Hybrid-7B: hidden 3840, attention 30 heads of 128, GDN 30 key / 30 value heads,"
        " key dim 96, value dim 192, conv 4, vocab 100352 untied; 3 linear + 1 full",
        dict(layer_types=["linear_attention"] * 3 + ["full_attention"], num_hidden_layers=4, intermediate_size=512),
        cut="intermediate 11008 -> 512",
    ),
    "qwen4_exp": Size(
        transformers.Qwen4ExpTextConfig,
        transformers.Qwen4ExpForCausalLM,
        "config default = Qwen/Qwen4-Exp: hidden 2048, attention 16/2 heads of 256, GDN 16 key / 32 value heads of"
        " 128, conv 4, vocab 248320 untied, hyper-connections 4 of rank 320; 3 linear + 1 indexed (the indexer has no"
        " default: 8 heads of 256, 1 kv head and the rotary dim as QSA requires, budget 64, compress 4, ours)",
        dict(
            layer_types=["linear_attention"] * 3 + ["indexed_attention"],
            num_hidden_layers=4,
            indexer_n_heads=8,
            indexer_kv_heads=1,
            indexer_head_dim=256,
            indexer_budget=64,
            indexer_compress_ratio=4,
            **_MOE,
        ),
        cut="512 -> 4 experts (top-10 -> 2)",
        fix=_lengthen_memory,
    ),
    "lara_mini": Size(
        transformers.LaraMiniConfig,
        transformers.LaraMiniForCausalLM,
        "config default = translated/Lara-4-Mini-Base: hidden 1024, attention 16/4 heads of 128, GDN 8 key / 16 value"
        " heads of 128, conv 4, sliding window 512, vocab 151936 tied; linear, sliding, linear, full (its first 4)",
        dict(
            layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        cut="128 -> 4 experts (top-4 -> 2)",
        fix=_lengthen_memory,
    ),
    # -- Kimi delta attention --------------------------------------------------------------------------------------
    "kimi_linear": Size(
        transformers.KimiLinearConfig,
        transformers.KimiLinearForCausalLM,
        "config default = moonshotai/Kimi-Linear-48B-A3B-Instruct (the only size): hidden 2304, MLA 32 heads (kv rank"
        " 512, nope 128, rope 64, v 128), KDA 32 heads of 128, conv 4, vocab 163840 untied; 3 linear + 1 full, the"
        " first MLP dense",
        dict(
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_hidden_layers=4,
            mlp_layer_types=["dense"] + ["sparse"] * 3,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=512,
            moe_intermediate_size=512,
        ),
        cut="256 -> 4 experts (top-8 -> 2); intermediate 9216 -> 512, expert 1024 -> 512",
    ),
    "bailing_hybrid": Size(
        transformers.BailingHybridConfig,
        transformers.BailingHybridForCausalLM,
        "config default = inclusionAI/Ling-3.0-Flash: hidden 2560, MLA 32 heads, KDA 32 heads of 128, conv 4, vocab"
        " 157184 untied; one layer group: 5 linear + 1 full, the first 2 MLPs dense",
        dict(
            layer_types=["linear_attention"] * 5 + ["full_attention"],
            num_hidden_layers=6,
            mlp_layer_types=["dense"] * 2 + ["sparse"] * 4,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            intermediate_size=512,
            moe_intermediate_size=512,
            num_mtp_layers=0,
            expert_swiglu_limit_list=[0] * 6,
            share_expert_swiglu_limit_list=[0] * 6,
        ),
        cut="512 -> 4 experts in 1 group (top-8 -> 2); intermediate 6144 -> 512, expert 768 -> 512; no MTP layer",
        fix=_zero_forget_gates,
    ),
    "glm5_next": Size(
        transformers.Glm5NextTextConfig,
        transformers.Glm5NextForConditionalGeneration,
        "config default = zai-org/GLM-5.3-Flash: hidden 4096, KDA 64 heads of 128, conv 4, MLA 64 heads (q rank 1536,"
        " kv rank 512, 256-dim heads), hyper-connections 4, vocab 154880 untied; 1 linear + 1 indexed",
        dict(
            layer_types=["linear_attention", "indexed_attention"],
            num_hidden_layers=2,
            mlp_layer_types=["dense", "sparse"],
            indexer_types=["full"] * 2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            intermediate_size=512,
            moe_intermediate_size=512,
        ),
        cut="2 layers of its 3 linear + 1 indexed period (memory: a KDA layer is 0.7 GB); 288 -> 4 experts (top-8 ->"
        " 2); intermediate 12288 -> 512, expert 2048 -> 512; vision tower 1 block of 32",
        make=_glm5_next_config,
    ),
    # -- Mamba-1 ---------------------------------------------------------------------------------------------------
    "mamba": Size(
        transformers.MambaConfig,
        transformers.MambaForCausalLM,
        "config default = state-spaces/mamba-130m dims (the docstring names mamba-2.8b): hidden 768, d_inner 1536,"
        " state 16, conv 4, dt rank 48, vocab 50280 tied; 2 layers",
        dict(num_hidden_layers=2),
        fix=lambda m: _strengthen_ssm(m, bc=4.0),
    ),
    "falcon_mamba": Size(
        transformers.FalconMambaConfig,
        transformers.FalconMambaForCausalLM,
        "tiiuae/falcon-mamba-7b (the only size; the config default copies mamba-130m's): hidden 4096, d_inner 8192,"
        " state 16, conv 4, dt rank 256, vocab 65024 untied; 1 layer",
        dict(hidden_size=4096, time_step_rank=256, vocab_size=65024, tie_word_embeddings=False, num_hidden_layers=1),
    ),
    "jamba": Size(
        transformers.JambaConfig,
        transformers.JambaForCausalLM,
        "config default = ai21labs/Jamba-v0.1: hidden 4096, attention 32/8 heads,"
        " d_inner 8192, state 16, conv 4, dt rank 256, vocab 65536 untied",
        dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=4, intermediate_size=512),
        cut="2 layers (mamba, attention+MoE) of its 8-layer period (7 mamba layers are 3 GB); 16 -> 4 experts;"
        " intermediate 14336 -> 512",
        fix=lambda m: _strengthen_ssm(m, dt=(0.01, 0.1), conv=16.0, out=4.0),
    ),
    "zamba": Size(
        transformers.ZambaConfig,
        transformers.ZambaForCausalLM,
        "config default = Zyphra/Zamba-7B-v1 (the only size): hidden 3712, d_inner 7424, 2 mamba heads, state 16,"
        " conv 4, dt rank 232, shared attention 16 heads over 7424, vocab 32000 tied",
        dict(layers_block_type=["mamba", "hybrid", "hybrid"], num_hidden_layers=3, intermediate_size=512),
        cut="3 layers (mamba, hybrid, hybrid: transformers cannot tie the shared block of a single hybrid layer) of"
        " its 6-layer period; intermediate 14848 -> 512",
        fix=lambda m: _strengthen_ssm(m, bc=512.0, conv=16.0, out=4.0),
    ),
    # -- Mamba-2 ---------------------------------------------------------------------------------------------------
    "mamba2": Size(
        transformers.Mamba2Config,
        transformers.Mamba2ForCausalLM,
        "state-spaces/mamba2-130m (the smallest; the config default is a 4096-wide model): hidden 768, 24 heads of 64,"
        " 1 group, state 128, conv 4, chunk 256, vocab 50288 tied; 2 layers",
        dict(
            hidden_size=768,
            num_heads=24,
            head_dim=64,
            n_groups=1,
            state_size=128,
            vocab_size=50288,
            time_step_rank=48,
            tie_word_embeddings=True,
            num_hidden_layers=2,
        ),
    ),
    "bamba": Size(
        transformers.BambaConfig,
        transformers.BambaForCausalLM,
        "config default (the docstring names no checkpoint): hidden 4096, attention 32/8 heads,"
        " mamba 128 heads of 64, 1 group, state 256, conv 4, chunk 256, vocab 128000 untied",
        dict(num_hidden_layers=2, attn_layer_indices=[1], intermediate_size=512),
        cut="2 layers (mamba, attention) of its 9-layer period; intermediate 14336 -> 512",
        fix=_MAMBA2_FIX,
    ),
    "falcon_h1": Size(
        transformers.FalconH1Config,
        transformers.FalconH1ForCausalLM,
        "config default (docstring: tiiuae/Falcon-H1-1.5B-Deep-Instruct): hidden 4096, attention 32/8 heads, mamba"
        " d_ssm 1024 in 128 heads of 8, 1 group, state 256, conv 4, chunk 256, vocab 128000 untied; every layer"
        " attention + mamba in parallel: 2 layers",
        dict(num_hidden_layers=2, intermediate_size=512),
        cut="intermediate 14336 -> 512",
        fix=lambda m: _strengthen_ssm(m, dt=(0.01, 0.1), bc=64.0, conv=16.0, out=4.0),
    ),
    "granitemoehybrid": Size(
        transformers.GraniteMoeHybridConfig,
        transformers.GraniteMoeHybridForCausalLM,
        "config default (docstring: ibm-granite/granite-speech-3.2-8b): hidden 4096, attention 32/32 heads, mamba 128"
        " heads of 64, 1 group, state 256, conv 4, chunk 256, vocab 32000 untied; mamba, attention",
        dict(
            layer_types=["mamba", "attention"],
            num_hidden_layers=2,
            num_local_experts=4,
            intermediate_size=512,
            shared_intermediate_size=512,
        ),
        cut="8 -> 4 experts; intermediate 11008 -> 512, shared 1024 -> 512",
        fix=_MAMBA2_FIX,
    ),
    "nemotron_h": Size(
        transformers.NemotronHConfig,
        transformers.NemotronHForCausalLM,
        "config default = nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: hidden 4096, attention 32/8 heads of 128, mamba 128"
        " heads of 64, 8 groups, state 128, conv 4, chunk 128, vocab 131072 untied; mamba, moe, attention, mlp",
        dict(
            n_routed_experts=4,
            intermediate_size=512,
            moe_intermediate_size=512,
            moe_shared_expert_intermediate_size=512,
        ),
        cut="8 -> 4 experts; intermediate 21504 -> 512, experts 7688 -> 512",
        fix=_MAMBA2_FIX,
    ),
    "zamba2": Size(
        transformers.Zamba2Config,
        transformers.Zamba2ForCausalLM,
        "config default = Zyphra/Zamba2-2.7B: hidden 2560, mamba 8 heads of 640 (as the config derives them), 1 group,"
        " state 64, conv 4, chunk 256,"
        " shared attention 32 heads, vocab 32000 tied",
        dict(layers_block_type=["mamba", "hybrid"], num_hidden_layers=2, intermediate_size=512),
        cut="2 layers (mamba, hybrid) of its 7-layer period; intermediate 10240 -> 512",
        fix=_MAMBA2_FIX,
    ),
    # -- the others ------------------------------------------------------------------------------------------------
    "recurrent_gemma": Size(
        transformers.RecurrentGemmaConfig,
        transformers.RecurrentGemmaForCausalLM,
        "config default = google/recurrentgemma-2b (the smallest), but 1 kv head as the checkpoint: hidden 2560, lru"
        " width 2560, 10 heads of 256, conv 4, window 2048, vocab 256000 tied; recurrent, recurrent, attention",
        dict(num_key_value_heads=1, num_hidden_layers=3, intermediate_size=512),
        cut="intermediate 7680 -> 512",
    ),
    "rwkv": Size(
        transformers.RwkvConfig,
        transformers.RwkvForCausalLM,
        "RWKV/rwkv-4-169m-pile (the docstring's; the config default is 4096 wide): hidden 768, attention hidden 768,"
        " intermediate 3072, vocab 50277 untied; 2 layers",
        dict(hidden_size=768, attention_hidden_size=768, intermediate_size=3072, num_hidden_layers=2),
    ),
    "minimax": Size(
        transformers.MiniMaxConfig,
        transformers.MiniMaxForCausalLM,
        "MiniMaxAI/MiniMax-Text-01-hf (the docstring's, the only size; the config default is 4096 wide): hidden"
        " 6144, 64 heads of 128, 8 kv heads, block 256, vocab 200064 untied; full, linear (the default pattern's"
        " period, full first as in tests/helpers/_models.py)",
        dict(
            hidden_size=6144,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=200064,
            layer_types=["full_attention", "linear_attention"],
            num_hidden_layers=2,
            num_local_experts=4,
            intermediate_size=512,
        ),
        cut="32 -> 4 experts; expert intermediate 9216 -> 512",
    ),
    "lfm2": Size(
        transformers.Lfm2Config,
        transformers.Lfm2ForCausalLM,
        "LiquidAI/LFM2-350M (the smallest; the config default is 2560 wide): hidden 1024, 16/8 heads, conv cache 3,"
        " vocab 65536 tied; conv, conv, attention",
        dict(
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=8,
            intermediate_size=512,
            block_auto_adjust_ff_dim=False,
            layer_types=["conv", "conv", "full_attention"],
            num_hidden_layers=3,
        ),
        cut="intermediate 4608 -> 512",
    ),
    "lfm2_moe": Size(
        transformers.Lfm2MoeConfig,
        transformers.Lfm2MoeForCausalLM,
        "config default = LiquidAI/LFM2-8B-A1B: hidden 2048, 32/8 heads, conv cache 3, vocab 65536 tied, the first 2"
        " MLPs dense; conv, conv, attention",
        dict(
            layer_types=["conv", "conv", "full_attention"],
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            intermediate_size=512,
            moe_intermediate_size=512,
        ),
        cut="32 -> 4 experts (top-4 -> 2); intermediate 7168 -> 512, experts 1792 -> 512",
    ),
    "lfm3": Size(
        transformers.Lfm3Config,
        transformers.Lfm3ForCausalLM,
        "config default = LiquidAI/LFM3-1.7B: hidden 2048, 16/4 heads of 128, conv cache 7, window 256, vocab 128000"
        " tied; conv, conv, full, conv, sliding (its first 5)",
        dict(
            layer_types=["conv", "conv", "full_attention", "conv", "sliding_attention"],
            num_hidden_layers=5,
            intermediate_size=512,
        ),
        cut="intermediate 7680 -> 512",
    ),
    "inkling": Size(
        _inkling("inkling"),
        transformers.InklingForCausalLM,
        "config default (the docstring names no checkpoint): hidden 6144, 64/8 heads of 128 (sliding 64/16), conv"
        " kernel 4, vocab 201024 untied; hybrid_sliding, hybrid",
        dict(
            layer_types=["hybrid_sliding", "hybrid"],
            mlp_layer_types=["dense", "sparse"],
            num_hidden_layers=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            intermediate_size=512,
            moe_intermediate_size=512,
        ),
        cut="2 layers of its 6-layer period (memory: 6144-wide layers); 256 -> 4 experts (top-6 -> 2), 2 -> 1 shared;"
        " intermediate 24576 -> 512, experts 3072 -> 512",
    ),
    "inkling2": Size(
        _inkling("inkling2"),
        transformers.Inkling2ForCausalLM,
        "config default = thinkingmachines/Inkling-2-Small: hidden 4608, 48/8 heads of 128, conv kernel 4, vocab"
        " 201024 (200058 unpadded) untied; hybrid_sliding, hybrid",
        dict(
            layer_types=["hybrid_sliding", "hybrid"],
            num_hidden_layers=2,
            n_layers_per_attn_res_block=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=512,
        ),
        cut="2 layers of its 6-layer period; 384 -> 4 experts (top-8 -> 2); experts 2304 -> 512",
    ),
    "inkling2_loop": Size(
        _inkling("inkling2_loop"),
        transformers.Inkling2LoopForCausalLM,
        "config default = thinkingmachines/Inkling-2-Mini: hidden 2304, 24/8 heads of 128, conv kernel 4, vocab"
        " 201024 (200058 unpadded) untied, loop of 3 passes with gate rank 64; hybrid_sliding, hybrid (looped),"
        " hybrid_sliding",
        dict(
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
            num_hidden_layers=3,
            n_layers_per_attn_res_block=1,
            loop_layer_index_start=1,
            loop_layer_index_end=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=512,
        ),
        cut="3 layers, the middle one looped (its loop spans 12 of 24); 128 -> 4 experts (top-8 -> 2); experts 1152 ->"
        " 512",
    ),
    "xlstm": Size(
        transformers.xLSTMConfig,
        transformers.xLSTMForCausalLM,
        "config default = NX-AI/xLSTM-7b (the only size): hidden 4096, 8 heads, qk 0.5 (256), v 1.0 (512), chunk 64,"
        " vocab 50304 untied; 2 blocks",
        dict(num_hidden_layers=2, num_blocks=2, ffn_proj_factor=0.125),
        cut="feed-forward factor 2.667 -> 0.125 (512 wide)",
        fix=_gate_the_mlstm,
    ),
    "zaya": Size(
        transformers.ZayaConfig,
        transformers.ZayaForCausalLM,
        "config default = Zyphra/ZAYA1-8B: hidden 2048, 8/2 heads of 128, CCA times 2/2, vocab 262272 tied; 2 hybrid"
        " layers",
        dict(layer_types=["hybrid", "hybrid"], num_hidden_layers=2, num_experts=4, moe_intermediate_size=512),
        cut="16 -> 4 experts (top-1); experts 2048 -> 512",
        fix=_unit_key_scales,
    ),
}

_PERIOD = (1 << 20) + 7  # a prime: the tiled fill's period
_BIG = 1 << 20  # parameters this large take the tiled fill
_BLOCK = torch.randn(2 * _PERIOD, generator=torch.Generator().manual_seed(0))  # unit normals, twice (any offset)


@contextlib.contextmanager
def _parameters_on_meta():
    """Register every new parameter on the meta device (buffers stay as computed, on the CPU)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


_ALIGN = 16  # elements (64 bytes) between the starts of two parameters in the pool
_POOL: list[torch.Tensor] = []  # one flat float32 tensor whose pages the models built one after another reuse


def _carve(sizes: list[int]) -> list[torch.Tensor]:
    """Flat pieces of the pool, one a size (the pool grows to fit them, the smaller one freed first): a model no
    larger than the last reuses its pages (first-touch page faults cost ~10 ns an element here, 3 s for 300 M).
    Every piece starts as NaN, so that what no init writes shows in the logits (not the last model's weights)."""
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // _ALIGN) * _ALIGN
    if not _POOL or _POOL[0].numel() < end:
        _POOL.clear()
        _POOL.append(torch.empty(end))
    _POOL[0][:end].fill_(float("nan"))
    return [_POOL[0][start : start + size] for start, size in zip(starts, sizes)]


def _materialize(model: torch.nn.Module) -> None:
    """Give every meta parameter uninitialised memory in the pool, keeping tied parameters tied."""
    metas: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.device.type == "meta":
                assert param.dtype == torch.float32, f"a {param.dtype} parameter: the pool is float32"
                metas.setdefault(id(param), param)
    pieces = dict(zip(metas, _carve([param.numel() for param in metas.values()])))
    made = {
        key: torch.nn.Parameter(pieces[key].view(param.shape), requires_grad=param.requires_grad)
        for key, param in metas.items()
    }
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in made:
                module._parameters[name] = made[id(param)]


def _tile(tensor: torch.Tensor, std: float, name: str) -> None:
    """Fill `tensor` with std x the unit-normal block, from an offset its name picks, one copy a period."""
    flat = tensor.detach().view(-1)
    start = zlib.crc32(name.encode()) % _PERIOD
    block = _BLOCK[start : start + _PERIOD]
    whole, rest = divmod(flat.numel(), _PERIOD)
    flat[: whole * _PERIOD].view(whole, _PERIOD).copy_(block.expand(whole, _PERIOD))
    flat[whole * _PERIOD :].copy_(block[:rest])
    flat.mul_(std)


def _initialize(model: transformers.PreTrainedModel) -> None:
    """The tiled fill for the embeddings, the head and the big parameters; the model's own init for the rest."""
    std = getattr(model.config.get_text_config(), "initializer_range", None) or 0.02
    embeddings = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        embeddings.add(id(head.weight))
    tiled = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in embeddings or param.numel() >= _BIG:
                _tile(param, std, name)
                param._is_hf_initialized = True
                tiled.append(param)
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    for param in tiled:
        del param._is_hf_initialized


def config_of(family: str) -> transformers.PretrainedConfig:
    """The family's config at its checkpoint's sizes (`SIZES[family]`)."""
    size = SIZES[family]
    return size.make(size.fields) if size.make else _config(size.config, **size.fields)


def _build(family: str) -> transformers.PreTrainedModel:
    size = SIZES[family]
    with _parameters_on_meta():
        model = size.model(config_of(family))
    _materialize(model)
    with torch.random.fork_rng():  # the model's own init draws from torch's generator: seeded, the caller's kept
        torch.manual_seed(0)
        _initialize(model)
    if size.fix is not None:
        model = size.fix(model)
    return model.float().eval().requires_grad_(False)


_BUILT: dict[str, transformers.PreTrainedModel] = {}


def _forget_built() -> None:
    """Forget the model built last, its parameters moved to the meta device, so that a reference kept to it fails
    loudly rather than reading the next model's weights from the pool."""
    for model in _BUILT.values():
        model.to("meta")
    _BUILT.clear()


def release() -> None:
    """Forget the model built last (`_forget_built`) and free the pool."""
    _forget_built()
    _POOL.clear()
    gc.collect()


def build(family: str) -> transformers.PreTrainedModel:
    """The family's model at real size, built once while it is the last one built (tests only read it). Building
    another family's model releases it: its parameters are the pool's pages, which the next model takes."""
    if family not in _BUILT:
        _forget_built()
        gc.collect()
        _BUILT[family] = _build(family)
    return _BUILT[family]


def vocab(model) -> int:
    """The ids a prompt may use: the vocabulary (inkling2's unpadded one)."""
    config = model.config.get_text_config()
    return getattr(config, "unpadded_vocab_size", None) or config.vocab_size
