"""A registered state hook or write, as the engine keeps it: what a handle registers and its tracker runs.

`RecurrentMixer.register_state_hook` and the writers (`set_state_after`, ...) make one; the handle's tracker
(`tracker.CallTracker.hooked`, `run_hook`) asks each which calls and tokens it targets and runs it
(`Hook.run`: the user's `fn(mixer, call, token, state)`, handed the handle it was registered on), and a compiled
graph finds it by its key (`hook_of`). It lives below the handle and its tracker, so that neither of the modules
under the handle needs to import the handle.
"""

import itertools
import sys
import weakref
from collections.abc import Callable
from typing import Any

SHOWN = 3  # calls named in a message about calls that never ran; the rest are counted

_KEYS = itertools.count(1)
_HOOKS: "weakref.WeakValueDictionary[int, Hook]" = weakref.WeakValueDictionary()


def hook_of(key: int) -> "Hook":
    """The hook registered under `key` (`Hook.key`), as a compiled graph's ops find it when the graph runs."""
    return _HOOKS[key]


class Hook:
    """A registered state hook or write: the handle it is on, the memory, calls and tokens it targets.

    `calls` is None (every call), a frozenset, or a `range` (a slice of calls, open-ended up to
    `sys.maxsize`); `tokens` is None (every token) or a tuple of positions. `write` tells a write
    (`set_state_after`, ...) from a user's hook: a write whose call never ran is reported on exit.
    """

    def __init__(
        self,
        handle: Any,
        fn: Callable[..., Any],
        memory: str,
        calls: "frozenset[int] | range | None",
        tokens: tuple[int, ...] | None,
        origin: str,
        *,
        write: bool = False,
    ):
        self.fn, self.memory, self.calls, self.tokens, self.origin = fn, memory, calls, tokens, origin
        self.write = write
        self._handle = weakref.ref(handle)  # the handle it was registered on, which holds it: no cycle
        self.key = next(_KEYS)  # how a compiled graph's ops find it (`hook_of`)
        _HOOKS[self.key] = self

    def run(self, call: int | None, token: int, state: Any) -> Any:
        """Call the user's `fn(mixer, call, token, state)` (a write's function alike), `mixer` the handle."""
        return self.fn(self._handle(), call, token, state)

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
