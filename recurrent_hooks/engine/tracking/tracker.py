"""The per-call bookkeeping of one handle: the call counter, the running call and its record, what each kernel call
wants.

    with recurrent_hooks.watch(model, keep=("states",)) as w:
        model(ids)                      # the tap's module hooks drive w.mixers[0].tracker:
    w.mixers[0].calls[0]                # begin (count call 0, open this record), plan and store per kernel
    w.mixers[0].tracker.index           # call, end: 0, the call that ran last

A `RecurrentMixer` (the user's handle) owns one `CallTracker`, made with what its watch asks (a `policy.Request`:
what to keep, the policy) and with the kind and where the mixer is (for messages); the tracker never holds the
handle. Dispatch drives it through a small interface, the same in both implementations:

- `begin(forward)`: a forward of the mixer begins: count it and open its record (a forward that autograd
  recomputes, gradient checkpointing, is matched to the call it repeats instead, `_Replay`);
- `plan(kernel, tokens) -> Plan`: what the handle wants of one kernel call (its hooks and kept tokens);
- `store(plan, kernel, kernel_call, tokens)`: file the kernel call (`records.KernelCall`: its arguments, results and
  path) in the call's record, with the states it kept;
- `end(checked)`: the forward is over (checked: it called a watched kernel if something targeted it);
- `wants_call()`: whether the running call has hooks, writes or kept values (a fused kernel is skipped then).

`CallTracker` implements it eagerly. While torch.compile traces a forward, `now()` hands out the traced
implementation instead (`compiled.TracedCallTracker`): a graph serves every call, so what changes from call to
call is not read while tracing but put into the graph as ops, which call this object's run-time methods
(`count`, `file`, `run_hook`, `refuse_outside`, `warn_restart`, `note_replaced`) when the graph runs.
"""

import collections
import dataclasses
import math
import warnings
from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch import Tensor

from ..declare.kernels import CONV_MEMORY, KEEP_NAMES, STATE_MEMORY, Kernel
from ..declare.memory_parts import State, axes_of, is_parts, map_parts, not_a_tensor, parts_of
from ..errors import InvalidValue, RecurrentHooksError, RecurrentHooksWarning, Unavailable, noted
from ..policy import Request
from ..tracing import compiling
from . import records as _calls
from .hooks import SHOWN, Hook
from .records import Call, Forward, KernelCall, position_of
from .threads import user_code

_REPLAY_MATCH = 1e-5  # relative fingerprint distance under which a recompute is the same forward
_REPLAYS_KEPT = 256  # recomputable calls remembered per mixer


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


def _replayed(replays: Iterable[_Replay], forward: Forward) -> tuple[int | None, "Call | None"]:
    """The call that a recomputed forward repeats: the remembered call whose input it matches."""
    replays = list(replays)
    if forward.hidden is None or not replays:
        return None, None
    shape, fingerprint = tuple(forward.hidden.shape), _fingerprint(forward.hidden)
    distances = [replay.distance(shape, fingerprint) for replay in replays]
    best = min(range(len(distances)), key=lambda i: (distances[i], -i))  # the latest of equals
    if distances[best] > _REPLAY_MATCH:
        return None, None  # no call with hooks, writes or kept values had this input: it wanted nothing
    replay = replays[best]
    return replay.index, replay.record


Hooked = list[tuple["Hook", frozenset[int] | None]]  # hooks in registration order, with absolute positions


class Plan:
    """What one attached mixer wants of one kernel call: its hooks (in registration order) and kept tokens."""

    __slots__ = ("owner", "call", "hooks", "keep", "kept", "stacked", "reduce", "device")

    def __init__(self, owner: "CallTracker", call: int | None, hooks: Hooked, keep: frozenset[int] | None,
                 memory: str | None = None):
        self.owner, self.call, self.hooks, self.keep = owner, call, hooks, keep
        self.kept: dict[int, Tensor] | None = None if keep is None else {}
        self.stacked: Tensor | None = None  # every token kept in grad mode: the leaf the forward read them through
        # what the handle's watch asked of kept `memory` values: fn(a chunk of kept states), kept instead of the
        # states (`watch(reduce=...)`), and the device they go to as they are kept (`watch(keep_device=...)`)
        self.reduce: Callable[[Any], Any] | None = None
        self.device: torch.device | None = None
        if keep is not None and memory is not None:
            policy = owner.policy
            self.reduce, self.device = policy.reduce.get(memory), policy.keep_device

    @property
    def kind(self) -> type:
        """The kind of the handle this plan is of (its class: `kind.Kind`'s declarations)."""
        return self.owner.kind

    @property
    def where(self) -> str:
        """The handle this plan is of, for messages."""
        return self.owner.where

    @property
    def idle(self) -> bool:
        return not self.hooks and not self.keep

    def apply(self, token: int, state: Tensor) -> Tensor:
        for hook, positions in self.hooks:
            if positions is None or token in positions:
                state = self._run(hook, token, state)
        return state

    def _run(self, hook: "Hook", token: int, state: State) -> State:
        return self.owner.run_hook(hook, self.call, token, state)


