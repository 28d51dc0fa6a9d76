"""A watch inside a compiled graph: what changes from call to call runs when the graph runs, not when it is traced.

    compiled = torch.compile(model, fullgraph=True)
    with recurrent_hooks.watch(model, keep={"states": [3]}) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: norms.append(float(s.norm())), token=-1)
        compiled(ids)      # traced once ...
        compiled(ids)      # ... and replayed: no recompile

torch.compile traces a forward once and replays the graph while its guards hold. Everything the engine
reads while tracing becomes a guard, so the per-call bookkeeping (the call counter, the call records, which
hooks and writes target this call, what is kept) must not be read then: every call would recompile, and
`call` would be baked into the graph. While compiling, the engine puts custom ops into the graph instead,
and the bookkeeping runs in Python when the graph runs:

- `recurrent_hooks::event(clock, mixer, what, ints, spec, tensors)`: a forward of a watched mixer begins
  ("begin": count the call, open its record), its kernel call ends ("store": file the kept states and
  kernel records), a hook that names calls has a token outside this call ("outside": an error if it
  targets the call), a hook runs with gradients on ("look"), the call restarts its memory from zeros
  ("restart": a warning if the call wants something);
- `recurrent_hooks::hook(clock, mixer, hook, token, tokens, head, parts) -> parts`: a hook or write at a
  token: at run time it is called as eagerly, with the call index as an int, and its replacement is what
  the graph continues from.

`clock` is the mixer's clock (`_CLOCKS`), a 0-d int64 tensor holding the running call's index. Every op declares
that it mutates it, which orders the ops of a mixer as they were traced and keeps them in the graph when
their results are not used. The ops name the mixer (its `CallTracker`) and the hook by a key (`register_tracker`,
`hooks.Hook.key`), fixed when they are made: a constant of the graph.

`TracedCallTracker` is the per-call interface of `tracker` (begin, plan, store, end, wants_call) as tracing
implements it: it puts these ops into the graph, and `TracedPlan` runs hooks through them; the mixer's
`CallTracker` hands it out while torch.compile traces (`CallTracker.now`), and the ops call that `CallTracker` when
the graph runs.

The ops hand Python copies of the graph's tensors and take copies back (the compiled graph reuses its
buffers once their last reader has run). With gradients on, a hook is handed a detached copy of the state
and may only read it (a replacement raises), and a write is traced into the graph as
`where(call targeted, value, state)`; kept states are values (no gradients with respect to them).
"""

import functools
import itertools
import weakref
from ast import literal_eval
from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import STATE_MEMORY, Kernel
from ..declare.memory_parts import is_parts, map_parts, parts_of, rebuild
from .hooks import Hook, hook_of
from .records import Forward, KernelCall
from .tracker import CallTracker, Plan

_KEYS = itertools.count(1)
_TRACKERS: "weakref.WeakValueDictionary[int, CallTracker]" = weakref.WeakValueDictionary()


_CLOCKS: dict[int, Tensor] = {}  # mixer key -> its clock (here, not on the mixer: a watch holds no tensor)
# The keys of collected trackers, whose clocks leave `_CLOCKS` at the next `register_tracker` (eager code), not when
# the garbage collector runs: tracing reads `_CLOCKS[key]` by iterating the dict, and a finalizer that popped an
# entry during that iteration failed the trace ("dictionary changed size during iteration").
_RETIRED: list[int] = []


def register_tracker(tracker: CallTracker) -> int:
    """A key by which the graph's ops find a mixer's `tracker` at run time; its clock is made with it."""
    while _RETIRED:
        _CLOCKS.pop(_RETIRED.pop(), None)
    key = next(_KEYS)
    _TRACKERS[key] = tracker
    _CLOCKS[key] = torch.zeros((), dtype=torch.int64)
    weakref.finalize(tracker, _RETIRED.append, key)
    return key


# -- the ops ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("recurrent_hooks::event", mutates_args=("clock",))
def _event(clock: Tensor, mixer: int, what: str, ints: list[int], spec: str, tensors: list[Tensor]) -> None:
    _EVENTS[what](_TRACKERS[mixer], clock, ints, literal_eval(spec), [t.clone() for t in tensors])


@_event.register_fake
def _(clock: Tensor, mixer: int, what: str, ints: list[int], spec: str, tensors: list[Tensor]) -> None:
    return None


@torch.library.custom_op("recurrent_hooks::hook", mutates_args=())
def _hook(
    clock: Tensor, mixer: int, hook: int, token: int, tokens: int, head: int, parts: list[Tensor]
) -> list[Tensor]:
    owner, fn = _TRACKERS[mixer], hook_of(hook)
    owner.tokens, owner.head = tokens, None if head < 0 else head
    if not fn.targets(owner.index):
        return [part.clone() for part in parts]
    state = _rebuild(owner, fn.memory, [part.clone() for part in parts])
    state = owner.run_hook(fn, owner.index, token, state)
    # fresh tensors with the layout the graph was traced with (a replacement may be any tensor of the user's)
    return [torch.empty_like(like).copy_(part) for like, (_, part) in zip(parts, parts_of(state))]


