"""Dispatch: which mixer a kernel call belongs to, and how it runs (the bound kernel, segments, the loop).

Module contents:
- `make_owner` (`forwards`'): for `rebinding.acquire_kernels`, the `__call__` bound on a mixer class: every forward
  of an instance, watched or not, pushes its `forwards.Running` entry on its thread's stack and pops it on the way
  out; a kernel call belongs to the innermost entry (`running_entry`). No stack frame is read.
- `attach(mixer)`: attach a `RecurrentMixer` to its module's `_Tap` (a module pre-forward hook that fills the
  forward's entry in).
- `make_dispatcher(kind)`: for `rebinding.acquire_kernels`, the function bound in place of each kernel.
- `_Tap.run_kernel`: the plans of the attached mixers decide: nothing wanted runs the bound kernel; a busy
  call takes the path `choose.choose` picks under its handles' policy (`_fast_path`, `policy.Paths`) and runs by
  that path's runner (`runners.RUNNERS`; the paths are listed in `policy.Strategy`). The path taken is recorded
  (`KernelCall.path`).
"""

import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ..binding.upstream import wraps_kernel
from ..declare.kernels import CONV_MEMORY, FORWARD, Kernel, Layout
from ..declare.memory_parts import map_parts
from ..handle.mixer import RecurrentMixer, note_unseen, sees
from ..paths import runners as _busy
from ..paths.choose import choose
from ..paths.visitor import Taker
from ..policy import Choice, Strategy
from ..tracing import compiling
from ..tracking.records import Forward, KernelCall
from ..tracking.threads import THREAD, in_backward
from ..tracking.tracker import Plan
from . import takeover as _takeover
from .forwards import Running, drop_left, pop, running_entry


