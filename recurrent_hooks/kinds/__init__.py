"""The mixer kinds: one module per kind, each a `RecurrentMixer` subclass with its kernels declared as data, its
token loops (and chunk-wise kernels where it has them), its cost shapes and its effective-attention maths.

    gated_delta_net   GatedDeltaNet               qwen3_next, qwen3_5, olmo_hybrid, ...
    kimi_delta        KimiDeltaAttention          kimi_linear, bailing_hybrid, glm5_next
    selective_scan    SelectiveScan, PerHeadSelectiveScan   mamba, falcon_mamba, jamba, zamba
    state_space       Mamba2StateSpace (Mamba-2, SSD)   mamba2, bamba, falcon_h1, granitemoehybrid, nemotron_h, zamba2
    rg_lru            RealGatedLinearRecurrence   recurrent_gemma
    wkv               WeightedKeyValue            rwkv
    lightning         LightningAttention          minimax
    short_conv        ShortConvolution, LoopedShortConvolution   lfm2, lfm2_moe, lfm3, inkling, ...
    dynamic_conv      DynamicShortConvolution, LoopedDynamicShortConvolution   inkling2, inkling2_loop
    mlstm             MatrixLSTM                  xlstm
    zaya              CompressedConvolutionalAttention   zaya
Shared by several kinds: `conv` (the short causal convolution's window kernels), `effective` (the result of an
effective attention and its decayed products). A kind imports the engine, never a study. Which transformers
families use which kind is the registry's business (`recurrent_hooks.registry`).
"""
