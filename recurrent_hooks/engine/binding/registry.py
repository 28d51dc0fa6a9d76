"""The families the engine serves: the row type, the registry that holds the rows, and its lookups.

    from recurrent_hooks.extend import Family, GatedDeltaNet, register
    register(Family("my_qwen", {"MyQwenGatedDeltaNet": GatedDeltaNet}, modeling="my_pkg.modeling_my_qwen"))

The engine names no family and imports no kind: `recurrent_hooks/registry.py` holds the library's rows and
registers them when the package is imported; `recurrent_hooks.extend.register` adds more at run time. The
lookups are built lazily from the rows as they are when first used after a change, so a row added at any
time is found by the next watch, `support` or `resolve_family`, without re-import.

A family is one row (`Family`): its name, each of its mixer classes with the kind that describes it, and
the owners of its kinds' class- and instance-attribute kernels where those are not the mixer class itself.
Each mixer class of a row is a `MixerClass` (its family, class name and kind): what a watch attaches.

Module contents:
- `Family`, `MixerClass`, `Unsupported`: the rows;
- `Registry` and its one instance `REGISTRY`: `register`, `unregister`, `replace` and the lookups;
- `FAMILIES` (name -> row), `UNSUPPORTED` (the mixer classes the library does not handle, with the reason):
  read-only live views of the registry's tables;
- `register`, `unregister`, `replace`, `family_of`, `mixer_of`, `unsupported_of`, `resolve_family`:
  `REGISTRY`'s methods.
"""

import dataclasses
import importlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType, ModuleType
from typing import Any

from torch import nn

from ..declare.kernels import Kernel, Site
from ..errors import InvalidValue, Unavailable
from ..handle.mixer import RecurrentMixer


