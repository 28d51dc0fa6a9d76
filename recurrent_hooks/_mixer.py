"""The shared mechanism of every recurrent mixer: calls, the call counter, hooks, writes and kept values.

Vocabulary (docs/concepts.md has the long form):
- mixer: one recurrent sequence-mixing module of a model (e.g. `Qwen3_5GatedDeltaNet` at layer 0).
  `RecurrentMixer` is the library's handle on it, one per mixer and watch.
- call: one forward of the mixer module. Inside a `watch`, call 0 is the first forward of that
  mixer in the block (the prompt); in `generate`, decode step k is call k.
- token: a position inside a call, counted from the call's own first token.
- kernel: a module-global function the mixer's forward calls; the library rebinds it (see
  `_patching`) to a dispatcher that knows which mixer is running.
- memory: what a mixer carries from token to token: its recurrent `state` and the window of its
  causal convolution, `conv_state`. Each kernel updates one of them (`Kernel.memory`).

Module contents:
- `Kernel`, `Segments`: the declaration of one kernel of a mixer kind (name, the library's token loop,
  where the memory goes in, what the results are called, where its tokens are counted, how it can
  run in segments).
- `Call`, `KernelCall`, `Memory`: what a call left behind.
- `RecurrentMixer`: the base class; subclasses declare their kernels and values as class constants.
- `attach`, `make_dispatcher`, `normalize_keep`: how mixers meet their modules and kernels (used by `_watch`).

How a kernel call is handled: a forward pre-hook on the mixer module pushes a `_Running` entry on the
running thread's stack (`THREAD.running`) and starts a call on every attached `RecurrentMixer` that sees
that thread; the dispatcher bound in place of the kernel takes the innermost entry, and only if the
module whose method calls the kernel is that entry's module (an unwatched model run inside a watched
forward calls its own kernels untouched, and so does code inside a user's hook, `THREAD.in_hook`). Each
attached mixer says what it wants of this kernel call (a `_Plan`). Then:
- nothing is wanted: the kernel bound before the watch runs unchanged;
- only a few tokens are wanted: that kernel runs in segments between them (`_run_in_segments`),
  chaining the state, and `_Plan.apply` runs at each stop;
- every state is kept, without gradients: the kind's chunk-wise `Segments.all_states` kernel runs;
- otherwise the library's token loop runs and calls `_Plan.apply` after each token's update.
In grad mode, kept states are read through one zero leaf per kernel call (`Call.differentiable`).
A forward that autograd recomputes (gradient checkpointing) is matched to the call it repeats by the
fingerprint of its input (`_Replay`) and runs that call's plan again, keeping nothing new.
"""

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import operator
import sys
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ._errors import InvalidValue, RecurrentHooksError, Unavailable

# A state hook: fn(mixer, call, token, state) -> None (keep the state) or a replacement tensor.
StateHook = Callable[["RecurrentMixer", int, int, Tensor], Tensor | None]

STATE_MEMORY, CONV_MEMORY = "state", "conv_state"  # the two memories of a mixer
KEEPABLE = {"inputs": None, "outputs": None, "states": STATE_MEMORY, "conv_states": CONV_MEMORY}  # keep name -> memory
KERNEL_RECORDS = ("inputs", "outputs")  # the keep names of the kernel's arguments and results
FORWARD = "forward"  # Kernel.seq: the kernel covers the forward's tokens (and maybe a cached prefix before them)


class Memory(NamedTuple):
    """The whole memory of a mixer after a token: what the next token continues from."""

    state: Tensor
    conv_state: Tensor


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


@dataclasses.dataclass(eq=False)
class KernelCall:
    """One kernel call: its name, its arguments and its results by name (None: not kept)."""

    kernel: str
    inputs: dict[str, Any] | None
    output: dict[str, Any] | None


def _position(token: int, tokens: int) -> int | None:
    return token % tokens if -tokens <= token < tokens else None


