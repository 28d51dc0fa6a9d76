"""Dispatch: which mixer a kernel call belongs to, and how it runs (the bound kernel, segments, the loop).

Module contents:
- `attach(mixer)`: attach a `RecurrentMixer` to its module's `_Tap` (module pre/post-forward hooks).
- `make_dispatcher(kind)`: for `patching.acquire_kernels`, the function bound in place of each kernel.
- `_Tap.run_kernel`: the plans of the attached mixers decide: nothing wanted runs the bound kernel; a busy
  call takes the path `strategies.choose` picks under its handles' policy (`_fast_path`, `strategies.Paths`): the bound kernel in
  segments between the stops (`_run_in_segments`, a piece maybe ending in a token loop from its last chunk
  boundary), or the library's loop with `stops` for a kernel that computes fast between stops itself
  (`Kernel.stops`); every state kept without gradients can run the chunk-wise kernel, and a hook on every token
  the chunk-wise kernel a block at a time (`blocks.run_in_blocks`); otherwise the token loop runs, calling
  the plans after each token. The path taken is recorded (`KernelCall.path`).
"""

import dataclasses
import functools
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import blocks as _blocks
from . import runners as _runners
from . import strategies
from .calls import KernelCall
from .kernels import CONV_MEMORY, FORWARD, Kernel, Layout, Pieces
from .mixer import RecurrentMixer, _Forward, _Plan
from .parts import State, map_parts, parts_of, rebuild
from .families import family_of
from .threads import THREAD, in_backward


def _forward_of(kind: type[RecurrentMixer], layout: Layout, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                recompute: bool) -> _Forward:
    """Tokens, cache and freshness of a mixer forward, from its arguments."""
    arguments = layout.bind(args, kwargs)
    tokens, cache, fresh, hidden = kind._parse_forward(module, arguments)
    return _Forward(tokens=tokens, cache=cache, fresh=fresh, hidden=hidden, recompute=recompute,
                    cache_index=kind._cache_index(module, arguments))


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
    running[:] = [entry for entry in running if id(entry.module) in live]
    for entry in stale:
        _end(entry, checked=False)


def _end(entry: _Running, checked: bool) -> None:
    for mixer in entry.mixers:
        mixer._end_call(checked=checked)


def _pop(running: list[_Running], i: int) -> None:
    """End and remove entry `i` of a thread's stack, and the stale entries above it (forwards an interrupt
    ended without their post-forward hook)."""
    entry, stale = running[i], running[i + 1:]
    del running[i:]
    for other in stale:
        _end(other, checked=False)
    _end(entry, checked=not entry.failed)


