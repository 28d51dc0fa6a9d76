"""The shared mechanism of every recurrent mixer: calls, the call counter, hooks, writes and kept values.

Vocabulary (docs/concepts.md has the long form):
- mixer: one recurrent sequence-mixing module of a model (e.g. `Qwen3_5GatedDeltaNet` at layer 0).
  `RecurrentMixer` is the library's handle on it, one per mixer and watch.
- call: one forward of the mixer module. Inside a `watch`, call 0 is the first forward of that
  mixer in the block (the prompt); in `generate`, decode step k is call k.
- token: a position inside a call, counted from the call's own first token.
- kernel: the module-global function the mixer's forward calls for its recurrence; the library
  rebinds it (see `_patching`) to a dispatcher that knows which mixer is running.

Module contents:
- `Kernel`: the declaration of one kernel of a mixer kind (name, the library's token loop, where the
  state goes in, what the results are called).
- `Call`: what a call left behind: kernel, named inputs and outputs, per-token states if kept.
- `RecurrentMixer`: the base class; subclasses declare their kernels and values as class constants.
- `running_tap()`: the tap of the mixer module whose forward is running (used by the dispatchers).

How a kernel call is handled: a forward pre-hook on the mixer module pushes its tap on a stack and
starts a call on every attached `RecurrentMixer`; the dispatcher bound in place of the kernel finds
that tap; each attached mixer says what it wants of this call (a `_Plan`); when nothing is wanted
beyond inputs and outputs, the kernel bound before the watch runs unchanged, otherwise the library's
token loop runs and calls `_Plan.on_token` after each token's state update.
"""

import dataclasses
import functools
from collections import OrderedDict
import inspect
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ._errors import InvalidValue, RecurrentHooksError, Unavailable

# A state hook: fn(mixer, call, token, state) -> None (keep the state) or a replacement tensor.
StateHook = Callable[["RecurrentMixer", int, int, Tensor], Tensor | None]

KEEPABLE = ("inputs", "outputs", "states")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a mixer kind, as data.

    - `name`: the module global the mixer's forward calls;
    - `loop`: the library's pure-torch token loop with the same signature and return value, plus a
      keyword-only `on_token(t, state) -> state`;
    - `state_in`: the argument that carries the state in (None: the kernel always starts from zeros);
    - `results`: names of the elements of the returned value (a single tensor is the first name);
    - `role`: "prompt" or "decode";
    - `seq`: `(argument, axis)` where the tokens of the call are counted (None: one token);
    - `in_place`: the kernel writes the new state into its `state_in` tensor instead of returning it.
    """

    name: str
    loop: Callable[..., Any]
    state_in: str | None
    results: tuple[str, ...]
    role: str
    seq: tuple[str, int] | None = None
    in_place: bool = False

    @property
    def signature(self) -> inspect.Signature:
        return _signature(self.loop)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by name (extra keyword arguments the kernel ignores are left out)."""
        bound = self.signature.bind(*args, **kwargs)
        return {k: v for k, v in bound.arguments.items() if k not in ("kwargs", "on_token")}

    def tokens(self, arguments: dict[str, Any]) -> int:
        """How many tokens the call covers."""
        return 1 if self.seq is None else arguments[self.seq[0]].shape[self.seq[1]]

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
    """One kernel call: its name, its arguments and its results by name."""

    kernel: str
    inputs: dict[str, Any]
    output: dict[str, Any]


