"""Rebinding kernel names of transformers modeling modules, with an undo stack.

A mixer's `forward` looks its kernels up at call time: as module globals (`LOAD_GLOBAL` of, e.g.,
`torch_chunk_gated_delta_rule` in `modeling_qwen3_5`), as methods of a class (`self._rnn_scan`), or as
attributes of an object built with the model (a `functools.partial` stored on a submodule). Rebinding
the attribute where it is looked up reaches models that are already built. This module owns every such
rebinding the library makes.

Module contents:
- `UndoStack`: records `(owner, name, old)` for each `setattr` and restores in reverse; the
  mechanism of pytest's MonkeyPatch, written for our one use.
- `acquire_kernels(targets, dispatchers)`: binds `owner.name` for each target (a module global, a class
  attribute, an attribute of an object) to a dispatcher, reference counted per name: the first
  acquisition saves what was bound, the last release restores exactly that object. The mixer classes'
  `__call__` (`forwards.make_owner`) are bound through it too.
- `rebind_process_wide(...)`: the same rebinding, for good (`route_kernels`).
- `import_default(owner, name)`: what a module or class bound to `name` before the library touched it.
- `Transient`: what the library sets on an object of the model (not a module or class): a deep copy or a
  pickle of the model gets the object that was there instead.
"""

import copy
import dataclasses
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from ..errors import RecurrentHooksError
from .upstream import TESTED_RANGE, in_bound_form, installed_version

MISSING = object()  # what `bound_original` returns for a name that is not bound


