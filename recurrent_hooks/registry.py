"""The family registry: which transformers modeling modules and mixer classes the library supports, as data.

A family is one transformers model type (its modeling module has its own copy of every kernel) and one row
here: its mixer classes, each with the kind that describes it, and where a kind's class- or instance-attribute
kernels live when that is not the mixer class (`owners`). A new family of an existing kind is one row and one
test builder; nothing else in the library names a family, and no kind names a transformers class.

The rows are added to the engine's registry (`recurrent_hooks.engine.binding.registry`: `Family`, `FAMILIES`,
`UNSUPPORTED` and the lazily built lookups, re-exported here) when the package is imported;
`recurrent_hooks.extend.register` adds more at run time.
"""

from .engine.binding.registry import FAMILIES as FAMILIES
from .engine.binding.registry import UNSUPPORTED as UNSUPPORTED
from .engine.binding.registry import Family as Family
from .engine.binding.registry import MixerClass as MixerClass
from .engine.binding.registry import Unsupported as Unsupported
from .engine.binding.registry import family_of as family_of
from .engine.binding.registry import mixer_of as mixer_of
from .engine.binding.registry import register as register
from .engine.binding.registry import replace as replace
from .engine.binding.registry import resolve_family as resolve_family
from .engine.binding.registry import unregister as unregister
from .engine.binding.registry import unsupported_of as unsupported_of
from .engine.binding.upstream import is_at_least
from .engine.declare.limits import Refused
from .engine.errors import Unavailable
from .kinds.dynamic_conv import DynamicShortConvolution, LoopedDynamicShortConvolution
from .kinds.gated_delta_net import GatedDeltaNet
from .kinds.kimi_delta import KimiDeltaAttention
from .kinds.lightning import LightningAttention
from .kinds.mlstm import MatrixLSTM
from .kinds.rg_lru import RealGatedLinearRecurrence
from .kinds.selective_scan import PerHeadSelectiveScan, SelectiveScan
from .kinds.short_conv import LoopedShortConvolution, ShortConvolution
from .kinds.state_space import Mamba2StateSpace
from .kinds.wkv import WeightedKeyValue
from .kinds.zaya import CompressedConvolutionalAttention


def _several_per_layer(how: str) -> dict[str, Refused]:
    """The limit of a family whose decoder layers hold several mixers that share the layer's `layer_idx`."""
    return {
        "one memory per layer": Refused(
            Unavailable,
            f"{how}, each its own mixer sharing the layer's layer_idx: Watch.memory_after,"
            " Watch.set_memory_after and patching_sweep raise for such a model ('have several mixers each'); use each"
            " mixer's own memory_after / set_memory_after, and w.mixer(layer) is the first of the layer's mixers"
            " (module"
            " order)",
        )
    }


# transformers 5.25's Inkling2LoopModel.forward deep-copies the cache layers of the looped passes, which by then hold
# tensors; dynamo refuses that in a full graph, with or without a watch (5.24's layers held none yet).
_INKLING2_LOOP_COMPILE = (
    {
        "torch.compile(fullgraph=True)": Refused(
            RuntimeError,
            "transformers 5.25's Inkling2LoopModel.forward deep-copies cache layers that hold tensors, which"
            " dynamo refuses in a full graph (torch._dynamo.exc.Unsupported, a RuntimeError), watched or not;"
            " torch.compile without fullgraph breaks the graph there and runs watched",
        )
    }
    if is_at_least(5, 25)
    else {}
)

