"""The family registry: which transformers modeling modules and mixer classes the library supports, as data.

A family is one transformers model type (its modeling module has its own copy of every kernel). A
new family is one row here and one test parametrization; nothing else in the library names a family.

Module contents:
- `Family`: one row (name, modeling module, mixer class name, mixer kind).
- `FAMILIES`: the supported families, by name (each with its first mixer class).
- `MORE_MIXERS`: further mixer classes of families in `FAMILIES` (a family whose layers hold mixers of two
  kinds, e.g. inkling2's static and dynamic convolutions): rows that share a family name.
- `UNSUPPORTED`: recurrent and short-convolution mixer classes of transformers that the library does not
  handle yet, with the reason; `unsupported_of(module)` finds a module's row.
- `family_of(module)`, `resolve_family(family)`: lookups.
"""

import dataclasses
import importlib
from types import ModuleType

from torch import nn

from ._dynamic_conv import DynamicShortConvolution, LoopedDynamicShortConvolution
from ._errors import Unavailable
from ._kimi_delta import KimiDeltaAttention
from ._gated_delta_net import GatedDeltaNet
from ._lightning import LightningAttention
from ._mixer import RecurrentMixer
from ._rg_lru import RealGatedLinearRecurrence
from ._mlstm import MatrixLSTM
from ._selective_scan import PerHeadSelectiveScan, SelectiveScan
from ._short_conv import LoopedShortConvolution, ShortConvolution
from ._state_space import StateSpace
from ._wkv import WeightedKeyValue
from ._zaya import CompressedConvolutionalAttention


