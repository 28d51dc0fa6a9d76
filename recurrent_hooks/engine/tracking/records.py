"""What a call left behind: `Call` (one forward of a mixer), `KernelCall` (one kernel call), `Memory`; and what the
library reads of a forward as it begins (`Forward`)."""

import collections
import dataclasses
import functools
import operator
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from torch import Tensor

from ..declare.kernels import CONV_MEMORY, KEEP_NAMES, STATE_MEMORY, memory_name
from ..declare.memory_parts import map_parts, stack_parts
from ..errors import InvalidValue, Unavailable, renamed


@dataclasses.dataclass
class Forward:
    """What the library needs to know of one forward of a mixer module."""

    tokens: int  # hidden_states.shape[1]
    cache: Any  # the transformers Cache, or None
    fresh: bool  # no cached state for this layer: the call starts from zeros (a prompt)
    hidden: Tensor | None = None  # the forward's input, read only to match a recompute to its call
    cache_index: Any = None  # where its memory is in the cache (the kind's `adapter.cache_index`: by default the layer)
    recompute: bool = False  # autograd is recomputing a checkpointed forward (this is not a new call)
    training: bool = False  # the module is in train mode (gradient checkpointing may recompute it)
    kernel_calls: int = 1  # recurrence kernel calls the forward makes (`adapter.kernel_calls`: its heads, zamba)


def brief(value: Any) -> str:
    """`value` for a repr: tensors as their shape and dtype (`Tensor[2, 12, 4] float32`), containers item by item."""
    if isinstance(value, Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {brief(item)}" for key, item in value.items()) + "}"
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return (
            f"{type(value).__name__}("
            + ", ".join(f"{name}={brief(item)}" for name, item in zip(type(value)._fields, value))
            + ")"
        )
    if isinstance(value, (list, tuple)):
        inner = ", ".join(brief(item) for item in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


class Memory(NamedTuple):
    """The whole memory of a mixer after a token: what the next token continues from (None: a memory
    the mixer's kind does not carry, e.g. the state of a short convolution). `window` is the convolution
    window (formerly `conv_state`)."""

    state: Tensor | None
    window: Tensor | None

    @property
    def conv_state(self) -> Tensor | None:
        """The former name of `window`."""
        renamed("Memory.conv_state", "Memory.window")
        return self.window


@dataclasses.dataclass(eq=False, frozen=True, slots=True)
class KernelCall:
    """One kernel call: its name, its arguments and its results by name (None: not kept), and the path it ran
    by: "bound kernel" (nothing was asked of it), or a path's label (`policy.Strategy` lists them;
    `recurrent_hooks.Paths` chooses)."""

    kernel: str
    inputs: dict[str, Any] | None
    output: dict[str, Any] | None
    path: str = "bound kernel"

    def __repr__(self) -> str:
        return (
            f"KernelCall(kernel={self.kernel!r}, path={self.path!r}, inputs={brief(self.inputs)},"
            f" output={brief(self.output)})"
        )


@functools.cache
def bare_kernel_call(kernel: str, path: str) -> KernelCall:
    """The record of a kernel call that kept neither inputs nor outputs: one per kernel and path, shared by every
    call's record (it holds nothing of the call)."""
    return KernelCall(kernel, None, None, path)


def position_of(token: int, tokens: int) -> int | None:
    return token % tokens if -tokens <= token < tokens else None


class _Nothing(Mapping):
    """The empty bookkeeping every record shares until it writes its own (`_own`): read-only, and one object, also
    in a copy or a pickle of a record."""

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, key: Any) -> bool:
        return False

    def get(self, key: Any, default: Any = None) -> Any:
        return default

    def __repr__(self) -> str:
        return "{}"

    def __reduce__(self) -> str:
        return "_NOTHING"  # (pickle and copy: the module's one instance)


# The shared empty values of a record's own bookkeeping: a call that kept nothing, replaced nothing and ran over its
# own tokens holds no dict or set of its own (`_own` makes one at its first write).
_NOTHING: Any = _Nothing()
_NONE: frozenset[str] = frozenset()