@_hook.register_fake
def _(clock: Tensor, mixer: int, hook: int, token: int, tokens: int, head: int, parts: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(part) for part in parts]


# Not mutating `clock` (an op that mutates an input cannot also return tensors), but effectful: kept in the
# graph and in order even where its result is not used (a hook at a call's last token).
_register_effectful = getattr(torch.library, "_register_effectful_op", None)  # torch 2.13's name for it
if _register_effectful is not None:
    _register_effectful(_hook._opoverload, torch.library.EffectType.ORDERED)


def _rebuild(owner: CallTracker, memory: str, parts: list[Tensor]) -> Any:
    state_type = owner.kind.STATE_TYPE if memory == STATE_MEMORY else None
    return state_type(*parts) if state_type is not None else parts[0]


# -- what the engine calls while tracing ------------------------------------------------------------------------


class TracedCallTracker:
    """The per-call interface while torch.compile traces a forward (see the module docstring): what changes
    from call to call is told when the graph runs, through the ops; the running forward's scratch (its kernel
    calls, head and tokens) is the `CallTracker`'s, as eagerly."""

    def __init__(self, tracker: CallTracker) -> None:
        self._tracker = weakref.ref(tracker)  # the tracker owns this object: no cycle
        self.key = register_tracker(tracker)

    @property
    def tracker(self) -> CallTracker:
        return self._tracker()

    def now(self) -> "TracedCallTracker":
        return self

    def wants_call(self) -> bool:
        """A graph serves every call: whether some call has hooks, writes or kept values."""
        return self.tracker.wants_some()

    def begin(self, forward: Forward) -> None:
        """A forward begins: counted, and its record opened, when the graph runs. A compiled beam search reports
        no `reorder` (a compiled forward cannot wrap the cache's method), and a compiled backward recomputes no
        forward of ours."""
        tracker = self.tracker
        tracker.start(forward)
        tracker.recomputing = False
        _begin(self, forward.fresh, forward.tokens)

    def plan(self, kernel: Kernel, tokens: int) -> Plan:
        """What the handle wants of a kernel call of any call the graph serves; which calls are targeted is told
        when it runs (a restart is warned then, and a token outside a call a hook names is refused then)."""
        tracker = self.tracker
        nth = tracker.next_kernel_call(kernel, tokens)
        if tracker.wants_some() and (reason := tracker.checks(kernel, nth, "?", split=False)) is not None:
            _event(_CLOCKS[self.key], self.key, "restart", [], repr((kernel.name, reason)), [])
        hooks = tracker.hooked(kernel, tokens, lambda hook: hook.targets_some, functools.partial(_outside, self))
        return TracedPlan(tracker, None, hooks, tracker.keep_at(kernel.memory, tokens), kernel.memory)

    def store(self, plan: Plan, kernel: Kernel, kernel_call: KernelCall, tokens: int) -> None:
        """File a kernel call's kept states, records and path in the running call's record, when the graph runs."""
        tracker = self.tracker
        if not tracker.history:
            return
        inputs = kernel_call.inputs if "inputs" in tracker.kernel_io else None
        output = kernel_call.output if "outputs" in tracker.kernel_io else None
        tensors: list[Tensor] = []
        spec = (
            kernel.memory,
            kernel.name,
            _encode(plan.kept, tensors),
            _encode(inputs, tensors),
            _encode(output, tensors),
            kernel_call.path,
        )
        _event(_CLOCKS[self.key], self.key, "store", [], repr(spec), tensors)

    def end(self, checked: bool = True) -> None:
        tracker = self.tracker
        tracker.finish(checked, tracker.wants_some, "?")


class TracedPlan(Plan):
    """A plan traced into a graph: its hooks run through the graph's ops."""

    __slots__ = ()

    def _run(self, hook: "Hook", token: int, state: Any) -> Any:
        return _run_hook(self.owner.traced, hook, token, state)


def _begin(traced: TracedCallTracker, fresh: bool, tokens: int) -> None:
    key = traced.key
    # `fresh` may be read from the memory's values (all zeros: a prompt): a symbol or a tensor of the graph,
    # which tracing must not branch on
    if isinstance(fresh, Tensor):
        _event(_CLOCKS[key], key, "begin", [tokens, -1], "None", [fresh])
        return
    fresh = int(fresh) if fresh is True or fresh is False else torch.sym_ite(fresh, 1, 0)
    _event(_CLOCKS[key], key, "begin", [tokens, fresh], "None", [])


