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

from ..declare.kernels import KEEP_NAMES, STATE_MEMORY, Kernel
from ..declare.memory_parts import State, axes_of, is_parts, map_parts, not_a_tensor, parts_of
from ..errors import InvalidValue, RecurrentHooksError, RecurrentHooksWarning, Unavailable, noted
from ..policy import Request
from ..tracing import compiling
from . import records as _calls
from .hooks import SHOWN, Hook
from .records import Call, Calls, Forward, KernelCall, position_of
from .threads import user_code

_REPLAY_MATCH = 1e-5  # relative fingerprint distance under which a recompute is the same forward
_REPLAYS_KEPT = 256  # recomputable calls remembered per mixer
_LINEAGE_KEPT = 64  # calls a rollback of the cache can reach back to (assisted decoding rolls back a few tokens)


def _fingerprint(hidden: Tensor) -> Tensor:
    """Two numbers that tell a forward's input from another one's: its sum and its sum of squares (float64)."""
    with torch.no_grad():
        h = hidden.detach().to(torch.float64)
        return torch.stack([h.sum(), h.square().sum()])


@dataclasses.dataclass(eq=False)
class _Replay:
    """A call that a checkpointed backward may recompute: its index and what its input looked like (its record is
    read from the handle's records: a dropped one, `watch(history=...)`, is not held here)."""

    index: int
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


def _replayed(replays: Iterable[_Replay], forward: Forward) -> int | None:
    """The call that a recomputed forward repeats: the remembered call whose input it matches."""
    replays = list(replays)
    if forward.hidden is None or not replays:
        return None
    shape, fingerprint = tuple(forward.hidden.shape), _fingerprint(forward.hidden)
    distances = [replay.distance(shape, fingerprint) for replay in replays]
    best = min(range(len(distances)), key=lambda i: (distances[i], -i))  # the latest of equals
    if distances[best] > _REPLAY_MATCH:
        return None  # no call with hooks, writes or kept values had this input: it wanted nothing
    return replays[best].index


Hooked = list[tuple["Hook", frozenset[int] | None]]  # hooks in registration order, with absolute positions


class Plan:
    """What one attached mixer wants of one kernel call: its hooks (in registration order) and kept tokens."""

    __slots__ = ("owner", "call", "hooks", "keep", "kept", "stacked", "reduce", "device", "offset", "later")

    def __init__(
        self,
        owner: "CallTracker",
        call: int | None,
        hooks: Hooked,
        keep: frozenset[int] | None,
        memory: str | None = None,
        offset: int = 0,
        later: bool = False,
    ):
        self.owner, self.call, self.hooks, self.keep = owner, call, hooks, keep
        # the call's token at this kernel call's token 0: a forward that transformers splits over several kernel
        # calls (a prompt kernel call, then one-token steps) is one call, its tokens counted across them; `later`:
        # this kernel call continues an earlier one's tokens (its first may have run over none)
        self.offset, self.later = offset, later
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
        return self.owner.run_hook(hook, self.call, token + self.offset, state)