class Call:
    """What one call (one forward) of a mixer left behind.

        mix.calls[0].kernel            # "torch_chunk_gated_delta_rule": which recurrence kernel fired
        mix.calls[0].inputs["value"]   # its arguments by name
        mix.calls[0].output["output"]  # its results by name
        mix.calls[0].states            # per-token states, if kept
        mix.calls[0].windows           # per-token convolution windows, if kept
        mix.calls[0].conv              # the convolution kernel's KernelCall
        mix.calls[3].reorder           # beam search: the cache rows this decode step continues, or None
        mix.calls[3].continues_from    # assisted decoding: (call, token) whose memory it continues, or None

    Inputs and outputs are the tensors the kernel saw (not copies), except the memory: the memory
    argument is cloned before the call and, for kernels that update it in place, its new value is
    cloned after the call into `output["final_state"]`.

    A mixer that runs its recurrence kernel once per head (zamba) makes several kernel calls in one
    call: `kernel_calls[h]` is head h's `KernelCall`, and `states` stacks the heads on the axis after `seq`.
    A forward that transformers splits over several kernel calls (over a cache that records its past, as assisted
    decoding's: the prompt kernel on its first tokens, then one-token decode-kernel steps) is one call too: its
    tokens count across them, and `kernel_calls` holds them in order (`kernels`: their names).
    (A call is the record of one forward; what it holds of the kernels' tensors is what `keep` kept.)
    """

    __slots__ = (
        "index",
        "where",
        "tokens",
        "reorder",
        "continues_from",
        "kernel_calls",
        "conv",
        "_kept",
        "_positions",
        "_stacked",
        "_buffers",
        "_replaced",
        "_ran",
        "_reduced",
        "_split",
    )

    def __init__(
        self,
        index: int,
        where: str = "",
        tokens: int | None = None,
        reorder: Tensor | None = None,
        kernel_calls: list[KernelCall] | None = None,
        conv: KernelCall | None = None,
    ) -> None:
        self.index = index
        self.where = where
        self.tokens = tokens
        self.reorder = reorder  # beam search: row b of this call continues row reorder[b] of the previous call
        # a cache rolled back to a recorded token (assisted decoding rejected candidates): this call's memories
        # continue those after token t of call c, (c, t); None: those after the previous call's last token
        self.continues_from: tuple[int, int] | None = None
        self.kernel_calls: list[KernelCall] = [] if kernel_calls is None else kernel_calls
        self.conv = conv
        # memory -> one {token: tensor} per kernel call (per head), and the positions kept (None: every token)
        self._kept: dict[str, list[dict[int, Tensor]]] = _NOTHING
        self._positions: dict[str, tuple[int, ...] | None] = _NOTHING
        self._stacked: dict[str, Tensor] = _NOTHING
        # memory -> per kernel call, the leaf every kept state of the call was read through (grad mode), or None
        self._buffers: dict[str, list[Tensor | None]] = _NOTHING
        # memory -> the tokens at which a hook or write replaced it (a hook returning a tensor): such a call's
        # outputs are no longer a function of its inputs and starting memory alone (effective attention refuses it)
        self._replaced: dict[str, set[int]] = _NOTHING
        # memory -> the positions its kernel ran over, where they differ from the forward's input's (rwkv's batched
        # decode bug, docs/concepts.md), and None -> the forward's (`note_ran`)
        self._ran: dict[str | None, int] = _NOTHING
        # the memories kept as reductions (`watch(reduce=...)`): what `_kept` holds of them is fn(states), per token
        self._reduced: frozenset[str] = _NONE
        # the memories whose kernel calls split the forward's tokens between them (`note_split`)
        self._split: frozenset[str] = _NONE

    def __repr__(self) -> str:
        kept = {
            memory + (" (reduced)" if memory in self._reduced else ""): "every token"
            if self._positions.get(memory) is None
            else sorted(by_kernel_call[0])
            for memory, by_kernel_call in self._kept.items()
        }
        return (
            f"Call(index={self.index}, where={self.where!r}, tokens={self.tokens}, kernel={self.kernel!r},"
            f" reorder={brief(self.reorder)}, kernel_calls={brief(self.kernel_calls)}, conv={brief(self.conv)},"
            f" kept={kept})"
        )

    @property
    def parts(self) -> list[KernelCall]:
        """The former name of `kernel_calls`."""
        renamed("Call.parts", "Call.kernel_calls")
        return self.kernel_calls

    @property
    def kernel(self) -> str | None:
        """The recurrence kernel that fired (a kind with only a convolution window: its conv kernel)."""
        if self.kernel_calls:
            return self.kernel_calls[0].kernel
        return self.conv.kernel if self.conv is not None else None

    @property
    def kernels(self) -> tuple[str, ...]:
        """The recurrence kernels that fired, one per kernel call in order: one, or one per head (zamba), or a
        forward split over several kernel calls (a recording cache: the prompt kernel, then one-token steps)."""
        return tuple(kernel_call.kernel for kernel_call in self.kernel_calls)

    @property
    def split(self) -> bool:
        """Whether transformers split this call's tokens over several kernel calls (a cache that records its past,
        as assisted and prompt-lookup decoding's): `inputs` and `output` are then per kernel call."""
        return bool(self._split)

    def _single(self, name: str) -> KernelCall:
        """The call's one recurrence kernel call (`name`: the attribute asked for, for the message)."""
        if len(self.kernel_calls) == 1:
            return self.kernel_calls[0]
        if self._split:
            raise Unavailable(
                f"{self.where}: call {self.index} ran as {len(self.kernel_calls)} kernel calls (the"
                f" forward was split: {', '.join(self.kernels)}, over a cache that records its past):"
                f" read call.kernel_calls[i].{name}"
            )
        if self.kernel_calls:
            raise Unavailable(
                f"{self.where}: call {self.index} made {len(self.kernel_calls)} recurrence kernel"
                f" calls (one per head): read call.kernel_calls[head].{name}"
            )
        if self.conv is not None:
            raise Unavailable(
                f"{self.where}: call {self.index} made no recurrence kernel call (this mixer's memory"
                f" is a convolution window only): its kernel call ({self.conv.kernel}) is call.conv;"
                f" read call.conv.{name}"
            )
        raise Unavailable(f"{self.where}: call {self.index} made no watched kernel call")

    @property
    def inputs(self) -> dict[str, Any]:
        """The recurrence kernel's arguments by name (kernel once per head: `kernel_calls[h].inputs`; a convolution
        window only: `conv.inputs`)."""
        return recorded(self, self._single("inputs").inputs, "inputs")

    @property
    def output(self) -> dict[str, Any]:
        """The recurrence kernel's results by name (kernel once per head: `kernel_calls[h].output`; a convolution
        window only: `conv.output`)."""
        return recorded(self, self._single("output").output, "outputs")

    @property
    def states(self) -> Tensor:
        """The state after every token of this call, stacked on a `seq` axis after `batch`.

        Kept as a reduction (`watch(reduce={"states": fn})`): fn's result for every token, `[batch, seq, ...]`
        (a kernel run once per head: fn saw every head's states, and its last head's kernel call kept them). Kept
        in grad mode, it is the tensor the forward read every state through:
        `torch.autograd.grad(metric, call.states)` gives the effect of a write at each token, also when
        the weights are frozen (for a kernel run once per head, see `differentiable`)."""
        return self.kept(STATE_MEMORY)

    @property
    def windows(self) -> Tensor:
        """The convolution window after every token of this call, `[batch, seq, channels, kernel_size]`."""
        return self.kept(CONV_MEMORY)

    @property
    def conv_states(self) -> Tensor:
        """The former name of `windows`."""
        renamed("Call.conv_states", "Call.windows")
        return self.windows

    def _kept_by_kernel_call(self, memory: str) -> list[dict[int, Tensor]]:
        if memory not in KEEP_NAMES:
            raise InvalidValue(
                f"{self.where}: expected a memory, one of {', '.join(map(repr, KEEP_NAMES))}, got {memory!r}"
            )
        if memory not in self._kept:
            name = KEEP_NAMES[memory]
            raise Unavailable(f"{self.where}: call {self.index} kept no {name}; pass keep=({name!r},) to watch")
        return self._kept[memory]

    def kept(self, memory: str) -> Tensor:
        """The memory `memory` ("state" or "window") after every token of this call, stacked on a `seq` axis after
        `batch`: `states` and `windows` by name."""
        memory = memory_name(memory, "Call.kept")
        by_kernel_call = self._kept_by_kernel_call(memory)
        if self._positions[memory] is not None:
            raise Unavailable(
                f"{self.where}: call {self.index} kept its {memory} at tokens"
                f" {sorted(by_kernel_call[0])} only; read them with {memory}_after(token)"
            )
        if memory not in self._stacked:
            buffers = self._buffers.get(memory) or [None] * len(by_kernel_call)
            if all(buffer is None for buffer in buffers) and memory not in self._split:
                stacked = self._stack_once(by_kernel_call)
            else:
                per_part = [
                    buffer if buffer is not None else stack_parts([kept[t] for t in sorted(kept)], dim=1)
                    for kept, buffer in zip(by_kernel_call, buffers)
                ]
                stacked = per_part[0] if len(per_part) == 1 else stack_parts(per_part, dim=2)
            _own(self, "_stacked")[memory] = stacked
        return self._stacked[memory]

    @staticmethod
    def _stack_once(by_kernel_call: list[dict[int, Tensor]]) -> Tensor:
        """Stack the kept states of every token (and head: axis 2) into one tensor, and keep views of it in place
        of the per-token tensors: the record holds one copy of them, not two (`state_after(t)` is `states[:, t]`).
        Not for states kept in grad mode, which are the tensors the forward read (`_buffers`)."""
        tokens = sorted(by_kernel_call[0])
        if len(by_kernel_call) == 1:
            stacked = stack_parts([by_kernel_call[0][t] for t in tokens], dim=1)
            for i, t in enumerate(tokens):
                by_kernel_call[0][t] = map_parts(lambda s, i=i: s[:, i], stacked)
            return stacked
        stacked = stack_parts([stack_parts([kept[t] for kept in by_kernel_call], dim=1) for t in tokens], dim=1)
        for i, t in enumerate(tokens):
            for head, kept in enumerate(by_kernel_call):
                kept[t] = map_parts(lambda s, i=i, head=head: s[:, i, head], stacked)
        return stacked

    def differentiable(self, memory: str) -> list[Tensor]:
        """Per kernel call (one, or one per head), the kept states of every token as one tensor that the
        forward read them through: `torch.autograd.grad(metric, ...)` works on each (grad mode, every token).
        `memory` is "state" or "window"."""
        memory = memory_name(memory, "Call.differentiable")
        by_kernel_call = self._kept_by_kernel_call(memory)
        buffers = self._buffers.get(memory) or [None] * len(by_kernel_call)
        if memory in self._reduced:
            raise Unavailable(
                f"{self.where}: call {self.index} kept reductions of its {memory}s (watch(reduce=...)),"
                " which the forward did not read: they have no gradient of a metric. Keep the states"
                " themselves for that, or take gradients through the reduction's own graph"
            )
        if memory in self._split:
            raise Unavailable(
                f"{self.where}: call {self.index} ran as {len(self.kernel_calls)} kernel calls (a cache"
                " that records its past split its tokens): no one tensor holds its kept states for"
                f" autograd; each token's, call.after({memory!r}, t), is the tensor the forward read"
            )
        if any(buffer is None for buffer in buffers):
            raise Unavailable(
                f"{self.where}: call {self.index} kept no differentiable {memory}s: keep every token"
                " (keep=('states',) or 'windows') and run the forward with gradients enabled"
            )
        return list(buffers)

    def ran(self, memory: str) -> int | None:
        """The positions the kernel of `memory` ran over: the call's `tokens`, except where transformers' own bug
        makes them differ (rwkv's batched decode, docs/concepts.md)."""
        return self._ran.get(memory_name(memory, "Call.ran"), self._ran.get(None, self.tokens))

    def replaced(self, memory: str = STATE_MEMORY) -> frozenset[int]:
        """The tokens at which a hook or write replaced `memory` in this call (its outputs are then no longer a
        function of its inputs and starting memory alone)."""
        return frozenset(self._replaced.get(memory_name(memory, "Call.replaced"), ()))

    def after(self, memory: str, token: int) -> Tensor:
        """The kept `memory` ("state" or "window") after `token` (an int, negative from the end) of this call."""
        memory = memory_name(memory, "Call.after")
        by_kernel_call = self._kept_by_kernel_call(memory)
        tokens = self.ran(memory)
        position = position_of(token, tokens)
        if position is None:
            raise Unavailable(
                f"{self.where}: token {token} is outside call {self.index}, which has {tokens}"
                f" tokens (valid: 0..{tokens - 1} or -{tokens}..-1)"
            )
        if position not in by_kernel_call[0]:
            raise Unavailable(
                f"{self.where}: the {memory} after token {token} of call {self.index} was not kept"
                f" (kept: tokens {sorted(by_kernel_call[0])})"
            )
        if len(by_kernel_call) == 1:
            return by_kernel_call[0][position]
        return stack_parts([kept[position] for kept in by_kernel_call], dim=1)