class _Tap:
    """The per-module side of the mechanism: module hooks, and the mixers attached to the module.

    One tap per mixer module, shared by every watch and standalone hook on it; it exists while at least
    one `RecurrentMixer` is attached. Its pre-forward hook pushes a `_Running` entry on the running
    thread's stack, its post-forward hook pops it; a kernel call is handled by the innermost entry of its
    thread, and only when the module that calls the kernel is that entry's module.
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
            return  # a forward run by a user's hook: not watched, not counted (its post hook skips it too)
        compiling = torch.compiler.is_compiling()
        if thread.running and not compiling:
            _drop_stale(thread.running, module)
        recompute = in_backward()
        ident = None if compiling else threading.get_ident()
        mixers = [mixer for mixer in self.mixers if mixer._sees(ident, recompute)]
        if not mixers or any(entry.module is module for entry in thread.running):
            thread.running.append(_Running(self, module, None, []))  # unwatched here, or re-entered
            return
        forward = _forward_of(type(mixers[0]), self._layout, module, args, kwargs, recompute)
        mixers = [mixer for mixer in mixers if mixer._serves(forward)]  # a handle per pass: only its own
        if not mixers:
            thread.running.append(_Running(self, module, None, []))
            return
        entry = _Running(self, module, forward, mixers)
        for mixer in mixers:
            mixer._begin_call(forward)
        forward.hidden = None  # read by _begin_call; a forward's record must not hold its input
        thread.running.append(entry)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.copied:
            _drop_hooks(module, self)
            return
        thread = THREAD
        if thread.in_hook:
            return
        running = thread.running
        for i in range(len(running) - 1, -1, -1):
            if running[i].module is module:
                _pop(running, i)
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
                _pop(running, running.index(entry))
            raise

    def _run_kernel(self, entry: _Running, kernel: Kernel, original: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        arguments = type(entry.mixers[0])._kernel_arguments(entry.module, kernel, kernel.bind(args, kwargs))
        tokens = kernel.tokens(arguments, entry.forward.tokens)
        served = [kernel.serving(memory) for memory in kernel.memories]  # one row per memory the kernel updates
        plans = [[mixer._plan(row, tokens) for mixer in entry.mixers] for row in served]
        recompute = entry.forward.recompute
        records = set() if recompute else {name for mixer in entry.mixers for name in mixer.records}
        live_state = arguments.get(kernel.state_in) if isinstance(kernel.state_in, str) else None
        if "inputs" in records:
            for name in kernel.state_arguments:
                value = arguments.get(name)
                # The cache (or the model's state list) updates these tensors in place, at the next step or in
                # this very call: keep their values. A memory may come as a tuple or list of tensors (RWKV).
                if isinstance(value, Tensor):
                    arguments[name] = value.clone()
                elif isinstance(value, (tuple, list)):
                    arguments[name] = type(value)(part.clone() if isinstance(part, Tensor) else part for part in value)
        busy = [[plan for plan in per_memory if not plan.idle] for per_memory in plans]
        path = BOUND_KERNEL
        runner = None if any(busy) else _runners.runner_for(entry.mixers, kernel)
        if runner is not None:  # a study runs this call itself (`runners`)
            result, path = runner.run(kernel, original, args, kwargs), runner.path
        elif not any(busy):
            result = original(*args, **kwargs)
        else:
            takers = [_Taker(per_memory, tokens) for per_memory in busy]
            fast = _fast_path(kernel, busy[0], tokens, arguments) if len(served) == 1 else None
            path = strategies.Path.LOOP.value if fast is None else fast.path.value
            on_token = takers[0].on_token
            extra = {"tokens": tokens} if kernel.seq == FORWARD else {}
            if len(served) > 1:  # the second memory's hooks, writes and kept values (`Kernel.also`)
                extra["on_also"] = takers[1].on_token
            if "original" in kernel.layout.named:  # a loop that reads settings the kernel captured
                extra["original"] = original
            if fast is not None and fast.path is strategies.Path.BLOCKS:  # the states chunk-wise, a block at a time
                result = _blocks.run_in_blocks(kernel, args, kwargs, on_token)
            elif fast is not None and kernel.segments is None:  # the loop computes fast between the stops itself
                result = kernel.loop(*args, on_token=on_token, stops=fast.stops, **extra, **kwargs)
            elif fast is not None:
                result = _run_in_segments(kernel, original, args, kwargs, fast.stops, fast.tails, on_token,
                                          [plan for plan in takers[0].keeping if fast.every_state])
            else:
                result = kernel.loop(*args, on_token=on_token, **extra, **kwargs)
            if kernel.memory == CONV_MEMORY and kernel.role == "prompt" and takers[0].last:
                self._sync_conv_cache(type(entry.mixers[0]), entry.forward, takers[0].last[0])
            for taker in takers:
                taker.finish()
        output = kernel.name_results(result) if "outputs" in records else {}
        if kernel.in_place and isinstance(live_state, Tensor) and "outputs" in records:
            output["final_state"] = live_state.clone()
        part = KernelCall(kernel.name, arguments if "inputs" in records else None, output, path)
        for row, per_memory in zip(served, plans):
            for mixer, plan in zip(entry.mixers, per_memory):
                mixer._store(plan, row, part, tokens)
        return result

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
        compiled = torch.compiler.is_compiling()  # a graph serves every call: fused is skipped if any is wanted
        if any(mixer._wants_some() if compiled else mixer._wants(mixer._index) for mixer in entry.mixers):
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

    def __init__(self, busy: list[_Plan], tokens: int) -> None:
        self.busy, self.tokens = busy, tokens
        self.keeping = [plan for plan in busy if plan.keep]
        self.kept_at = sorted(frozenset().union(*(plan.keep for plan in self.keeping)))
        self.slot = {token: i for i, token in enumerate(self.kept_at)}
        # (under torch.compile, kept states are values: `compiled`)
        self.differentiable = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        # A state is one tensor or a NamedTuple of parts (`parts`): each step below is done part by part.
        self.buffer: list[State] = []  # grad mode: one leaf for every kept state of the call, zeros when read
        self.slots: list[State] = []  # its per-token views
        self.filled: dict[int, State] = {}  # slot -> the state it holds
        self.last: list[State] = []

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
            for plan in self.keeping:
                if token in plan.keep:
                    plan.kept[token] = state
        if token == self.tokens - 1:
            self.last.append(state)
        return state

    def finish(self) -> None:
        """The kernel call is over: the leaf holds the kept states from now on (the forward read it as zeros)."""
        if self.buffer:
            with torch.no_grad():
                for i, state in self.filled.items():
                    map_parts(lambda leaf, s: leaf[:, i].copy_(s), self.buffer[0], state)
        for plan in self.keeping:
            if self.buffer and len(plan.keep) == len(self.kept_at) == self.tokens:
                plan.stacked = self.buffer[0]


def _own(state: Tensor) -> Tensor:
    """A kept state of its own: a slice of a kernel's larger tensor is copied (a compiled graph copies always:
    it cannot ask for the storage)."""
    if torch.compiler.is_compiling() or state.untyped_storage().nbytes() > state.nbytes:
        return state.clone()
    return state


BOUND_KERNEL = "bound kernel"  # `KernelCall.path` of a call nothing was asked of: the kernel bound before the watch


def _fast_path(kernel: Kernel, busy: list[_Plan], tokens: int,
               arguments: dict[str, Any] | None = None) -> strategies.Choice | None:
    """How a busy call runs (`strategies.choose` under the policy of its handles, `strategies.Paths`); None: the
    token loop. Handles whose policies differ (a watch and a standalone hook on one module) get the token loop."""
    paths = busy[0].mixer.paths
    for plan in busy[1:]:
        if plan.mixer.paths is not paths and plan.mixer.paths != paths:
            return None
    return strategies.choose(kernel, busy, tokens, arguments, paths=paths)


def _run_in_segments(kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict, stops: list[int],
                     tails: tuple[tuple[int, int], ...], on_token: Callable[[int, Tensor], Tensor],
                     keeping_all: list[_Plan]) -> Any:
    """Run `original` on the tokens between the stops, chaining the state through `on_token` at each stop.

    The token ranges `tails` (`[start, end)`, each inside one piece and ending it) run through the library's
    token loop instead, from the piece's last chunk boundary to its stop (`strategies.Choice.tails`). With
    `keeping_all`, the pieces run through the kernel's chunk-wise `all_states` version instead, and the
    states of the tokens between the stops go to those plans. `Segments.kernel`, when given, runs the
    pieces in place of `original` (which cannot start from a state).
    """
    segments = kernel.segments
    run = segments.all_states if keeping_all else segments.kernel or original
    pieces = Pieces(kernel, args, kwargs)
    state = pieces.state
    looped = dict(tails)  # start -> end of each range the token loop runs
    outputs = []
    start = 0
    for end in sorted({*(stop + 1 for stop in stops), *looped, pieces.tokens}):
        if end <= start:
            continue
        leading, named = pieces.call(start, end, state)
        if keeping_all:
            (out, state), states = run(*leading, **named)
            for plan in keeping_all:
                plan.kept.update((start + i, states[i]) for i in range(end - start))
        elif looped.get(start) == end:
            out, state = kernel.loop(*leading, **named)
        else:
            out, state = run(*leading, **named)
        outputs.append(out)
        if end - 1 in stops:
            state = on_token(end - 1, state)  # the state after the stop, as the token loop would hand it over
        start = end
    return pieces.result(outputs, state)


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
    if torch.compiler.is_compiling():
        return entry
    caller = _calling_module(sys._getframe(2))
    if caller is not None and caller is not entry.module and family_of(caller) is not None:
        return None  # another mixer's forward (an unwatched model run inside this one): not ours
    return entry


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