def _run_hook(traced: TracedCallTracker, hook: "Hook", token: int, state: Any) -> Any:
    """Hook or write `hook` at `token`, called when the graph runs; returns what the graph continues from."""
    owner, key = traced.tracker, traced.key
    head = -1 if owner.head is None else owner.head
    if not torch.is_grad_enabled():
        parts = _hook(_CLOCKS[key], key, hook.key, token, owner.tokens, head, [part for _, part in parts_of(state)])
        return rebuild(state, parts)
    # gradients on: a hook reads a detached copy at run time; a write is traced, masked by the call counter
    _event(
        _CLOCKS[key],
        key,
        "look",
        [hook.key, token, owner.tokens, head],
        "None",
        [part.detach() for _, part in parts_of(state)],
    )
    if not hook.write:
        return state
    written = hook.run(None, token, state)
    targeted = _targeted(hook.calls, _CLOCKS[key])
    if targeted is None:
        return written
    return map_parts(lambda w, s: torch.where(targeted.to(s.device), w, s), written, state)


def _outside(traced: TracedCallTracker, hook: "Hook", token: int, tokens: int, kernel: str) -> None:
    """A hook that names calls has token `token` outside this call of `tokens` tokens: an error if it
    targets this call (told when the graph runs)."""
    _event(_CLOCKS[traced.key], traced.key, "outside", [hook.key, token, tokens], repr(kernel), [])


def _targeted(calls: Any, clock: Tensor) -> Tensor | None:
    """Whether the running call (`clock`) is one of `calls` (None: every call), as a 0-d bool tensor."""
    if calls is None:
        return None
    if isinstance(calls, range):
        after = clock - calls.start
        hit = (after >= 0) & (clock < calls.stop)
        return hit & (after % calls.step == 0) if calls.step != 1 else hit
    if not calls:
        return torch.zeros((), dtype=torch.bool)
    return torch.isin(clock, torch.tensor(sorted(calls), dtype=clock.dtype))


# A value as a spec of constants (repr-able, so a string constant of the graph) and its tensors, in order.
def _encode(value: Any, tensors: list[Tensor]) -> Any:
    if isinstance(value, Tensor):
        tensors.append(value.detach())
        return ("tensor",)
    if is_parts(value):
        return ("parts", tuple(_encode(part, tensors) for part in value))
    if isinstance(value, dict):
        return ("dict", tuple((key, _encode(item, tensors)) for key, item in value.items()))
    if isinstance(value, (tuple, list)):
        return ("list" if isinstance(value, list) else "tuple", tuple(_encode(item, tensors) for item in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    return ("dropped", type(value).__name__)  # not a tensor nor a constant: not kept under compile


def _decode(spec: Any, tensors: "Any", state_type: type | None) -> Any:
    kind = spec[0]
    if kind == "tensor":
        return next(tensors)
    if kind == "parts":
        return state_type(*(_decode(item, tensors, state_type) for item in spec[1]))
    if kind == "dict":
        return {key: _decode(item, tensors, state_type) for key, item in spec[1]}
    if kind in ("list", "tuple"):
        items = [_decode(item, tensors, state_type) for item in spec[1]]
        return items if kind == "list" else tuple(items)
    return spec[1] if kind == "value" else None


# -- what runs when the graph runs -------------------------------------------------------------------------------


def _on_begin(owner: CallTracker, clock: Tensor, ints: list[int], fresh: bool, tensors: list[Tensor]) -> None:
    fresh = bool(tensors[0]) if ints[1] < 0 else bool(ints[1])
    owner.count(fresh, ints[0], reorder=None)
    clock.fill_(owner.index)


def _on_store(owner: CallTracker, clock: Tensor, ints: list[int], spec: Any, tensors: list[Tensor]) -> None:
    memory, kernel, kept, inputs, output, path = spec
    values = iter(tensors)
    decoded = [_decode(item, values, owner.kind.STATE_TYPE) for item in (kept, inputs, output)]
    owner.file(memory, kernel, *decoded, path=path)


def _on_outside(owner: CallTracker, clock: Tensor, ints: list[int], kernel: str, tensors: list[Tensor]) -> None:
    hook, token, tokens = hook_of(ints[0]), ints[1], ints[2]
    if hook.targets(owner.index):
        owner.refuse_outside(hook, token, tokens, kernel)


def _on_look(owner: CallTracker, clock: Tensor, ints: list[int], spec: Any, tensors: list[Tensor]) -> None:
    hook, token = hook_of(ints[0]), ints[1]
    owner.tokens, owner.head = ints[2], None if ints[3] < 0 else ints[3]
    if not hook.targets(owner.index):
        return
    if hook.write:
        owner.note_replaced(hook, token)
        return
    state = _rebuild(owner, hook.memory, tensors)
    owner.run_hook(hook, owner.index, token, state, replaces=False)


def _on_restart(owner: CallTracker, clock: Tensor, ints: list[int], spec: Any, tensors: list[Tensor]) -> None:
    if owner.wants(owner.index):
        owner.warn_restart(owner.index, *spec)


_EVENTS = {"begin": _on_begin, "store": _on_store, "outside": _on_outside, "look": _on_look, "restart": _on_restart}
