"""The mixer kinds: one module per kind, each a `RecurrentMixer` subclass with its kernels declared as data, its
token loops (and chunk-wise kernels where it has them), its cost shapes and its effective-attention maths.

    gated_delta_net   GatedDeltaNet (gated DeltaNet)
    kimi_delta        KimiDeltaAttention (Kimi delta attention)
    selective_scan    SelectiveScan, PerHeadSelectiveScan (Mamba-1)
    state_space       Mamba2StateSpace (Mamba-2, SSD)
    rg_lru            RealGatedLinearRecurrence (RG-LRU, Griffin)
    wkv               WeightedKeyValue (RWKV-4 time mixing)
    lightning         LightningAttention (MiniMax lightning attention)
    short_conv        ShortConvolution, LoopedShortConvolution
    dynamic_conv      DynamicShortConvolution, LoopedDynamicShortConvolution
    mlstm             MatrixLSTM (the mLSTM of xLSTM)
    zaya              CompressedConvolutionalAttention (zaya's CCA)
The maths several kinds share live beside them in `kinds/shared/` and are not kinds: `conv` (the short causal
convolution's window kernels and its attribution maths), `delta_rule` (the gated delta rule's maths: gated DeltaNet,
Kimi delta attention), `ssm` (Mamba-1's and Mamba-2's discretisation, and their kernels' signatures written once). A
kind module opens with its declaration (the `RecurrentMixer` subclass, after the kernels it names: a factory line
each where a shared module writes their signatures, else the token loop itself, which the class needs at creation)
and has its maths after it. A kind imports the engine (the effective-attention result is
`engine.declare.effective`), the shared modules' and other kinds' public names, never a study or another kind's
private helper. Which transformers families use which kind is the registry's business (`recurrent_hooks.registry`;
the docs' tables are written from it by scripts/doc_tables.py).
"""
