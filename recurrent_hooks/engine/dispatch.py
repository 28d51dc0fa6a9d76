"""Dispatch: which mixer a kernel call belongs to, and how it runs (the bound kernel, segments, the loop).

Module contents:
- `make_owner`: for `patching.acquire_kernels`, the `__call__` bound on a mixer class: every forward of an
  instance, watched or not, pushes its `_Running` entry on its thread's stack and pops it on the way out; a
  kernel call belongs to the innermost entry (`running_entry`). No stack frame is read.
- `attach(mixer)`: attach a `RecurrentMixer` to its module's `_Tap` (a module pre-forward hook that fills the
  forward's entry in).
- `make_dispatcher(kind)`: for `patching.acquire_kernels`, the function bound in place of each kernel.
- `_Tap.run_kernel`: the plans of the attached mixers decide: nothing wanted runs the bound kernel; a busy
  call takes the path `strategies.choose` picks under its handles' policy (`_fast_path`, `strategies.Paths`) and
  runs by that path's runner (`busy.RUNNERS`: the token loop, segments, every state chunk-wise, blocks, chunks).
  The path taken is recorded (`KernelCall.path`).
"""

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import blocks as _blocks
from . import busy as _busy
from . import runners as _runners
from . import strategies
from .calls import KernelCall
from .kernels import CONV_MEMORY, FORWARD, Kernel, Layout
from .call_state import Plan, _Forward
from .errors import InvalidValue, noted
from .mixer import RecurrentMixer
from .parts import State, is_parts, map_parts, parts_of, rebuild, stack_parts
from .threads import THREAD, in_backward, user_code
from .upstream import wraps_kernel


def _forward_of(kind: type[RecurrentMixer], layout: Layout, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                recompute: bool) -> _Forward:
    """Tokens, cache and freshness of a mixer forward, from its arguments."""
    arguments = layout.bind(args, kwargs)
    tokens, cache, fresh, hidden = kind._parse_forward(module, arguments)
    return _Forward(tokens=tokens, cache=cache, fresh=fresh, hidden=hidden, recompute=recompute,
                    cache_index=kind._cache_index(module, arguments))


@dataclasses.dataclass(eq=False)
class _Running:
    """One forward of a mixer module running in this thread: what its kernel calls belong to.

    The `__call__` of every mixer class a watch or hook holds pushes one for each instance, watched or not
    (`make_owner`), and pops it in a `finally`; the module's tap, if it has one, fills it in (`_Tap._pre`)."""

    module: nn.Module
    tap: "_Tap | None"  # the tap that filled it in; None: the module has none (an unwatched instance)
    forward: _Forward | None  # None: a forward the library does not watch (re-entered, or no handle sees it)
    mixers: list[RecurrentMixer]
    failed: bool = False  # a kernel call of this forward raised: its end is not checked
    by_hook: bool = False  # pushed by the tap's pre-forward hook: a forward that did not go through `__call__`


def _end(entry: _Running, checked: bool) -> None:
    mixers, entry.mixers, entry.forward = entry.mixers, [], None
    for mixer in mixers:
        mixer.call_state.now().end(checked=checked)


def _pop(running: list[_Running], i: int, checked: bool) -> None:
    """End and remove entry `i` of a thread's stack, and the entries above it: forwards that left without
    popping theirs (only those the pre-forward hook pushed, which an interrupt can skip past)."""
    entry, stale = running[i], running[i + 1:]
    del running[i:]
    for other in stale:
        _end(other, checked=False)
    _end(entry, checked=checked and not entry.failed)


def _leave(entry: _Running, checked: bool) -> None:
    """The forward of `entry` is over: pop it, and what is left above it (if it is not there, someone cleared the
    stack: just end its calls)."""
    running = THREAD.running
    for i in range(len(running) - 1, -1, -1):
        if running[i] is entry:
            _pop(running, i, checked)
            return
    _end(entry, checked=False)


def _drop_left(running: list[_Running], module: nn.Module) -> None:
    """`module` begins a forward while an entry its pre-forward hook pushed is still there: that forward was left
    by an interrupt that skipped the post-forward hook (a forward re-entered past `__call__` is taken to be one)."""
    left = [entry for entry in running[:-1] if entry.by_hook and entry.module is module]
    running[:] = [entry for entry in running if not any(entry is other for other in left)]
    for entry in left:
        _end(entry, checked=False)