@dataclasses.dataclass(eq=False)
class Call:
    """What one call (one forward) of a mixer left behind.

        mix.calls[0].kernel            # "torch_chunk_gated_delta_rule": which recurrence kernel fired
        mix.calls[0].inputs["value"]   # its arguments by name
        mix.calls[0].output["output"]  # its results by name
        mix.calls[0].states            # per-token states, if kept
        mix.calls[0].conv              # the convolution kernel's KernelCall
        mix.calls[3].reorder           # beam search: the cache rows this decode step continues, or None

    Inputs and outputs are the tensors the kernel saw (not copies), except the memory: the memory
    argument is cloned before the call and, for kernels that update it in place, its new value is
    cloned after the call into `output["final_state"]`.

    A mixer that runs its recurrence kernel once per head (zamba) makes several kernel calls in one
    call: `parts[h]` is head h's `KernelCall`, and `states` stacks the heads on the axis after `seq`.
    """

    index: int
    where: str = ""
    tokens: int | None = None
    reorder: Tensor | None = None  # beam search: row b of this call continues row reorder[b] of the previous call
    parts: list[KernelCall] = dataclasses.field(default_factory=list)
    conv: KernelCall | None = None
    # memory -> one {token: tensor} per kernel call (per head), and the positions kept (None: every token)
    _kept: dict[str, list[dict[int, Tensor]]] = dataclasses.field(default_factory=dict, repr=False)
    _positions: dict[str, tuple[int, ...] | None] = dataclasses.field(default_factory=dict, repr=False)
    _stacked: dict[str, Tensor] = dataclasses.field(default_factory=dict, repr=False)
    # memory -> per kernel call, the leaf every kept state of the call was read through (grad mode), or None
    _buffers: dict[str, list[Tensor | None]] = dataclasses.field(default_factory=dict, repr=False)
    # memory -> the tokens at which a hook or write replaced it (a hook returning a tensor): such a call's
    # outputs are no longer a function of its inputs and starting memory alone (effective attention refuses it)
    _replaced: dict[str, set[int]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def kernel(self) -> str | None:
        return self.parts[0].kernel if self.parts else None

    def _single(self) -> KernelCall:
        if len(self.parts) != 1:
            raise Unavailable(f"{self.where}: call {self.index} made {len(self.parts)} recurrence kernel calls"
                              " (one per head): read call.parts[head].inputs / .output")
        return self.parts[0]

    @property
    def inputs(self) -> dict[str, Any]:
        return self._recorded(self._single().inputs, "inputs")

    @property
    def output(self) -> dict[str, Any]:
        return self._recorded(self._single().output, "outputs")

    def _recorded(self, values: dict[str, Any] | None, name: str) -> dict[str, Any]:
        if values is None:
            raise Unavailable(f"{self.where}: the kernel {name} of call {self.index} were not kept:"
                              " pass keep=('inputs', 'outputs') to watch")
        return values

    @property
    def states(self) -> Tensor:
        """The state after every token of this call, stacked on a `seq` axis after `batch`.

        Kept in grad mode, it is the tensor the forward read every state through:
        `torch.autograd.grad(metric, call.states)` gives the effect of a write at each token, also when
        the weights are frozen (for a kernel run once per head, see `differentiable`)."""
        return self._all(STATE_MEMORY)

    @property
    def conv_states(self) -> Tensor:
        """The convolution window after every token of this call, `[batch, seq, channels, kernel_size]`."""
        return self._all(CONV_MEMORY)

    def _kept_parts(self, memory: str) -> list[dict[int, Tensor]]:
        if memory not in self._kept:
            name = "states" if memory == STATE_MEMORY else "conv_states"
            raise Unavailable(f"{self.where}: call {self.index} kept no {name}; pass keep=({name!r},) to watch")
        return self._kept[memory]

    def _all(self, memory: str) -> Tensor:
        parts = self._kept_parts(memory)
        if self._positions[memory] is not None:
            raise Unavailable(f"{self.where}: call {self.index} kept its {memory} at tokens"
                              f" {sorted(parts[0])} only; read them with {memory}_after(token)")
        if memory not in self._stacked:
            buffers = self._buffers.get(memory) or [None] * len(parts)
            per_part = [buffer if buffer is not None else torch.stack([kept[t] for t in sorted(kept)], dim=1)
                        for kept, buffer in zip(parts, buffers)]
            self._stacked[memory] = per_part[0] if len(per_part) == 1 else torch.stack(per_part, dim=2)
        return self._stacked[memory]

    def differentiable(self, memory: str) -> list[Tensor]:
        """Per kernel call (one, or one per head), the kept states of every token as one tensor that the
        forward read them through: `torch.autograd.grad(metric, ...)` works on each (grad mode, every token)."""
        parts = self._kept_parts(memory)
        buffers = self._buffers.get(memory) or [None] * len(parts)
        if any(buffer is None for buffer in buffers):
            raise Unavailable(f"{self.where}: call {self.index} kept no differentiable {memory}s: keep every token"
                              " (keep=('states',) or 'conv_states') and run the forward with gradients enabled")
        return list(buffers)

    def _after(self, memory: str, token: int) -> Tensor:
        parts = self._kept_parts(memory)
        position = _position(token, self.tokens)
        if position is None:
            raise Unavailable(f"{self.where}: token {token} is outside call {self.index}, which has {self.tokens}"
                              f" tokens (valid: 0..{self.tokens - 1} or -{self.tokens}..-1)")
        if position not in parts[0]:
            raise Unavailable(f"{self.where}: the {memory} after token {token} of call {self.index} was not kept"
                              f" (kept: tokens {sorted(parts[0])})")
        if len(parts) == 1:
            return parts[0][position]
        return torch.stack([kept[position] for kept in parts], dim=1)


class _Hook:
    """A registered state hook or write: the memory, calls and tokens it targets.

    `calls` is None (every call), a frozenset, or a `range` (a slice of calls, open-ended up to
    `sys.maxsize`); `tokens` is None (every token) or a tuple of positions. `write` tells a write
    (`set_state_after`, ...) from a user's hook: a write whose call never ran is reported on exit.
    """

    def __init__(self, fn: StateHook, memory: str, calls: "frozenset[int] | range | None",
                 tokens: tuple[int, ...] | None, origin: str, *, write: bool = False):
        self.fn, self.memory, self.calls, self.tokens, self.origin = fn, memory, calls, tokens, origin
        self.write = write

    def targets(self, call: int | None) -> bool:
        return call is not None and (self.calls is None or call in self.calls)

    @property
    def explicit(self) -> bool:
        """It names finitely many calls: a token outside such a call is an error, not a skip."""
        return isinstance(self.calls, frozenset) or (isinstance(self.calls, range) and self.calls.stop < sys.maxsize)

    def missed(self, seen: int) -> list[int]:
        """The calls it targets that a mixer which saw `seen` calls never reached (open ranges: none)."""
        if not self.explicit:
            return []
        if isinstance(self.calls, range):
            start = self.calls.start + max(0, -(-(seen - self.calls.start) // self.calls.step)) * self.calls.step
            return list(range(start, self.calls.stop, self.calls.step)[:_SHOWN + 1])
        return sorted(c for c in self.calls if c >= seen)[:_SHOWN + 1]


_SHOWN = 3  # calls named in a message about calls that never ran; the rest are counted


class _Handle(RemovableHandle):
    """A torch `RemovableHandle` that also tells its mixer, so that the last removal can release kernels."""

    def __init__(self, hooks: dict, mixer: "RecurrentMixer") -> None:
        super().__init__(hooks)
        self._mixer_ref = weakref.ref(mixer)

    def remove(self) -> None:
        super().remove()
        mixer = self._mixer_ref()
        if mixer is not None:
            mixer._hook_removed()


def as_index(value: Any, what: str, where: str) -> int:
    """`value` as a Python int: an int or an integer 0-d tensor; bools, floats and the rest raise InvalidValue."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        raise InvalidValue(f"{where}: {what} must be an int, got the bool {value!r}")
    if isinstance(value, Tensor) and (value.dim() != 0 or value.is_floating_point() or value.is_complex()):
        raise InvalidValue(f"{where}: {what} must be an int or an integer 0-d tensor,"
                           f" got a {value.dtype} tensor of shape {tuple(value.shape)}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidValue(f"{where}: {what} must be an int, got {type(value).__name__} {value!r}") from None


def _as_targets(value: Any, what: str, where: str) -> tuple[int, ...] | None:
    """Token positions: None (every token), an int, or a non-empty iterable of ints (negative: from the end)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, float)) or not isinstance(value, Iterable) or isinstance(value, Tensor) \
            and value.dim() == 0:
        return (as_index(value, what, where),)
    items = tuple(as_index(item, what, where) for item in value)
    if not items:
        raise InvalidValue(f"{where}: {what} must be an int, a non-empty iterable of ints or None, got {value!r}")
    return items


def as_calls(value: Any, where: str) -> "frozenset[int] | range | None":
    """Call targets: None (every call), an int, a non-empty iterable of ints, a `range` or a `slice` of
    calls (`slice(1, None)`: every decode step). Calls count from 0; negative calls are refused."""
    if value is None:
        return None
    if isinstance(value, (slice, range)):
        start, stop, step = value.start, value.stop, value.step
        start, step = (0 if start is None else start), (1 if step is None else step)
        stop = sys.maxsize if stop is None else stop
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop, step)) \
                or start < 0 or stop < 0 or step < 1:
            raise InvalidValue(f"{where}: a slice of calls needs start >= 0, stop >= 0 or None and step >= 1,"
                               f" got call={value!r}")
        if stop <= start:
            raise InvalidValue(f"{where}: call={value!r} targets no call")
        return range(start, stop, step)
    calls = _as_targets(value, "call", where)
    if any(c < 0 for c in calls):
        raise InvalidValue(f"{where}: calls count from 0, got call={value!r}")
    return frozenset(calls)


def _describe_calls(calls: "frozenset[int] | range | None") -> str:
    if calls is None:
        return "None"
    if isinstance(calls, range):
        stop = "None" if calls.stop == sys.maxsize else calls.stop
        return f"slice({calls.start}, {stop}, {calls.step})" if calls.step != 1 else f"slice({calls.start}, {stop})"
    return str(next(iter(calls))) if len(calls) == 1 else str(sorted(calls))


def _describe_token(token: Any) -> str:
    if isinstance(token, Tensor) and token.dim() > 0:
        return f"<{'mask' if token.dtype == torch.bool else 'tokens'} {tuple(token.shape)}>"
    return repr(token)