class UndoStack:
    """`setattr` with a record of what was there; `undo()` restores in reverse and consumes the record.

    undo = UndoStack()
    try:
        undo.setattr(module, "torch_chunk_gated_delta_rule", replacement)
        ...
    finally:
        undo.undo()
    """

    def __init__(self) -> None:
        self._records: list[tuple[Any, str, Any]] = []

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        # Read class attributes through __dict__ so that descriptors come back unchanged.
        old = owner.__dict__.get(name, MISSING) if isinstance(owner, type) else getattr(owner, name, MISSING)
        if old is MISSING:
            raise AttributeError(f"{owner!r} has no attribute {name!r} to rebind")
        setattr(owner, name, value)
        self._records.append((owner, name, old))

    def set_instance_attribute(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name` in the owner's own `__dict__` (shadowing what a class or base class defines);
        undo restores the entry that was there, or deletes it."""
        old = owner.__dict__.get(name, MISSING)
        setattr(owner, name, value)
        self._records.append((owner, name, old))

    def undo(self) -> None:
        """Restore every recorded attribute, last first. A second call does nothing."""
        while self._records:
            owner, name, old = self._records.pop()
            if old is MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def __len__(self) -> int:
        return len(self._records)


class Transient:
    """A replacement the library sets on an object of the model for a while (a kernel's dispatcher, a wrapped
    `reorder_cache`): it calls `replacement`, and a copy or a pickle of the object gets `original` instead.

        owner.kernel = Transient(dispatcher, owner.kernel)
        copy.deepcopy(owner).kernel   # a deep copy of the original kernel, as without the library

    Attributes other than its own (`__self__`, `__func__`, `__name__`, ...) are the replacement's.
    """

    def __init__(self, replacement: Callable[..., Any], original: Any) -> None:
        self.replacement, self.original = replacement, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.replacement(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("replacement", "original"):  # not set (yet): not the replacement's either
            raise AttributeError(name)
        return getattr(self.replacement, name)

    @property
    def __wrapped__(self) -> Any:
        return self.original

    @property
    def __recurrent_hooks__(self) -> bool:
        return True

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.original, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.original.__reduce_ex__(protocol)


def _owner_key(owner: Any) -> str:
    """A name for the owner of a binding: a module's or a class's dotted name; an object's id."""
    if isinstance(owner, ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"{type(owner).__qualname__} at {id(owner):#x}"


def _current(owner: Any, name: str) -> Any:
    """What `owner.name` is bound to, as `UndoStack.setattr` will restore it (a class's own `__dict__` entry)."""
    if isinstance(owner, type):  # as the class holds it (or a base class): descriptors unbound
        return inspect.getattr_static(owner, name, MISSING)
    return getattr(owner, name, MISSING)


# What each module or class bound before the library first touched it: route_kernels(..., "default")
# restores these. (Objects' attributes are not recorded: they are rebound per watch, never process-wide.)
_IMPORT_DEFAULTS: dict[tuple[str, str], Any] = {}


def _is_ours(obj: Any) -> bool:
    return getattr(obj, "__recurrent_hooks__", False)


def import_default(owner: Any, name: str) -> Any:
    """The object `owner.name` (a module global or a class attribute) held before recurrent_hooks rebound it
    (recorded at first sight)."""
    key = (_owner_key(owner), name)
    if key not in _IMPORT_DEFAULTS:
        current = _current(owner, name)
        if _is_ours(current):  # only possible if the record was lost; never guess
            raise RecurrentHooksError(f"{key[0]}.{name} is bound to a recurrent_hooks function already")
        _IMPORT_DEFAULTS[key] = current
    return _IMPORT_DEFAULTS[key]


@dataclasses.dataclass
class _Binding:
    """The library's rebinding of one kernel name, shared by every watch and hook on mixers that call it."""

    undo: UndoStack
    original: Any  # the object bound before the first acquisition
    count: int = 0


_BINDINGS: dict[tuple[str, str], _Binding] = {}  # (owner, name) -> its binding
_LOCK = threading.RLock()  # watches may be entered and left in several threads at once


def bound_original(owner: Any, name: str) -> Any:
    """The object `owner.name` holds when the library's binding is released (what idle calls run)."""
    binding = _BINDINGS.get((_owner_key(owner), name))
    return binding.original if binding is not None else _current(owner, name)


Target = tuple[Any, str]  # (owner, name): a modeling module and a global, a class and an attribute, an object


def acquire_kernels(
    targets: Sequence[Target], make_dispatcher: Callable[[str, Any], Callable[..., Any]]
) -> Callable[[], None]:
    """Bind each `owner.name` of `targets` to `make_dispatcher(name, original)`; return the release function.

    Reference counted per name: nested watches and hooks share one binding; the last release restores
    exactly the object that was bound before the first acquisition. All or nothing: if a name is
    missing, nothing stays rebound.
    """
    with _LOCK:
        releases: list[Callable[[], None]] = []
        try:
            for owner, name in targets:
                releases.append(_acquire(owner, name, make_dispatcher))
        except BaseException:
            for release in reversed(releases):
                release()
            raise

    def release_all() -> None:
        for release in reversed(releases):
            release()

    return release_all


def _acquire(owner: Any, name: str, make_dispatcher: Callable[[str, Any], Callable[..., Any]]) -> Callable[[], None]:
    key = (_owner_key(owner), name)
    binding = _BINDINGS.get(key)
    if binding is None:
        original = _current(owner, name)
        if original is MISSING:
            raise RecurrentHooksError(
                f"{key[0]} has no kernel named {name!r} under transformers {installed_version()} (tested:"
                f" {TESTED_RANGE}); its mixer would never call a rebound kernel"
            )
        if isinstance(owner, (ModuleType, type)):
            import_default(owner, name)
        undo = UndoStack()
        dispatcher = in_bound_form(make_dispatcher(name, original), original)
        if not isinstance(owner, (ModuleType, type)):  # an object of the model's: copied and pickled with it
            dispatcher = Transient(dispatcher, original)
        # in the owner's own __dict__ (a method a base class defines is shadowed there; undo deletes it)
        undo.set_instance_attribute(owner, name, dispatcher)
        binding = _BINDINGS[key] = _Binding(undo=undo, original=original)
    binding.count += 1
    released = False

    def release() -> None:
        nonlocal released
        with _LOCK:
            if released:
                return
            released = True
            binding.count -= 1
            if binding.count == 0:
                del _BINDINGS[key]
                binding.undo.undo()

    return release


def rebind_process_wide(replacements: Mapping[Target, Any]) -> None:
    """Set module globals and class attributes for good (route_kernels); refused while a watch or hook holds
    one of them."""
    with _LOCK:
        _rebind(replacements)


def _rebind(replacements: Mapping[Target, Any]) -> None:
    for owner, name in replacements:
        if (_owner_key(owner), name) in _BINDINGS:
            raise RecurrentHooksError(
                f"cannot reroute {_owner_key(owner)}.{name} while a watch or a state hook is active on its"
                " mixers: leave the watch (or remove the hooks) first"
            )
    for owner, name in replacements:
        import_default(owner, name)
    for (owner, name), value in replacements.items():
        setattr(owner, name, value)