def make_owner(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """For `acquire_kernels`: the `__call__` bound on a mixer class while a watch or hook holds it.

    Every forward of an instance, watched or not, pushes its entry on this thread's stack and pops it on the way
    out, by return, exception or interrupt: a kernel call belongs to the innermost entry (`running_entry`), so
    an unwatched mixer run inside a watched one runs its own kernels, whichever of its submodules calls them."""
    while getattr(original, "__recurrent_hooks__", False):  # a base class's, bound by another watch
        original = original.__wrapped__

    @functools.wraps(original)
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if THREAD.in_hook:
            return original(self, *args, **kwargs)  # a forward run by a user's hook: not watched
        entry = _Running(self, None, None, [])
        THREAD.running.append(entry)
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            _leave(entry, checked=False)
            raise
        _leave(entry, checked=True)
        return result

    __call__.__recurrent_hooks__ = True
    return __call__


def _keep_memory_arguments(kernel: Kernel, arguments: dict[str, Any]) -> None:
    """Copy the memory arguments that `inputs` records: the cache (or the model's state list) updates these
    tensors in place, at the next step or in this very call. A memory may come as a tuple or list of tensors
    (RWKV)."""
    for name in kernel.state_arguments:
        value = arguments.get(name)
        if isinstance(value, Tensor):
            arguments[name] = value.clone()
        elif isinstance(value, (tuple, list)):
            arguments[name] = type(value)(part.clone() if isinstance(part, Tensor) else part for part in value)


class _Tap:
    """The per-module side of the mechanism: module hooks, and the mixers attached to the module.

    One tap per mixer module, shared by every watch and standalone hook on it; it exists while at least
    one `RecurrentMixer` is attached. The mixer class's `__call__` pushes the forward's `_Running` entry
    (`make_owner`); the tap's pre-forward hook fills it in with the attached mixers that see this forward, and
    begins their calls. (A forward that did not go through `__call__` gets its entry from the pre-forward hook
    and pops it in the post-forward hook.) A kernel call is handled by the innermost entry of its thread.
    """

    copied = False  # a copy's tap (`__deepcopy__`): it takes its hooks off the copy and watches nothing

    def __init__(self, module: nn.Module) -> None:
        self.mixers: list[RecurrentMixer] = []
        self._module = weakref.ref(module)
        self._layout = Layout.of(module.forward)  # read now, not while compiling
        self._handles = (
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, always_call=True),
        )

    # A deep copy or a pickle of a watched model copies its module hooks, and with them the tap: the copy's hooks
    # get an inert tap instead, which takes them off the copy once the deep copy is over (pickle: at the copy's
    # first forward), so the copy is the plain model. `Transient` does the same for kernels bound on objects.

    @classmethod
    def _inert(cls) -> "_Tap":
        tap = cls.__new__(cls)
        tap.mixers, tap._module, tap._handles, tap.copied = [], None, (), True
        return tap

    def __deepcopy__(self, memo: dict) -> "_Tap":
        tap = _Tap._inert()
        module = self._module() if self._module is not None else None
        copied = memo.get(id(module)) if module is not None else None
        if isinstance(copied, nn.Module):  # filled in by the deep copy: cleaned when it is over (its memo dies)
            sentinel = _Sentinel()
            weakref.finalize(sentinel, _drop_hooks, copied, tap)
            memo.setdefault(id(memo), []).append(sentinel)
        return tap

    def __reduce__(self) -> tuple:
        return (_Tap._inert, ())

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.copied:
            _drop_hooks(module, self)
            return
        thread = THREAD
        if thread.in_hook:
            return  # a forward run by a user's hook: not watched, not counted
        running = thread.running
        if running and running[-1].module is module and running[-1].tap is None and not running[-1].by_hook:
            entry = running[-1]  # pushed by the class's `__call__`
        else:  # a forward called past the class's `__call__` (`module._call_impl`, a bound `__call__` kept from
            entry = _Running(module, None, None, [], by_hook=True)  # before the watch)
            running.append(entry)
        entry.tap = self
        if any(other.by_hook and other.module is module for other in running[:-1]):
            _drop_left(running, module)
        compiling = torch.compiler.is_compiling()
        recompute = in_backward()
        ident = None if compiling else threading.get_ident()
        mixers = [mixer for mixer in self.mixers if mixer._sees(ident, recompute)]
        if not mixers or any(other.module is module for other in running[:-1]):
            return  # unwatched here, or re-entered
        forward = _forward_of(type(mixers[0]), self._layout, module, args, kwargs, recompute)
        mixers = [mixer for mixer in mixers if mixer._serves(forward)]  # a handle per pass: only its own
        if not mixers:
            return
        entry.forward, entry.mixers = forward, mixers
        for mixer in mixers:
            mixer.call_state.now().begin(forward)
        forward.hidden = None  # read by begin; a forward's record must not hold its input

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.copied:
            _drop_hooks(module, self)
            return
        thread = THREAD
        if thread.in_hook:
            return
        running = thread.running  # only the entries this hook pushed: `__call__` pops its own
        for i in range(len(running) - 1, -1, -1):
            if running[i].module is module:
                if running[i].by_hook:
                    _pop(running, i, checked=True)
                return

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        running = THREAD.running  # this thread's entries of this tap: their forwards go on unwatched
        for entry in running:
            if entry.tap is self:
                entry.forward, entry.mixers = None, []
        running[:] = [entry for entry in running if not (entry.tap is self and entry.by_hook)]

    def run_kernel(self, entry: _Running, kernel: Kernel, original: Callable[..., Any], args: tuple,
                   kwargs: dict) -> Any:
        """Run one kernel call for the attached mixers: unchanged when idle, else through the token loop."""
        try:
            return self._run_kernel(entry, kernel, original, args, kwargs)
        except Exception:
            entry.failed = True  # the forward stops here: its end is not checked
            raise
        except BaseException:
            # KeyboardInterrupt and the like skip the post-forward hook: end a forward it pushed here (`__call__`
            # pops its own).
            entry.failed = True
            running = THREAD.running
            if entry.by_hook and entry in running:
                _pop(running, running.index(entry), checked=False)
            raise

    def _run_kernel(self, entry: _Running, kernel: Kernel, original: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        arguments = type(entry.mixers[0])._kernel_arguments(entry.module, kernel, kernel.bind(args, kwargs))
        tokens = kernel.tokens(arguments, entry.forward.tokens)
        served = [kernel.serving(memory) for memory in kernel.memories]  # one row per memory the kernel updates
        states = [mixer.call_state.now() for mixer in entry.mixers]  # traced ones while torch.compile traces
        plans = [[state.plan(row, tokens) for state in states] for row in served]
        recompute = entry.forward.recompute
        records = set() if recompute else {name for mixer in entry.mixers for name in mixer.kernel_io}
        live_state = arguments.get(kernel.state_in) if isinstance(kernel.state_in, str) else None
        if "inputs" in records:
            _keep_memory_arguments(kernel, arguments)
        busy = [[plan for plan in per_memory if not plan.idle] for per_memory in plans]
        path = BOUND_KERNEL
        runner = None if any(busy) else _runners.runner_for(entry.mixers, kernel)
        if runner is not None:  # a study runs this call itself (`runners`)
            result, path = runner.run(kernel, original, args, kwargs), runner.path
        elif not any(busy):
            result = original(*args, **kwargs)
        else:
            result, path = self._run_busy(entry, kernel, original, args, kwargs, busy, tokens, arguments)
        output = kernel.name_results(result) if "outputs" in records else {}
        if kernel.in_place and isinstance(live_state, Tensor) and "outputs" in records:
            output["final_state"] = live_state.clone()
        part = KernelCall(kernel.name, arguments if "inputs" in records else None, output, path)
        for row, per_memory in zip(served, plans):
            for state, plan in zip(states, per_memory):
                state.store(plan, row, part, tokens)
        return result

    def _run_busy(self, entry: _Running, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict,
                  busy: list[list[Plan]], tokens: int, arguments: dict[str, Any]) -> tuple[Any, str]:
        """Run a kernel call that some plan wants something of (`busy`: per memory it updates, the busy plans),
        by the path its handles' policy picks, calling the plans at their tokens; returns its result and path."""
        takers = [_Taker(per_memory, tokens) for per_memory in busy]
        fast = _fast_path(kernel, busy[0], tokens, arguments) if len(busy) == 1 else None
        strategy = strategies.Strategy.LOOP if fast is None else fast.path
        extra = {"tokens": tokens} if kernel.seq == FORWARD else {}
        if len(busy) > 1:  # the second memory's hooks, writes and kept values (`Kernel.also`)
            extra["on_also"] = takers[1].on_token
        if "original" in kernel.layout.named:  # a loop that reads settings the kernel captured
            extra["original"] = original
        call = _busy.BusyCall(kernel, original, args, kwargs, busy, takers, arguments, fast, extra)
        result = _busy.RUNNERS[strategy](call)
        if kernel.memory == CONV_MEMORY and kernel.role == "prompt" and takers[0].last:
            self._sync_conv_cache(type(entry.mixers[0]), entry.forward, takers[0].last[0])
        for taker in takers:
            taker.finish()
        return result, strategy.value

    @staticmethod
    def _sync_conv_cache(kind: type[RecurrentMixer], forward: _Forward, window: Tensor) -> None:
        """The prompt path caches the raw last inputs before its conv kernel runs: cache the window as continued."""
        cache = forward.cache
        if cache is None or forward.cache_index is None:
            return
        cached = kind._cached_window(cache, forward.cache_index)
        if cached is not None and cached.shape == window.shape:
            cached.copy_(window)

    @staticmethod
    def run_fused(entry: _Running, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A fused whole-forward kernel: skipped (None, as without mamba_ssm) when a mixer wants this call."""
        # (a compiled graph serves every call: fused is skipped there if any call is wanted)
        if any(mixer.call_state.now().wants_call() for mixer in entry.mixers):
            return None
        return original(*args, **kwargs)


class _Sentinel:
    """Lives as long as a deep copy's memo (see `_Tap.__deepcopy__`)."""


def _drop_hooks(module: nn.Module, tap: _Tap) -> None:
    """Take the module hooks of `tap` (a copy's inert tap) off `module`."""
    state = vars(module)  # (a deep copy that failed may have left it without some of them)
    for hooks in (state.get("_forward_pre_hooks", {}), state.get("_forward_hooks", {})):
        for key in [key for key, hook in hooks.items() if getattr(hook, "__self__", None) is tap]:
            del hooks[key]
            for flags in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                state.get(flags, {}).pop(key, None)


class _Taker:
    """The `on_token` a busy kernel call hands its loop for one memory: the plans' hooks and writes at each token,
    and the kept states (in grad mode read through one zero leaf, filled by `finish` once the call is over)."""

    def __init__(self, busy: list[Plan], tokens: int) -> None:
        self.busy, self.tokens = busy, tokens
        self.keeping = [plan for plan in busy if plan.keep]
        self.storing = [plan for plan in self.keeping if plan.reduce is None]  # the states themselves
        self.reducing = [_Reduction(plan) for plan in self.keeping if plan.reduce is not None]
        self.kept_at = sorted(frozenset().union(*(plan.keep for plan in self.storing)))
        self.slot = {token: i for i, token in enumerate(self.kept_at)}
        # (under torch.compile, kept states are values: `compiled`)
        self.differentiable = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        # the states handed over are views of a block's buffer, which nothing changes later (`blocks`): a
        # reduction may hold them until its chunk is full
        self.borrowed = False
        # A state is one tensor or a NamedTuple of parts (`parts`): each step below is done part by part.
        self.buffer: list[State] = []  # grad mode: one leaf for every kept state of the call, zeros when read
        self.slots: list[State] = []  # its per-token views
        self.filled: dict[int, State] = {}  # slot -> the state it holds
        self.last: list[State] = []
        self.moved: set[torch.device] = set()  # devices kept values were copied from without blocking

    def on_token(self, token: int, state: State) -> State:
        for plan in self.busy:
            state = plan.apply(token, state)
        if token in self.slot:
            slot = self.slot[token]
            # a slice of a kernel's larger tensor: keep only the state itself
            state = map_parts(_own, state)
            # A tensor that only the later tokens read: the gradient with respect to a kept state is the
            # effect of changing it there (what a write does), not through token `token`'s own output.
            if self.differentiable:
                # ... read through a slot of one zero leaf, so that the stack of every kept state is a
                # tensor the forward used (autograd.grad(metric, mix.states)), with frozen weights too.
                # The slots come from one unbind: its backward stacks their gradients once (a slice
                # per token would add a whole-buffer gradient per token, quadratic in the tokens).
                if not self.buffer:
                    count = len(self.kept_at)
                    self.buffer.append(map_parts(lambda s: s.new_zeros((s.shape[0], count, *s.shape[1:]),
                                                                       requires_grad=True), state))
                    views = [part.unbind(1) for _, part in parts_of(self.buffer[0])]
                    self.slots.extend(rebuild(state, per_token) for per_token in zip(*views))
                state = map_parts(torch.add, state, self.slots[slot])
                self.filled[slot] = state  # copied into the leaf once the kernel call is over
            else:
                state = map_parts(lambda s: s.view_as(s), state)
            for plan in self.storing:
                if token in plan.keep:
                    plan.kept[token] = self._moved(plan, token, state)
        for reduction in self.reducing:
            if token in reduction.plan.keep:
                reduction.add(token, state if self.borrowed else map_parts(_own, state), self)
        if token == self.tokens - 1:
            self.last.append(state)
        return state

    def _moved(self, plan: Plan, token: int, value: State, graph: bool = False) -> State:
        """`value` on the plan's keep device (`watch(keep_device=...)`), copied without blocking (synchronized
        when the call is over). A state kept with gradients stays where the forward read it (`graph`: a
        reduction, whose copy keeps its graph)."""
        device = plan.device
        if device is None:
            return value
        source = parts_of(value)[0][1].device
        if source == device:
            return value
        if self.differentiable and not graph:
            raise InvalidValue(
                f"{plan.mixer}, call {plan.call}, token {token}: keep_device={str(device)!r} with gradients on: a"
                f" state kept in grad mode is the tensor the forward read (on {source}), which a copy on another"
                " device is not. Run the forward under torch.no_grad(), keep on the model's device (keep_device="
                "None), or keep a reduction (reduce=...), whose copy keeps its graph")
        if source.type != "cpu":
            self.moved.add(source)
        return map_parts(lambda s: s.to(device, non_blocking=True), value)

    def finish(self) -> None:
        """The kernel call is over: the leaf holds the kept states from now on (the forward read it as zeros);
        the last chunk of each reduction is reduced; copies made without blocking are waited for."""
        for reduction in self.reducing:
            reduction.flush(self)
        for plan in self.storing:  # (the chunk-wise states path keeps the states of a whole piece directly)
            if plan.device is not None:
                for token, value in plan.kept.items():
                    plan.kept[token] = self._moved(plan, token, value)
        for device in self.moved:
            torch.accelerator.synchronize(device)
        if self.buffer:
            with torch.no_grad():
                for i, state in self.filled.items():
                    map_parts(lambda leaf, s: leaf[:, i].copy_(s), self.buffer[0], state)
        for plan in self.keeping:
            if self.buffer and len(plan.keep) == len(self.kept_at) == self.tokens:
                plan.stacked = self.buffer[0]


class _Reduction:
    """A reducing plan's kept states of one kernel call, `CHUNK` tokens at a time: each full chunk
    `[batch, chunk, *state]` goes through the plan's `reduce` function, and the plan keeps, per token, its
    slice of the result (`[batch, ...]`). At most one chunk of states is held (O(chunk x state)). On the
    chunk-wise reductions' path (`_reduce_in_chunks`) the kernel's own chunks go to `reduce` directly."""

    CHUNK = _blocks.BLOCK

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.tokens: list[int] = []
        self.states: list[State] = []

    def add(self, token: int, state: State, taker: "_Taker") -> None:
        self.tokens.append(token)
        self.states.append(state)
        if len(self.tokens) == self.CHUNK:
            self.flush(taker)

    def flush(self, taker: "_Taker") -> None:
        if not self.tokens:
            return
        tokens, states = self.tokens, self.states
        self.tokens, self.states = [], []
        chunk = stack_parts(states, dim=1)  # [batch, chunk, *state]
        del states  # (the stacked copy is all `reduce` needs: the chunk's states are held once)
        self.reduce(tokens, chunk, taker)

    def reduce(self, tokens: "list[int] | range", chunk: State, taker: "_Taker", buffer: Tensor | None = None) -> None:
        """Keep, per token of `tokens`, its slice of the plan's `reduce(chunk)` (`chunk`: those tokens' states,
        `[batch, chunk, *state]`). `buffer`: the tensor `chunk` is a view of, which the kernel overwrites with the
        next chunk (`Segments.on_chunk`): a result in its memory (the chunk itself, or a view of it) is copied."""
        plan = self.plan
        where = f"{plan.mixer}, call {plan.call}, tokens {tokens[0]}..{tokens[-1]}: the reduction {_name(plan.reduce)}"
        with user_code(), noted(lambda: f"raised in {where}"):
            reduced = plan.reduce(chunk)
        del chunk
        for name, part in parts_of(reduced) if is_parts(reduced) else [("", reduced)]:
            if not isinstance(part, Tensor) or part.dim() < 2 or part.shape[1] != len(tokens):
                got = f"a tensor of shape {tuple(part.shape)}" if isinstance(part, Tensor) else type(part).__name__
                raise InvalidValue(f"{where} returned {got}{f' in part {name!r}' if name else ''}; expected a tensor"
                                   f" [batch, chunk, ...] with chunk = {len(tokens)} (a result per token of the"
                                   " chunk of states [batch, chunk, *state] it was given)")
        if buffer is not None:
            memory = buffer.untyped_storage().data_ptr()
            reduced = map_parts(lambda r: r.clone() if r.untyped_storage().data_ptr() == memory else r, reduced)
        self.keep(tokens, reduced, taker)

    def keep(self, tokens: "list[int] | range", reduced: State, taker: "_Taker") -> None:
        """Keep, per token of `tokens`, its slice of `reduced` (`[batch, chunk, ...]`, the chunk's results)."""
        plan = self.plan
        reduced = taker._moved(plan, tokens[0], reduced, graph=True)
        per_token = zip(*(part.unbind(1) for _, part in parts_of(reduced)))  # one view per token of each part
        plan.kept.update((token, rebuild(reduced, parts)) for token, parts in zip(tokens, per_token))


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _own(state: Tensor) -> Tensor:
    """A kept state of its own: a slice of a kernel's larger tensor is copied (a compiled graph copies always:
    it cannot ask for the storage)."""
    if torch.compiler.is_compiling() or state.untyped_storage().nbytes() > state.nbytes:
        return state.clone()
    return state


BOUND_KERNEL = "bound kernel"  # `KernelCall.path` of a call nothing was asked of: the kernel bound before the watch


def _fast_path(kernel: Kernel, busy: list[Plan], tokens: int,
               arguments: dict[str, Any] | None = None) -> strategies.Choice | None:
    """How a busy call runs (`strategies.choose` under the policy of its handles, `strategies.Paths`); None: the
    token loop. Handles whose policies differ (a watch and a standalone hook on one module) get the token loop."""
    paths = busy[0].mixer.paths
    for plan in busy[1:]:
        if plan.mixer.paths is not paths and plan.mixer.paths != paths:
            return None
    return strategies.choose(kernel, busy, tokens, arguments, paths=paths)



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
    """The innermost forward of this thread, if it is a watched one: the kernel called now belongs to it."""
    thread = THREAD
    if thread.in_hook or not thread.running:
        return None
    entry = thread.running[-1]
    return None if entry.forward is None else entry


def make_dispatcher(kind: type[RecurrentMixer]) -> Callable[[str, Any], Callable[..., Any]]:
    """For `acquire_kernels`: the function bound in place of kernel `name` of a module of mixer kind `kind`."""

    def make(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if name in kind.FUSED:

            @wraps_kernel(original)
            def watched(*args: Any, **kwargs: Any) -> Any:
                entry = running_entry()
                return original(*args, **kwargs) if entry is None else _Tap.run_fused(entry, original, args, kwargs)

        else:
            kernel = kind.kernel(name)

            @wraps_kernel(original)
            def watched(*args: Any, **kwargs: Any) -> Any:
                entry = running_entry()
                if entry is None:  # a call from outside a watched forward of this thread
                    return original(*args, **kwargs)
                return entry.tap.run_kernel(entry, kernel, original, args, kwargs)

        watched.__recurrent_hooks__ = True
        return watched

    return make