@dataclasses.dataclass(frozen=True)
class _RowTokens:
    """A write at a different token in each batch row: one token per row (negative: from the end), or a
    `[batch, seq]` mask of the tokens written in each row."""

    per_row: Tensor | None  # [batch] integer tokens
    mask: Tensor | None  # [batch, seq] bool
    tokens: tuple[int, ...]  # the tokens at which some row is written (what the write's hook targets)

    @classmethod
    def of(cls, token: Tensor, where: str) -> "_RowTokens":
        if token.dtype == torch.bool:
            if token.dim() != 2:
                raise InvalidValue(f"{where}: a mask of tokens must be [batch, seq], got shape {tuple(token.shape)}")
            columns = token.any(0).nonzero().flatten().tolist()
            if not columns:
                raise InvalidValue(f"{where}: the mask of tokens selects no token")
            return cls(None, token.detach().cpu(), tuple(columns))
        if token.dim() != 1 or token.is_floating_point() or token.is_complex():
            raise InvalidValue(f"{where}: per-row tokens must be a 1-d integer tensor (one token per batch row)"
                               f" or a [batch, seq] bool mask, got a {token.dtype} tensor of shape {tuple(token.shape)}")
        per_row = token.detach().cpu().long()
        return cls(per_row, None, tuple(sorted(set(per_row.tolist()))))

    def at(self, token: int, tokens: int, batch: int, where: str) -> Tensor:
        """The rows written at `token` of a call of `tokens` tokens: `[batch]` bool."""
        given = (self.per_row if self.per_row is not None else self.mask).shape[0]
        if given != batch:
            raise InvalidValue(f"{where}: per-row tokens for {given} rows, but the call has batch {batch}")
        if self.mask is not None:
            if self.mask.shape[1] != tokens:
                raise InvalidValue(f"{where}: a mask of {self.mask.shape[1]} tokens, but the call has {tokens}")
            return self.mask[:, token]
        valid = (self.per_row >= -tokens) & (self.per_row < tokens)
        return valid & (self.per_row % tokens == token)


def normalize_keep(
    keep: Sequence[str] | Mapping[str, Iterable[int] | None],
) -> tuple[dict[str, tuple[int, ...] | None], frozenset[str]]:
    """`keep` as (memory -> kept token positions, None for every token; the kernel records kept: "inputs",
    "outputs"). Names are checked against KEEPABLE."""
    if isinstance(keep, str):
        keep = (keep,)
    items = keep.items() if isinstance(keep, Mapping) else ((name, None) for name in keep)
    memories: dict[str, tuple[int, ...] | None] = {}
    records: set[str] = set()
    for name, positions in items:
        if name not in KEEPABLE:
            raise InvalidValue(f"watch: cannot keep {[name]}; keep takes names from {tuple(KEEPABLE)}")
        if KEEPABLE[name] is None:
            records.add(name)
        else:
            memories[KEEPABLE[name]] = _as_targets(positions, f"keep[{name!r}]", "watch")
    return memories, frozenset(records)


@dataclasses.dataclass
class _Forward:
    """What the library needs to know of one forward of a mixer module."""

    tokens: int  # hidden_states.shape[1]
    cache: Any  # the transformers Cache, or None
    fresh: bool  # no cached state for this layer: the call starts from zeros (a prompt)
    hidden: Tensor | None = None  # the forward's input, read only to match a recompute to its call
    recompute: bool = False  # autograd is recomputing a checkpointed forward (this is not a new call)


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass (where checkpointing recomputes forwards)."""
    return torch._C._current_graph_task_id() != -1


class _ThreadState(threading.local):
    """What the library tracks per thread: the mixer forwards running in it, and whether user hook code runs."""

    def __init__(self) -> None:
        self.running: list[_Running] = []  # innermost last
        self.in_hook = 0  # depth of user hook calls: forwards and kernels they run are not watched


THREAD = _ThreadState()


@contextlib.contextmanager
def _user_code() -> Iterator[None]:
    """Run a user's hook: a model it runs (this one or another) is not watched, and its kernels run untouched."""
    THREAD.in_hook += 1
    try:
        yield
    finally:
        THREAD.in_hook -= 1


def _fingerprint(hidden: Tensor) -> Tensor:
    """Two numbers that tell a forward's input from another one's: its sum and its sum of squares (float64)."""
    with torch.no_grad():
        h = hidden.detach().to(torch.float64)
        return torch.stack([h.sum(), h.square().sum()])


@dataclasses.dataclass(eq=False)
class _Replay:
    """A call that a checkpointed backward may recompute: its index, its record and what its input looked like."""

    index: int
    record: "Call | None"
    shape: tuple[int, ...]
    fingerprint: Tensor

    def distance(self, shape: tuple[int, ...], fingerprint: Tensor) -> float:
        if shape != self.shape:
            return math.inf
        n = math.prod(shape)
        total, squares = self.fingerprint.tolist()
        other_total, other_squares = fingerprint.tolist()
        scale = max(squares, 1e-30)
        return abs(total - other_total) / math.sqrt(n * scale) + abs(squares - other_squares) / scale


_REPLAY_MATCH = 1e-5  # relative fingerprint distance under which a recompute is the same forward
_REPLAYS_KEPT = 256  # recomputable calls remembered per mixer


