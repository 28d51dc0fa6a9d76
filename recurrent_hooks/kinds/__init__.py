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
Shared by several kinds: `conv` (the short causal convolution's window kernels and its attribution maths),
`delta_rule` (the gated delta rule's maths: gated DeltaNet, Kimi delta attention), `ssm` (the discretisation of
Mamba-1 and Mamba-2). A kind imports the engine (the effective-attention result is `engine.effective`) and other
kinds' public names, never a study or another kind's private helper. Which transformers families use which kind is
the registry's business (`recurrent_hooks.registry`).
"""