@dataclasses.dataclass(frozen=True)
class Family:
    """One supported transformers family: where its mixer lives and which mixer kind describes it."""

    name: str  # the transformers model type, e.g. "qwen3_5"
    mixer_class: str  # the class name of its recurrent mixer module
    kind: type[RecurrentMixer]

    @property
    def module_name(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    def module(self) -> ModuleType:
        return importlib.import_module(self.module_name)


FAMILIES: dict[str, Family] = {
    row.name: row
    for row in (
        Family("qwen3_next", "Qwen3NextGatedDeltaNet", GatedDeltaNet),
        Family("qwen3_5", "Qwen3_5GatedDeltaNet", GatedDeltaNet),
        Family("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", GatedDeltaNet),
        Family("olmo_hybrid", "OlmoHybridGatedDeltaNet", GatedDeltaNet),
        Family("qwen4_exp", "Qwen4ExpTextGatedDeltaNet", GatedDeltaNet),
        Family("lara_mini", "LaraMiniGatedDeltaNet", GatedDeltaNet),
        Family("kimi_linear", "KimiLinearDeltaAttention", KimiDeltaAttention),
        Family("bailing_hybrid", "BailingHybridDeltaAttention", KimiDeltaAttention),
        Family("glm5_next", "Glm5NextTextLinearAttention", KimiDeltaAttention),
        Family("mamba", "MambaMixer", SelectiveScan),
        Family("falcon_mamba", "FalconMambaMixer", SelectiveScan),
        Family("jamba", "JambaMambaMixer", SelectiveScan),
        Family("zamba", "ZambaMambaMixer", PerHeadSelectiveScan),
        Family("mamba2", "Mamba2Mixer", StateSpace),
        Family("bamba", "BambaMixer", StateSpace),
        Family("falcon_h1", "FalconH1Mixer", StateSpace),
        Family("granitemoehybrid", "GraniteMoeHybridMambaLayer", StateSpace),
        Family("nemotron_h", "NemotronHMamba2Mixer", StateSpace),
        Family("zamba2", "Zamba2MambaMixer", StateSpace),
        Family("recurrent_gemma", "RecurrentGemmaRecurrentBlock", RealGatedLinearRecurrence),
        Family("rwkv", "RwkvSelfAttention", WeightedKeyValue),
        Family("minimax", "MiniMaxLightningAttention", LightningAttention),
        Family("lfm2", "Lfm2ShortConv", ShortConvolution),
        Family("lfm2_moe", "Lfm2MoeShortConv", ShortConvolution),
        Family("lfm3", "Lfm3ShortConv", ShortConvolution),
        Family("inkling", "InklingShortConvolution", ShortConvolution),
        Family("inkling2", "Inkling2ShortConvolution", ShortConvolution),
        Family("inkling2_loop", "Inkling2LoopShortConvolution", LoopedShortConvolution),
        Family("xlstm", "xLSTMLayer", MatrixLSTM),
        Family("zaya", "ZayaCCAProjection", CompressedConvolutionalAttention),
    )
}

# A family's further mixer classes, each with its own kind: `family_of` finds them (the registry is keyed by
# (modeling module, mixer class)); `FAMILIES[name]` and `resolve_family` give the family's first row.
MORE_MIXERS: tuple[Family, ...] = (
    Family("inkling2", "Inkling2DynamicShortConvolution", DynamicShortConvolution),
    Family("inkling2_loop", "Inkling2LoopDynamicShortConvolution", LoopedDynamicShortConvolution),
)

_BY_CLASS: dict[tuple[str, str], Family] = {
    (f.module_name, f.mixer_class): f for f in (*FAMILIES.values(), *MORE_MIXERS)}

@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A recurrent or short-convolution mixer class of transformers that the library does not handle, and why."""

    family: str  # the transformers model type whose modeling module defines it
    mixer_class: str
    reason: str


def _external_xlstm() -> bool:
    """transformers builds xLSTM from the xlstm package when it is importable (modeling_xlstm.external_xlstm)."""
    from transformers.utils import is_xlstm_available

    return bool(is_xlstm_available())


def _external_xlstm_rows() -> tuple[Unsupported, ...]:
    """With the xlstm package, transformers' xLSTM blocks are xlstm's mLSTMBlock: none of MatrixLSTM's kernels."""
    if not _external_xlstm():
        return ()
    return (Unsupported("xlstm", "xLSTMBlock", "the xlstm package is installed, so transformers builds xlstm's own"
                        " mLSTMBlock (modeling_xlstm.external_xlstm is True), which calls none of the kernels the"
                        " MatrixLSTM kind rebinds; uninstall xlstm to watch xLSTM models"),)


UNSUPPORTED: tuple[Unsupported, ...] = (
    *_external_xlstm_rows(),
)


_UNSUPPORTED_BY_CLASS: dict[tuple[str, str], Unsupported] = {
    (f"transformers.models.{row.family}.modeling_{row.family}", row.mixer_class): row for row in UNSUPPORTED
}


def unsupported_of(module: nn.Module) -> Unsupported | None:
    """The row of `UNSUPPORTED` that `module` is an instance of, or None."""
    cls = type(module)
    return _UNSUPPORTED_BY_CLASS.get((cls.__module__, cls.__name__))


def family_of(module: nn.Module) -> Family | None:
    """The supported family whose mixer class `module` is an instance of, or None."""
    cls = type(module)
    return _BY_CLASS.get((cls.__module__, cls.__name__))


def resolve_family(family: "str | ModuleType | nn.Module") -> Family:
    """A family from its name (`"qwen3_5"`), its modeling module, or a model containing its mixers."""
    if isinstance(family, str):
        if family in FAMILIES:
            return FAMILIES[family]
        raise Unavailable(f"unknown or unsupported family {family!r}; supported: {', '.join(FAMILIES)}")
    if isinstance(family, ModuleType):
        for row in FAMILIES.values():
            if row.module_name == family.__name__:
                return row
        raise Unavailable(
            f"{family.__name__} is not the modeling module of a supported family; supported: {', '.join(FAMILIES)}"
        )
    if isinstance(family, nn.Module):
        found = {row.name: FAMILIES[row.name] for m in family.modules() if (row := family_of(m)) is not None}
        if len(found) == 1:
            return next(iter(found.values()))
        what = "no supported recurrent mixer" if not found else f"mixers of several families ({', '.join(found)})"
        raise Unavailable(f"{type(family).__name__} has {what}; name the family instead")
    raise Unavailable(f"expected a family name, a modeling module or a model, got {type(family).__name__}")