# -- the engine's writes to a record (the dispatcher's `CallTracker` files each kernel call through these) ------------


def recorded(call: Call, values: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """`values`, a kernel call's kept inputs or outputs (`name`); an `Unavailable` where they were not kept."""
    if values is None:
        raise Unavailable(
            f"{call.where}: the kernel {name} of call {call.index} were not kept:"
            " pass keep=('inputs', 'outputs') to watch"
        )
    return values


def _own(call: Call, field: str) -> dict:
    """The call's own dict `field` (one of its bookkeeping's), made at its first write."""
    value = getattr(call, field)
    if value is _NOTHING:
        value = {}
        setattr(call, field, value)
    return value


def note_ran(call: Call, memory: str, tokens: int) -> None:
    """The kernel of `memory` ran over `tokens` positions in `call`. Noted only where they differ from the forward's
    input's (rwkv's batched decode bug, a split forward's first kernel calls): the call's own dict then holds them,
    and the forward's tokens under None (the call's `tokens` are its first memory's, which the tracker sets)."""
    forward = call._ran.get(None, call.tokens)
    if tokens != forward or memory in call._ran:
        ran = _own(call, "_ran")
        ran.setdefault(None, forward)
        ran[memory] = tokens


def file_kept(
    call: Call, memory: str, kept: dict[int, Any], stacked: Any, positions: tuple[int, ...] | None, reduced: bool
) -> None:
    """One kernel call's kept values of `memory` (token -> value; `stacked`: the leaf they were read through in grad
    mode, or None), kept at `positions` (None: every token), as reductions if `reduced`."""
    _own(call, "_kept").setdefault(memory, []).append(kept)
    _own(call, "_buffers").setdefault(memory, []).append(stacked)
    _own(call, "_positions")[memory] = positions
    if memory in call._stacked:
        del call._stacked[memory]
    if reduced:
        call._reduced |= {memory}


def kept_by_kernel_call(call: Call, memory: str) -> list[dict[int, Any]] | None:
    """The kept values of `memory`, one {token: value} per kernel call (None: none kept)."""
    return call._kept.get(memory)


def refile_recomputed(call: Call, memory: str, nth: int, token: int, value: Any) -> None:
    """A recompute (reentrant checkpointing) replaced kernel call `nth`'s kept value at `token` by a differentiable
    one: the call's states are read one by one from now on."""
    call._kept[memory][nth][token] = value
    call._buffers[memory][nth] = None
    if memory in call._stacked:
        del call._stacked[memory]


def note_split(call: Call, memory: str) -> None:
    """A later kernel call of `memory` continued the tokens of the call's earlier one (a split forward)."""
    call._split |= {memory}


def file_continued(call: Call, memory: str, kept: dict[int, Any], offset: int) -> None:
    """A split forward's later kernel call kept `kept` (its token -> value), the call's tokens from `offset`: filed
    with the earlier kernel calls' values, as one call's (read token by token from now on: no single leaf holds
    them in grad mode)."""
    first = call._kept[memory][0]
    for token, value in kept.items():
        first[token + offset] = value
    call._buffers[memory][0] = None
    if memory in call._stacked:
        del call._stacked[memory]


def note_replaced(call: Call, memory: str, token: int) -> None:
    """A hook or write replaced `memory` at `token` of `call`."""
    _own(call, "_replaced").setdefault(memory, set()).add(token)


def file_kernel_call(call: Call, memory: str, kernel_call: KernelCall) -> None:
    """One kernel call of `call`: its convolution kernel's (`memory` the window) or one of its recurrence kernel's
    (one per head for a kernel run once per head)."""
    if memory == CONV_MEMORY:
        call.conv = kernel_call
    elif call.kernel_calls:
        call.kernel_calls.append(kernel_call)
    else:
        call.kernel_calls = [kernel_call]  # (a list of one: no room for more held by every record)


# -- the records of a handle's calls -------------------------------------------------------------------------------


class Calls:
    """The records of one handle's calls, by call index: `calls[k]` is call k's `Call` (`calls[k].index == k`),
    `calls[-1]` the last, a slice a list of them.

        mix.calls[3]                    # call 3 (decode step 3 of a generate)
        [c.tokens for c in mix.calls]   # every record kept, oldest first

    `len(calls)` counts every call the handle recorded. A watch with `history=N` keeps the records of the last N
    calls only: iterating gives those, and reading an earlier call raises `Unavailable` (naming N and the call).
    `history` is N (None: every call's record is kept) and `dropped` the number of calls dropped so far, so that the
    oldest record kept is call `dropped`."""

    __slots__ = ("history", "dropped", "_records", "_where")

    def __init__(self, history: int | None, where: str) -> None:
        self.history = history
        self.dropped = 0
        self._records: "list[Call] | collections.deque[Call]" = (
            [] if history is None else collections.deque(maxlen=history)
        )
        self._where = where

    def append(self, call: Call) -> None:
        """A new call's record: the oldest one kept goes where `history` calls are kept already."""
        if len(self._records) == self.history:
            self.dropped += 1
        self._records.append(call)

    def __len__(self) -> int:
        return self.dropped + len(self._records)

    def __iter__(self) -> Iterator[Call]:
        return iter(self._records)

    def __reversed__(self) -> Iterator[Call]:
        return reversed(self._records)

    def __getitem__(self, index: "int | slice") -> "Call | list[Call]":
        if isinstance(index, slice):
            return [self[each] for each in range(len(self))[index]]
        index = operator.index(index)
        seen = len(self)
        position = index + seen if index < 0 else index
        if not 0 <= position < seen:
            raise IndexError(f"{self._where}: no call {index}; {seen} call{'s' if seen != 1 else ''} were recorded")
        if position < self.dropped:
            raise Unavailable(f"{self._where}: {self.dropped_message(position)}")
        return self._records[position - self.dropped]

    def get(self, index: int) -> Call | None:
        """The record of call `index` (0 or more), or None where it is not kept (dropped, or not recorded)."""
        return self._records[index - self.dropped] if self.dropped <= index < len(self) else None

    def dropped_message(self, index: int) -> str:
        """Why call `index`, dropped, cannot be read."""
        n = self.history
        return (
            f"the record of call {index} was dropped: watch(history={n}) keeps the last {n}"
            f" call{'s' if n != 1 else ''} only (calls {self.dropped}..{len(self) - 1} are kept); watch with a"
            " larger history (None keeps every call) to read it"
        )

    def __repr__(self) -> str:
        if not self.dropped:
            return repr(list(self._records))
        return f"Calls(history={self.history}, calls 0..{self.dropped - 1} dropped, kept={list(self._records)!r})"