@dataclasses.dataclass(eq=False)
class Call:
    """What one call (one forward) of a mixer left behind.

        mix.calls[0].kernel            # "torch_chunk_gated_delta_rule": which kernel fired
        mix.calls[0].inputs["value"]   # the kernel's arguments by name
        mix.calls[0].output["output"]  # the kernel's results by name
        mix.calls[0].states            # per-token states, if kept

    Inputs and outputs are the tensors the kernel saw (not copies), except the state: the state
    argument is cloned before the call and, for kernels that update it in place, its new value is
    cloned after the call into `output["final_state"]`.

    A mixer that runs its kernel once per head (zamba) makes several kernel calls in one call:
    `parts[h]` is head h's `KernelCall`, and `states` stacks the heads on the axis after `seq`.
    """

    index: int
    where: str = ""
    tokens: int | None = None
    parts: list[KernelCall] = dataclasses.field(default_factory=list)
    _states: list[list[Tensor]] | None = dataclasses.field(default=None, repr=False)  # per part, per token
    _stacked: Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def kernel(self) -> str | None:
        return self.parts[0].kernel if self.parts else None

    def _single(self) -> KernelCall:
        if len(self.parts) != 1:
            raise Unavailable(f"{self.where}: call {self.index} made {len(self.parts)} kernel calls"
                              " (one per head): read call.parts[head].inputs / .output")
        return self.parts[0]

    @property
    def inputs(self) -> dict[str, Any]:
        return self._single().inputs

    @property
    def output(self) -> dict[str, Any]:
        return self._single().output

    @property
    def states(self) -> Tensor:
        """The state after every token of this call, stacked on a `seq` axis after `batch`."""
        if self._states is None:
            raise Unavailable(f"{self.where}: call {self.index} kept no states; pass keep=('states',) to watch")
        if self._stacked is None:
            per_part = [torch.stack(states, dim=1) for states in self._states]
            self._stacked = per_part[0] if len(per_part) == 1 else torch.stack(per_part, dim=2)
        return self._stacked

    def _state_after(self, token: int) -> Tensor:
        if len(self._states) == 1:
            return self._states[0][token]
        return torch.stack([states[token] for states in self._states], dim=1)


class _Hook:
    """A registered state hook or write, with the calls and tokens it targets."""

    def __init__(self, fn: StateHook, calls: frozenset[int] | None, tokens: tuple[int, ...] | None, origin: str):
        self.fn, self.calls, self.tokens, self.origin = fn, calls, tokens, origin

    def targets(self, call: int) -> bool:
        return self.calls is None or call in self.calls


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


def _as_targets(value: int | Iterable[int] | None, what: str, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, int) else tuple(value)
    if not items or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise InvalidValue(f"{where}: {what} must be an int, a non-empty iterable of ints or None, got {value!r}")
    return items


