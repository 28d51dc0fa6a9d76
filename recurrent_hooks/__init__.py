"""recurrent_hooks: read and write the per-token state of recurrent mixers in transformers models.

    import recurrent_hooks as rh
    with rh.watch(model, keep=("states",)) as w:
        model(input_ids)
    w.mixers[0].states        # the state after every token: [batch, seq, heads, key_dim, value_dim]

The public names are listed in `__all__`; everything else lives in private modules. The names for adding a
mixer kind or a family (`Kernel`, `Role`, `Site`, `Segments`, `RecurrentMixer`, the kind classes, `Family`)
are in `recurrent_hooks.extend`; the kinds, `Kernel` and `FAMILIES` stay importable from here too, and
`LinearAttention` is the gated DeltaNet kind's former name.
"""

from ._attribution import Attribution as Attribution
from ._attribution import attribute as attribute
from ._effective_attention import EffectiveAttention as EffectiveAttention
from ._effective_attention import effective_attention as effective_attention
from ._errors import InvalidValue as InvalidValue
from ._errors import RecurrentHooksError as RecurrentHooksError
from ._errors import RecurrentHooksWarning as RecurrentHooksWarning
from ._errors import Unavailable as Unavailable
from ._kimi_delta import KimiDeltaAttention as KimiDeltaAttention
from ._lightning import LightningAttention as LightningAttention
from ._gated_delta_net import GatedDeltaNet as GatedDeltaNet
from ._gated_delta_net import GatedDeltaNet as LinearAttention  # noqa: F401  (its former name, for code that uses it)
from ._calls import Call as Call
from ._calls import KernelCall as KernelCall
from ._calls import Memory as Memory
from ._kernels import Kernel as Kernel
from ._mixer import RecurrentMixer as RecurrentMixer
from ._registry import FAMILIES as FAMILIES
from ._rg_lru import RealGatedLinearRecurrence as RealGatedLinearRecurrence
from ._selective_scan import PerHeadSelectiveScan as PerHeadSelectiveScan
from ._selective_scan import SelectiveScan as SelectiveScan
from ._short_conv import LoopedShortConvolution as LoopedShortConvolution
from ._short_conv import ShortConvolution as ShortConvolution
from ._dynamic_conv import DynamicShortConvolution as DynamicShortConvolution
from ._dynamic_conv import LoopedDynamicShortConvolution as LoopedDynamicShortConvolution
from ._state_space import StateSpace as StateSpace
from ._sweep import Sweep as Sweep
from ._sweep import patching_sweep as patching_sweep
from ._watch import MixerSupport as MixerSupport
from ._watch import Watch as Watch
from ._watch import register_state_hook as register_state_hook
from ._watch import route_kernels as route_kernels
from ._watch import support as support
from ._watch import watch as watch
from ._wkv import WeightedKeyValue as WeightedKeyValue
from ._zaya import CompressedConvolutionalAttention as CompressedConvolutionalAttention

__all__ = [
    "watch",
    "Watch",
    "register_state_hook",
    "route_kernels",
    "support",
    "patching_sweep",
    "Sweep",
    "MixerSupport",
    "attribute",
    "Attribution",
    "Call",
    "KernelCall",
    "Memory",
    "effective_attention",
    "EffectiveAttention",
    "FAMILIES",
    "RecurrentHooksError",
    "RecurrentHooksWarning",
    "Unavailable",
    "InvalidValue",
]
