"""The shared mechanism of every recurrent mixer: calls, the call counter, hooks, writes and kept values.

Vocabulary (docs/concepts.md has the long form):
- mixer: one recurrent sequence-mixing module of a model (e.g. `Qwen3_5GatedDeltaNet` at layer 0).
  `RecurrentMixer` is the library's handle on it, one per mixer and watch.
- call: one forward of the mixer module. Inside a `watch`, call 0 is the first forward of that
  mixer in the block (the prompt); in `generate`, decode step k is call k.
- token: a position inside a call, counted from the call's own first token.
- kernel: a module-global function the mixer's forward calls; the library rebinds it (see
  `rebinding`) to a dispatcher that knows which mixer is running.
- memory: what a mixer carries from token to token: its recurrent `state` and the window of its
  causal convolution, `window`. Each kernel updates one of them (`Kernel.memory`), or both (`Kernel.also`:
  a whole forward that carries two, zaya's CCA).

Where this module sits: the package's layers are drawn in docs/architecture.md (and listed in
`recurrent_hooks/__init__.py`); the engine's modules in `recurrent_hooks/engine/__init__.py`. A mixer has three
roles, each in its own place:
- the kind's declaration: class constants and its adapter (`kind.Kind`, the protocol a kind fills in;
  `adapter.KindAdapter`, what the engine and the studies ask of the kind, reached as `kind.adapter`);
- the user's handle: `RecurrentMixer` here, with its readings, hooks and writes (each registered as a `hooks.Hook`);
- the per-call bookkeeping: the call counter, the running call's record, replays, what each kernel call wants
  (`tracker.CallTracker`, owned by the handle as `tracker` and made with what its watch asks, a `policy.Request`;
  `compiled.TracedCallTracker` while tracing). The tracker never holds the handle.

How a kernel call is handled: the mixer class's `__call__`, rebound for the watch, pushes a `forwards.Running` entry
on the running thread's stack (`THREAD.running`) for every forward of an instance, watched or not, and pops it
in a `finally`; the module's forward pre-hook fills it in and starts a call on every attached `RecurrentMixer`
that sees that thread. The dispatcher bound in place of the kernel takes the innermost entry (an unwatched
model run inside a watched forward has its own entries, and calls its own kernels untouched; so does code
inside a user's hook, `THREAD.in_hook`). Each attached mixer says what it wants of this kernel call (a
`tracker.Plan`). Nothing wanted: the kernel bound before the watch runs unchanged; else the call runs by one of
the paths (`policy.Strategy` lists them), which call `Plan.apply` at the tokens the plans name. In grad mode, kept
states are read through one zero leaf per kernel call (`Call.differentiable`).
A forward that autograd recomputes (gradient checkpointing) is matched to the call it repeats by the
fingerprint of its input (`tracker._Replay`) and runs that call's plan again, keeping nothing new.
"""

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..declare.kernels import CONV_MEMORY, STATE_MEMORY, memory_name
from ..declare.memory_parts import State, describe, is_parts, map_parts, not_a_tensor, parts_of, stack_parts
from ..errors import InvalidValue, RecurrentHooksError, Unavailable, renamed
from ..policy import Policy, Request
from ..tracking.compiled import TracedCallTracker
from ..tracking.hooks import SHOWN, Hook
from ..tracking.records import Call, Calls, Memory, recorded
from ..tracking.tracker import CallTracker
from .arguments import (
    RowTokens,
    as_calls,
    as_index,
    as_targets,
    as_token_selection,
    describe_calls,
    describe_token,
    normalize_keep,
)
from .kind import Kind

# A state hook: fn(mixer, call, token, state) -> None (keep the state) or a replacement tensor.
StateHook = Callable[["RecurrentMixer", int, int, Tensor], Tensor | None]


# how a memory is read and written, for messages
_ACCESSORS = {STATE_MEMORY: "state_after, set_state_after", CONV_MEMORY: "window_after, set_window_after"}


