"""recurrent_hooks: read and write the per-token state of recurrent mixers in transformers models.

    import recurrent_hooks as rh
    with rh.watch(model, keep=("states",)) as w:
        model(input_ids)
    w.mixers[0].states        # the state after every token: [batch, seq, heads, key_dim, value_dim]

The public names are listed in `__all__`. The names for adding a mixer kind or a family (`Kernel`, `Role`,
`Site`, `Segments`, `RecurrentMixer`, the kind classes, `Family`) are in `recurrent_hooks.extend`; the kinds,
`Kernel` and `FAMILIES` stay importable from here too. `recurrent_hooks.toys` has the trained toys,
`recurrent_hooks.plots` the figures.

The package is three layers and the registry between two of them (docs/architecture.md has the picture):

    studies/    sweep, attribution, effective attention, probes, harvest     imports the engine (and the kinds' data)
    registry.py the families: transformers modules and mixer classes -> kinds
    kinds/      one module per mixer kind: its kernels, loops, costs     imports the engine
    engine/     watch, the mixer handle, calls, dispatch, patching, compile support, the paths and their choice

Imports run downwards only: the engine imports no kind, no study and not the registry; a kind imports no study
(tests/package/test_layout.py).
"""

from .engine.declare.kernels import Kernel as Kernel
from .engine.errors import InvalidValue as InvalidValue
from .engine.errors import RecurrentHooksDeprecationWarning as RecurrentHooksDeprecationWarning
from .engine.errors import RecurrentHooksError as RecurrentHooksError
from .engine.errors import RecurrentHooksWarning as RecurrentHooksWarning
from .engine.errors import Unavailable as Unavailable
from .engine.errors import former_names as _former_names
from .engine.handle.mixer import RecurrentMixer as RecurrentMixer
from .engine.policy import Paths as Paths
from .engine.standalone import register_state_hook as register_state_hook
from .engine.support import MixerSupport as MixerSupport
from .engine.support import route_kernels as route_kernels
from .engine.support import support as support
from .engine.tracking.records import Call as Call
from .engine.tracking.records import KernelCall as KernelCall
from .engine.tracking.records import Memory as Memory
from .engine.watch import Watch as Watch
from .engine.watch import watch as watch
from .kinds.dynamic_conv import DynamicShortConvolution as DynamicShortConvolution
from .kinds.dynamic_conv import LoopedDynamicShortConvolution as LoopedDynamicShortConvolution
from .kinds.gated_delta_net import GatedDeltaNet as GatedDeltaNet
from .kinds.kimi_delta import KimiDeltaAttention as KimiDeltaAttention
from .kinds.lightning import LightningAttention as LightningAttention
from .kinds.rg_lru import RealGatedLinearRecurrence as RealGatedLinearRecurrence
from .kinds.selective_scan import PerHeadSelectiveScan as PerHeadSelectiveScan
from .kinds.selective_scan import SelectiveScan as SelectiveScan
from .kinds.short_conv import LoopedShortConvolution as LoopedShortConvolution
from .kinds.short_conv import ShortConvolution as ShortConvolution
from .kinds.state_space import Mamba2StateSpace as Mamba2StateSpace
from .kinds.wkv import WeightedKeyValue as WeightedKeyValue
from .kinds.zaya import CompressedConvolutionalAttention as CompressedConvolutionalAttention
from .registry import FAMILIES as FAMILIES
from .studies import metrics as metrics
from .studies.attribution import Attribution as Attribution
from .studies.attribution import attribute as attribute
from .studies.contexts import TopContexts as TopContexts
from .studies.contexts import top_contexts as top_contexts
from .studies.effective_attention import EffectiveAttention as EffectiveAttention
from .studies.effective_attention import effective_attention as effective_attention
from .studies.harvest import Harvest as Harvest
from .studies.harvest import HarvestDataset as HarvestDataset
from .studies.harvest import harvest as harvest
from .studies.harvest.export import export_saelens as export_saelens
from .studies.probes import probe as probe
from .studies.sweep import Sweep as Sweep
from .studies.sweep import patching_sweep as patching_sweep

__all__ = [
    "watch",
    "Watch",
    "register_state_hook",
    "route_kernels",
    "support",
    "patching_sweep",
    "Sweep",
    "MixerSupport",
    "Paths",
    "attribute",
    "Attribution",
    "metrics",
    "probe",
    "harvest",
    "Harvest",
    "HarvestDataset",
    "export_saelens",
    "top_contexts",
    "TopContexts",
    "Call",
    "KernelCall",
    "Memory",
    "effective_attention",
    "EffectiveAttention",
    "FAMILIES",
    "RecurrentHooksError",
    "RecurrentHooksWarning",
    "RecurrentHooksDeprecationWarning",
    "Unavailable",
    "InvalidValue",
]


# the former names of the kinds (docs/api.md, "Renamed"): they work for one release, with a warning
__getattr__ = _former_names(__name__, {"StateSpace": "Mamba2StateSpace", "LinearAttention": "GatedDeltaNet"}, globals())
