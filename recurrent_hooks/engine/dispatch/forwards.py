"""The per-thread stack of running mixer forwards: which forward a kernel call belongs to, without stack frames.

While a watch or a standalone hook holds a mixer class, its `__call__` is `make_owner`'s: every forward of an
instance, watched or not, pushes its `Running` entry on its thread's stack (`threads.THREAD.running`) and pops it on
the way out, by return, exception or interrupt. A kernel call belongs to the innermost entry (`running_entry`); the
module's tap, if it has one, fills the entry in (`tap._Tap`), and ends the calls of a forward that left.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..handle.mixer import RecurrentMixer
from ..tracking.records import Forward
from ..tracking.threads import THREAD


@dataclasses.dataclass(eq=False)
class Running:
    """One forward of a mixer module running in this thread: what its kernel calls belong to.

    The `__call__` of every mixer class a watch or hook holds pushes one for each instance, watched or not
    (`make_owner`), and pops it in a `finally`; the module's tap, if it has one, fills it in (`tap._Tap._pre`)."""

    module: nn.Module
    tap: Any  # the tap that filled it in; None: the module has none (an unwatched instance)
    forward: Forward | None  # None: a forward the library does not watch (re-entered, or no handle sees it)
    mixers: list[RecurrentMixer]
    failed: bool = False  # a kernel call of this forward raised: its end is not checked
    by_hook: bool = False  # pushed by the tap's pre-forward hook: a forward that did not go through `__call__`


def end(entry: Running, checked: bool) -> None:
    mixers, entry.mixers, entry.forward = entry.mixers, [], None
    for mixer in mixers:
        mixer.tracker.now().end(checked=checked)


def pop(running: list[Running], i: int, checked: bool) -> None:
    """End and remove entry `i` of a thread's stack, and the entries above it: forwards that left without
    popping theirs (only those the pre-forward hook pushed, which an interrupt can skip past)."""
    entry, stale = running[i], running[i + 1 :]
    del running[i:]
    for other in stale:
        end(other, checked=False)
    end(entry, checked=checked and not entry.failed)


def leave(entry: Running, checked: bool) -> None:
    """The forward of `entry` is over: pop it, and what is left above it (if it is not there, someone cleared the
    stack: just end its calls)."""
    running = THREAD.running
    for i in range(len(running) - 1, -1, -1):
        if running[i] is entry:
            pop(running, i, checked)
            return
    end(entry, checked=False)


def drop_left(running: list[Running], module: nn.Module) -> None:
    """`module` begins a forward while an entry its pre-forward hook pushed is still there: that forward was left
    by an interrupt that skipped the post-forward hook (a forward re-entered past `__call__` is taken to be one)."""
    left = [entry for entry in running[:-1] if entry.by_hook and entry.module is module]
    running[:] = [entry for entry in running if not any(entry is other for other in left)]
    for entry in left:
        end(entry, checked=False)


def make_owner(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """For `acquire_kernels`: the `__call__` bound on a mixer class while a watch or hook holds it.

    Every forward of an instance, watched or not, pushes its entry on this thread's stack and pops it on the way
    out, by return, exception or interrupt: a kernel call belongs to the innermost entry (`running_entry`), so
    an unwatched mixer run inside a watched one runs its own kernels, whichever of its submodules calls them."""
    while getattr(original, "__recurrent_hooks__", False):  # a base class's, bound by another watch
        original = original.__wrapped__

    @functools.wraps(original)
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if THREAD.in_hook:
            return original(self, *args, **kwargs)  # a forward run by a user's hook: not watched
        entry = Running(self, None, None, [])
        THREAD.running.append(entry)
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            leave(entry, checked=False)
            raise
        leave(entry, checked=True)
        return result

    __call__.__recurrent_hooks__ = True
    return __call__


def running_entry() -> Running | None:
    """The innermost forward of this thread, if it is a watched one: the kernel called now belongs to it."""
    thread = THREAD
    if thread.in_hook or not thread.running:
        return None
    entry = thread.running[-1]
    return None if entry.forward is None else entry
