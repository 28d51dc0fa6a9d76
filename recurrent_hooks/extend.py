"""The names for people who add a mixer kind or a family: declarations, kinds and the registry.

    from recurrent_hooks.extend import Kernel, Role, Site, Segments, RecurrentMixer, FAMILIES

A family of an existing kind is one `Family` row in `recurrent_hooks/_registry.py` (and one test builder);
a new kind is a `RecurrentMixer` subclass that declares its kernels (`Kernel` rows), its memories and its
values as class constants, in a module of its own. docs/concepts.md ("Adding a family") walks through both.
Users who read and write states need none of this: `recurrent_hooks` itself has their names.
"""

from ._conv import CONV_KERNELS as CONV_KERNELS
from ._gated_delta_net import GatedDeltaNet as GatedDeltaNet
from ._kernels import CONV_MEMORY as CONV_MEMORY
from ._kernels import FORWARD as FORWARD
from ._kernels import STATE_MEMORY as STATE_MEMORY
from ._kernels import Kernel as Kernel
from ._kernels import Role as Role
from ._kernels import Segments as Segments
from ._kernels import Site as Site
from ._kimi_delta import KimiDeltaAttention as KimiDeltaAttention
from ._lightning import LightningAttention as LightningAttention
from ._mixer import RecurrentMixer as RecurrentMixer
from ._rg_lru import RealGatedLinearRecurrence as RealGatedLinearRecurrence
from ._mlstm import MatrixLSTM as MatrixLSTM
from ._mlstm import MLSTMState as MLSTMState
from ._registry import FAMILIES as FAMILIES
from ._registry import UNSUPPORTED as UNSUPPORTED
from ._registry import MORE_MIXERS as MORE_MIXERS
from ._registry import Family as Family
from ._registry import Unsupported as Unsupported
from ._selective_scan import PerHeadSelectiveScan as PerHeadSelectiveScan
from ._selective_scan import SelectiveScan as SelectiveScan
from ._short_conv import LoopedShortConvolution as LoopedShortConvolution
from ._short_conv import ShortConvolution as ShortConvolution
from ._dynamic_conv import DynamicShortConvolution as DynamicShortConvolution
from ._dynamic_conv import LoopedDynamicShortConvolution as LoopedDynamicShortConvolution
from ._state_space import StateSpace as StateSpace
from ._wkv import WeightedKeyValue as WeightedKeyValue
from ._wkv import WkvState as WkvState
from ._zaya import CompressedConvolutionalAttention as CompressedConvolutionalAttention

__all__ = [
    "RecurrentMixer",
    "Kernel",
    "Role",
    "Site",
    "Segments",
    "STATE_MEMORY",
    "CONV_MEMORY",
    "FORWARD",
    "CONV_KERNELS",
    "Family",
    "FAMILIES",
    "Unsupported",
    "UNSUPPORTED",
    "MORE_MIXERS",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "SelectiveScan",
    "PerHeadSelectiveScan",
    "StateSpace",
    "RealGatedLinearRecurrence",
    "WeightedKeyValue",
    "LightningAttention",
    "ShortConvolution",
    "LoopedShortConvolution",
    "DynamicShortConvolution",
    "LoopedDynamicShortConvolution",
    "MatrixLSTM",
    "CompressedConvolutionalAttention",
    "MLSTMState",
    "WkvState",
]