class RecurrentMixer:
    """The library's handle on one recurrent mixer module; subclasses declare kernels and values.

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        mix = w.mixers[0]
        mix.states           # the state after every token of the last call
        mix.state_after(4)   # the state after token 4

    Class constants a subclass declares:
    - `KERNELS`: the `Kernel`s its modeling modules call (prompt and decode);
    - `STATE`: the axes of the state, as a jaxtyping shape string (e.g. "batch heads key_dim value_dim");
    - `INPUTS`, `OUTPUTS`: the named kernel values with their axes, for the docs and `support`;
    - `LIMITS`: what cannot be had from this kind, and why (reported by `support`);
    - `VALUES`: the per-token values `values()` returns, with their axes;
    - `FUSED`: names of fused whole-forward kernels (if its module has them) that return the mixer's
      output and skip the kernels above; inside a watch they return None, as their pure-torch
      versions do, for a call that has hooks or kept states, so that the forward goes on;
    - `KERNEL_PER_HEAD`: the forward calls its kernels once per head (axis 1 of the state): hooks run
      once per head with that head's state, and `mixer.head` says which head is running.
    """

    KERNELS: ClassVar[tuple[Kernel, ...]] = ()
    STATE: ClassVar[str] = ""
    INPUTS: ClassVar[dict[str, str]] = {}
    OUTPUTS: ClassVar[dict[str, str]] = {}
    LIMITS: ClassVar[dict[str, str]] = {}
    FUSED: ClassVar[tuple[str, ...]] = ()
    KERNEL_PER_HEAD: ClassVar[bool] = False
    VALUES: ClassVar[dict[str, str]] = {}  # what `values()` returns: name -> axes

    def __init__(self, module: nn.Module, family: str, *, keep: Sequence[str] = (), record: bool = True,
                 restart_on_prompt: bool = False) -> None:
        self.module = module
        self.family = family
        self.layer: int | None = getattr(module, "layer_idx", None)
        self.keep = frozenset(keep)
        self.calls: list[Call] = []
        self._record = record
        self._restart_on_prompt = restart_on_prompt
        self._hooks: OrderedDict[int, _Hook] = OrderedDict()  # weakly referenced by the handles
        self._begun = 0  # forwards begun since the mixer was attached
        self._offset = 0  # begun count at the last prompt (hooks registered outside a watch count from it)
        self._current: Call | None = None
        self._fired = False  # whether the current forward called a kernel
        self.head: int | None = None  # the head of the running kernel call (KERNEL_PER_HEAD kinds)
        self._on_empty: Callable[[], None] | None = None
        self._live = False  # attached to its module's tap

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
        return self._call(None).states

    def state_after(self, token: int, call: int | None = None) -> Float[Tensor, "batch *state"]:
        """The state after `token` (negative counts from the end) of call `call` (default: the last call).

        It is the state token+1 continues from: a write or hook at `token` is included. The tensor is
        the one the recurrence used, so `torch.autograd.grad(metric, mix.state_after(t))` works (for
        KERNEL_PER_HEAD kinds it is a stack of the heads' states; take gradients through a written leaf).
        """
        record = self._call(call)
        record.states  # raises Unavailable if the states were not kept
        if not -record.tokens <= token < record.tokens:
            raise Unavailable(
                f"{self}: token {token} is outside call {record.index}, which has {record.tokens} tokens"
                f" (valid: 0..{record.tokens - 1} or -{record.tokens}..-1)"
            )
        return record._state_after(token)

    def values(self, call: int | None = None) -> dict[str, Tensor]:
        """The per-token values of call `call` (default: the last), token-major, named as in `VALUES`.

            mix.values()["dt"]     # Mamba: the step after bias and softplus, [batch, seq, d_inner]

        Computed from the kernel's recorded inputs and outputs (no states needed). Mixers that run
        their kernel once per head stack the heads on the axis after `seq`.
        """
        parts = self._call(call).parts
        if not parts:
            raise Unavailable(f"{self}: call {self._call(call).index} made no kernel call")
        per_part = [self._token_values(part) for part in parts]
        if len(per_part) == 1:
            return per_part[0]
        return {name: torch.stack([values[name] for values in per_part], dim=2) for name in per_part[0]}

    @classmethod
    def _token_values(cls, part: KernelCall) -> dict[str, Tensor]:
        """`values()` of one kernel call; each kind derives them from its kernel's arguments."""
        raise NotImplementedError

    def _call(self, call: int | None) -> Call:
        if not self._record:
            raise Unavailable(f"{self} records nothing: hooks registered outside a watch keep no values; use watch()")
        if not self.calls:
            raise Unavailable(f"{self} has not been called inside this watch yet")
        if call is None:
            return self.calls[-1]
        if not -len(self.calls) <= call < len(self.calls):
            raise Unavailable(f"{self}: no call {call}; this watch saw {len(self.calls)} calls (0..{len(self.calls) - 1})")
        return self.calls[call]

    # -- hooks and writes --------------------------------------------------------------------------------

    def register_state_hook(self, fn: StateHook, *, call: int | Iterable[int] | None = None,
                            token: int | Iterable[int] | None = None) -> RemovableHandle:
        """Call `fn(mixer, call, token, state)` after the state update of each targeted token.

            h = mix.register_state_hook(lambda m, c, t, s: s * 0.5, call=0, token=[3, 4])
            model(ids)
            h.remove()

        `call` and `token` take an int, several, or None for all (tokens may be negative: -1 is the
        last token of each call). `state` is the state token `token` produced; its output is already
        computed from it. Return None to keep it, or a tensor of the same shape, dtype and device to
        replace it: token+1 continues from the replacement, and so does the cache after the last token.
        The state handed to `fn` is not copied: clone it to keep it. A hook with an explicit `call`
        whose tokens lie outside that call raises; with `call=None`, calls without the token are skipped.
        """
        where = f"{self}.register_state_hook"
        if not callable(fn):
            raise InvalidValue(f"{where}: expected a callable fn(mixer, call, token, state), got {fn!r}")
        calls = _as_targets(call, "call", where)
        if calls is not None and any(c < 0 for c in calls):
            raise InvalidValue(f"{where}: calls count from 0, got call={call!r}")
        name = getattr(fn, "__qualname__", repr(fn))
        return self._add_hook(_Hook(fn, None if calls is None else frozenset(calls), _as_targets(token, "token", where),
                                    f"state hook {name}"))

    def set_state_after(self, token: int, value: Tensor, call: int = 0) -> RemovableHandle:
        """Replace the state after `token` of call `call` (default 0, the prompt) by `value`.

            mix.set_state_after(4, patched_state)        # tokens 5.. of the prompt continue from it
            mix.set_state_after(0, patched_state, call=3)   # decode step 3

        Token `token`'s own output is unchanged; later tokens, and the cache, continue from `value`.
        `value` must have the state's shape, dtype and device (checked when the call runs).
        """
        where = f"{self}.set_state_after({token}, call={call})"
        if not isinstance(value, Tensor):
            raise InvalidValue(f"{where}: expected a Tensor with axes ({self.STATE}), got {type(value).__name__}")
        if not isinstance(call, int) or call < 0:
            raise InvalidValue(f"{where}: expected a call index >= 0, got call={call!r}")
        if not isinstance(token, int):
            raise InvalidValue(f"{where}: expected an int token, got {token!r}")

        def write(mixer: RecurrentMixer, call: int, token: int, state: Tensor) -> Tensor:
            return value if mixer.head is None else value[:, mixer.head]

        return self._add_hook(_Hook(write, frozenset((call,)), (token,), f"set_state_after({token}, call={call})"))

    def _add_hook(self, hook: _Hook) -> RemovableHandle:
        if not self._live:
            raise RecurrentHooksError(f"{self} is detached (its watch has ended): register hooks inside the with block")
        handle = _Handle(self._hooks, self)
        self._hooks[handle.id] = hook
        return handle

    def _detached(self) -> None:
        self._live = False

    def _hook_removed(self) -> None:
        if not self._hooks and self._on_empty is not None:
            self._on_empty()

    def unapplied(self) -> list[str]:
        """Hooks and writes with an explicit call that this mixer never reached (checked when a watch ends)."""
        seen = self._begun - self._offset
        return [
            f"{hook.origin} targets call {c}, but {self} saw {seen} call{'s' if seen != 1 else ''}"
            for hook in self._hooks.values() if hook.calls is not None for c in sorted(hook.calls) if c >= seen
        ]

    # -- the call counter (driven by the tap's module hooks) -----------------------------------------------

    def _forward_started(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Called with the mixer forward's arguments before it runs; kinds that must look at them override it."""

    def _refusal(self, kernel: Kernel) -> str | None:
        """Why this kernel call cannot serve hooks or kept states (None: it can); kinds override it."""
        return None

    def _wants(self, index: int) -> bool:
        """Whether call `index` has hooks, writes or kept states."""
        return (self._record and "states" in self.keep) or any(hook.targets(index) for hook in self._hooks.values())

    def _peek_index(self, fresh: bool) -> int:
        """The running call's index, without fixing it (see `_call_index`)."""
        return 0 if self._restart_on_prompt and fresh else self._begun - 1 - self._offset

    def _begin_call(self, args: tuple, kwargs: dict[str, Any]) -> None:
        self._begun += 1
        self._fired = False
        self.head = None
        self._forward_started(args, kwargs)
        self._current = None
        if self._record:
            self._current = Call(index=len(self.calls), where=repr(self))
            self.calls.append(self._current)

    def _end_call(self) -> None:
        if self._fired:
            return
        index = self._begun - 1 - self._offset
        if self._wants(index):
            raise RecurrentHooksError(
                f"{self}: call {index} finished without calling a watched kernel ({', '.join(k.name for k in self.KERNELS)})"
                " although hooks or kept states target it; the mixer took a path the library cannot see"
                " (a fused kernel, or a forward this transformers version changed)"
            )

    def _call_index(self, fresh: bool) -> int:
        """The index of the running call, fixed at its first kernel (prompt = starts from no state).

        Later kernel calls of the same forward (KERNEL_PER_HEAD kinds) are the next heads.
        """
        if self._fired:
            self.head = None if self.head is None else self.head + 1
        else:
            self._fired = True
            self.head = 0 if self.KERNEL_PER_HEAD else None
            if self._restart_on_prompt and fresh:
                self._offset = self._begun - 1
        return self._begun - 1 - self._offset

    def _plan(self, kernel: Kernel, arguments: dict[str, Any], tokens: int) -> "_Plan":
        fresh = kernel.state_in is None or arguments.get(kernel.state_in) is None
        index = self._call_index(fresh)
        if self._wants(index) and (reason := self._refusal(kernel)) is not None:
            raise Unavailable(f"{self}, call {index} ({kernel.name}): {reason}")
        hooks: list[tuple[_Hook, frozenset[int] | None]] = []  # registration order, with absolute positions
        for hook in self._hooks.values():
            if not hook.targets(index):
                continue
            if hook.tokens is None:
                hooks.append((hook, None))
                continue
            outside = [t for t in hook.tokens if not -tokens <= t < tokens]
            if outside and hook.calls is not None:
                raise InvalidValue(
                    f"{self}: {hook.origin} targets token {outside[0]}, but call {index} ({kernel.name}) has {tokens}"
                    f" token{'s' if tokens != 1 else ''} (valid: 0..{tokens - 1} or -{tokens}..-1)"
                )
            positions = frozenset(t % tokens for t in hook.tokens if -tokens <= t < tokens)
            if positions:
                hooks.append((hook, positions))
        return _Plan(self, index, hooks, "states" in self.keep and self._record)

    def _store(self, plan: "_Plan", part: KernelCall, tokens: int) -> None:
        record = self._current
        if record is None:
            return
        record.tokens = tokens
        record.parts.append(part)
        if plan.states is not None:
            record._states = (record._states or []) + [plan.states]
            record._stacked = None


class _Plan:
    """What one attached mixer wants of one kernel call: its hooks (in registration order) and kept states."""

    __slots__ = ("mixer", "call", "hooks", "states")

    def __init__(self, mixer: RecurrentMixer, call: int, hooks: list[tuple[_Hook, frozenset[int] | None]],
                 keep: bool):
        self.mixer, self.call, self.hooks = mixer, call, hooks
        self.states: list[Tensor] | None = [] if keep else None

    @property
    def idle(self) -> bool:
        return not self.hooks and self.states is None

    def apply(self, token: int, state: Tensor) -> Tensor:
        for hook, positions in self.hooks:
            if positions is None or token in positions:
                replacement = hook.fn(self.mixer, self.call, token, state)
                if replacement is not None:
                    state = _checked(replacement, state, self.mixer, hook, self.call, token)
        return state


def _checked(replacement: Any, state: Tensor, mixer: RecurrentMixer, hook: _Hook, call: int, token: int) -> Tensor:
    where = f"{mixer}, call {call}, token {token}: {hook.origin}"
    if not isinstance(replacement, Tensor):
        raise InvalidValue(f"{where} returned {type(replacement).__name__}; expected None or a Tensor")
    for what, want, got in (("shape", tuple(state.shape), tuple(replacement.shape)),
                            ("dtype", state.dtype, replacement.dtype), ("device", state.device, replacement.device)):
        if want != got:
            raise InvalidValue(
                f"{where} gave a state with {what} {got}, expected {want} (axes: {mixer.STATE})"
            )
    return replacement


class _Tap:
    """The per-module side of the mechanism: module hooks, and the mixers attached to the module.

    One tap per mixer module, shared by every watch and standalone hook on it; it exists while at least
    one `RecurrentMixer` is attached.
    """

    def __init__(self, module: nn.Module) -> None:
        self.mixers: list[RecurrentMixer] = []
        self._handles = (
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, always_call=True),
        )

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        for mixer in self.mixers:
            mixer._begin_call(args, kwargs)
        _RUNNING.append(self)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if _RUNNING and _RUNNING[-1] is self:
            _RUNNING.pop()
        for mixer in self.mixers:
            mixer._end_call()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def run_kernel(self, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run one kernel call for the attached mixers: unchanged when idle, else through the token loop."""
        arguments = kernel.bind(args, kwargs)
        tokens = kernel.tokens(arguments)
        plans = [mixer._plan(kernel, arguments, tokens) for mixer in self.mixers]
        live_state = arguments.get(kernel.state_in) if kernel.state_in is not None else None
        if isinstance(live_state, Tensor):
            # The cache updates this tensor in place (at the next step, or in this very call): keep its value.
            arguments[kernel.state_in] = live_state.clone()
        busy = [plan for plan in plans if not plan.idle]
        if not busy:
            result = original(*args, **kwargs)
        else:
            keeping = [plan.states for plan in busy if plan.states is not None]

            def on_token(token: int, state: Tensor) -> Tensor:
                for plan in busy:
                    state = plan.apply(token, state)
                if keeping:
                    # A view that only the later tokens read: the gradient with respect to a kept state is
                    # the effect of changing it there (what a write does), not through token `token`'s output.
                    state = state.view_as(state)
                    for states in keeping:
                        states.append(state)
                return state

            result = kernel.loop(*args, on_token=on_token, **kwargs)
        output = kernel.name_results(result)
        if kernel.in_place and isinstance(live_state, Tensor):
            output["final_state"] = live_state.clone()
        part = KernelCall(kernel.name, arguments, output)
        for mixer, plan in zip(self.mixers, plans):
            mixer._store(plan, part, tokens)
        return result

    def run_fused(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A fused whole-forward kernel: skipped (None, as without mamba_ssm) when a mixer wants this call."""
        if any(mixer._wants(mixer._peek_index(fresh=True)) for mixer in self.mixers):
            return None
        return original(*args, **kwargs)


_TAPS: "weakref.WeakKeyDictionary[nn.Module, _Tap]" = weakref.WeakKeyDictionary()
_RUNNING: list[_Tap] = []


def running_tap() -> _Tap | None:
    """The tap of the innermost mixer module whose forward is running, if it is attached."""
    return _RUNNING[-1] if _RUNNING else None


def attach(mixer: RecurrentMixer) -> Callable[[], None]:
    """Attach `mixer` to its module's tap (created on first use); return the detach function."""
    tap = _TAPS.get(mixer.module)
    if tap is None:
        tap = _TAPS[mixer.module] = _Tap(mixer.module)
    tap.mixers.append(mixer)
    mixer._live = True

    def detach() -> None:
        if mixer in tap.mixers:
            tap.mixers.remove(mixer)
            if not tap.mixers:
                tap.remove()
                if _TAPS.get(mixer.module) is tap:
                    del _TAPS[mixer.module]

    return detach


def make_dispatcher(kind: type[RecurrentMixer]) -> Callable[[str, Any], Callable[..., Any]]:
    """For `acquire_kernels`: the function bound in place of kernel `name` of a module of mixer kind `kind`."""

    def make(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if name in kind.FUSED:

            @functools.wraps(original)
            def watched(*args: Any, **kwargs: Any) -> Any:
                tap = running_tap()
                return original(*args, **kwargs) if tap is None else tap.run_fused(original, args, kwargs)

        else:
            kernel = kind.kernel(name)

            @functools.wraps(original)
            def watched(*args: Any, **kwargs: Any) -> Any:
                tap = running_tap()
                if tap is None:  # a call from outside an attached mixer's forward
                    return original(*args, **kwargs)
                return tap.run_kernel(kernel, original, args, kwargs)

        watched.__recurrent_hooks__ = True
        return watched

    return make
