"""The families the engine serves, as rows the registry adds (`recurrent_hooks.registry`), and their lookups.

The engine names no family and imports no kind: `recurrent_hooks/registry.py` holds the rows (a transformers
modeling module, a mixer class, the kind that describes it) and adds them here with `register` when the package
is imported; `recurrent_hooks.extend` can add more at run time. The lookups read the tables as they are now.

Module contents:
- `Family`, `Unsupported`: the rows;
- `FAMILIES` (by name: each family's first mixer class), `MORE_MIXERS` (further mixer classes of a family),
  `UNSUPPORTED` (mixer classes the library does not handle, with the reason): the tables, filled by `register`;
- `family_of(module)`, `unsupported_of(module)`, `resolve_family(family)`: lookups.
"""

import dataclasses
import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from torch import nn

from .errors import Unavailable

if TYPE_CHECKING:
    from .mixer import RecurrentMixer


@dataclasses.dataclass(frozen=True)
class Family:
    """One supported transformers family: where its mixer lives and which mixer kind describes it."""

    name: str  # the transformers model type, e.g. "qwen3_5"
    mixer_class: str  # the class name of its recurrent mixer module
    kind: "type[RecurrentMixer]"

    @property
    def module_name(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    def module(self) -> ModuleType:
        return importlib.import_module(self.module_name)


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A recurrent or short-convolution mixer class of transformers that the library does not handle, and why."""

    family: str  # the transformers model type whose modeling module defines it
    mixer_class: str
    reason: str


FAMILIES: dict[str, Family] = {}
MORE_MIXERS: list[Family] = []
UNSUPPORTED: list[Unsupported] = []
_BY_CLASS: dict[tuple[str, str], Family] = {}  # (modeling module, mixer class) -> its row
_UNSUPPORTED_BY_CLASS: dict[tuple[str, str], Unsupported] = {}


def register(*rows: "Family | Unsupported") -> None:
    """Add rows: a family's first mixer class goes into `FAMILIES`, a further one of a family already there into
    `MORE_MIXERS`; an `Unsupported` row into `UNSUPPORTED`. A mixer class registered twice is refused."""
    for row in rows:
        if isinstance(row, Unsupported):
            UNSUPPORTED.append(row)
            _UNSUPPORTED_BY_CLASS[(f"transformers.models.{row.family}.modeling_{row.family}", row.mixer_class)] = row
            continue
        key = (row.module_name, row.mixer_class)
        if key in _BY_CLASS:
            raise ValueError(f"the mixer class {row.mixer_class} of {row.name} is registered already"
                             f" (as {_BY_CLASS[key].kind.__name__})")
        if row.name in FAMILIES:
            MORE_MIXERS.append(row)
        else:
            FAMILIES[row.name] = row
        _BY_CLASS[key] = row


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