# why a second kernel call of one memory in one forward is refused inside a compiled graph that wants something
_SPLIT = (
    "the forward split its tokens over several kernel calls (transformers 5.25 runs a call's last tokens as"
    " one-token steps when the cache records its past with recurrent_states_to_keep, as assisted decoding"
    " does), which a compiled graph does not serve; run it eagerly (transformers does not compile a cache that"
    " records its past)"
)


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
        self.calls = Calls(request.calls_kept, where)  # the handle's `calls` (its last `calls_kept`)
        self.begun = 0  # forwards begun since the mixer was attached
        self.offset = 0  # begun count at the last prompt (hooks registered outside a watch count from it)
        self.index: int | None = 0  # the running call's index (None: a recompute of a call that wanted nothing)
        self.forward: Forward | None = None
        self.current: Call | None = None
        self.kernel_call_counts: dict[str, int] = {}  # memory -> kernel calls in the running forward
        # memory -> the running forward's tokens its kernel calls covered so far (a split forward: several)
        self.covered: dict[str, int] = {}
        self.tokens = 0  # tokens of the running call (of its forward, across the kernel calls it is split over)
        self.first = 0  # the call's token at the running kernel call's token 0
        self.later = False  # the running kernel call continues the tokens of an earlier one of its memory
        self.head: int | None = None  # the head of the running recurrence kernel call (KERNEL_PER_HEAD kinds)
        # memory -> the earlier heads' states a reduction waits on until the forward's last head (`visitor.HeldHeads`)
        self.held_heads: dict[str, Any] = {}
        self.recomputing = False  # the running forward is a checkpointed forward being recomputed
        self.replays: collections.deque[_Replay] = collections.deque(maxlen=_REPLAYS_KEPT)
        self.saw_cache: Callable[[Any], None] | None = None  # the watch's: record how the cache gets reordered
        self.reorder: Tensor | None = None  # cache rows reordered since the last call (beam search)
        self.lineage = Lineage()  # where each call's memories continue from, across a rollback of the cache
        self.reach = KeepReach(self.keep)  # the positions `keep` asks for that some call had (`unkept`)
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
        return index is not None and (
            bool(self.keep) or bool(self.kernel_io) or any(hook.targets(index) for hook in self.all_hooks())
        )

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
        self.covered = {}
        self.head = None
        self.held_heads = {}
        self.recomputing = forward.recompute

    def begin(self, forward: Forward) -> None:
        self.start(forward)
        if forward.recompute:
            self.index = _replayed(self.replays, forward)
            self.current = None if self.index is None else self.calls.get(self.index)
            return
        reorder = None
        if self.history:
            reorder, self.reorder = (self.reorder, None) if not forward.fresh else (None, None)
        self.count(forward.fresh, forward.tokens, reorder)
        if self.history and forward.cache is not None and self.saw_cache is not None:
            self.saw_cache(forward.cache)
        if forward.hidden is not None and (torch.is_grad_enabled() or forward.training) and self.wants(self.index):
            # Autograd may recompute this forward (gradient checkpointing): remember how to recognize it.
            self.replays.append(_Replay(self.index, tuple(forward.hidden.shape), _fingerprint(forward.hidden)))

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
            self.current.continues_from = self.lineage.next_continues(fresh)
            self.calls.append(self.current)

    def reordered(self, beam_idx: Tensor) -> None:
        """The cache's rows were reordered (beam search): the next call's row b continues row beam_idx[b]."""
        if not self.kind.REORDERED_BY_CACHE:
            return  # the cache's reordering leaves this kind's memory where it is
        beam_idx = beam_idx.detach().clone()
        self.reorder = beam_idx if self.reorder is None else self.reorder[beam_idx]

    def end(self, checked: bool = True) -> None:
        record = self.current
        if record is not None and self.forward is not None and not self.recomputing:
            self.lineage.ended(record, self.forward.fresh)
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
        kernel run once per head). The kernel calls of one memory that are not heads cover the forward's tokens
        one after the other: `first` is this one's first token in the call, `tokens` the call's tokens (the
        forward's; the kernel call's own where it ran over more, rwkv's batched decode)."""
        nth = self.kernel_call_counts.get(kernel.memory, 0)
        self.kernel_call_counts[kernel.memory] = nth + 1
        per_head = self.kind.KERNEL_PER_HEAD and kernel.memory == STATE_MEMORY
        self.head = nth if per_head else None
        self.first = 0 if per_head else self.covered.get(kernel.memory, 0)
        self.later = nth > 0 and not per_head
        self.covered[kernel.memory] = self.first + tokens
        forward = 0 if self.forward is None else self.forward.tokens
        self.tokens = max(forward, self.first + tokens)
        return nth

    def handed_on(self, memory: str) -> bool:
        """Whether a later kernel call of the running forward continues `memory` from the running one's final state
        (a split forward: the running one covered fewer tokens than the call has)."""
        return self.covered.get(memory, 0) < self.tokens and not (self.kind.KERNEL_PER_HEAD and memory == STATE_MEMORY)

    def checks(self, kernel: Kernel, nth: int, shown: Any, split: bool = True) -> str | None:
        """For a kernel call that something wants: refuse it if it cannot serve that, and return why it restarts
        its memory (None: it continues it). `shown`: the call's index as the message shows it; `split`: whether a
        forward split over several kernel calls is served (not inside a compiled graph)."""
        if (reason := self.kind.adapter.refusal(kernel)) is not None:
            raise Unavailable(f"{self.where}, call {shown} ({kernel.name}): {reason}")
        if nth > 0 and not self.kind.KERNEL_PER_HEAD and not split:
            raise Unavailable(
                f"{self.where}, call {shown} ({kernel.name}): kernel call {nth + 1} of the"
                f" {kernel.memory} in one forward: {_SPLIT}"
            )
        return self.kind.adapter.restart(kernel, self.forward) if nth == 0 else None

    def plan(self, kernel: Kernel, tokens: int) -> Plan:
        nth = self.next_kernel_call(kernel, tokens)
        index = self.index
        if index is None:
            return Plan(self, index, [], None)
        if self.wants(index) and (reason := self.checks(kernel, nth, index)) is not None:
            self.warn_restart(index, kernel.name, reason)
        span, offset = self.tokens, self.first
        hooks = (
            self.hooked(kernel, tokens, lambda hook: hook.targets(index), self.refuse_outside, span, offset)
            if tokens
            else []
        )
        keep = self.keep_at(kernel.memory, tokens, span, offset)
        self.reach.saw(kernel.memory, index, span)
        return Plan(self, index, hooks, keep, kernel.memory, offset, self.later)

    def hooked(
        self,
        kernel: Kernel,
        tokens: int,
        targets: Callable[["Hook"], bool],
        outside: Callable[["Hook", int, int, str], None],
        span: int | None = None,
        offset: int = 0,
    ) -> Hooked:
        """The hooks of the kernel's memory that `targets` picks, with their positions in this kernel call of
        `tokens` tokens, the call's tokens `offset` to `offset + tokens` of `span` (`outside` is told of a hook that
        names calls and a token outside the call)."""
        span = tokens if span is None else span
        hooks: Hooked = []
        for hook in self.all_hooks():
            if hook.memory != kernel.memory or not targets(hook):
                continue
            if hook.tokens is None:
                hooks.append((hook, None))
                continue
            missing = [t for t in hook.tokens if position_of(t, span) is None]
            if missing and hook.explicit and offset == 0:
                outside(hook, missing[0], span, kernel.name)
            positions = _within(hook.tokens, span, offset, tokens)
            if positions:
                hooks.append((hook, positions))
        return hooks

    def keep_at(self, memory: str, tokens: int, span: int | None = None, offset: int = 0) -> frozenset[int] | None:
        """The positions of this kernel call (of `tokens` tokens, the call's `offset` to `offset + tokens` of `span`)
        whose `memory` is kept (None: the memory is not kept)."""
        if memory not in self.keep:
            return None
        wanted = self.keep[memory]
        if wanted is None:
            return frozenset(range(tokens))
        return _within(wanted, tokens if span is None else span, offset, tokens)

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
        # the positions the kernel ran over, per memory: the forward's input's (across the kernel calls a split
        # forward makes), except where transformers' own bug makes them differ (rwkv's batched decode); the
        # call's tokens are its first memory's
        _calls.note_ran(record, kernel.memory, plan.offset + tokens)
        if kernel.memory == self.kind.MEMORIES[0]:
            record.tokens = plan.offset + tokens
        self.file(
            kernel.memory,
            kernel.name,
            plan.kept,
            inputs,
            output,
            plan.stacked,
            path=kernel_call.path,
            offset=plan.offset if plan.later else None,
        )

    def file(
        self,
        memory: str,
        kernel: str,
        kept: "dict[int, State] | None",
        inputs: dict[str, Any] | None,
        output: dict[str, Any] | None,
        stacked: State | None = None,
        path: str = "bound kernel",
        offset: int | None = None,
    ) -> None:
        """File one kernel call in the running call's record: its inputs and outputs, its path, and the states it
        kept (`offset`: for a later kernel call of a split forward, the call's token at its token 0)."""
        record = self.current
        if record is None:
            return
        kernel_call = (
            KernelCall(kernel, inputs, output, path)
            if inputs is not None or output is not None
            else _calls.bare_kernel_call(kernel, path)
        )  # (shared: it holds nothing of the call)
        _calls.file_kernel_call(record, memory, kernel_call)
        if offset is not None:
            _calls.note_split(record, memory)
        if kept is not None and offset is not None and _calls.kept_by_kernel_call(record, memory):
            _calls.file_continued(record, memory, kept, offset)
        elif kept is not None:
            kept = {token + offset: value for token, value in kept.items()} if offset else kept
            _calls.file_kept(
                record,
                memory,
                kept,
                None if offset is not None else stacked,
                self.keep[memory],
                memory in self.policy.reduce,
            )

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
                " torch.no_grad() a hook may replace, and a write (set_state_after) works either way"
            )
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
        return self.reach.unkept(self.where)