class RecurrentMixer:
    """The library's handle on one recurrent mixer module; subclasses declare kernels and values.

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        mix = w.mixers[0]
        mix.states           # the state after every token of the last call
        mix.state_after(4)   # the state after token 4

    Class constants a subclass declares:
    - `KERNELS`: the `Kernel`s its modeling modules call (recurrence and convolution, prompt and decode);
    - `STATE`: the axes of the state, as a jaxtyping shape string (e.g. "batch heads key_dim value_dim");
    - `INPUTS`, `OUTPUTS`: the recurrence kernels' named values with their axes, for the docs;
    - `VALUES`: the per-token values `values()` returns, with their axes;
    - `LIMITS`: what cannot be had from this kind, and why (reported by `support`);
    - `FUSED`: names of fused whole-forward kernels (if its module has them) that return the mixer's
      output and skip the kernels above; inside a watch they return None, as their pure-torch
      versions do, for a call that has hooks or kept states, so that the forward goes on;
    - `KERNEL_PER_HEAD`: the forward calls its recurrence kernel once per head (axis 1 of the state):
      hooks run once per head with that head's state, and `mixer.head` says which head is running;
    - `ROUTES`: the words `route_kernels` accepts for this kind, each meaning "torch" or "default".

    `recomputing` is True while autograd recomputes a checkpointed forward of this mixer (gradient
    checkpointing): hooks run again then, with the call index of the forward being recomputed.
    """

    KERNELS: ClassVar[tuple[Kernel, ...]] = ()
    STATE: ClassVar[str] = ""
    CONV_STATE: ClassVar[str] = "batch channels kernel_size"
    INPUTS: ClassVar[dict[str, str]] = {}
    OUTPUTS: ClassVar[dict[str, str]] = {}
    VALUES: ClassVar[dict[str, str]] = {}
    LIMITS: ClassVar[dict[str, str]] = {}
    FUSED: ClassVar[tuple[str, ...]] = ()
    KERNEL_PER_HEAD: ClassVar[bool] = False
    # route_kernels' words for this kind: word -> "torch" (the library's token loops) or "default" (transformers')
    ROUTES: ClassVar[dict[str, str]] = {"torch": "torch", "default": "default"}

    def __init__(self, module: nn.Module, family: str, *,
                 keep: Sequence[str] | Mapping[str, Iterable[int] | None] = (), history: bool = True,
                 restart_on_prompt: bool = False, thread: int | None = None) -> None:
        self._module = weakref.ref(module)  # a standalone hook must not keep its module alive
        self.family = family
        self.layer: int | None = getattr(module, "layer_idx", None)
        self.keep, self.records = normalize_keep(keep)
        self.calls: list[Call] = []
        self.head: int | None = None  # the head of the running recurrence kernel call (KERNEL_PER_HEAD kinds)
        self.recomputing = False  # the running forward is a checkpointed forward being recomputed
        self._history = history  # False: a standalone hook's handle, which records no calls
        self._thread = thread  # the thread whose forwards this handle sees (None: every thread)
        self._restart_on_prompt = restart_on_prompt
        self._hooks: OrderedDict[int, tuple[_Hook, ...]] = OrderedDict()  # weakly referenced by the handles
        self._begun = 0  # forwards begun since the mixer was attached
        self._offset = 0  # begun count at the last prompt (hooks registered outside a watch count from it)
        self._index: int | None = 0  # the running call's index (None: a recompute of a call that wanted nothing)
        self._forward: _Forward | None = None
        self._current: Call | None = None
        self._kernel_calls: dict[str, int] = {}  # memory -> kernel calls in the running forward
        self._tokens = 0  # tokens of the running kernel call
        self._replays: collections.deque[_Replay] = collections.deque(maxlen=_REPLAYS_KEPT)
        self._saw_cache: Callable[[Any], None] | None = None  # the watch's: record how the cache gets reordered
        self._reorder: Tensor | None = None  # cache rows reordered since the last call (beam search)
        self._on_empty: Callable[[], None] | None = None
        self._live = False  # attached to its module's tap

    @property
    def module(self) -> nn.Module:
        """The transformers mixer module this handle watches."""
        module = self._module()
        if module is None:
            raise RecurrentHooksError(f"{self}: its module has been garbage-collected")
        return module

    @classmethod
    def kernel(cls, name: str) -> Kernel:
        """The declared kernel called `name`."""
        for kernel in cls.KERNELS:
            if kernel.name == name:
                return kernel
        raise KeyError(f"{cls.__name__} declares no kernel {name!r}; it has {[k.name for k in cls.KERNELS]}")

    # -- reading -----------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.family}, layer {self.layer})"

    @property
    def states(self) -> Float[Tensor, "batch seq *state"]:
        """The state after every token of the last call (the call's own token count on `seq`).

        The layout after `batch seq` is the kind's `STATE`; gated DeltaNet:
        `Float[Tensor, "batch seq heads key_dim value_dim"]`.
        """
        return self._call(None, "states").states

    @property
    def conv_states(self) -> Float[Tensor, "batch seq channels kernel_size"]:
        """The convolution window after every token of the last call (needs keep=("conv_states",))."""
        return self._call(None, "conv_states").conv_states

    def state_after(self, token: int, call: int | None = None) -> Float[Tensor, "batch *state"]:
        """The state after `token` (negative counts from the end) of call `call` (default: the last call).

        It is the state token+1 continues from: a write or hook at `token` is included. The tensor is
        the one the recurrence used, so `torch.autograd.grad(metric, mix.state_after(t))` works (for
        KERNEL_PER_HEAD kinds it is a stack of the heads' states; take gradients through a written leaf).
        """
        where = f"{self}.state_after"
        return self._call(call, "state_after")._after(STATE_MEMORY, as_index(token, "token", where))

    def conv_state_after(self, token: int, call: int | None = None) -> Float[Tensor, "batch channels kernel_size"]:
        """The convolution window after `token` of call `call`: the last kernel_size conv inputs, oldest
        first, in the layout of transformers' cache; token+1 reads its last kernel_size-1 columns."""
        where = f"{self}.conv_state_after"
        return self._call(call, "conv_state_after")._after(CONV_MEMORY, as_index(token, "token", where))

    def memory_after(self, token: int, call: int | None = None) -> Memory:
        """The whole memory after `token`: `Memory(state, conv_state)` (needs both kept)."""
        return Memory(self.state_after(token, call), self.conv_state_after(token, call))

    def values(self, call: int | None = None) -> dict[str, Tensor]:
        """The per-token values of call `call` (default: the last), token-major, named as in `VALUES`.

            mix.values()["dt"]     # Mamba: the step after bias and softplus, [batch, seq, d_inner]

        Computed from the kernel's kept inputs and outputs (`keep=("inputs", "outputs")`; no states
        needed). Mixers that run their kernel once per head stack the heads on the axis after `seq`.
        """
        record = self._call(call, "values")
        if not record.parts:
            raise Unavailable(f"{self}: call {record.index} made no recurrence kernel call")
        for part in record.parts:
            record._recorded(part.inputs, "inputs"), record._recorded(part.output, "outputs")
        per_part = [self._token_values(part) for part in record.parts]
        if len(per_part) == 1:
            return per_part[0]
        return {name: torch.stack([values[name] for values in per_part], dim=2) for name in per_part[0]}

    @classmethod
    def _token_values(cls, part: KernelCall) -> dict[str, Tensor]:
        """`values()` of one kernel call; each kind derives them from its kernel's arguments."""
        raise NotImplementedError

    def _call(self, call: Any, method: str) -> Call:
        if call is not None:
            call = as_index(call, "call", f"{self}.{method}")
        if not self._history:
            raise Unavailable(f"{self} records nothing: hooks registered outside a watch keep no values; use watch()")
        if not self.calls:
            raise Unavailable(f"{self} has not been called inside this watch yet")
        if call is None:
            return self.calls[-1]
        if not -len(self.calls) <= call < len(self.calls):
            raise Unavailable(f"{self}: no call {call}; this watch saw {len(self.calls)} calls (0..{len(self.calls) - 1})")
        return self.calls[call]

    # -- hooks and writes --------------------------------------------------------------------------------

    def register_state_hook(self, fn: StateHook, *, call: "int | Iterable[int] | slice | None" = None,
                            token: int | Iterable[int] | None = None, which: str = STATE_MEMORY) -> RemovableHandle:
        """Call `fn(mixer, call, token, state)` after the state update of each targeted token.

            h = mix.register_state_hook(lambda m, c, t, s: s * 0.5, call=0, token=[3, 4])
            model(ids)
            h.remove()

        `call` takes an int, several (a list, a `range`), a `slice` (`slice(1, None)`: every decode step)
        or None for all; `token` an int, several, or None for all (negative: -1 is the last token of each
        call). `state` is the state token `token` produced; its output is already computed from it.
        Return None to keep it, or a tensor of the same shape, dtype and device to replace it: token+1
        continues from the replacement, and so does the cache after the last token. The state handed to
        `fn` is not copied: clone it to keep it. A hook that names finitely many calls whose tokens lie
        outside one of them raises; with `call=None` or an open slice, calls without the token are
        skipped. Calls that never run (a generation that stopped early) are not an error for hooks.
        A model that `fn` runs is not watched: its kernels run untouched.
        `which="conv_state"` hooks the convolution window instead (`[batch, channels, kernel_size]`).
        """
        where = f"{self}.register_state_hook"
        if not callable(fn):
            raise InvalidValue(f"{where}: expected a callable fn(mixer, call, token, state), got {fn!r}")
        if which not in (STATE_MEMORY, CONV_MEMORY):
            raise InvalidValue(f"{where}: expected which='state' or which='conv_state', got {which!r}")
        calls = as_calls(call, where)
        name = getattr(fn, "__qualname__", repr(fn))
        return self._add_hooks(_Hook(fn, which, calls, _as_targets(token, "token", where), f"{which} hook {name}"))

    def set_state_after(self, token: int, value: Tensor, call: "int | Iterable[int] | slice | None" = 0
                        ) -> RemovableHandle:
        """Replace the state after `token` of call `call` (default 0, the prompt) by `value`.

            mix.set_state_after(4, patched_state)        # tokens 5.. of the prompt continue from it
            mix.set_state_after(0, patched_state, call=3)   # decode step 3

        Token `token`'s own output is unchanged; later tokens, and the cache, continue from `value`.
        `value` must have the state's shape, dtype and device (checked when the call runs). `call`
        takes what hooks take (several calls, a slice, None for every call).
        """
        return self._add_hooks(self._write(STATE_MEMORY, token, value, call, "set_state_after"))

    def set_conv_state_after(self, token: int, value: Tensor, call: "int | Iterable[int] | slice | None" = 0
                             ) -> RemovableHandle:
        """Replace the convolution window after `token` of call `call` by `value` (`[batch, channels,
        kernel_size]`, the cache's layout and dtype): tokens token+1.. read it, and so does the cache."""
        return self._add_hooks(self._write(CONV_MEMORY, token, value, call, "set_conv_state_after"))

    def set_memory_after(self, token: int, memory: Memory, call: "int | Iterable[int] | slice | None" = 0
                         ) -> RemovableHandle:
        """Write the whole memory after `token` (state and conv window), e.g. kept in another run.

            with rh.watch(model, keep=("states", "conv_states")) as a:
                model(ids_a)
            with rh.watch(model) as b:
                b.mixers[0].set_memory_after(7, a.mixers[0].memory_after(7))
                model(ids_b)   # from token 8 on, layer 0 continues exactly as in run A
        """
        if not isinstance(memory, tuple) or len(memory) != 2:
            raise InvalidValue(f"{self}.set_memory_after({token!r}, call={call!r}): expected a Memory(state,"
                               f" conv_state), got {type(memory).__name__}")
        state, conv_state = memory
        return self._add_hooks(self._write(STATE_MEMORY, token, state, call, "set_memory_after"),
                               self._write(CONV_MEMORY, token, conv_state, call, "set_memory_after"))

    def _write(self, memory: str, token: Any, value: Tensor, call: Any, method: str) -> _Hook:
        where = f"{self}.{method}({_describe_token(token)}, call={call!r})"
        axes = self.STATE if memory == STATE_MEMORY else self.CONV_STATE
        calls = as_calls(call, where)
        if not isinstance(value, Tensor):
            raise InvalidValue(f"{where}: expected a Tensor with axes ({axes}), got {type(value).__name__}")
        rows = _RowTokens.of(token, where) if isinstance(token, Tensor) and token.dim() > 0 else None
        tokens = rows.tokens if rows is not None else (as_index(token, "token", where),)

        def write(mixer: RecurrentMixer, call: int, token: int, state: Tensor) -> Tensor:
            written = value if mixer.head is None else value[:, mixer.head]
            if rows is None or written.shape != state.shape or written.dtype != state.dtype \
                    or written.device != state.device:
                return written  # a write of the whole batch, or a value the check will refuse with its message
            at = rows.at(token, mixer._tokens, state.shape[0], f"{mixer}, call {call}, token {token}: {method}")
            return torch.where(at.to(state.device).view(-1, *(1,) * (state.dim() - 1)), written, state)

        origin = f"{method}({_describe_token(token)}, call={_describe_calls(calls)})"
        return _Hook(write, memory, calls, tokens, origin, write=True)

    def _add_hooks(self, *hooks: _Hook) -> RemovableHandle:
        if not self._live:
            raise RecurrentHooksError(f"{self} is detached (its watch has ended): register hooks inside the with block")
        handle = _Handle(self._hooks, self)
        self._hooks[handle.id] = hooks
        return handle

    def _all_hooks(self) -> Iterable[_Hook]:
        return (hook for hooks in self._hooks.values() for hook in hooks)

    def _detached(self) -> None:
        self._live = False

    def _hook_removed(self) -> None:
        if not self._hooks and self._on_empty is not None:
            self._on_empty()

    def unapplied(self) -> list[str]:
        """Writes aimed at calls this mixer never reached (reported when a watch ends; hooks are not)."""
        seen = self._begun - self._offset
        problems = []
        for hook in self._all_hooks():
            missed = hook.missed(seen) if hook.write else []
            if missed:
                shown = ", ".join(map(str, missed[:_SHOWN])) + (", ..." if len(missed) > _SHOWN else "")
                problems.append(f"{hook.origin} on {self} (call {shown}; it saw {seen} call{'s' if seen != 1 else ''})")
        return problems

    # -- the call counter (driven by the tap's module hooks) -----------------------------------------------

    def _refusal(self, kernel: Kernel) -> str | None:
        """Why this kernel call cannot serve hooks or kept states (None: it can); kinds override it."""
        return None

    def _wants(self, index: int | None) -> bool:
        """Whether call `index` has hooks, writes or kept values (None: a recompute of an idle call)."""
        return index is not None and (bool(self.keep) or bool(self.records)
                                      or any(hook.targets(index) for hook in self._all_hooks()))

    def _sees(self, thread: int, recompute: bool) -> bool:
        """Whether this handle takes part in a forward running in `thread` (a recompute runs where autograd runs it)."""
        return recompute or self._thread is None or self._thread == thread

    def _begin_call(self, forward: _Forward) -> None:
        self._forward = forward
        self._kernel_calls = {}
        self.head = None
        self.recomputing = forward.recompute
        if forward.recompute:
            self._index, self._current = self._replayed(forward)
            return
        self._begun += 1
        if self._restart_on_prompt and forward.fresh:
            self._offset = self._begun - 1
        self._index = self._begun - 1 - self._offset
        self._current = None
        if self._history:
            reorder, self._reorder = (self._reorder, None) if not forward.fresh else (None, None)
            self._current = Call(index=len(self.calls), where=repr(self), tokens=forward.tokens, reorder=reorder)
            self.calls.append(self._current)
            if forward.cache is not None and self._saw_cache is not None:
                self._saw_cache(forward.cache)
        if forward.hidden is not None and (torch.is_grad_enabled() or self.module.training) \
                and self._wants(self._index):
            # Autograd may recompute this forward (gradient checkpointing): remember how to recognize it.
            self._replays.append(_Replay(self._index, self._current, tuple(forward.hidden.shape),
                                         _fingerprint(forward.hidden)))

    def _reordered(self, beam_idx: Tensor) -> None:
        """The cache's rows were reordered (beam search): the next call's row b continues row beam_idx[b]."""
        beam_idx = beam_idx.detach().clone()
        self._reorder = beam_idx if self._reorder is None else self._reorder[beam_idx]

    def _replayed(self, forward: _Forward) -> tuple[int | None, "Call | None"]:
        """The call that a recomputed forward repeats: the remembered call whose input it matches."""
        if forward.hidden is None or not self._replays:
            return None, None
        shape, fingerprint = tuple(forward.hidden.shape), _fingerprint(forward.hidden)
        distances = [replay.distance(shape, fingerprint) for replay in self._replays]
        best = min(range(len(distances)), key=lambda i: (distances[i], -i))  # the latest of equals
        if distances[best] > _REPLAY_MATCH:
            return None, None  # no call with hooks, writes or kept values had this input: it wanted nothing
        replay = self._replays[best]
        return replay.index, replay.record

    def _end_call(self, checked: bool = True) -> None:
        self.head = None
        recompute, self.recomputing = self.recomputing, False
        forward, self._forward = self._forward, None
        if forward is None or recompute:
            return
        if checked and self._kernel_calls.get(STATE_MEMORY, 0) == 0 and self._wants(self._index):
            raise RecurrentHooksError(
                f"{self}: call {self._index} finished without calling a watched kernel"
                f" ({', '.join(k.name for k in self.KERNELS if k.memory == STATE_MEMORY)}) although hooks or kept"
                " values target it; the mixer took a path the library cannot see (a fused kernel, or a forward"
                " this transformers version changed)"
            )

    def _plan(self, kernel: Kernel, tokens: int) -> "_Plan":
        self._tokens = tokens
        part = self._kernel_calls.get(kernel.memory, 0)
        self._kernel_calls[kernel.memory] = part + 1
        self.head = part if self.KERNEL_PER_HEAD and kernel.memory == STATE_MEMORY else None
        index = self._index
        if index is None:
            return _Plan(self, index, [], None)
        if self._wants(index) and (reason := self._refusal(kernel)) is not None:
            raise Unavailable(f"{self}, call {index} ({kernel.name}): {reason}")
        hooks: list[tuple[_Hook, frozenset[int] | None]] = []  # registration order, with absolute positions
        for hook in self._all_hooks():
            if hook.memory != kernel.memory or not hook.targets(index):
                continue
            if hook.tokens is None:
                hooks.append((hook, None))
                continue
            outside = [t for t in hook.tokens if _position(t, tokens) is None]
            if outside and hook.explicit:
                raise InvalidValue(
                    f"{self}: {hook.origin} targets token {outside[0]}, but call {index} ({kernel.name}) has {tokens}"
                    f" token{'s' if tokens != 1 else ''} (valid: 0..{tokens - 1} or -{tokens}..-1)"
                )
            positions = frozenset(p for t in hook.tokens if (p := _position(t, tokens)) is not None)
            if positions:
                hooks.append((hook, positions))
        keep = None
        if kernel.memory in self.keep:
            wanted = self.keep[kernel.memory]
            keep = frozenset(range(tokens)) if wanted is None else frozenset(
                p for t in wanted if (p := _position(t, tokens)) is not None)
        return _Plan(self, index, hooks, keep)

    def _store(self, plan: "_Plan", kernel: Kernel, part: KernelCall, tokens: int) -> None:
        record = self._current
        if record is None:
            return
        if self.recomputing:
            self._store_recomputed(plan, kernel, record)
            return
        part = KernelCall(part.kernel, part.inputs if "inputs" in self.records else None,
                          part.output if "outputs" in self.records else None)
        if kernel.memory == CONV_MEMORY:
            record.conv = part
        else:
            record.parts.append(part)
        if plan.kept is not None:
            record._kept.setdefault(kernel.memory, []).append(plan.kept)
            record._buffers.setdefault(kernel.memory, []).append(plan.stacked)
            record._positions[kernel.memory] = self.keep[kernel.memory]
            record._stacked.pop(kernel.memory, None)

    def _store_recomputed(self, plan: "_Plan", kernel: Kernel, record: Call) -> None:
        """A recompute keeps nothing new, except where the call's own forward ran without gradients
        (reentrant checkpointing): its kept states are then replaced by the recomputed, differentiable
        ones, whose `.grad` is retained for `loss.backward()`."""
        kept = record._kept.get(kernel.memory)
        part = self._kernel_calls[kernel.memory] - 1
        if plan.kept is None or kept is None or part >= len(kept):
            return
        for token, state in plan.kept.items():
            if state.requires_grad and token in kept[part] and not kept[part][token].requires_grad:
                state.retain_grad()
                kept[part][token] = state
                record._buffers[kernel.memory][part] = None  # the recomputed states are read one by one
        record._stacked.pop(kernel.memory, None)


