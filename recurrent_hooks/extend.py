"""The names for people who add a mixer kind or a family: declarations, kinds and the registry.

    from recurrent_hooks.extend import Kernel, Role, Site, Segments, RecurrentMixer, FAMILIES
    from recurrent_hooks.extend import Family, GatedDeltaNet, register
    register(Family("my_qwen", {"MyQwenGatedDeltaNet": GatedDeltaNet}, modeling="my_pkg.modeling_my_qwen"))

A family of an existing kind is one `Family` row: its mixer classes, each with its kind, and the owners of
class-attribute kernels that are not the mixer class's. The library's rows are in `recurrent_hooks/registry.py`
(with one test builder each); `register` adds a row at run time (a fork of a transformers modeling module, a
family the library does not list yet), which the next watch finds, and refuses a family or mixer class that is
registered already. A new kind is a `RecurrentMixer` subclass that declares its kernels (`Kernel` rows), its
memories and its values as class constants, in a module of its own, and, where the defaults do not fit it, its
adapter (`ADAPTER`, a `KindAdapter` subclass: how its forwards, cache and values are read). docs/concepts.md
("Adding a family") walks through both.
Users who read and write states need none of this: `recurrent_hooks` itself has their names.
"""

from .engine.binding.upstream import torch_kernel as torch_kernel
from .engine.declare.kernels import CONV_MEMORY as CONV_MEMORY
from .engine.declare.kernels import FORWARD as FORWARD
from .engine.declare.kernels import STATE_MEMORY as STATE_MEMORY
from .engine.declare.kernels import Kernel as Kernel
from .engine.declare.kernels import Role as Role
from .engine.declare.kernels import Segments as Segments
from .engine.declare.kernels import Site as Site
from .engine.declare.limits import Caveat as Caveat
from .engine.declare.limits import Refused as Refused
from .engine.errors import former_names as _former_names
from .engine.handle.adapter import KindAdapter as KindAdapter
from .engine.handle.mixer import RecurrentMixer as RecurrentMixer
from .kinds.dynamic_conv import DynamicShortConvolution as DynamicShortConvolution
from .kinds.dynamic_conv import LoopedDynamicShortConvolution as LoopedDynamicShortConvolution
from .kinds.gated_delta_net import GatedDeltaNet as GatedDeltaNet
from .kinds.kimi_delta import KimiDeltaAttention as KimiDeltaAttention
from .kinds.lightning import LightningAttention as LightningAttention
from .kinds.mlstm import MatrixLSTM as MatrixLSTM
from .kinds.mlstm import MLSTMState as MLSTMState
from .kinds.rg_lru import RealGatedLinearRecurrence as RealGatedLinearRecurrence
from .kinds.selective_scan import PerHeadSelectiveScan as PerHeadSelectiveScan
from .kinds.selective_scan import SelectiveScan as SelectiveScan
from .kinds.shared.conv import CONV_KERNELS as CONV_KERNELS
from .kinds.short_conv import LoopedShortConvolution as LoopedShortConvolution
from .kinds.short_conv import ShortConvolution as ShortConvolution
from .kinds.state_space import Mamba2StateSpace as Mamba2StateSpace
from .kinds.wkv import WeightedKeyValue as WeightedKeyValue
from .kinds.wkv import WkvState as WkvState
from .kinds.zaya import CompressedConvolutionalAttention as CompressedConvolutionalAttention
from .registry import FAMILIES as FAMILIES
from .registry import UNSUPPORTED as UNSUPPORTED
from .registry import Family as Family
from .registry import Unsupported as Unsupported
from .registry import register as register

__all__ = [
    "RecurrentMixer",
    "KindAdapter",
    "Kernel",
    "Role",
    "Site",
    "Segments",
    "STATE_MEMORY",
    "CONV_MEMORY",
    "FORWARD",
    "CONV_KERNELS",
    "Caveat",
    "Refused",
    "Family",
    "FAMILIES",
    "register",
    "Unsupported",
    "UNSUPPORTED",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "SelectiveScan",
    "PerHeadSelectiveScan",
    "Mamba2StateSpace",
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
    "torch_kernel",
]


# the former names of the kinds (docs/api.md, "Renamed"): they work for one release, with a warning
__getattr__ = _former_names(__name__, {"StateSpace": "Mamba2StateSpace", "LinearAttention": "GatedDeltaNet"}, globals())