class KeepReach:
    """The positions `keep` asks for that some call had, and the first calls' lengths: what the warning at a watch's
    exit about positions outside every call says (`unkept`)."""

    def __init__(self, keep: "dict[str, tuple[int, ...] | None]") -> None:
        self.keep = keep
        self.reached: dict[str, set[int]] = {}  # memory -> the asked positions some call had
        self.lengths: dict[str, list[tuple[int, int]]] = {}  # memory -> the first calls' (index, tokens)

    def saw(self, memory: str, index: int, tokens: int) -> None:
        """Call `index` of `tokens` tokens ran a kernel call of `memory`."""
        wanted = self.keep.get(memory)
        if wanted is None:
            return
        self.reached.setdefault(memory, set()).update(t for t in wanted if position_of(t, tokens) is not None)
        lengths = self.lengths.setdefault(memory, [])
        if len(lengths) <= SHOWN and (not lengths or lengths[-1][0] != index):
            lengths.append((index, tokens))

    def unkept(self, where: str) -> list[str]:
        """Positions of `keep` outside every call the mixer (`where`) saw, which kept nothing (reported when a
        watch ends)."""
        problems = []
        for memory, wanted in self.keep.items():
            lengths = self.lengths.get(memory)
            missed = [t for t in wanted or () if t not in self.reached.get(memory, set())]
            if not lengths or not missed:
                continue
            name = KEEP_NAMES[memory]
            shown = "; ".join(
                f"call {call}: {tokens} token{'s' if tokens != 1 else ''}" for call, tokens in lengths[:SHOWN]
            ) + ("; ..." if len(lengths) > SHOWN else "")
            at = ", ".join(f"token {t}" for t in missed)
            problems.append(
                f"keep={{{name!r}: {list(wanted)}}} kept nothing at {at} on {where}: outside every"
                f" call it saw ({shown})"
            )
        return problems


