"""Call runners: a study's way to run a mixer's kernel calls itself (the engine declares the hook, a study sets it).

    with takeover.running(mixer, runner):     # inside a watch that attached `mixer`
        model(ids)                           # each call runner.takes(kernel) is run by runner.run(...)

A runner is consulted only for a call that nothing else wants (no hook, write or kept value of that memory,
from any handle attached to the module): such a call would otherwise run the bound kernel. It then runs
`runner.run(kernel, original, args, kwargs)` in its place, which must return what the kernel returns
(e.g. the bound kernel in chunks inside one `torch.autograd.Function`: `studies.attribution`). The call is
recorded as usual, its path `runner.path`. The engine imports no study: this module is the whole contract.
"""

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..declare.kernels import Kernel
from ..errors import RecurrentHooksError


class CallRunner(Protocol):
    path: str  # `KernelCall.path` of the calls it runs

    def takes(self, kernel: Kernel) -> bool:
        """Whether this runner runs the calls of `kernel` (the others run as without it)."""

    def run(self, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run one call of `kernel` (`original`: the kernel bound before the watch) and return its result."""


_RUNNERS: "weakref.WeakKeyDictionary[Any, CallRunner]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def running(mixer: Any, runner: CallRunner) -> Iterator[None]:
    """Run the calls of `mixer` (a `RecurrentMixer` handle) that `runner` takes through it, for the block."""
    if mixer in _RUNNERS:
        raise RecurrentHooksError(f"{mixer}: a call runner is set already ({type(_RUNNERS[mixer]).__name__});"
                                  f" expected none while setting {type(runner).__name__} (one study runs a mixer's"
                                  " calls at a time)")
    _RUNNERS[mixer] = runner
    try:
        yield
    finally:
        _RUNNERS.pop(mixer, None)


def runner_for(mixers: list[Any], kernel: Kernel) -> CallRunner | None:
    """The runner of the first of `mixers` that takes `kernel`'s calls (None: the call runs as usual)."""
    if not _RUNNERS:
        return None
    for mixer in mixers:
        runner = _RUNNERS.get(mixer)
        if runner is not None and runner.takes(kernel):
            return runner
    return None
