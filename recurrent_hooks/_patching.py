"""Rebinding kernel names of transformers modeling modules, with an undo stack.

A mixer's `forward` looks its kernels up as module globals at call time (`LOAD_GLOBAL` of, e.g.,
`torch_chunk_gated_delta_rule` in `modeling_qwen3_5`), so rebinding the module attribute reaches
models that are already built. This module owns every such rebinding the library makes.

Module contents:
- `UndoStack`: records `(owner, name, old)` for each `setattr` and restores in reverse; the
  mechanism of pytest's MonkeyPatch, written for our one use.
- `acquire_kernels(module, dispatchers)`: binds names of `module` to dispatchers, reference counted per
  module: the first acquisition saves what was bound, the last release restores exactly those objects.
- `route_kernels(family, "torch" | "default")`: the same rebinding, process-wide and unscoped.
- `import_default(module, name)`: the object a module bound to `name` before the library touched it.
"""

import dataclasses
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ._errors import RecurrentHooksError

_MISSING = object()


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
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        if old is _MISSING:
            raise AttributeError(f"{owner!r} has no attribute {name!r} to rebind")
        setattr(owner, name, value)
        self._records.append((owner, name, old))

    def set_instance_attribute(self, owner: Any, name: str, value: Any) -> None:
        """Shadow an attribute of an object (a method its class defines) by one of the instance; undo deletes it."""
        old = owner.__dict__.get(name, _MISSING)
        setattr(owner, name, value)
        self._records.append((owner, name, old))

    def undo(self) -> None:
        """Restore every recorded attribute, last first. A second call does nothing."""
        while self._records:
            owner, name, old = self._records.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def __len__(self) -> int:
        return len(self._records)


# What each module bound before the library first touched it: route_kernels(..., "default") restores these.
_IMPORT_DEFAULTS: dict[tuple[str, str], Any] = {}


def _is_ours(obj: Any) -> bool:
    return getattr(obj, "__recurrent_hooks__", False)


def import_default(module: ModuleType, name: str) -> Any:
    """The object `module.name` held before recurrent_hooks rebound it (recorded at first sight)."""
    key = (module.__name__, name)
    if key not in _IMPORT_DEFAULTS:
        current = getattr(module, name)
        if _is_ours(current):  # only possible if the record was lost; never guess
            raise RecurrentHooksError(f"{module.__name__}.{name} is bound to a recurrent_hooks function already")
        _IMPORT_DEFAULTS[key] = current
    return _IMPORT_DEFAULTS[key]


@dataclasses.dataclass
class _Binding:
    """The library's rebinding of one modeling module, shared by every watch and hook on its mixers."""

    undo: UndoStack
    originals: dict[str, Any]  # name -> the object bound before the first acquisition
    count: int = 0


_BINDINGS: dict[str, _Binding] = {}
_LOCK = threading.RLock()  # watches may be entered and left in several threads at once


def bound_original(module: ModuleType, name: str) -> Any:
    """The object `module.name` holds when the library's binding is released (what idle calls run)."""
    binding = _BINDINGS.get(module.__name__)
    return binding.originals[name] if binding is not None else getattr(module, name)


def acquire_kernels(
    module: ModuleType, make_dispatcher: Callable[[str, Any], Callable[..., Any]], names: tuple[str, ...]
) -> Callable[[], None]:
    """Bind `names` of `module` to `make_dispatcher(name, original)`; return the release function.

    Reference counted per module: nested watches and hooks share one binding; the last release
    restores exactly the objects that were bound before the first acquisition. All or nothing: if a
    name is missing, nothing stays rebound.
    """
    with _LOCK:
        return _acquire(module, make_dispatcher, names)


def _acquire(
    module: ModuleType, make_dispatcher: Callable[[str, Any], Callable[..., Any]], names: tuple[str, ...]
) -> Callable[[], None]:
    binding = _BINDINGS.get(module.__name__)
    if binding is None:
        undo = UndoStack()
        originals = {}
        try:
            for name in names:
                import_default(module, name)
                originals[name] = getattr(module, name, _MISSING)
                if originals[name] is _MISSING:
                    raise RecurrentHooksError(
                        f"{module.__name__} has no kernel named {name!r}: expected the transformers version this"
                        f" library supports (5.24); its mixer would never call a rebound kernel"
                    )
                undo.setattr(module, name, make_dispatcher(name, originals[name]))
        except BaseException:
            undo.undo()
            raise
        binding = _BINDINGS[module.__name__] = _Binding(undo=undo, originals=originals)
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
                del _BINDINGS[module.__name__]
                binding.undo.undo()

    return release


def rebind_process_wide(module: ModuleType, replacements: Mapping[str, Any]) -> None:
    """Set module attributes for good (route_kernels); refused while a watch or hook holds the module."""
    with _LOCK:
        _rebind(module, replacements)


def _rebind(module: ModuleType, replacements: Mapping[str, Any]) -> None:
    if module.__name__ in _BINDINGS:
        raise RecurrentHooksError(
            f"cannot reroute the kernels of {module.__name__} while a watch or a state hook is active on its"
            " mixers: leave the watch (or remove the hooks) first"
        )
    for name in replacements:
        import_default(module, name)
    for name, value in replacements.items():
        setattr(module, name, value)