class Lineage:
    """Where each call's memories continue from, across a rollback of the cache: assisted decoding rolls a cache
    that records its past back to the last accepted token (`cache.crop(-k)`), and the next call's record names the
    (call, token) whose memories it continues (`Call.continues_from`)."""

    def __init__(self) -> None:
        # the last calls (index -> their tokens, the (call, token) they continued or None, whether from zeros)
        self.calls: collections.OrderedDict[int, tuple[int, tuple[int, int] | None, bool]] = collections.OrderedDict()
        self.rollback: tuple[int, int] | None = None

    def ended(self, record: Call, fresh: bool) -> None:
        self.calls[record.index] = (record.tokens or 0, record.continues_from, fresh)
        if len(self.calls) > _LINEAGE_KEPT:
            self.calls.popitem(last=False)

    def cropped(self, tokens_to_remove: int) -> None:
        """The cache rolled its memories back by `tokens_to_remove` tokens: the next call continues those after the
        token that many before the end of the last call (None where that token is no longer known)."""
        if tokens_to_remove > 0 and self.calls:
            self.rollback = self.walked_back(next(reversed(self.calls)), tokens_to_remove)

    def next_continues(self, fresh: bool) -> tuple[int, int] | None:
        """What the call that begins continues after a rollback (None: the previous call's last token, or zeros)."""
        rollback, self.rollback = self.rollback, None
        return None if fresh else rollback

    def walked_back(self, call: int, remaining: int) -> tuple[int, int] | None:
        """The (call, token) whose memories are `remaining` tokens before the end of call `call`, following each call
        back to the memories it continued (None: past a call that started from zeros, or past the calls kept)."""
        calls = self.calls
        token = calls[call][0] - 1
        while True:
            if token >= remaining:
                return call, token - remaining
            remaining -= token + 1
            _, before, fresh = calls[call]
            if fresh:
                return None
            call, token = before if before is not None else (call - 1, None)
            if call not in calls:
                return None
            token = calls[call][0] - 1 if token is None else token
            if remaining == 0:
                return call, token


def _within(wanted: Iterable[int], span: int, offset: int, tokens: int) -> frozenset[int]:
    """The positions in a kernel call of `tokens` tokens, the call's `offset` to `offset + tokens` of `span`, of the
    call's tokens `wanted` (negative: from the call's end)."""
    return frozenset(
        p - offset for t in wanted if (p := position_of(t, span)) is not None and offset <= p < offset + tokens
    )


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
        for what, expected, given in (
            ("shape", tuple(want.shape), tuple(got.shape)),
            ("dtype", want.dtype, got.dtype),
            ("device", want.device, got.device),
        ):
            if expected != given:
                raise InvalidValue(
                    f"{where} gave a {what_part} with {what} {given}, expected {expected} (axes: {axes})"
                )
    return replacement