# why a second kernel call of one memory in one forward is refused where something is wanted
_SPLIT = ("the forward split its tokens over several kernel calls (transformers 5.25 runs a call's last tokens as"
          " one-token steps when the cache records its past with recurrent_states_to_keep, as assisted decoding"
          " does), and the library counts a call's tokens per kernel call, so hooks, writes and kept states would get"
          " wrong positions; run this call without hooks or kept values, or without past recording")


class CallTracker:
    """The eager per-call bookkeeping of one handle (see the module docstring for its interface)."""

    def __init__(self, request: Request, kind: type, where: str, hooks: "dict[int, tuple[Hook, ...]]") -> None:
        self.request = request  # what the handle's watch (or standalone hooks) asks, read from here only
        self.kind = kind  # the handle's class: its declarations (`kind.Kind`)
        self.where = where  # the handle as messages and records name it ("GatedDeltaNet(qwen3_5, layer 0)")
        self.hooks = hooks  # the handle's registrations (handle id -> its hooks), the same dict
        self.keep, self.kernel_io = request.keep, request.kernel_io
        self.policy = request.policy  # how its calls run and keep
        self.history = request.history  # False: a standalone hook's handle, which records no calls
        self.restart_on_prompt = request.restart_on_prompt
        self.calls: list[Call] = []  # the handle's `calls`
        self.begun = 0  # forwards begun since the mixer was attached
        self.offset = 0  # begun count at the last prompt (hooks registered outside a watch count from it)
        self.index: int | None = 0  # the running call's index (None: a recompute of a call that wanted nothing)
        self.forward: Forward | None = None
        self.current: Call | None = None
        self.kernel_call_counts: dict[str, int] = {}  # memory -> kernel calls in the running forward
        self.tokens = 0  # tokens of the running kernel call
        self.head: int | None = None  # the head of the running recurrence kernel call (KERNEL_PER_HEAD kinds)
        # memory -> the earlier heads' states a reduction waits on until the forward's last head (`visitor.HeldHeads`)
        self.held_heads: dict[str, Any] = {}
        self.recomputing = False  # the running forward is a checkpointed forward being recomputed
        self.replays: collections.deque[_Replay] = collections.deque(maxlen=_REPLAYS_KEPT)
        self.saw_cache: Callable[[Any], None] | None = None  # the watch's: record how the cache gets reordered
        self.reorder: Tensor | None = None  # cache rows reordered since the last call (beam search)
        # keep at some tokens: memory -> the asked positions some call had, and the first calls' lengths (for
        # the warning on exit about positions outside every call, `unkept`)
        self.keep_reached: dict[str, set[int]] = {}
        self.keep_lengths: dict[str, list[tuple[int, int]]] = {}
        self.traced: Any = None  # the implementation a compiled graph's tracing uses (`compiled.TracedCallTracker`)

    def now(self) -> "CallTracker":
        """The implementation that serves the running forward: the traced one while torch.compile traces it."""
        return self.traced if compiling() else self

    @property
    def seen(self) -> int:
        """The calls counted since the last restart (a watch: since it began)."""
        return self.begun - self.offset

    def all_hooks(self) -> Iterable["Hook"]:
        return (hook for hooks in self.hooks.values() for hook in hooks)

    def wants(self, index: int | None) -> bool:
        """Whether call `index` has hooks, writes or kept values (None: a recompute of an idle call)."""
        return index is not None and (bool(self.keep) or bool(self.kernel_io)
                                      or any(hook.targets(index) for hook in self.all_hooks()))

    def wants_some(self) -> bool:
        """Whether some call has hooks, writes or kept values (a compiled graph serves every call)."""
        return bool(self.keep) or bool(self.kernel_io) or any(hook.targets_some for hook in self.all_hooks())

    def wants_call(self) -> bool:
        """Whether the running call has hooks, writes or kept values."""
        return self.wants(self.index)

    # -- a forward begins and ends ------------------------------------------------------------------------------

    def start(self, forward: Forward) -> None:
        """What every implementation does when a forward begins: the running forward's scratch."""
        self.forward = forward
        self.kernel_call_counts = {}
        self.head = None
        self.held_heads = {}
        self.recomputing = forward.recompute

    def begin(self, forward: Forward) -> None:
        self.start(forward)
        if forward.recompute:
            self.index, self.current = _replayed(self.replays, forward)
            return
        reorder = None
        if self.history:
            reorder, self.reorder = (self.reorder, None) if not forward.fresh else (None, None)
        self.count(forward.fresh, forward.tokens, reorder)
        if self.history and forward.cache is not None and self.saw_cache is not None:
            self.saw_cache(forward.cache)
        if forward.hidden is not None and (torch.is_grad_enabled() or forward.training) \
                and self.wants(self.index):
            # Autograd may recompute this forward (gradient checkpointing): remember how to recognize it.
            self.replays.append(_Replay(self.index, self.current, tuple(forward.hidden.shape),
                                        _fingerprint(forward.hidden)))

    def count(self, fresh: bool, tokens: int, reorder: Tensor | None) -> None:
        """A new call begins (not a recompute): count it and open its record."""
        self.begun += 1
        if self.restart_on_prompt and fresh:
            self.offset = self.begun - 1
        self.index = self.begun - 1 - self.offset
        self.current = None
        if self.history:
            # one counter: a watch's handle never restarts, so call k is calls[k]
            self.current = Call(index=self.index, where=self.where, tokens=tokens, reorder=reorder)
            self.calls.append(self.current)

    def reordered(self, beam_idx: Tensor) -> None:
        """The cache's rows were reordered (beam search): the next call's row b continues row beam_idx[b]."""
        if not self.kind.REORDERED_BY_CACHE:
            return  # the cache's reordering leaves this kind's memory where it is
        beam_idx = beam_idx.detach().clone()
        self.reorder = beam_idx if self.reorder is None else self.reorder[beam_idx]

    def end(self, checked: bool = True) -> None:
        self.finish(checked, self.wants_call, self.index)

    def finish(self, checked: bool, wants: Callable[[], bool], shown: Any) -> None:
        """What every implementation does when a forward ends: check that a call that `wants` something called
        a watched kernel (`shown`: the call's index as the message shows it)."""
        self.head = None
        self.held_heads = {}
        recompute, self.recomputing = self.recomputing, False
        forward, self.forward = self.forward, None
        if forward is None or recompute:
            return
        primary = self.kind.MEMORIES[0]
        if checked and self.kernel_call_counts.get(primary, 0) == 0 and wants():
            raise RecurrentHooksError(
                f"{self.where}: call {shown} finished without calling a watched kernel"
                f" ({', '.join(k.name for k in self.kind.KERNELS if k.memory == primary)}) although hooks or kept"
                " values target it; the mixer took a path the library cannot see (a fused kernel, or a forward"
                " this transformers version changed)"
            )

    # -- a kernel call ------------------------------------------------------------------------------------------

    def next_kernel_call(self, kernel: Kernel, tokens: int) -> int:
        """Count a kernel call of the running forward; its number among those of its memory (the head, for a
        kernel run once per head)."""
        self.tokens = tokens
        nth = self.kernel_call_counts.get(kernel.memory, 0)
        self.kernel_call_counts[kernel.memory] = nth + 1
        self.head = nth if self.kind.KERNEL_PER_HEAD and kernel.memory == STATE_MEMORY else None
        return nth

    def checks(self, kernel: Kernel, nth: int, shown: Any) -> str | None:
        """For a kernel call that something wants: refuse it if it cannot serve that, and return why it restarts
        its memory (None: it continues it). `shown`: the call's index as the message shows it."""
        if (reason := self.kind._refusal(kernel)) is not None:
            raise Unavailable(f"{self.where}, call {shown} ({kernel.name}): {reason}")
        if nth > 0 and not self.kind.KERNEL_PER_HEAD:
            raise Unavailable(f"{self.where}, call {shown} ({kernel.name}): kernel call {nth + 1} of the"
                              f" {kernel.memory} in one forward: {_SPLIT}")
        return self.kind._restart(kernel, self.forward) if nth == 0 else None

    def plan(self, kernel: Kernel, tokens: int) -> Plan:
        nth = self.next_kernel_call(kernel, tokens)
        index = self.index
        if index is None:
            return Plan(self, index, [], None)
        if self.wants(index) and (reason := self.checks(kernel, nth, index)) is not None:
            self.warn_restart(index, kernel.name, reason)
        hooks = self.hooked(kernel, tokens, lambda hook: hook.targets(index), self.refuse_outside)
        keep = self.keep_at(kernel.memory, tokens)
        wanted = self.keep.get(kernel.memory)
        if wanted is not None:
            self.keep_reached.setdefault(kernel.memory, set()).update(
                t for t in wanted if position_of(t, tokens) is not None)
            lengths = self.keep_lengths.setdefault(kernel.memory, [])
            if len(lengths) <= SHOWN and (not lengths or lengths[-1][0] != index):
                lengths.append((index, tokens))
        return Plan(self, index, hooks, keep, kernel.memory)

    def hooked(self, kernel: Kernel, tokens: int, targets: Callable[["Hook"], bool],
                outside: Callable[["Hook", int, int, str], None]) -> Hooked:
        """The hooks of the kernel's memory that `targets` picks, with their positions in this kernel call
        (`outside` is told of a hook that names calls and a token outside this one)."""
        hooks: Hooked = []
        for hook in self.all_hooks():
            if hook.memory != kernel.memory or not targets(hook):
                continue
            if hook.tokens is None:
                hooks.append((hook, None))
                continue
            missing = [t for t in hook.tokens if position_of(t, tokens) is None]
            if missing and hook.explicit:
                outside(hook, missing[0], tokens, kernel.name)
            positions = frozenset(p for t in hook.tokens if (p := position_of(t, tokens)) is not None)
            if positions:
                hooks.append((hook, positions))
        return hooks

    def keep_at(self, memory: str, tokens: int) -> frozenset[int] | None:
        """The positions of this kernel call whose `memory` is kept (None: the memory is not kept)."""
        if memory not in self.keep:
            return None
        wanted = self.keep[memory]
        if wanted is None:
            return frozenset(range(tokens))
        return frozenset(p for t in wanted if (p := position_of(t, tokens)) is not None)

    def refuse_outside(self, hook: "Hook", token: int, tokens: int, kernel: str) -> None:
        raise InvalidValue(
            f"{self.where}: {hook.origin} targets token {token}, but call {self.index} ({kernel}) has {tokens}"
            f" token{'s' if tokens != 1 else ''} (valid: 0..{tokens - 1} or -{tokens}..-1)"
        )

    def warn_restart(self, index: int | None, kernel: str, reason: str) -> None:
        """Say once, for call `index` (it has hooks, writes or kept values), that the model restarted its memory."""
        warnings.warn(f"{self.where}, call {index} ({kernel}): {reason}", RecurrentHooksWarning, stacklevel=2)

    def store(self, plan: Plan, kernel: Kernel, kernel_call: KernelCall, tokens: int) -> None:
        inputs = kernel_call.inputs if "inputs" in self.kernel_io else None
        output = kernel_call.output if "outputs" in self.kernel_io else None
        record = self.current
        if record is None:
            return
        if self.recomputing:
            self._store_recomputed(plan, kernel, record)
            return
        # the positions the kernel ran over, per memory: the forward's input's, except where transformers' own
        # bug makes them differ (rwkv's batched decode); the call's tokens are its first memory's
        _calls.note_ran(record, kernel.memory, tokens)
        if kernel.memory == self.kind.MEMORIES[0]:
            record.tokens = tokens
        self.file(kernel.memory, kernel.name, plan.kept, inputs, output, plan.stacked, path=kernel_call.path)

    def file(self, memory: str, kernel: str, kept: "dict[int, State] | None", inputs: dict[str, Any] | None,
             output: dict[str, Any] | None, stacked: State | None = None, path: str = "bound kernel") -> None:
        """File one kernel call in the running call's record: its inputs and outputs, its path, and the states it
        kept."""
        record = self.current
        if record is None:
            return
        kernel_call = KernelCall(kernel, inputs, output, path)
        if memory == CONV_MEMORY:
            record.conv = kernel_call
        else:
            record.kernel_calls.append(kernel_call)
        if kept is not None:
            _calls.file_kept(record, memory, kept, stacked, self.keep[memory], memory in self.policy.reduce)

    def _store_recomputed(self, plan: Plan, kernel: Kernel, record: Call) -> None:
        """A recompute keeps nothing new, except where the call's own forward ran without gradients
        (reentrant checkpointing): its kept states are then replaced by the recomputed, differentiable
        ones, whose `.grad` is retained for `loss.backward()`."""
        kept = _calls.kept_by_kernel_call(record, kernel.memory)
        nth = self.kernel_call_counts[kernel.memory] - 1
        if plan.kept is None or plan.reduce is not None or kept is None or nth >= len(kept):
            return  # (reductions: the first forward's stand)
        for token, state in plan.kept.items():
            if _requires_grad(state) and token in kept[nth] and not _requires_grad(kept[nth][token]):
                map_parts(lambda s: s.retain_grad(), state)
                _calls.refile_recomputed(record, kernel.memory, nth, token, state)

    # -- a hook at a token ----------------------------------------------------------------------------------------

    def run_hook(self, hook: "Hook", call: int | None, token: int, state: State, *, replaces: bool = True) -> State:
        """Call hook or write `hook` at `token`; returns the state token+1 continues from (checked)."""
        if hook.write:
            replacement = hook.run(call, token, state)
        else:
            with user_code(), noted(lambda: self._where(hook, call, token)):
                replacement = hook.run(call, token, state)
        if replacement is None or replacement is state:
            return state
        if not replaces:
            raise RecurrentHooksError(
                f"{self.where}, call {call}, token {token}: {hook.origin} returned a replacement inside a compiled"
                " graph with gradients on, where hooks can only read (a replacement would cut the gradient); under"
                " torch.no_grad() a hook may replace, and a write (set_state_after) works either way")
        state = _checked(replacement, state, self, hook, call, token)
        self.note_replaced(hook, token)
        return state

    def _where(self, hook: "Hook", call: int | None, token: int) -> str:
        """Where a user's hook was called, for the note on what it raised."""
        head = "" if self.head is None else f", head {self.head}"
        return f"raised in the {hook.origin} on {self.where}, at call {call}, token {token}{head}"

    def note_replaced(self, hook: "Hook", token: int) -> None:
        record = self.current
        if record is not None and not self.recomputing:
            _calls.note_replaced(record, hook.memory, token)

    # -- on exit ----------------------------------------------------------------------------------------------

    def unkept(self) -> list[str]:
        """Positions of `keep` outside every call this mixer saw, which kept nothing (reported when a watch ends)."""
        problems = []
        for memory, wanted in self.keep.items():
            lengths = self.keep_lengths.get(memory)
            missed = [t for t in wanted or () if t not in self.keep_reached.get(memory, set())]
            if not lengths or not missed:
                continue
            name = KEEP_NAMES[memory]
            shown = "; ".join(f"call {call}: {tokens} token{'s' if tokens != 1 else ''}"
                              for call, tokens in lengths[:SHOWN]) + ("; ..." if len(lengths) > SHOWN else "")
            at = ", ".join(f"token {t}" for t in missed)
            problems.append(f"keep={{{name!r}: {list(wanted)}}} kept nothing at {at} on {self.where}: outside every"
                            f" call it saw ({shown})")
        return problems