class _Plan:
    """What one attached mixer wants of one kernel call: its hooks (in registration order) and kept tokens."""

    __slots__ = ("mixer", "call", "hooks", "keep", "kept", "stacked")

    def __init__(self, mixer: RecurrentMixer, call: int | None, hooks: list[tuple[_Hook, frozenset[int] | None]],
                 keep: frozenset[int] | None):
        self.mixer, self.call, self.hooks, self.keep = mixer, call, hooks, keep
        self.kept: dict[int, Tensor] | None = None if keep is None else {}
        self.stacked: Tensor | None = None  # every token kept in grad mode: the leaf the forward read them through

    @property
    def idle(self) -> bool:
        return not self.hooks and not self.keep

    def stops(self, tokens: int) -> frozenset[int] | None:
        """The tokens this plan acts at, or None when it acts at every token (a hook with no token)."""
        if any(positions is None for _, positions in self.hooks):
            return None
        stops = frozenset(p for _, positions in self.hooks for p in positions)
        return stops | self.keep if self.keep else stops

    def apply(self, token: int, state: Tensor) -> Tensor:
        for hook, positions in self.hooks:
            if positions is None or token in positions:
                if hook.write:
                    replacement = hook.fn(self.mixer, self.call, token, state)
                else:
                    with _user_code():
                        replacement = hook.fn(self.mixer, self.call, token, state)
                if replacement is not None and replacement is not state:
                    state = _checked(replacement, state, self.mixer, hook, self.call, token)
                    record = self.mixer._current
                    if record is not None and not self.mixer.recomputing:
                        record._replaced.setdefault(hook.memory, set()).add(token)
        return state


