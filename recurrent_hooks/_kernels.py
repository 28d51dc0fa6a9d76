"""The declaration of a mixer kind's kernels, as data: which module global, the library's loop, roles.

Module contents:
- `STATE_MEMORY`, `CONV_MEMORY`: the two memories of a mixer (its recurrent state, its conv window);
  `KEEPABLE`: what `watch(keep=...)` takes, and which memory each name keeps; `KERNEL_RECORDS`.
- `Kernel`: one kernel of a kind (name, the library's token loop, where the memory goes in, what the
  results are called, where its tokens are counted, how it can run in segments).
- `Segments`: how a prompt kernel can run on consecutive pieces of its tokens, chaining the state.
"""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any


STATE_MEMORY, CONV_MEMORY = "state", "conv_state"  # the two memories of a mixer
KEEPABLE = {"inputs": None, "outputs": None, "states": STATE_MEMORY, "conv_states": CONV_MEMORY}  # keep name -> memory
KERNEL_RECORDS = ("inputs", "outputs")  # the keep names of the kernel's arguments and results
FORWARD = "forward"  # Kernel.seq: the kernel covers the forward's tokens (and maybe a cached prefix before them)


@dataclasses.dataclass(frozen=True)
class Segments:
    """How a prompt kernel can be run on consecutive pieces of its tokens, chaining the state.

    - `per_token`: the arguments that have a token axis, and which axis;
    - `state_in`: the argument that takes the state a piece starts from;
    - `final_flag`: the argument that asks the kernel to return its last state;
    - `out_axis`: the token axis of the output;
    - `tuple_without_final`: the kernel returns `(out, None)`, not `out`, when the last state is not asked for;
    - `all_states`: the library's chunk-wise version of the kernel (same signature) that returns
      `(result, states)`, every token's state too (token first: `states[t]`), or None. Used when every state is kept and
      gradients are off (with gradients on, the token loop keeps the states the recurrence used).
    """

    per_token: dict[str, int]
    state_in: str
    final_flag: str
    out_axis: int
    tuple_without_final: bool
    all_states: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a mixer kind, as data.

    - `name`: the module global the mixer's forward calls;
    - `loop`: the library's pure-torch token loop with the same signature and return value, plus a
      keyword-only `on_token(t, memory) -> memory` (and `tokens=` when `seq` is FORWARD);
    - `state_in`: the argument that carries the memory in (None: the kernel always starts from zeros);
    - `results`: names of the elements of the returned value (a single tensor is the first name);
    - `role`: "prompt" or "decode";
    - `seq`: `(argument, axis)` where the tokens of the call are counted, None for one token, or
      FORWARD: the forward's tokens, the last positions of the kernel's input;
    - `in_place`: the kernel writes the new memory into its `state_in` tensor instead of returning it;
    - `memory`: which memory the kernel updates, STATE_MEMORY or CONV_MEMORY;
    - `segments`: how the kernel bound before the watch can run piece by piece, chaining the state (None:
      it cannot). Then a call with hooks and kept states at a few tokens only runs that kernel on the
      pieces between them, instead of the token loop.
    """

    name: str
    loop: Callable[..., Any]
    state_in: str | None
    results: tuple[str, ...]
    role: str
    seq: tuple[str, int] | str | None = None
    in_place: bool = False
    memory: str = STATE_MEMORY
    segments: Segments | None = None

    @property
    def signature(self) -> inspect.Signature:
        return _signature(self.loop)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by name (extra keyword arguments the kernel ignores are left out)."""
        bound = self.signature.bind(*args, **kwargs)
        return {k: v for k, v in bound.arguments.items() if k not in ("kwargs", "on_token", "tokens")}

    def tokens(self, arguments: dict[str, Any], forward_tokens: int) -> int:
        """How many tokens the call covers."""
        if self.seq is None:
            return 1
        if self.seq == FORWARD:
            return forward_tokens
        name, axis = self.seq
        return arguments[name].shape[axis]

    def name_results(self, result: Any) -> dict[str, Any]:
        values = result if isinstance(result, tuple) else (result,)
        return dict(zip(self.results, values))


_SIGNATURES: dict[Callable, inspect.Signature] = {}


def _signature(fn: Callable) -> inspect.Signature:
    if fn not in _SIGNATURES:
        _SIGNATURES[fn] = inspect.signature(fn)
    return _SIGNATURES[fn]


