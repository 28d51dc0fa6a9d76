"""A registered state hook or write, as the engine keeps it: what a handle registers and the per-call state runs.

`RecurrentMixer.register_state_hook` and the writers (`set_state_after`, ...) make one; the per-call state
(`tracker.CallTracker.hooked`, `run_hook`) asks each which calls and tokens it targets, and a compiled graph finds
it by its key (`compiled.register_hook`). It lives below the handle so that the modules under it need not import
the handle to name it.
"""

import itertools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

from . import compiled as _compiled
from .tracker import SHOWN

if TYPE_CHECKING:
    from .mixer import RecurrentMixer

StateHook = Callable[["RecurrentMixer", int, int, Tensor], Tensor | None]


class Hook:
    """A registered state hook or write: the memory, calls and tokens it targets.

    `calls` is None (every call), a frozenset, or a `range` (a slice of calls, open-ended up to
    `sys.maxsize`); `tokens` is None (every token) or a tuple of positions. `write` tells a write
    (`set_state_after`, ...) from a user's hook: a write whose call never ran is reported on exit.
    """

    def __init__(self, fn: StateHook, memory: str, calls: "frozenset[int] | range | None",
                 tokens: tuple[int, ...] | None, origin: str, *, write: bool = False):
        self.fn, self.memory, self.calls, self.tokens, self.origin = fn, memory, calls, tokens, origin
        self.write = write
        self.key = _compiled.register_hook(self)  # how a compiled graph's ops find it

    def targets(self, call: int | None) -> bool:
        return call is not None and (self.calls is None or call in self.calls)

    @property
    def targets_some(self) -> bool:
        """It targets some call (what a compiled graph, traced for every call, must provide for)."""
        return self.calls is None or len(self.calls) > 0

    @property
    def explicit(self) -> bool:
        """It names finitely many calls: a token outside such a call is an error, not a skip."""
        return isinstance(self.calls, frozenset) or (isinstance(self.calls, range) and self.calls.stop < sys.maxsize)

    def missed(self, seen: int) -> list[int]:
        """The first few calls it targets that a mixer which saw `seen` calls never reached (open ranges:
        none): at most `SHOWN + 1`, so that a message can say there are more."""
        if not self.explicit:
            return []
        targeted = self.calls if isinstance(self.calls, range) else sorted(self.calls)
        return list(itertools.islice((c for c in targeted if c >= seen), SHOWN + 1))