def _checked(replacement: Any, state: Tensor, mixer: RecurrentMixer, hook: _Hook, call: int, token: int) -> Tensor:
    where = f"{mixer}, call {call}, token {token}: {hook.origin}"
    if mixer.head is not None:
        where += f" (head {mixer.head} of a kernel run once per head)"
    if not isinstance(replacement, Tensor):
        raise InvalidValue(f"{where} returned {type(replacement).__name__}; expected None or a Tensor")
    axes = mixer.STATE if hook.memory == STATE_MEMORY else mixer.CONV_STATE
    for what, want, got in (("shape", tuple(state.shape), tuple(replacement.shape)),
                            ("dtype", state.dtype, replacement.dtype), ("device", state.device, replacement.device)):
        if want != got:
            raise InvalidValue(f"{where} gave a {hook.memory} with {what} {got}, expected {want} (axes: {axes})")
    return replacement


_FORWARD_SIGNATURES: dict[type, inspect.Signature] = {}


def _forward_of(module: nn.Module, args: tuple, kwargs: dict[str, Any], recompute: bool) -> _Forward:
    """Tokens, cache and freshness of a mixer forward, from its arguments."""
    cls = type(module)
    if cls not in _FORWARD_SIGNATURES:
        _FORWARD_SIGNATURES[cls] = inspect.signature(module.forward)
    arguments = _FORWARD_SIGNATURES[cls].bind_partial(*args, **kwargs).arguments
    extra = arguments.get("kwargs", {})
    cache = arguments.get("cache", extra.get("cache_params"))
    layer = getattr(module, "layer_idx", None)
    fresh = cache is None or layer is None or cache.get_recurrent_state(layer) is None
    hidden = arguments["hidden_states"]
    return _Forward(tokens=hidden.shape[1], cache=cache, fresh=fresh, hidden=hidden, recompute=recompute)