register(
    Family("qwen3_next", {"Qwen3NextGatedDeltaNet": GatedDeltaNet}),
    Family("qwen3_5", {"Qwen3_5GatedDeltaNet": GatedDeltaNet}),
    Family("qwen3_5_moe", {"Qwen3_5MoeGatedDeltaNet": GatedDeltaNet}),
    Family("olmo_hybrid", {"OlmoHybridGatedDeltaNet": GatedDeltaNet}),
    Family("qwen4_exp", {"Qwen4ExpTextGatedDeltaNet": GatedDeltaNet}),
    Family("lara_mini", {"LaraMiniGatedDeltaNet": GatedDeltaNet}),
    Family("kimi_linear", {"KimiLinearDeltaAttention": KimiDeltaAttention}),
    Family("bailing_hybrid", {"BailingHybridDeltaAttention": KimiDeltaAttention}),
    Family("glm5_next", {"Glm5NextTextLinearAttention": KimiDeltaAttention}),
    Family("mamba", {"MambaMixer": SelectiveScan}),
    Family("falcon_mamba", {"FalconMambaMixer": SelectiveScan}),
    Family("jamba", {"JambaMambaMixer": SelectiveScan}),
    Family("zamba", {"ZambaMambaMixer": PerHeadSelectiveScan}),
    Family("mamba2", {"Mamba2Mixer": Mamba2StateSpace}),
    Family("bamba", {"BambaMixer": Mamba2StateSpace}),
    Family("falcon_h1", {"FalconH1Mixer": Mamba2StateSpace}),
    Family("granitemoehybrid", {"GraniteMoeHybridMambaLayer": Mamba2StateSpace}),
    Family("nemotron_h", {"NemotronHMamba2Mixer": Mamba2StateSpace}),
    Family("zamba2", {"Zamba2MambaMixer": Mamba2StateSpace}),
    # the block's forward (the window) is the mixer class's; the recurrence is a method of its RG-LRU class
    Family(
        "recurrent_gemma",
        {"RecurrentGemmaRecurrentBlock": RealGatedLinearRecurrence},
        owners={"_rnn_scan": "RecurrentGemmaRglru"},
    ),
    Family("rwkv", {"RwkvSelfAttention": WeightedKeyValue}),
    Family("minimax", {"MiniMaxLightningAttention": LightningAttention}),
    Family("lfm2", {"Lfm2ShortConv": ShortConvolution}),
    Family("lfm2_moe", {"Lfm2MoeShortConv": ShortConvolution}),
    Family("lfm3", {"Lfm3ShortConv": ShortConvolution}),
    Family(
        "inkling",
        {"InklingShortConvolution": ShortConvolution},
        limits=_several_per_layer("inkling runs four short convolutions in each decoder layer"),
    ),
    # static convolutions in the linear layers, dynamic ones of the keys and values in the full-attention layers
    Family(
        "inkling2",
        {"Inkling2ShortConvolution": ShortConvolution, "Inkling2DynamicShortConvolution": DynamicShortConvolution},
        limits=_several_per_layer(
            "inkling2 runs four short convolutions in each decoder layer (two of them"
            " dynamic in its full-attention layers)"
        ),
    ),
    Family(
        "inkling2_loop",
        {
            "Inkling2LoopShortConvolution": LoopedShortConvolution,
            "Inkling2LoopDynamicShortConvolution": LoopedDynamicShortConvolution,
        },
        limits={
            **_several_per_layer(
                "inkling2_loop runs four short convolutions in each decoder layer (two of them"
                " dynamic in its full-attention layers), and a mixer per pass of a looped"
                " layer"
            ),
            **_INKLING2_LOOP_COMPILE,
        },
    ),
    # the kernels are partials captured by each layer's backend object when the model is built
    Family(
        "xlstm", {"xLSTMLayer": MatrixLSTM}, owners={"_inference_fn": "mlstm_backend", "_train_fn": "mlstm_backend"}
    ),
    Family("zaya", {"ZayaCCAProjection": CompressedConvolutionalAttention}),
)


def _external_xlstm() -> bool:
    """transformers builds xLSTM from the xlstm package when it is importable (modeling_xlstm.external_xlstm)."""
    from transformers.utils import is_xlstm_available

    return bool(is_xlstm_available())


def _external_xlstm_rows() -> tuple[Unsupported, ...]:
    """With the xlstm package, transformers' xLSTM blocks are xlstm's mLSTMBlock: none of MatrixLSTM's kernels."""
    if not _external_xlstm():
        return ()
    return (
        Unsupported(
            "xlstm",
            "xLSTMBlock",
            "the xlstm package is installed, so transformers builds xlstm's own"
            " mLSTMBlock (modeling_xlstm.external_xlstm is True), which calls none of the kernels the"
            " MatrixLSTM kind rebinds; uninstall xlstm to watch xLSTM models",
        ),
    )


register(*_external_xlstm_rows())