class _Handle(RemovableHandle):
    """A torch `RemovableHandle` that also tells its mixer, so that the last removal can release kernels."""

    def __init__(self, hooks: dict, mixer: "RecurrentMixer") -> None:
        super().__init__(hooks)
        self._mixer_ref = weakref.ref(mixer)

    def remove(self) -> None:
        super().remove()
        mixer = self._mixer_ref()
        if mixer is not None:
            mixer.hook_removed()


def _policy_field(name: str, doc: str) -> property:
    """A handle's read-only view of one field of the `Policy` it was made with."""
    return property(lambda mixer: getattr(mixer.tracker.policy, name), doc=doc)


def _tracker_field(name: str, doc: str) -> property:
    """A handle's read-only view of one attribute of its tracker."""
    return property(lambda mixer: getattr(mixer.tracker, name), doc=doc)


def _former(old: str, new: str) -> property:
    """A former name of a handle's attribute or method: the new one, with a warning."""

    def former(mixer: "RecurrentMixer") -> Any:
        renamed(f"RecurrentMixer.{old}", f"RecurrentMixer.{new}")
        return getattr(mixer, new)

    return property(former, doc=f"The former name of `{new}`.")


class RecurrentMixer(Kind):
    """The library's handle on one recurrent mixer module; subclasses declare kernels and values.

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        mix = w.mixers[0]
        mix.states           # the state after every token of the last call
        mix.state_after(4)   # the state after token 4

    What a subclass (a kind) declares, its class constants and its adapter (`adapter`, the kind's
    `adapter.KindAdapter`), is the protocol of `kind.Kind`. The handle keeps what a user registers (hooks, writes)
    and reads what the calls left (`calls`); the per-call bookkeeping that the tap's module hooks drive is `tracker`
    (`tracker.CallTracker`).

    `recomputing` is True while autograd recomputes a checkpointed forward of this mixer (gradient
    checkpointing): hooks run again then, with the call index of the forward being recomputed. `head` is
    the head of the running recurrence kernel call, for a kind that runs its kernel once per head.
    """

    # the policy its calls run by (`policy.Policy`, given by its watch or standalone hooks), read-only here
    paths = _policy_field("paths", "How this handle's busy calls pick their path (a `Paths`).")
    keep_device = _policy_field("keep_device", "Where kept values go as they are kept (None: where computed).")
    reduce = _policy_field("reduce", "Memory -> the function kept in place of its states (`watch(reduce=...)`).")

    def __init__(
        self,
        module: nn.Module,
        family: str,
        *,
        keep: Sequence[str] | Mapping[str, Iterable[int] | None] = (),
        history: bool = True,
        restart_on_prompt: bool = False,
        thread: int | None = None,
        layer: int | None = None,
        cache_index: Any = None,
        policy: Policy | None = None,
        calls_kept: int | None = None,
    ) -> None:
        self._module = weakref.ref(module)  # a standalone hook must not keep its module alive
        self.family = family
        # the module's own layer_idx; else `layer`, the watch's reading of the module's path (a mixer module
        # that does not store its index, e.g. "model.layers.3.temporal_block")
        self.layer: int | None = getattr(module, self.LAYER_ATTRIBUTE, layer)
        self._thread = thread  # the thread whose forwards this handle sees (None: every thread)
        self._unseen: dict[int, list] = {}  # its module's forwards in threads it does not see: id -> [name, count]
        # the forwards this handle takes part in: those whose memory is at this cache index (`adapter.cache_index`;
        # None: every forward of the module). A module run several times per model forward, each time on its
        # own cache layer, has one handle per run (`adapter.instances`; `adapter.serves` says which forwards)
        self.cache_index = cache_index
        self._hooks: OrderedDict[int, tuple[Hook, ...]] = OrderedDict()  # weakly referenced by the handles
        self._on_empty: Callable[[], None] | None = None
        self._live = False  # attached to its module's tap
        # what its watch (or its standalone hooks) asks of its calls, handed to its tracker once (`history` False: a
        # standalone hook's handle, which records no calls)
        memories, kernel_io = normalize_keep(keep)
        request = Request(memories, kernel_io, policy or Policy(), history, restart_on_prompt, calls_kept)
        self.tracker = CallTracker(request, type(self), repr(self), self._hooks)
        self.tracker.traced = TracedCallTracker(self.tracker)
        self.calls: Calls = self.tracker.calls

    @property
    def module(self) -> nn.Module:
        """The transformers mixer module this handle watches."""
        module = self._module()
        if module is None:
            raise RecurrentHooksError(f"{self}: its module has been garbage-collected")
        return module

    head = _tracker_field("head", "The head of the running recurrence kernel call (KERNEL_PER_HEAD kinds, else None).")
    recomputing = _tracker_field("recomputing", "The running forward is a checkpointed forward being recomputed.")
    keep = _tracker_field("keep", "What it keeps of every call: memory -> token positions (None: every token).")
    kernel_io = _tracker_field("kernel_io", 'Which of the kernels\' "inputs" and "outputs" it keeps.')
    # former names (docs/api.md, "Renamed"): they warn
    call_state = _former("call_state", "tracker")  # "state" is the recurrent state, never the bookkeeping
    conv_states = _former("conv_states", "windows")
    conv_state_after = _former("conv_state_after", "window_after")
    set_conv_state_after = _former("set_conv_state_after", "set_window_after")

    def _has(self, memory: str, method: str) -> None:
        if memory not in self.MEMORIES:
            carried = " and ".join(self.MEMORIES)
            raise Unavailable(
                f"{self}.{method}: a {type(self).__name__} mixer has no {memory}; it carries only"
                f" {carried} ({', '.join(_ACCESSORS[m] for m in self.MEMORIES)})"
            )

    # -- reading -----------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.family}, layer {self.layer})"

    @property
    def states(self) -> Float[Tensor, "batch seq *state"]:
        """The state after every token of the last call (the call's own token count on `seq`).

        The layout after `batch seq` is the kind's `STATE`; gated DeltaNet:
        `Float[Tensor, "batch seq heads key_dim value_dim"]`.
        """
        self._has(STATE_MEMORY, "states")
        return self._call(None, "states").states

    @property
    def windows(self) -> Float[Tensor, "batch seq channels kernel_size"]:
        """The convolution window after every token of the last call (needs keep=("windows",))."""
        self._has(CONV_MEMORY, "windows")
        return self._call(None, "windows").windows

    def after(self, memory: str, token: "int | Sequence[int] | slice", call: int | None = None) -> State:
        """The kept `memory` ("state" or "window") after `token` of call `call`: `state_after` or `window_after` by
        the memory's name (the memory-generic reader, as `register_state_hook(memory=...)` takes it).

            mix.after("window", 4)      # mix.window_after(4)
        """
        memory = memory_name(memory, f"{self}.after")
        if memory not in (STATE_MEMORY, CONV_MEMORY):
            raise InvalidValue(f"{self}.after: expected memory='state' or memory='window', got {memory!r}")
        return (self.state_after if memory == STATE_MEMORY else self.window_after)(token, call)

    def state_after(
        self, token: "int | Sequence[int] | slice", call: int | None = None
    ) -> Float[Tensor, "batch *state"] | Float[Tensor, "batch tokens *state"]:  # noqa: F821 (jaxtyping's shape string)
        """The state after `token` (negative counts from the end) of call `call` (default: the last call).

            mix.state_after(4)          # [batch, *state]
            mix.state_after([3, 4])     # [batch, 2, *state]: several tokens, stacked on the seq axis
            mix.state_after(slice(-3, None))   # the last three tokens' states, as mix.states[:, -3:]

        It is the state token+1 continues from: a write or hook at `token` is included. The tensor is
        the one the recurrence used, so `torch.autograd.grad(metric, mix.state_after(t))` works (for
        KERNEL_PER_HEAD kinds it is a stack of the heads' states; take gradients through a written leaf).
        """
        self._has(STATE_MEMORY, "state_after")
        return self._after(STATE_MEMORY, token, call, "state_after")

    def window_after(
        self, token: "int | Sequence[int] | slice", call: int | None = None
    ) -> Float[Tensor, "batch channels kernel_size"] | Float[Tensor, "batch tokens channels kernel_size"]:
        """The convolution window after `token` of call `call`: the last kernel_size conv inputs, oldest
        first, in the layout of transformers' cache; token+1 reads its last kernel_size-1 columns. Several
        tokens (a list or a slice) are stacked on the seq axis, as for `state_after`."""
        self._has(CONV_MEMORY, "window_after")
        return self._after(CONV_MEMORY, token, call, "window_after")

    def _after(self, memory: str, token: Any, call: int | None, method: str) -> State:
        record = self._call(call, method)
        selected = as_token_selection(token, f"{self}.{method}", record.ran(memory))
        if isinstance(selected, int):
            return record.after(memory, selected)
        return stack_parts([record.after(memory, each) for each in selected], dim=1)

    def memory_after(self, token: "int | Sequence[int] | slice", call: int | None = None) -> Memory:
        """The whole memory after `token`: `Memory(state, window)` (needs both kept; a memory the kind
        does not carry is None). Several tokens (a list or a slice): each memory stacked on the seq axis."""
        return Memory(
            *(
                getter(token, call) if memory in self.MEMORIES else None
                for memory, getter in ((STATE_MEMORY, self.state_after), (CONV_MEMORY, self.window_after))
            )
        )

    def values(self, call: int | None = None) -> dict[str, Tensor]:
        """The per-token values of call `call` (default: the last), token-major, named as in `VALUES`.

            mix.values()["dt"]     # Mamba: the step after bias and softplus, [batch, seq, d_inner]

        Computed from the kernel's kept inputs and outputs (`keep=("inputs", "outputs")`; no states
        needed). Mixers that run their kernel once per head stack the heads on the axis after `seq`.
        """
        record = self._call(call, "values")
        if not record.kernel_calls:
            raise Unavailable(f"{self}: call {record.index} made no recurrence kernel call")
        for kernel_call in record.kernel_calls:
            recorded(record, kernel_call.inputs, "inputs"), recorded(record, kernel_call.output, "outputs")
        per_kernel_call = [self.adapter.token_values(self, kernel_call) for kernel_call in record.kernel_calls]
        if len(per_kernel_call) == 1:
            return per_kernel_call[0]
        return {name: torch.stack([values[name] for values in per_kernel_call], dim=2) for name in per_kernel_call[0]}

    def _call(self, call: Any, method: str) -> Call:
        return record_of(self, call, method)

    # -- hooks and writes --------------------------------------------------------------------------------

    def register_state_hook(
        self,
        fn: StateHook,
        *,
        call: "int | Iterable[int] | slice | None" = None,
        token: int | Iterable[int] | None = None,
        memory: str | None = None,
        which: str | None = None,
    ) -> RemovableHandle:
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
        `memory="window"` hooks the convolution window instead (`[batch, channels, kernel_size]`; `which=` is its
        former name).
        The default is the kind's first memory (`MEMORIES[0]`): the state, or the window of a kind that
        carries only a window (a short convolution).
        """
        where = f"{self}.register_state_hook"
        if which is not None:
            if memory is not None:
                raise InvalidValue(
                    f"{where}: memory={memory!r} and which={which!r}: `which` is the former name of"
                    " `memory`; pass memory= alone"
                )
            renamed(f"{where}(which=...)", f"{where}(memory=...)")
            memory = which
        which = self.MEMORIES[0] if memory is None else memory_name(memory, where)
        if not callable(fn):
            raise InvalidValue(f"{where}: expected a callable fn(mixer, call, token, state), got {fn!r}")
        if which not in (STATE_MEMORY, CONV_MEMORY):
            raise InvalidValue(f"{where}: expected memory='state' or memory='window', got {which!r}")
        self._has(which, "register_state_hook")
        calls = as_calls(call, where)
        name = getattr(fn, "__qualname__", repr(fn))
        return self._add_hooks(Hook(self, fn, which, calls, as_targets(token, "token", where), f"{which} hook {name}"))

    def set_after(
        self, memory: str, token: int, value: Tensor, call: "int | Iterable[int] | slice | None" = 0
    ) -> RemovableHandle:
        """Replace the `memory` ("state" or "window") after `token` of call `call` by `value`: `set_state_after` or
        `set_window_after` by the memory's name.

            mix.set_after("state", 4, patched_state)     # mix.set_state_after(4, patched_state)
        """
        memory = memory_name(memory, f"{self}.set_after")
        if memory not in (STATE_MEMORY, CONV_MEMORY):
            raise InvalidValue(f"{self}.set_after: expected memory='state' or memory='window', got {memory!r}")
        return (self.set_state_after if memory == STATE_MEMORY else self.set_window_after)(token, value, call)

    def set_state_after(
        self, token: int, value: Tensor, call: "int | Iterable[int] | slice | None" = 0
    ) -> RemovableHandle:
        """Replace the state after `token` of call `call` (default 0, the prompt) by `value`.

            mix.set_state_after(4, patched_state)        # tokens 5.. of the prompt continue from it
            mix.set_state_after(0, patched_state, call=3)   # decode step 3

        Token `token`'s own output is unchanged; later tokens, and the cache, continue from `value`.
        `value` must have the state's shape, dtype and device (checked when the call runs). `call`
        takes what hooks take (several calls, a slice, None for every call).
        """
        return self._add_hooks(*_writes(self, STATE_MEMORY, token, value, call, "set_state_after"))

    def set_window_after(
        self, token: int, value: Tensor, call: "int | Iterable[int] | slice | None" = 0
    ) -> RemovableHandle:
        """Replace the convolution window after `token` of call `call` by `value` (`[batch, channels,
        kernel_size]`, the cache's layout and dtype): tokens token+1.. read it, and so does the cache."""
        return self._add_hooks(*_writes(self, CONV_MEMORY, token, value, call, "set_window_after"))

    def set_memory_after(
        self, token: int, memory: Memory, call: "int | Iterable[int] | slice | None" = 0
    ) -> RemovableHandle:
        """Write the whole memory after `token` (state and conv window), e.g. kept in another run.

        with rh.watch(model, keep=("states", "windows")) as a:
            model(ids_a)
        with rh.watch(model) as b:
            b.mixers[0].set_memory_after(7, a.mixers[0].memory_after(7))
            model(ids_b)   # from token 8 on, layer 0 continues exactly as in run A
        """
        if not isinstance(memory, tuple) or len(memory) != 2:
            raise InvalidValue(
                f"{self}.set_memory_after({token!r}, call={call!r}): expected a Memory(state,"
                f" window), got {type(memory).__name__}"
            )
        parts = [(name, value) for name, value in zip((STATE_MEMORY, CONV_MEMORY), memory) if name in self.MEMORIES]
        return self._add_hooks(
            *(hook for name, value in parts for hook in _writes(self, name, token, value, call, "set_memory_after"))
        )

    def _add_hooks(self, *hooks: Hook) -> RemovableHandle:
        if not self._live:
            raise RecurrentHooksError(f"{self} is detached (its watch has ended): register hooks inside the with block")
        handle = _Handle(self._hooks, self)
        self._hooks[handle.id] = hooks
        return handle

    # -- its lifecycle: its watch (or its standalone hooks) and its module's tap drive it ------------------------

    def mark_attached(self) -> None:
        """It was attached to its module's tap (`tap.attach`): hooks and writes may be registered."""
        self._live = True

    def mark_detached(self) -> None:
        """Its watch ended (or its standalone hooks were released): it takes part in no forward from now on."""
        self._live = False

    def release_when_empty(self, release: Callable[[], None] | None) -> None:
        """Run `release` when its last hook is removed (its standalone hooks' kernels); None: nothing."""
        self._on_empty = release

    def hook_removed(self) -> None:
        """One of its hooks was removed: the last one runs what `release_when_empty` set."""
        if not self._hooks and self._on_empty is not None:
            self._on_empty()

    def unapplied(self) -> list[str]:
        """Writes aimed at calls this mixer never reached (reported when a watch ends; hooks are not)."""
        seen = self.tracker.seen
        problems = []
        for hook in self.tracker.all_hooks():
            missed = hook.missed(seen) if hook.write else []
            if missed:
                shown = ", ".join(map(str, missed[:SHOWN])) + (", ..." if len(missed) > SHOWN else "")
                problems.append(f"{hook.origin} on {self} (call {shown}; it saw {seen} call{'s' if seen != 1 else ''})")
        return problems

    def unkept(self) -> list[str]:
        """Positions of `keep` outside every call this mixer saw, which kept nothing (reported when a watch ends)."""
        return self.tracker.unkept()


def _writes(mixer: RecurrentMixer, memory: str, token: Any, value: Any, call: Any, method: str) -> list[Hook]:
    """The writes of `value` after `token`: one, or, for several tokens (a list, tuple, range or bounded slice),
    one per token, of `value`'s slice on the seq axis (`[batch, tokens, *memory]`, as `state_after` reads them)."""
    if not isinstance(token, (list, tuple, range, slice)):
        return [_write(mixer, memory, token, value, call, method)]
    where = f"{mixer}.{method}({token!r}, call={call!r})"
    tokens = as_token_selection(token, where, None)
    parts = parts_of(value) if isinstance(value, Tensor) or is_parts(value) else []
    shapes = [tuple(part.shape) for _, part in parts if isinstance(part, Tensor)]
    if not parts or len(shapes) != len(parts) or any(len(shape) < 2 or shape[1] != len(tokens) for shape in shapes):
        got = f"shapes {shapes}" if shapes else type(value).__name__
        raise InvalidValue(
            f"{where}: expected the {memory} after each of the {len(tokens)} tokens stacked on axis 1,"
            f" [batch, {len(tokens)}, ...] (as {method.removeprefix('set_')}({token!r}) reads them),"
            f" got {got}"
        )
    return [
        _write(mixer, memory, each, map_parts(lambda part, i=i: part[:, i], value), call, method)
        for i, each in enumerate(tokens)
    ]


def _write(mixer: RecurrentMixer, memory: str, token: Any, value: Tensor, call: Any, method: str) -> Hook:
    """The hook a write (`set_state_after`, ...) registers: `value` after `token` of the calls `call`; a tensor of
    tokens (`RowTokens`) writes each row after its own token."""
    where = f"{mixer}.{method}({describe_token(token)}, call={call!r})"
    mixer._has(memory, method)
    declared = mixer.STATE if memory == STATE_MEMORY else mixer.CONV_STATE
    calls = as_calls(call, where)
    wanted = mixer.STATE_TYPE if memory == STATE_MEMORY and mixer.STATE_TYPE is not None else Tensor
    if not isinstance(value, wanted):
        raise InvalidValue(
            f"{where}: expected a {wanted.__name__} with axes ({describe(declared)}), got {type(value).__name__}"
        )
    if (wrong := not_a_tensor(value, declared)) is not None:
        raise InvalidValue(f"{where}: {wrong}")
    rows = RowTokens.of(token, where) if isinstance(token, Tensor) and token.dim() > 0 else None
    tokens = rows.tokens if rows is not None else (as_index(token, "token", where),)

    def write(mixer: RecurrentMixer, call: int, token: int, state: State) -> State:
        written = value if mixer.head is None else map_parts(lambda v: v[:, mixer.head], value)
        if rows is None or any(
            w.shape != s.shape or w.dtype != s.dtype or w.device != s.device
            for (_, w), (_, s) in zip(parts_of(written), parts_of(state))
        ):
            return written  # a write of the whole batch, or a value the check will refuse with its message
        batch = parts_of(state)[0][1].shape[0]
        at = rows.at(token, mixer.tracker.tokens, batch, f"{mixer}, call {call}, token {token}: {method}")
        return map_parts(
            lambda w, s: torch.where(at.to(s.device).view(-1, *(1,) * (s.dim() - 1)), w, s), written, state
        )

    origin = f"{method}({describe_token(token)}, call={describe_calls(calls)})"
    return Hook(mixer, write, memory, calls, tokens, origin, write=True)


def sees(mixer: RecurrentMixer, thread: int | None, recompute: bool) -> bool:
    """Whether a handle takes part in a forward running in `thread` (a recompute runs where autograd runs it; None:
    a compiled forward, whose thread cannot be told)."""
    return recompute or thread is None or mixer._thread is None or mixer._thread == thread


def record_of(mixer: RecurrentMixer, call: Any, method: str) -> Call:
    """The record of call `call` of a watched mixer (None: the last), for `method` (named in the errors); a call whose
    record its watch dropped (`watch(history=...)`) raises `Unavailable`."""
    if call is not None:
        call = as_index(call, "call", f"{mixer}.{method}")
    if not mixer.tracker.history:
        raise Unavailable(f"{mixer} records nothing: hooks registered outside a watch keep no values; use watch()")
    calls = mixer.calls
    if not calls:
        raise Unavailable(f"{mixer} has not been called inside this watch yet: {other_threads(mixer)}")
    if call is None:
        return calls[-1]
    if not -len(calls) <= call < len(calls):
        raise Unavailable(f"{mixer}: no call {call}; this watch saw {len(calls)} calls (0..{len(calls) - 1})")
    return calls[call]


# The thread rule, as the warning on a watch's exit and the error on a mixer never called say it.
THREAD_RULE = (
    "a watch sees only the forwards of the thread that entered it: enter the watch in the thread that runs"
    ' the model (docs/concepts.md, "Known limits")'
)


def note_unseen(mixers: Sequence[RecurrentMixer], thread: int) -> None:
    """A forward of their module runs in `thread`: each of `mixers` entered in another thread notes it (its watch
    warns on exit), unless one of them was entered in that thread (its own watch there sees the forward)."""
    if any(mixer._thread == thread for mixer in mixers):
        return
    for mixer in mixers:
        if mixer._thread is not None:
            seen = mixer._unseen
            if thread not in seen:
                seen[thread] = [threading.current_thread().name, 0]
            seen[thread][1] += 1


def unseen_threads(mixer: RecurrentMixer) -> dict[tuple[int, str], int]:
    """The forwards of a mixer's module that ran in threads its watch does not see: (thread id, name) -> how many."""
    return {(ident, name): forwards for ident, (name, forwards) in mixer._unseen.items()}


def other_threads(mixer: RecurrentMixer) -> str:
    """Why a mixer has no call: its forwards in threads its watch does not see, or the reasons there may be."""
    seen = unseen_threads(mixer)
    if not seen:
        return (
            "the model did not run inside the block, or it ran in another thread than the one that entered the"
            f" watch ({THREAD_RULE})"
        )
    ran = ", ".join(f"{n} forward{'s' if n != 1 else ''} in thread {name!r}" for (_, name), n in seen.items())
    return f"its module ran {ran}, which this watch does not see ({THREAD_RULE})"