def _requires_grad(state: State) -> bool:
    return any(part.requires_grad for _, part in parts_of(state))


def _checked(replacement: Any, state: State, owner: CallTracker, hook: "Hook", call: int, token: int) -> State:
    kind = owner.kind
    where = f"{owner.where}, call {call}, token {token}: {hook.origin}"
    if owner.head is not None:
        where += f" (head {owner.head} of a kernel run once per head)"
    wanted = type(state) if is_parts(state) else Tensor
    declared = kind.STATE if hook.memory == STATE_MEMORY else kind.CONV_STATE
    if isinstance(replacement, wanted) and (wrong := not_a_tensor(replacement, declared, state)) is not None:
        raise InvalidValue(f"{where} returned a {wanted.__name__} whose {wrong}")
    if not isinstance(replacement, wanted):
        raise InvalidValue(f"{where} returned {type(replacement).__name__}; expected None or a {wanted.__name__}")
    for (name, want), (_, got) in zip(parts_of(state), parts_of(replacement)):
        axes = axes_of(declared, name)
        what_part = f"{hook.memory} part {name!r}" if name else hook.memory
        for what, expected, given in (("shape", tuple(want.shape), tuple(got.shape)), ("dtype", want.dtype, got.dtype),
                                      ("device", want.device, got.device)):
            if expected != given:
                raise InvalidValue(f"{where} gave a {what_part} with {what} {given}, expected {expected}"
                                   f" (axes: {axes})")
    return replacement