def _forward_of(
    kind: type[RecurrentMixer], layout: Layout, module: nn.Module, args: tuple, kwargs: dict[str, Any], recompute: bool
) -> Forward:
    """Tokens, cache and freshness of a mixer forward, from its arguments."""
    arguments = layout.bind(args, kwargs)
    tokens, cache, fresh, hidden = kind.adapter.parse_forward(module, arguments)
    return Forward(
        tokens=tokens,
        cache=cache,
        fresh=fresh,
        hidden=hidden,
        recompute=recompute,
        cache_index=kind.adapter.cache_index(module, arguments),
        training=module.training,
        kernel_calls=kind.adapter.kernel_calls(module),
    )


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
    one `RecurrentMixer` is attached. The mixer class's `__call__` pushes the forward's `forwards.Running` entry
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
            entry = Running(module, None, None, [], by_hook=True)  # before the watch)
            running.append(entry)
        entry.tap = self
        if any(other.by_hook and other.module is module for other in running[:-1]):
            drop_left(running, module)
        traced = compiling()
        recompute = in_backward()
        ident = None if traced else threading.get_ident()
        mixers = [mixer for mixer in self.mixers if sees(mixer, ident, recompute)]
        if len(mixers) != len(self.mixers):  # a watch entered in another thread: it warns on exit
            note_unseen(self.mixers, ident)
        if not mixers or any(other.module is module for other in running[:-1]):
            return  # unwatched here, or re-entered
        forward = _forward_of(type(mixers[0]), self._layout, module, args, kwargs, recompute)
        mixers = [mixer for mixer in mixers if mixer.adapter.serves(mixer, forward)]  # a handle per pass: its own
        if not mixers:
            return
        entry.forward, entry.mixers = forward, mixers
        for mixer in mixers:
            mixer.tracker.now().begin(forward)
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
                    pop(running, i, checked=True)
                return

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        running = THREAD.running  # this thread's entries of this tap: their forwards go on unwatched
        for entry in running:
            if entry.tap is self:
                entry.forward, entry.mixers = None, []
        running[:] = [entry for entry in running if not (entry.tap is self and entry.by_hook)]

    def run_kernel(
        self, entry: Running, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
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
                pop(running, running.index(entry), checked=False)
            raise

    def _run_kernel(
        self, entry: Running, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        arguments = entry.mixers[0].adapter.kernel_arguments(entry.module, kernel, kernel.bind(args, kwargs))
        tokens = kernel.tokens(arguments, entry.forward.tokens)
        served = [kernel.serving(memory) for memory in kernel.memories]  # one row per memory the kernel updates
        trackers = [mixer.tracker.now() for mixer in entry.mixers]  # traced ones while torch.compile traces
        plans = [[tracker.plan(row, tokens) for tracker in trackers] for row in served]
        recompute = entry.forward.recompute
        records = set() if recompute else {name for mixer in entry.mixers for name in mixer.kernel_io}
        live_state = arguments.get(kernel.state_in) if isinstance(kernel.state_in, str) else None
        if "inputs" in records:
            _keep_memory_arguments(kernel, arguments)
        busy = [[plan for plan in per_memory if not plan.idle] for per_memory in plans]
        path = BOUND_KERNEL
        takeover = None if any(busy) else _takeover.takeover_for(entry.mixers, kernel)
        if takeover is not None:  # a study runs this call itself (`takeover`)
            result, path = takeover.run(kernel, original, args, kwargs), takeover.path
        elif not any(busy):
            result = original(*args, **kwargs)
        else:
            result, path = self._run_busy(entry, kernel, original, args, kwargs, busy, tokens, arguments)
            if entry.mixers[0].tracker.handed_on(kernel.memory):  # (eager: a compiled graph runs no split)
                result = _own_final_state(kernel, result)
        output = kernel.name_results(result) if "outputs" in records else {}
        if kernel.in_place and isinstance(live_state, Tensor) and "outputs" in records:
            output["final_state"] = live_state.clone()
        kernel_call = KernelCall(kernel.name, arguments if "inputs" in records else None, output, path)
        for row, per_memory in zip(served, plans):
            for tracker, plan in zip(trackers, per_memory):
                tracker.store(plan, row, kernel_call, tokens)
        return result

    def _run_busy(
        self,
        entry: Running,
        kernel: Kernel,
        original: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        busy: list[list[Plan]],
        tokens: int,
        arguments: dict[str, Any],
    ) -> tuple[Any, str]:
        """Run a kernel call that some plan wants something of (`busy`: per memory it updates, the busy plans),
        by the path its handles' policy picks, calling the plans at their tokens; returns its result and path."""
        takers = [Taker(per_memory, tokens) for per_memory in busy]
        fast = _fast_path(kernel, busy[0], tokens, arguments) if len(busy) == 1 else None
        path = Strategy.LOOP if fast is None else fast.path
        extra = {"tokens": tokens} if kernel.seq == FORWARD else {}
        if len(busy) > 1:  # the second memory's hooks, writes and kept values (`Kernel.also`)
            extra["on_also"] = takers[1].on_token
        if "original" in kernel.layout.named:  # a loop that reads settings the kernel captured
            extra["original"] = original
        call = _busy.BusyCall(kernel, original, args, kwargs, busy, takers, arguments, fast, extra)
        result = _busy.RUNNERS[path](call)
        if kernel.memory == CONV_MEMORY and kernel.role == "prompt" and takers[0].last:
            self._sync_conv_cache(type(entry.mixers[0]), entry.forward, takers[0].last[0])
        for taker in takers:
            taker.finish()
        return result, path.label

    @staticmethod
    def _sync_conv_cache(kind: type[RecurrentMixer], forward: Forward, window: Tensor) -> None:
        """The prompt path caches the raw last inputs before its conv kernel runs: cache the window as continued."""
        cache = forward.cache
        if cache is None or forward.cache_index is None:
            return
        cached = kind.adapter.cached_window(cache, forward.cache_index)
        if cached is not None and cached.shape == window.shape:
            cached.copy_(window)

    @staticmethod
    def run_fused(entry: Running, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A fused whole-forward kernel: skipped (None, as without mamba_ssm) when a mixer wants this call."""
        # (a compiled graph serves every call: fused is skipped there if any call is wanted)
        if any(mixer.tracker.now().wants_call() for mixer in entry.mixers):
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
            for flags in (
                "_forward_pre_hooks_with_kwargs",
                "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called",
            ):
                state.get(flags, {}).pop(key, None)


def _own_final_state(kernel: Kernel, result: Any) -> Any:
    """`result` with its final state copied: a split forward's next kernel call updates that state in place
    (transformers' one-token steps after the prompt kernel), and the busy call's final state may be a kept state or
    a write's value, which must not change."""
    if not isinstance(result, tuple) or "final_state" not in kernel.results:
        return result
    at = kernel.results.index("final_state")
    if at >= len(result) or result[at] is None:
        return result
    return (*result[:at], map_parts(lambda s: s.clone(), result[at]), *result[at + 1 :])


BOUND_KERNEL = "bound kernel"  # `KernelCall.path` of a call nothing was asked of: the kernel bound before the watch


def _fast_path(kernel: Kernel, busy: list[Plan], tokens: int, arguments: dict[str, Any] | None = None) -> Choice | None:
    """How a busy call runs (`choose.choose` under the policy of its handles, `policy.Paths`); None: the token loop.
    Handles whose policies differ (a watch and a standalone hook on one module) get the token loop."""
    paths = busy[0].owner.policy.paths
    for plan in busy[1:]:
        if plan.owner.policy.paths is not paths and plan.owner.policy.paths != paths:
            return None
    return choose(kernel, busy, tokens, arguments, paths=paths)


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
        mixer.mark_attached()

    def detach() -> None:
        with _LOCK:
            if mixer in tap.mixers:
                tap.mixers = [m for m in tap.mixers if m is not mixer]
                if not tap.mixers:
                    tap.remove()
                    owner = tap._module()
                    if owner is not None and _TAPS.get(owner) is tap:
                        del _TAPS[owner]

    return detach


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