@dataclasses.dataclass(eq=False)
class _Running:
    """One forward of an attached mixer module running in this thread: what its kernel calls belong to."""

    tap: "_Tap"
    module: nn.Module
    forward: _Forward | None  # None: a forward the library does not watch (re-entered, or no handle sees it)
    mixers: list[RecurrentMixer]
    failed: bool = False  # a kernel call of this forward raised: its end is not checked


def _self_of(frame: types.FrameType) -> Any:
    """The `self` of a method's frame (None for other frames)."""
    code = frame.f_code
    return frame.f_locals.get("self") if code.co_argcount and code.co_varnames[0] == "self" else None


def _calling_module(frame: types.FrameType | None) -> nn.Module | None:
    """The module whose method called a kernel: the nearest frame up the stack with an `nn.Module` self."""
    for _ in range(_FRAMES_LOOKED_AT):
        if frame is None:
            return None
        owner = _self_of(frame)
        if isinstance(owner, nn.Module):
            return owner
        frame = frame.f_back
    return None


_FRAMES_LOOKED_AT = 4  # kernels are called from the mixer's forward or a helper method of it


def _drop_stale(running: list[_Running], starting: nn.Module) -> None:
    """Drop the entries of forwards that ended without their post-forward hook (a KeyboardInterrupt skips
    it): those whose module has no method on this thread's stack above the call of `starting` that is
    beginning. Only runs when a forward begins while entries are left, which is rare."""
    frame = sys._getframe(1)
    while frame is not None and _self_of(frame) is not starting:  # down to the starting module's own call ...
        frame = frame.f_back
    while frame is not None and _self_of(frame) is starting:  # ... and past it
        frame = frame.f_back
    live = set()
    while frame is not None:
        owner = _self_of(frame)
        if isinstance(owner, nn.Module):
            live.add(id(owner))
        frame = frame.f_back
    stale = [entry for entry in running if id(entry.module) not in live]
    for entry in stale:
        _end(entry, checked=False)
    running[:] = [entry for entry in running if id(entry.module) in live]


def _end(entry: _Running, checked: bool) -> None:
    for mixer in entry.mixers:
        mixer._end_call(checked=checked)


