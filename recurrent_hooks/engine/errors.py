"""The library's exceptions.

Module contents:
- `RecurrentHooksError`: every error the library raises on purpose derives from it.
- `Unavailable`: a value cannot be had (not kept, unsupported family, position outside the call).
- `InvalidValue`: a value handed to the library (a written state, a hook's return) has the wrong
  shape, dtype or device, or an argument is out of its range.
- `RecurrentHooksWarning`: something the block asked for did not happen, but nothing went wrong
  (a write aimed at a decode step that a generation stopped before).
- `RecurrentHooksDeprecationWarning`, `renamed`: a renamed name was used (it works for one more release).
- `noted(where)`: an exception raised by a user's function (a hook, a reduction, a metric) goes on with its own
  type and a note saying where it was called (PEP 678).
"""

import contextlib
import warnings
from collections.abc import Callable, Iterator


class RecurrentHooksError(Exception):
    """Base class of every error raised on purpose by recurrent_hooks."""


class Unavailable(RecurrentHooksError, LookupError):
    """A value cannot be had; the message says why and, where there is one, what to do instead.

    try:
        mix.states
    except recurrent_hooks.Unavailable as e:
        print(e)   # "GatedDeltaNet(qwen3_5, layer 0): call 0 kept no states; pass keep=('states',) to watch"
    """


class InvalidValue(RecurrentHooksError, ValueError):
    """A value given to the library does not fit: the message names what was expected, what arrived and where."""


class RecurrentHooksWarning(UserWarning):
    """Something a watch was asked for did not happen, though nothing went wrong (e.g. a write whose call never ran)."""


class RecurrentHooksDeprecationWarning(FutureWarning):
    """A name the library renamed was used: it still works for one release; the message names the new one."""


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that `old` is the former name of `new` (docs/api.md, "Renamed")."""
    warnings.warn(
        f"{old} is renamed {new}; the old name goes in the next release",
        RecurrentHooksDeprecationWarning,
        stacklevel=stacklevel,
    )


def former_names(module: str, renames: dict[str, str], namespace: dict[str, object]) -> Callable[[str], object]:
    """A module's `__getattr__` for its former names (`renames`: former name -> new name): the object under the new
    name, with a warning.

        __getattr__ = former_names(__name__, {"StateSpace": "Mamba2StateSpace"}, globals())
    """

    def __getattr__(name: str) -> object:
        if name not in renames:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        # (`from recurrent_hooks import StateSpace` looks the name up twice, importlib's `hasattr` check of the
        # package and the import itself, so it may warn twice: the library reads no stack frames to tell them apart.)
        renamed(f"{module}.{name}", f"{module}.{renames[name]}", stacklevel=3)
        return namespace[renames[name]]

    return __getattr__


def add_note(error: BaseException, note: str) -> None:
    """`error.add_note(note)` (PEP 678), once per note. On Python 3.10, which has no `add_note`, the note goes in
    `__notes__` as well (3.10's traceback does not print it; `str(error)` is left alone either way)."""
    notes = getattr(error, "__notes__", None)
    if notes is not None and note in notes:
        return
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        try:
            error.__notes__ = [*(notes or ()), note]
        except (AttributeError, TypeError):  # an exception type that refuses new attributes
            pass


@contextlib.contextmanager
def noted(where: Callable[[], str]) -> Iterator[None]:
    """Run a user's function: an exception it raises keeps its type and gains the note `where()` (built only then).

    with noted(lambda: f"in state hook {name} of {mixer}, call {call}, token {token}"):
        replacement = fn(mixer, call, token, state)
    """
    try:
        yield
    except Exception as error:
        add_note(error, where())
        raise