def _modeling_of(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """One supported family: its mixer classes, each with the kind that describes it, as one row.

        Family("qwen3_5", {"Qwen3_5GatedDeltaNet": GatedDeltaNet})
        Family("inkling2", {"Inkling2ShortConvolution": ShortConvolution,
                            "Inkling2DynamicShortConvolution": DynamicShortConvolution})
        Family("recurrent_gemma", {"RecurrentGemmaRecurrentBlock": RealGatedLinearRecurrence},
               owners={"_rnn_scan": "RecurrentGemmaRglru"})

    - `name`: the family's name, the transformers model type for a family of transformers;
    - `mixers`: mixer class name -> kind (a `RecurrentMixer` subclass), the family's first mixer class first;
    - `owners`: kernel name -> where a kind's `Site.CLASS` kernel is bound (a class of the modeling module) or
      its `Site.INSTANCE` kernel (the dotted path of an object inside each mixer module), for every mixer class
      of the family; by default a class-attribute kernel is an attribute of the mixer class, an instance-attribute
      kernel one of the mixer module itself;
    - `limits`: what the family's models do only with a caveat or refuse, whatever the library does (a bug of its
      transformers modeling module, several mixers per layer), what -> a `Caveat` or a `Refused`
      (`declare.limits`; a plain str counts as a caveat): listed with the kind's `LIMITS` by `support`;
    - `modeling`: the dotted name of the modeling module that defines the mixer classes and whose globals the
      kinds' module-global kernels are (default `transformers.models.<name>.modeling_<name>`). It is imported
      when a watch first needs it, not when the row is made.
    """

    name: str
    mixers: Mapping[str, type[RecurrentMixer]]
    owners: Mapping[str, str] = dataclasses.field(default_factory=dict)
    modeling: str | None = None
    limits: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidValue(
                f"Family: expected a family name (a str), got {self.name!r} ({type(self.name).__name__})"
            )
        where = f"Family({self.name!r})"
        if not isinstance(self.mixers, Mapping) or not self.mixers:
            raise InvalidValue(
                f"{where}: expected at least one mixer class, as {{class name: kind}}, got {self.mixers!r}"
            )
        for cls, kind in self.mixers.items():
            if not isinstance(cls, str) or not cls:
                raise InvalidValue(f"{where}: expected mixer class names (str), got {cls!r}")
            if not (isinstance(kind, type) and issubclass(kind, RecurrentMixer)):
                raise InvalidValue(
                    f"{where}: expected a RecurrentMixer subclass for the mixer class {cls!r},"
                    f" got {getattr(kind, '__name__', type(kind).__name__)}"
                )
        if not isinstance(self.owners, Mapping):
            raise InvalidValue(f"{where}: expected owners as {{kernel name: owner}}, got {type(self.owners).__name__}")
        placed = {k.name for kind in self.mixers.values() for k in kind.KERNELS if k.site is not Site.MODULE}
        for kernel, owner in self.owners.items():
            if kernel not in placed:
                kinds = ", ".join(sorted({kind.__name__ for kind in self.mixers.values()}))
                raise InvalidValue(
                    f"{where}: owners names {kernel!r}, which is not a class- or instance-attribute"
                    f" kernel of {kinds} (those are: {', '.join(sorted(placed)) or 'none'})"
                )
            if not isinstance(owner, str):
                raise InvalidValue(f"{where}: expected the owner of {kernel!r} as a str, got {type(owner).__name__}")
        if not isinstance(self.limits, Mapping) or not all(
            isinstance(x, str) for x in (*self.limits, *self.limits.values())
        ):
            raise InvalidValue(f"{where}: expected limits as {{what: why}} strings, got {self.limits!r}")
        if self.modeling is not None and (not isinstance(self.modeling, str) or not self.modeling):
            raise InvalidValue(f"{where}: expected modeling= as a module's dotted name, got {self.modeling!r}")
        object.__setattr__(self, "mixers", MappingProxyType(dict(self.mixers)))
        object.__setattr__(self, "owners", MappingProxyType(dict(self.owners)))
        object.__setattr__(self, "limits", MappingProxyType(dict(self.limits)))
        object.__setattr__(self, "classes", tuple(MixerClass(self, cls, kind) for cls, kind in self.mixers.items()))

    classes: tuple["MixerClass", ...] = dataclasses.field(init=False, repr=False)  # one per mixer class, in order

    @property
    def mixer_class(self) -> str:
        """The family's first mixer class."""
        return self.classes[0].mixer_class

    @property
    def kind(self) -> type[RecurrentMixer]:
        """The kind of the family's first mixer class (`classes` has every mixer class with its kind)."""
        return self.classes[0].kind

    @property
    def module_name(self) -> str:
        return self.modeling or _modeling_of(self.name)

    def module(self) -> ModuleType:
        return importlib.import_module(self.module_name)


@dataclasses.dataclass(frozen=True, eq=False)
class MixerClass:
    """One mixer class of a family and its kind: where each of the kind's kernels is bound for it."""

    family: Family
    mixer_class: str
    kind: type[RecurrentMixer]

    @property
    def name(self) -> str:
        """The family's name."""
        return self.family.name

    @property
    def module_name(self) -> str:
        return self.family.module_name

    def module(self) -> ModuleType:
        return self.family.module()

    def owner(self, kernel: Kernel) -> str | None:
        """Where `kernel` is bound: None for a module global; the row's owner, else the mixer class (a class
        attribute) or "" (the mixer module itself, for an instance attribute)."""
        if kernel.site is Site.MODULE:
            return None
        return self.family.owners.get(kernel.name, self.mixer_class if kernel.site is Site.CLASS else "")

    def target(self, kernel: Kernel, mixer_module: Any = None) -> tuple[Any, str]:
        """The object and attribute name `kernel` is bound to (for an instance attribute, inside `mixer_module`)."""
        return kernel.target(self.module(), self.owner(kernel), mixer_module)


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A recurrent or short-convolution mixer class of transformers that the library does not handle, and why."""

    family: str  # the transformers model type whose modeling module defines it
    mixer_class: str
    reason: str

    @property
    def module_name(self) -> str:
        return _modeling_of(self.family)


class _Rows(Sequence):
    """A read-only live view of a list of rows."""

    def __init__(self, rows: list) -> None:
        self._rows = rows

    def __getitem__(self, index):  # type: ignore[override]
        return self._rows[index]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator:
        return iter(list(self._rows))

    def __repr__(self) -> str:
        return repr(self._rows)


Key = tuple[str, str]  # (modeling module, mixer class): what a module's type is looked up by


class Registry:
    """The rows, and lookups built from them when first used after a change (so run-time rows are found).

    `families` and `unsupported` are read-only views; `register` adds rows (refusing duplicates, all or
    none), `unregister` removes them, `replace` puts a family's new row in its place (tests use the last two)."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}
        self._unsupported: list[Unsupported] = []
        self.families: Mapping[str, Family] = MappingProxyType(self._families)
        self.unsupported: Sequence[Unsupported] = _Rows(self._unsupported)
        self._lock = threading.RLock()  # register reads the lookups' tables while it holds it
        self._index: tuple[dict[Key, MixerClass], dict[Key, Unsupported]] | None = None

    # -- changes ------------------------------------------------------------------------------------------------

    def register(self, *rows: "Family | Unsupported") -> None:
        """Add rows: a `Family` under its name, an `Unsupported` mixer class. A family name or a mixer class
        registered already is refused (naming the row that has it), and then none of the rows is added."""
        with self._lock:
            classes, unsupported = (dict(table) for table in self._tables())
            names = set(self._families)
            for row in rows:
                self._check_new(row, names, classes, unsupported)
            for row in rows:
                if isinstance(row, Family):
                    self._families[row.name] = row
                else:
                    self._unsupported.append(row)
            self._index = None

    def unregister(self, *rows: "Family | Unsupported") -> None:
        """Remove rows registered before (the very rows: a family by its row, not a copy of it)."""
        with self._lock:
            for row in rows:
                there = (
                    row in self._unsupported
                    if isinstance(row, Unsupported)
                    else self._families.get(getattr(row, "name", None)) is row
                )
                if not there:
                    raise InvalidValue(f"unregister: {row!r} is not a registered row")
            for row in rows:
                if isinstance(row, Unsupported):
                    self._unsupported.remove(row)
                else:
                    del self._families[row.name]
            self._index = None

    def replace(self, row: Family) -> Family:
        """Put `row` in place of the registered family of its name (keeping its place); return the old row."""
        with self._lock:
            if not isinstance(row, Family) or row.name not in self._families:
                raise InvalidValue(f"replace: expected a Family row of a registered family, got {row!r}")
            old, self._families[row.name] = self._families[row.name], row
            self._index = None
            return old

    def _check_new(
        self, row: Any, names: set[str], classes: dict[Key, MixerClass], unsupported: dict[Key, Unsupported]
    ) -> None:
        """Refuse `row` if it repeats a registered (or an earlier new) one; else count it as registered."""
        if isinstance(row, Unsupported):
            key = (row.module_name, row.mixer_class)
            if key in unsupported or key in classes:
                how = "listed as unsupported" if key in unsupported else f"supported by {classes[key].name!r}"
                raise InvalidValue(f"register: the mixer class {row.mixer_class} of {row.family} is {how} already")
            unsupported[key] = row
            return
        if not isinstance(row, Family):
            raise InvalidValue(f"register: expected Family or Unsupported rows, got {type(row).__name__}")
        if row.name in names:
            there = self._families.get(row.name)
            if there is None:
                raise InvalidValue(f"register: the family {row.name!r} is given twice")
            raise InvalidValue(
                f"register: the family {row.name!r} is registered already (mixer classes"
                f" {', '.join(there.mixers)}); a family is one row: give all its mixer classes"
                " in it, or another name"
            )
        for mixer in row.classes:
            key = (row.module_name, mixer.mixer_class)
            if key in classes:
                raise InvalidValue(
                    f"register: {mixer.mixer_class} of {row.module_name}, in the row of"
                    f" {row.name!r}, is a mixer class of the family {classes[key].name!r} already"
                )
            if key in unsupported:
                raise InvalidValue(
                    f"register: {mixer.mixer_class} of {row.module_name}, in the row of"
                    f" {row.name!r}, is listed as unsupported: {unsupported[key].reason}"
                )
            classes[key] = mixer
        names.add(row.name)

    # -- lookups ------------------------------------------------------------------------------------------------

    def _tables(self) -> tuple[dict[Key, MixerClass], dict[Key, Unsupported]]:
        """(module, class) -> its mixer class row, and -> its unsupported row: built when first needed."""
        index = self._index
        if index is None:
            with self._lock:  # not while a change is half made
                classes = {(f.module_name, m.mixer_class): m for f in self._families.values() for m in f.classes}
                unsupported = {(row.module_name, row.mixer_class): row for row in self._unsupported}
                index = self._index = (classes, unsupported)
        return index

    def mixer_of(self, module: nn.Module) -> MixerClass | None:
        """The mixer class row (family, class, kind) that `module` is an instance of, or None."""
        cls = type(module)
        return self._tables()[0].get((cls.__module__, cls.__name__))

    def family_of(self, module: nn.Module) -> Family | None:
        """The supported family whose mixer class `module` is an instance of, or None."""
        mixer = self.mixer_of(module)
        return None if mixer is None else mixer.family

    def unsupported_of(self, module: nn.Module) -> Unsupported | None:
        """The row of `UNSUPPORTED` that `module` is an instance of, or None."""
        cls = type(module)
        return self._tables()[1].get((cls.__module__, cls.__name__))

    def resolve_family(self, family: "str | ModuleType | nn.Module") -> Family:
        """A family from its name (`"qwen3_5"`), its modeling module, or a model containing its mixers."""
        supported = ", ".join(self._families)
        if isinstance(family, str):
            if family in self._families:
                return self._families[family]
            raise Unavailable(f"unknown or unsupported family {family!r}; supported: {supported}")
        if isinstance(family, ModuleType):
            for row in list(self._families.values()):
                if row.module_name == family.__name__:
                    return row
            raise Unavailable(
                f"{family.__name__} is not the modeling module of a supported family; supported: {supported}"
            )
        if isinstance(family, nn.Module):
            found = {row.name: row for m in family.modules() if (row := self.family_of(m)) is not None}
            if len(found) == 1:
                return next(iter(found.values()))
            what = "no supported recurrent mixer" if not found else f"mixers of several families ({', '.join(found)})"
            raise Unavailable(f"{type(family).__name__} has {what}; name the family instead")
        raise Unavailable(f"expected a family name, a modeling module or a model, got {type(family).__name__}")


REGISTRY = Registry()
FAMILIES = REGISTRY.families
UNSUPPORTED = REGISTRY.unsupported
register = REGISTRY.register
unregister = REGISTRY.unregister
replace = REGISTRY.replace
mixer_of = REGISTRY.mixer_of
family_of = REGISTRY.family_of
unsupported_of = REGISTRY.unsupported_of
resolve_family = REGISTRY.resolve_family


def layer_in_path(path: str) -> int | None:
    """The decoder layer a module's path names: its last integer part ("model.layers.3.temporal_block" -> 3)."""
    numbers = [int(part) for part in path.split(".") if part.isdigit()]
    return numbers[-1] if numbers else None