class _Tap:
    """The per-module side of the mechanism: module hooks, and the mixers attached to the module.

    One tap per mixer module, shared by every watch and standalone hook on it; it exists while at least
    one `RecurrentMixer` is attached. Its pre-forward hook pushes a `_Running` entry on the running
    thread's stack, its post-forward hook pops it; a kernel call is handled by the innermost entry of its
    thread, and only when the module that calls the kernel is that entry's module.
    """

    def __init__(self, module: nn.Module) -> None:
        self.mixers: list[RecurrentMixer] = []
        self.layer = getattr(module, "layer_idx", None)
        self._handles = (
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, always_call=True),
        )

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        thread = THREAD
        if thread.in_hook:
            return  # a forward run by a user's hook: not watched, not counted (its post hook skips it too)
        if thread.running:
            _drop_stale(thread.running, module)
        recompute = in_backward()
        ident = threading.get_ident()
        mixers = [mixer for mixer in self.mixers if mixer._sees(ident, recompute)]
        if not mixers or any(entry.module is module for entry in thread.running):
            thread.running.append(_Running(self, module, None, []))  # unwatched here, or re-entered
            return
        forward = _forward_of(module, args, kwargs, recompute)
        entry = _Running(self, module, forward, mixers)
        for mixer in mixers:
            mixer._begin_call(forward)
        forward.hidden = None  # read by _begin_call; a forward's record must not hold its input
        thread.running.append(entry)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        thread = THREAD
        if thread.in_hook:
            return
        running = thread.running
        for i in range(len(running) - 1, -1, -1):
            if running[i].module is module:
                entry = running[i]
                for stale in running[i + 1:]:
                    _end(stale, checked=False)
                del running[i:]
                _end(entry, checked=not entry.failed)
                return

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        running = THREAD.running  # this thread's entries of this tap (other threads drop theirs when stale)
        running[:] = [entry for entry in running if entry.tap is not self]

    def run_kernel(self, entry: _Running, kernel: Kernel, original: Callable[..., Any], args: tuple,
                   kwargs: dict) -> Any:
        """Run one kernel call for the attached mixers: unchanged when idle, else through the token loop."""
        try:
            return self._run_kernel(entry, kernel, original, args, kwargs)
        except Exception:
            entry.failed = True  # the forward stops here: its end is not checked
            raise
        except BaseException:
            # KeyboardInterrupt and the like skip the post-forward hook: end the forward here.
            entry.failed = True
            running = THREAD.running
            if entry in running:
                for stale in running[running.index(entry):]:
                    _end(stale, checked=False)
                del running[running.index(entry):]
            raise

    def _run_kernel(self, entry: _Running, kernel: Kernel, original: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        arguments = kernel.bind(args, kwargs)
        tokens = kernel.tokens(arguments, entry.forward.tokens)
        plans = [mixer._plan(kernel, tokens) for mixer in entry.mixers]
        recompute = entry.forward.recompute
        records = set() if recompute else {name for mixer in entry.mixers for name in mixer.records}
        live_state = arguments.get(kernel.state_in) if kernel.state_in is not None else None
        if isinstance(live_state, Tensor) and "inputs" in records:
            # The cache updates this tensor in place (at the next step, or in this very call): keep its value.
            arguments[kernel.state_in] = live_state.clone()
        busy = [plan for plan in plans if not plan.idle]
        if not busy:
            result = original(*args, **kwargs)
        else:
            keeping = [plan for plan in busy if plan.keep]
            kept_at = sorted(frozenset().union(*(plan.keep for plan in keeping)))
            slot = {token: i for i, token in enumerate(kept_at)}
            differentiable = torch.is_grad_enabled()
            buffer: list[Tensor] = []  # grad mode: one leaf for every kept state of the call, zeros when read
            slots: list[Tensor] = []  # its per-token views
            filled: dict[int, Tensor] = {}  # slot -> the state it holds
            last: list[Tensor] = []

            def on_token(token: int, state: Tensor) -> Tensor:
                for plan in busy:
                    state = plan.apply(token, state)
                if token in slot:
                    if state.untyped_storage().nbytes() > state.nbytes:
                        state = state.clone()  # a slice of a kernel's larger tensor: keep only the state itself
                    # A tensor that only the later tokens read: the gradient with respect to a kept state is the
                    # effect of changing it there (what a write does), not through token `token`'s own output.
                    if differentiable:
                        # ... read through a slot of one zero leaf, so that the stack of every kept state is a
                        # tensor the forward used (autograd.grad(metric, mix.states)), with frozen weights too.
                        # The slots come from one unbind: its backward stacks their gradients once (a slice
                        # per token would add a whole-buffer gradient per token, quadratic in the tokens).
                        if not buffer:
                            buffer.append(state.new_zeros((state.shape[0], len(kept_at), *state.shape[1:]),
                                                          requires_grad=True))
                            slots.extend(buffer[0].unbind(1))
                        state = state + slots[slot[token]]
                        filled[slot[token]] = state  # copied into the leaf once the kernel call is over
                    else:
                        state = state.view_as(state)
                    for plan in keeping:
                        if token in plan.keep:
                            plan.kept[token] = state
                if token == tokens - 1:
                    last.append(state)
                return state

            fast = _fast_path(kernel, busy, tokens)
            if fast is not None:
                stops, every_state = fast
                result = _run_in_segments(kernel, original, args, kwargs, stops, on_token,
                                          [plan for plan in keeping if every_state])
            else:
                extra = {"tokens": tokens} if kernel.seq == FORWARD else {}
                result = kernel.loop(*args, on_token=on_token, **extra, **kwargs)
            if kernel.memory == CONV_MEMORY and kernel.role == "prompt" and last:
                self._sync_conv_cache(entry.forward, last[0])
            if buffer:
                with torch.no_grad():  # the leaf holds the states from now on (the forward read it as zeros)
                    for i, state in filled.items():
                        buffer[0][:, i].copy_(state)
            for plan in keeping:
                if buffer and len(plan.keep) == len(kept_at) == tokens:
                    plan.stacked = buffer[0]
        output = kernel.name_results(result) if "outputs" in records else {}
        if kernel.in_place and isinstance(live_state, Tensor) and "outputs" in records:
            output["final_state"] = live_state.clone()
        part = KernelCall(kernel.name, arguments if "inputs" in records else None, output)
        for mixer, plan in zip(entry.mixers, plans):
            mixer._store(plan, kernel, part, tokens)
        return result

    def _sync_conv_cache(self, forward: _Forward, window: Tensor) -> None:
        """The prompt path caches the raw last inputs before its conv kernel runs: cache the window as continued."""
        cache = forward.cache
        if cache is None or self.layer is None:
            return
        cached = cache.get_conv_state(self.layer)
        if cached is not None and cached.shape == window.shape:
            cached.copy_(window)

    @staticmethod
    def run_fused(entry: _Running, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A fused whole-forward kernel: skipped (None, as without mamba_ssm) when a mixer wants this call."""
        if any(mixer._wants(mixer._index) for mixer in entry.mixers):
            return None
        return original(*args, **kwargs)


FAST_PATHS = True  # False: every call that is not idle runs the token loop (the tests compare both)


def _fast_path(kernel: Kernel, busy: list[_Plan], tokens: int) -> tuple[list[int], bool] | None:
    """How a busy call can skip the token loop: the tokens to stop at, and whether every state is kept
    chunk-wise in between; None when it cannot (a hook at every token, too many stops, no segments)."""
    if not FAST_PATHS or kernel.segments is None:
        return None
    stops: set[int] = set()
    every_state = False
    for plan in busy:
        if any(positions is None for _, positions in plan.hooks):
            return None
        stops.update(p for _, positions in plan.hooks for p in positions)
        if plan.keep and len(plan.keep) == tokens and kernel.segments.all_states is not None \
                and not torch.is_grad_enabled():
            every_state = True
        elif plan.keep:
            stops.update(plan.keep)
    # each segment costs a kernel call; beyond about one stop per 32 tokens, the token loop is cheaper
    return (sorted(stops), every_state) if len(stops) <= max(8, tokens // 32) else None


def _run_in_segments(kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict, stops: list[int],
                     on_token: Callable[[int, Tensor], Tensor], keeping_all: list[_Plan]) -> Any:
    """Run `original` on the tokens between the stops, chaining the state through `on_token` at each stop.

    With `keeping_all`, the pieces run through the kernel's chunk-wise `all_states` version instead, and
    the states of the tokens between the stops go to those plans.
    """
    segments = kernel.segments
    run = segments.all_states if keeping_all else original
    bound = dict(kernel.signature.bind(*args, **kwargs).arguments)
    extra = bound.pop("kwargs", {})
    positional = list(bound)[: len(args)]  # call each piece the way the mixer called the kernel
    wants_final = bool(bound.get(segments.final_flag, False))
    tokens = kernel.tokens(bound, 0)
    state = bound.get(segments.state_in)
    outputs = []
    start = 0
    for end in [*(stop + 1 for stop in stops), tokens]:
        if end <= start:
            continue
        piece = {name: (value.narrow(segments.per_token[name], start, end - start)
                        if name in segments.per_token else value) for name, value in bound.items()}
        piece[segments.state_in], piece[segments.final_flag] = state, True
        leading = [piece.pop(name) for name in positional]
        if keeping_all:
            (out, state), states = run(*leading, **piece, **extra)
            for plan in keeping_all:
                plan.kept.update((start + i, states[i]) for i in range(end - start))
        else:
            out, state = run(*leading, **piece, **extra)
        outputs.append(out)
        if end - 1 in stops:
            state = on_token(end - 1, state)  # the state after the stop, as the token loop would hand it over
        start = end
    out = torch.cat(outputs, dim=segments.out_axis)
    if wants_final:
        return out, state
    return (out, None) if segments.tuple_without_final else out


_TAPS: "weakref.WeakKeyDictionary[nn.Module, _Tap]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()  # attaching and detaching handles, from any thread


def attach(mixer: RecurrentMixer) -> Callable[[], None]:
    """Attach `mixer` to its module's tap (created on first use); return the detach function."""
    module = mixer.module
    with _LOCK:
        tap = _TAPS.get(module)
        if tap is None:
            tap = _TAPS[module] = _Tap(module)
        tap.mixers = [*tap.mixers, mixer]  # a new list: a forward in another thread may be reading the old one
        mixer._live = True

    def detach() -> None:
        with _LOCK:
            if mixer in tap.mixers:
                tap.mixers = [m for m in tap.mixers if m is not mixer]
                if not tap.mixers:
                    tap.remove()
                    owner = mixer._module()
                    if owner is not None and _TAPS.get(owner) is tap:
                        del _TAPS[owner]

    return detach


def running_entry() -> _Running | None:
    """The innermost watched forward of this thread, if a kernel called now belongs to it."""
    thread = THREAD
    if thread.in_hook or not thread.running:
        return None
    entry = thread.running[-1]
    if entry.forward is None:
        return None
    caller = _calling_module(sys._getframe(2))
    if caller is not None and caller is not entry.module and _is_mixer(caller):
        return None  # another mixer's forward (an unwatched model run inside this one): not ours
    return entry


def _is_mixer(module: nn.Module) -> bool:
    from ._registry import family_of  # the registry imports the kinds, which import this module

    return family_of(module) is not None


def make_dispatcher(kind: type[RecurrentMixer]) -> Callable[[str, Any], Callable[..., Any]]:
    """For `acquire_kernels`: the function bound in place of kernel `name` of a module of mixer kind `kind`."""

    def make(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if name in kind.FUSED:

            @functools.wraps(original)
            def watched(*args: Any, **kwargs: Any) -> Any:
                entry = running_entry()
                return original(*args, **kwargs) if entry is None else _Tap.run_fused(entry, original, args, kwargs)

        else:
            kernel = kind.kernel(name)

            @functools.wraps(original)
            def watched(*args: Any, **kwargs: Any) -> Any:
                entry = running_entry()
                if entry is None:  # a call from outside a watched forward of this thread
                    return original(*args, **kwargs)
                return entry.tap.run_kernel(entry, kernel, original, args, kwargs)

        watched.__recurrent_hooks__ = True
        return watched

    return make
