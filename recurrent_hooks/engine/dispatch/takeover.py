"""Takeovers: a study's way to run a mixer's kernel calls itself (the engine declares the hook, a study sets it).

    with takeover.active(mixer, study):       # inside a watch that attached `mixer`
        model(ids)                           # each call study.takes(kernel) is run by study.run(...)

A takeover is consulted only for a call that nothing else wants (no hook, write or kept value of that memory,
from any handle attached to the module): such a call would otherwise run the bound kernel. It then runs
`takeover.run(kernel, original, args, kwargs)` in its place, which must return what the kernel returns
(e.g. the bound kernel in chunks inside one `torch.autograd.Function`: `studies.attribution`). The call is
recorded as usual, its path `takeover.path`. The engine imports no study: this module is the whole contract.
"""

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..declare.kernels import Kernel
from ..errors import RecurrentHooksError


class Takeover(Protocol):
    path: str  # `KernelCall.path` of the calls it runs

    def takes(self, kernel: Kernel) -> bool:
        """Whether this takeover runs the calls of `kernel` (the others run as without it)."""

    def run(self, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run one call of `kernel` (`original`: the kernel bound before the watch) and return its result."""


_ACTIVE: "weakref.WeakKeyDictionary[Any, Takeover]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def active(mixer: Any, takeover: Takeover) -> Iterator[None]:
    """Run the calls of `mixer` (a `RecurrentMixer` handle) that `takeover` takes through it, for the block."""
    if mixer in _ACTIVE:
        raise RecurrentHooksError(
            f"{mixer}: a takeover is set already ({type(_ACTIVE[mixer]).__name__});"
            f" expected none while setting {type(takeover).__name__} (one study runs a mixer's"
            " calls at a time)"
        )
    _ACTIVE[mixer] = takeover
    try:
        yield
    finally:
        _ACTIVE.pop(mixer, None)


def takeover_for(mixers: list[Any], kernel: Kernel) -> Takeover | None:
    """The takeover of the first of `mixers` that takes `kernel`'s calls (None: the call runs as usual)."""
    if not _ACTIVE:
        return None
    for mixer in mixers:
        takeover = _ACTIVE.get(mixer)
        if takeover is not None and takeover.takes(kernel):
            return takeover
    return None
