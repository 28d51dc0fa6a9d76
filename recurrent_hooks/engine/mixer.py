"""The shared mechanism of every recurrent mixer: calls, the call counter, hooks, writes and kept values.

Vocabulary (docs/concepts.md has the long form):
- mixer: one recurrent sequence-mixing module of a model (e.g. `Qwen3_5GatedDeltaNet` at layer 0).
  `RecurrentMixer` is the library's handle on it, one per mixer and watch.
- call: one forward of the mixer module. Inside a `watch`, call 0 is the first forward of that
  mixer in the block (the prompt); in `generate`, decode step k is call k.
- token: a position inside a call, counted from the call's own first token.
- kernel: a module-global function the mixer's forward calls; the library rebinds it (see
  `patching`) to a dispatcher that knows which mixer is running.
- memory: what a mixer carries from token to token: its recurrent `state` and the window of its
  causal convolution, `window`. Each kernel updates one of them (`Kernel.memory`), or both (`Kernel.also`:
  a whole forward that carries two, zaya's CCA).

Where this module sits: the package's layers are drawn in docs/architecture.md (and listed in
`recurrent_hooks/__init__.py`); the engine's modules in `recurrent_hooks/engine/__init__.py`. This module holds
`RecurrentMixer`, the user's handle on a mixer and the base class of the kinds, with its hooks, writes and call
counter, and `_Plan`, what one handle wants of one kernel call.

How a kernel call is handled: the mixer class's `__call__`, rebound for the watch, pushes a `_Running` entry
on the running thread's stack (`THREAD.running`) for every forward of an instance, watched or not, and pops it
in a `finally`; the module's forward pre-hook fills it in and starts a call on every attached `RecurrentMixer`
that sees that thread. The dispatcher bound in place of the kernel takes the innermost entry (an unwatched
model run inside a watched forward has its own entries, and calls its own kernels untouched; so does code
inside a user's hook, `THREAD.in_hook`). Each attached mixer says what it wants of this kernel call (a
`_Plan`). Then:
- nothing is wanted: the kernel bound before the watch runs unchanged;
- only a few tokens are wanted: that kernel runs in segments between them (`_run_in_segments`),
  chaining the state, and `_Plan.apply` runs at each stop (a kernel declared with `Kernel.stops` gets
  the stops and computes between them itself);
- every state is kept, without gradients: the kind's chunk-wise `Segments.all_states` kernel runs;
- otherwise the library's token loop runs and calls `_Plan.apply` after each token's update.
In grad mode, kept states are read through one zero leaf per kernel call (`Call.differentiable`).
A forward that autograd recomputes (gradient checkpointing) is matched to the call it repeats by the
fingerprint of its input (`_Replay`) and runs that call's plan again, keeping nothing new.
"""

import collections
import dataclasses
import itertools
import math
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .errors import InvalidValue, RecurrentHooksError, RecurrentHooksWarning, Unavailable, renamed
from .arguments import _as_targets, _describe_calls, _describe_token, _RowTokens, as_calls, as_index, normalize_keep
from . import compiled as _compiled
from .calls import Call, KernelCall, Memory, _position
from .kernels import CONV_MEMORY, KEEP_NAMES, STATE_MEMORY, Kernel, Role, memory_name
from .parts import State, axes_of, describe, is_parts, map_parts, not_a_tensor, parts_of
from .strategies import DEFAULT as _DEFAULT_PATHS
from .strategies import Paths
from .threads import user_code


# A state hook: fn(mixer, call, token, state) -> None (keep the state) or a replacement tensor.
StateHook = Callable[["RecurrentMixer", int, int, Tensor], Tensor | None]


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
        self._key = _compiled.register_hook(self)  # how a compiled graph's ops find it

    def targets(self, call: int | None) -> bool:
        return call is not None and (self.calls is None or call in self.calls)

    @property
    def targets_some(self) -> bool:
        """It targets some call (what a compiled graph, traced for every call, must provide for)."""
        return self.calls is None or len(self.calls) > 0

    @property
    def explicit(self) -> bool:
        """It names finitely many calls: a token outside such a call is an error, not a skip."""
        return isinstance(self.calls, frozenset) or (isinstance(self.calls, range) and self.calls.stop < sys.maxsize)

    def missed(self, seen: int) -> list[int]:
        """The first few calls it targets that a mixer which saw `seen` calls never reached (open ranges:
        none): at most `_SHOWN + 1`, so that a message can say there are more."""
        if not self.explicit:
            return []
        targeted = self.calls if isinstance(self.calls, range) else sorted(self.calls)
        return list(itertools.islice((c for c in targeted if c >= seen), _SHOWN + 1))


# how a memory is read and written, for messages
_ACCESSORS = {STATE_MEMORY: "state_after, set_state_after", CONV_MEMORY: "window_after, set_window_after"}
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


@dataclasses.dataclass
class _Forward:
    """What the library needs to know of one forward of a mixer module."""

    tokens: int  # hidden_states.shape[1]
    cache: Any  # the transformers Cache, or None
    fresh: bool  # no cached state for this layer: the call starts from zeros (a prompt)
    hidden: Tensor | None = None  # the forward's input, read only to match a recompute to its call
    cache_index: Any = None  # where its memory is in the cache (the kind's `_cache_index`: by default the layer)
    recompute: bool = False  # autograd is recomputing a checkpointed forward (this is not a new call)


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
    - `STATE`: the axes of the state, as a jaxtyping shape string (e.g. "batch heads key_dim value_dim"),
      or, for a state of several parts, a mapping part name -> axes, with `STATE_TYPE` the `NamedTuple`
      of tensors that hooks receive and writes take (see `parts`);
    - `INPUTS`, `OUTPUTS`: the recurrence kernels' named values with their axes, for the docs;
    - `VALUES`: the per-token values `values()` returns, with their axes;
    - `LIMITS`: what cannot be had from this kind, and why (reported by `support`);
    - `FUSED`: names of fused whole-forward kernels (if its module has them) that return the mixer's
      output and skip the kernels above; inside a watch they return None, as their pure-torch
      versions do, for a call that has hooks or kept states, so that the forward goes on;
    - `REORDERED_BY_CACHE`: beam search's `cache.reorder_cache` moves this kind's memory rows (True for
      the kinds whose memory is in the cache's layers); False: it leaves them in place, so `call.reorder`
      stays None (each row continues its own row), and `support` lists "beam search" as unavailable
      (with the kind's `LIMITS["beam search"]` if it says why);
    - `KERNEL_PER_HEAD`: the forward calls its recurrence kernel once per head (axis 1 of the state):
      hooks run once per head with that head's state, and `mixer.head` says which head is running;
    - `ROUTES`: the words `route_kernels` accepts for this kind, each meaning "torch" or "default";
    - `MEMORIES`: the memories the kind's mixers carry, the one every watched call updates first
      (`state`, `window`; a short convolution has only `window`);
    - `FORWARD_INPUT`, `FORWARD_CACHE`: the mixer forward's argument whose axis 1 counts the call's
      tokens, and the names its cache may come under (`_parse_forward` reads them; a kind whose
      forward differs overrides it);
    - `LAYER_ATTRIBUTE`: the mixer module's attribute that holds its decoder layer index (`mixer.layer`).

    `recomputing` is True while autograd recomputes a checkpointed forward of this mixer (gradient
    checkpointing): hooks run again then, with the call index of the forward being recomputed.
    """

    KERNELS: ClassVar[tuple[Kernel, ...]] = ()
    STATE: ClassVar[str | dict[str, str]] = ""
    STATE_TYPE: ClassVar[type | None] = None  # a NamedTuple of tensors, for a state of several parts
    CONV_STATE: ClassVar[str] = "batch channels kernel_size"
    INPUTS: ClassVar[dict[str, str]] = {}
    OUTPUTS: ClassVar[dict[str, str]] = {}
    VALUES: ClassVar[dict[str, str]] = {}
    LIMITS: ClassVar[dict[str, str]] = {}
    FUSED: ClassVar[tuple[str, ...]] = ()
    KERNEL_PER_HEAD: ClassVar[bool] = False
    REORDERED_BY_CACHE: ClassVar[bool] = True
    # route_kernels' words for this kind: word -> "torch" (the library's token loops) or "default" (transformers')
    ROUTES: ClassVar[dict[str, str]] = {"torch": "torch", "default": "default"}
    MEMORIES: ClassVar[tuple[str, ...]] = (STATE_MEMORY, CONV_MEMORY)
    FORWARD_INPUT: ClassVar[str] = "hidden_states"
    FORWARD_CACHE: ClassVar[tuple[str, ...]] = ("cache", "cache_params")
    LAYER_ATTRIBUTE: ClassVar[str] = "layer_idx"
    # how this handle's busy calls pick their path (`Paths`; `watch(model, paths=...)`, `register_state_hook`)
    paths: Paths = _DEFAULT_PATHS

    def __init__(self, module: nn.Module, family: str, *,
                 keep: Sequence[str] | Mapping[str, Iterable[int] | None] = (), history: bool = True,
                 restart_on_prompt: bool = False, thread: int | None = None, layer: int | None = None,
                 cache_index: Any = None) -> None:
        self._module = weakref.ref(module)  # a standalone hook must not keep its module alive
        self.family = family
        # the module's own layer_idx; else `layer`, the watch's reading of the module's path (a mixer module
        # that does not store its index, e.g. "model.layers.3.temporal_block")
        self.layer: int | None = getattr(module, self.LAYER_ATTRIBUTE, layer)
        self.keep, self.kernel_io = normalize_keep(keep)
        self.calls: list[Call] = []
        self.head: int | None = None  # the head of the running recurrence kernel call (KERNEL_PER_HEAD kinds)
        self.recomputing = False  # the running forward is a checkpointed forward being recomputed
        self._history = history  # False: a standalone hook's handle, which records no calls
        self._thread = thread  # the thread whose forwards this handle sees (None: every thread)
        # the forwards this handle takes part in: those whose memory is at this cache index (`_cache_index`;
        # None: every forward of the module). A module run several times per model forward, each time on its
        # own cache layer, has one handle per run (`_instances`)
        self.cache_index = cache_index
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
        # keep at some tokens: memory -> the asked positions some call had, and the first calls' lengths (for
        # the warning on exit about positions outside every call, `unkept`)
        self._keep_reached: dict[str, set[int]] = {}
        self._keep_lengths: dict[str, list[tuple[int, int]]] = {}
        self._live = False  # attached to its module's tap
        self._key = _compiled.register_mixer(self)  # how a compiled graph's ops find this handle (`compiled`)

    @property
    def module(self) -> nn.Module:
        """The transformers mixer module this handle watches."""
        module = self._module()
        if module is None:
            raise RecurrentHooksError(f"{self}: its module has been garbage-collected")
        return module

    @classmethod
    def kernel_for(cls, role: "Role | str", memory: str | None = None) -> Kernel:
        """The declared kernel that serves `role` ("prompt" or "decode") for `memory` (default: the kind's
        first memory); a kernel declared for both roles serves either, one that updates two memories both.

            rh.Mamba2StateSpace.kernel_for("prompt").name   # "mamba2_chunk_scan"
        """
        role, memory = Role(role), memory or cls.MEMORIES[0]
        for kernel in cls.KERNELS:
            if memory in kernel.memories and kernel.role in (role, Role.BOTH):
                return kernel.serving(memory)
        raise KeyError(f"{cls.__name__} declares no {role.value} kernel for its {memory}")

    @classmethod
    def kernel(cls, name: str) -> Kernel:
        """The declared kernel called `name`."""
        for kernel in cls.KERNELS:
            if kernel.name == name:
                return kernel
        raise KeyError(f"{cls.__name__} declares no kernel {name!r}; it has {[k.name for k in cls.KERNELS]}")

    @classmethod
    def _parse_forward(cls, module: nn.Module, arguments: dict[str, Any]) -> tuple[int, Any, bool, Tensor]:
        """From a mixer forward's arguments by name: its token count, its cache (or None), whether it starts
        from no cached memory (a prompt), and the input a checkpointed recompute is matched by."""
        extra = arguments.get("kwargs", {})
        cache = next((found for name in cls.FORWARD_CACHE
                      if (found := arguments.get(name, extra.get(name))) is not None), None)
        hidden = arguments[cls.FORWARD_INPUT]
        where = cls._cache_index(module, arguments)
        fresh = cache is None or where is None or cls._cached(cache, where) is None
        return hidden.shape[1], cache, fresh, hidden

    @classmethod
    def _cache_index(cls, module: nn.Module, arguments: dict[str, Any]) -> Any:
        """Where a forward's memory is in the cache, as `_cached` takes it (None: nowhere): by default
        the module's layer (`LAYER_ATTRIBUTE`). A kind whose mixers share a cache layer (several windows per layer)
        or whose forward picks its cache layer returns more, e.g. `(cache_layer, state_index)`."""
        return getattr(module, cls.LAYER_ATTRIBUTE, None)

    @classmethod
    def _cached(cls, cache: Any, where: Any) -> Tensor | None:
        """The cache's memory at `where` (`_cache_index`; None: nothing cached yet)."""
        if cls.MEMORIES[0] == CONV_MEMORY:
            return cls._cached_window(cache, where)
        return cache.get_recurrent_state(where)

    @classmethod
    def _cached_window(cls, cache: Any, where: Any) -> Tensor | None:
        """The cache's convolution window at `where` (`_cache_index`; None: nothing cached yet)."""
        return cache.get_conv_state(where)

    @classmethod
    def _kernel_arguments(cls, module: nn.Module, kernel: Kernel, arguments: dict[str, Any]) -> dict[str, Any]:
        """A kernel call's arguments by name, as `inputs` records them and `Kernel.state_in` names them: the
        kernel's own, by default. A kind whose kernel reads its memory from elsewhere (a whole forward that
        reads the cache) overrides it to name that memory, and may leave out what should not be kept."""
        return arguments

    def _has(self, memory: str, method: str) -> None:
        if memory not in self.MEMORIES:
            carried = " and ".join(self.MEMORIES)
            raise Unavailable(f"{self}.{method}: a {type(self).__name__} mixer has no {memory}; it carries only"
                              f" {carried} ({', '.join(_ACCESSORS[m] for m in self.MEMORIES)})")

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

    @property
    def conv_states(self) -> Float[Tensor, "batch seq channels kernel_size"]:
        """The former name of `windows`."""
        renamed("RecurrentMixer.conv_states", "RecurrentMixer.windows")
        return self.windows

    def state_after(self, token: int, call: int | None = None) -> Float[Tensor, "batch *state"]:
        """The state after `token` (negative counts from the end) of call `call` (default: the last call).

        It is the state token+1 continues from: a write or hook at `token` is included. The tensor is
        the one the recurrence used, so `torch.autograd.grad(metric, mix.state_after(t))` works (for
        KERNEL_PER_HEAD kinds it is a stack of the heads' states; take gradients through a written leaf).
        """
        where = f"{self}.state_after"
        self._has(STATE_MEMORY, "state_after")
        return self._call(call, "state_after")._after(STATE_MEMORY, as_index(token, "token", where))

    def window_after(self, token: int, call: int | None = None) -> Float[Tensor, "batch channels kernel_size"]:
        """The convolution window after `token` of call `call`: the last kernel_size conv inputs, oldest
        first, in the layout of transformers' cache; token+1 reads its last kernel_size-1 columns."""
        where = f"{self}.window_after"
        self._has(CONV_MEMORY, "window_after")
        return self._call(call, "window_after")._after(CONV_MEMORY, as_index(token, "token", where))

    def conv_state_after(self, token: int, call: int | None = None) -> Float[Tensor, "batch channels kernel_size"]:
        """The former name of `window_after`."""
        renamed("RecurrentMixer.conv_state_after", "RecurrentMixer.window_after")
        return self.window_after(token, call)

    def memory_after(self, token: int, call: int | None = None) -> Memory:
        """The whole memory after `token`: `Memory(state, window)` (needs both kept; a memory the kind
        does not carry is None)."""
        return Memory(*(getter(token, call) if memory in self.MEMORIES else None for memory, getter in
                        ((STATE_MEMORY, self.state_after), (CONV_MEMORY, self.window_after))))

    def values(self, call: int | None = None) -> dict[str, Tensor]:
        """The per-token values of call `call` (default: the last), token-major, named as in `VALUES`.

            mix.values()["dt"]     # Mamba: the step after bias and softplus, [batch, seq, d_inner]

        Computed from the kernel's kept inputs and outputs (`keep=("inputs", "outputs")`; no states
        needed). Mixers that run their kernel once per head stack the heads on the axis after `seq`.
        """
        record = self._call(call, "values")
        if not record.kernel_calls:
            raise Unavailable(f"{self}: call {record.index} made no recurrence kernel call")
        for part in record.kernel_calls:
            record._recorded(part.inputs, "inputs"), record._recorded(part.output, "outputs")
        per_part = [self._token_values(part) for part in record.kernel_calls]
        if len(per_part) == 1:
            return per_part[0]
        return {name: torch.stack([values[name] for values in per_part], dim=2) for name in per_part[0]}

    @classmethod
    def _token_values(cls, part: KernelCall) -> dict[str, Tensor]:
        """`values()` of one kernel call; each kind derives them from its kernel's arguments."""
        raise NotImplementedError

    def _effective_attention(self, calls: range, dtype: torch.dtype) -> Any:
        """The exact effective attention (`effective.EffectiveAttention`) over the history `calls`, from their
        kept inputs and outputs; a kind with the maths overrides this (`rh.effective_attention` checks the history)."""
        raise Unavailable(f"{self}: no effective attention for the kind {type(self).__name__}")

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
                            token: int | Iterable[int] | None = None, which: str | None = None) -> RemovableHandle:
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
        `which="window"` hooks the convolution window instead (`[batch, channels, kernel_size]`).
        The default is the kind's first memory (`MEMORIES[0]`): the state, or the window of a kind that
        carries only a window (a short convolution).
        """
        where = f"{self}.register_state_hook"
        which = self.MEMORIES[0] if which is None else memory_name(which, where)
        if not callable(fn):
            raise InvalidValue(f"{where}: expected a callable fn(mixer, call, token, state), got {fn!r}")
        if which not in (STATE_MEMORY, CONV_MEMORY):
            raise InvalidValue(f"{where}: expected which='state' or which='window', got {which!r}")
        self._has(which, "register_state_hook")
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

    def set_window_after(self, token: int, value: Tensor, call: "int | Iterable[int] | slice | None" = 0
                         ) -> RemovableHandle:
        """Replace the convolution window after `token` of call `call` by `value` (`[batch, channels,
        kernel_size]`, the cache's layout and dtype): tokens token+1.. read it, and so does the cache."""
        return self._add_hooks(self._write(CONV_MEMORY, token, value, call, "set_window_after"))

    def set_conv_state_after(self, token: int, value: Tensor, call: "int | Iterable[int] | slice | None" = 0
                             ) -> RemovableHandle:
        """The former name of `set_window_after`."""
        renamed("RecurrentMixer.set_conv_state_after", "RecurrentMixer.set_window_after")
        return self.set_window_after(token, value, call)

    def set_memory_after(self, token: int, memory: Memory, call: "int | Iterable[int] | slice | None" = 0
                         ) -> RemovableHandle:
        """Write the whole memory after `token` (state and conv window), e.g. kept in another run.

            with rh.watch(model, keep=("states", "windows")) as a:
                model(ids_a)
            with rh.watch(model) as b:
                b.mixers[0].set_memory_after(7, a.mixers[0].memory_after(7))
                model(ids_b)   # from token 8 on, layer 0 continues exactly as in run A
        """
        if not isinstance(memory, tuple) or len(memory) != 2:
            raise InvalidValue(f"{self}.set_memory_after({token!r}, call={call!r}): expected a Memory(state,"
                               f" window), got {type(memory).__name__}")
        parts = [(name, value) for name, value in zip((STATE_MEMORY, CONV_MEMORY), memory) if name in self.MEMORIES]
        return self._add_hooks(*(self._write(name, token, value, call, "set_memory_after") for name, value in parts))

    def _write(self, memory: str, token: Any, value: Tensor, call: Any, method: str) -> _Hook:
        where = f"{self}.{method}({_describe_token(token)}, call={call!r})"
        self._has(memory, method)
        axes = describe(self.STATE if memory == STATE_MEMORY else self.CONV_STATE)
        calls = as_calls(call, where)
        wanted = self.STATE_TYPE if memory == STATE_MEMORY and self.STATE_TYPE is not None else Tensor
        if not isinstance(value, wanted):
            raise InvalidValue(f"{where}: expected a {wanted.__name__} with axes ({axes}), got {type(value).__name__}")
        if (wrong := not_a_tensor(value, self.STATE if memory == STATE_MEMORY else self.CONV_STATE)) is not None:
            raise InvalidValue(f"{where}: {wrong}")
        rows = _RowTokens.of(token, where) if isinstance(token, Tensor) and token.dim() > 0 else None
        tokens = rows.tokens if rows is not None else (as_index(token, "token", where),)

        def write(mixer: RecurrentMixer, call: int, token: int, state: State) -> State:
            written = value if mixer.head is None else map_parts(lambda v: v[:, mixer.head], value)
            if rows is None or any(w.shape != s.shape or w.dtype != s.dtype or w.device != s.device
                                   for (_, w), (_, s) in zip(parts_of(written), parts_of(state))):
                return written  # a write of the whole batch, or a value the check will refuse with its message
            batch = parts_of(state)[0][1].shape[0]
            at = rows.at(token, mixer._tokens, batch, f"{mixer}, call {call}, token {token}: {method}")
            return map_parts(lambda w, s: torch.where(at.to(s.device).view(-1, *(1,) * (s.dim() - 1)), w, s),
                             written, state)

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

    def unkept(self) -> list[str]:
        """Positions of `keep` outside every call this mixer saw, which kept nothing (reported when a watch ends)."""
        problems = []
        for memory, wanted in self.keep.items():
            lengths = self._keep_lengths.get(memory)
            missed = [t for t in wanted or () if t not in self._keep_reached.get(memory, set())]
            if not lengths or not missed:
                continue
            name = KEEP_NAMES[memory]
            shown = "; ".join(f"call {call}: {tokens} token{'s' if tokens != 1 else ''}"
                              for call, tokens in lengths[:_SHOWN]) + ("; ..." if len(lengths) > _SHOWN else "")
            at = ", ".join(f"token {t}" for t in missed)
            problems.append(f"keep={{{name!r}: {list(wanted)}}} kept nothing at {at} on {self}: outside every call it"
                            f" saw ({shown})")
        return problems

    # -- the call counter (driven by the tap's pre-forward hook and the class's `__call__`) -----------------------------------------------

    def _refusal(self, kernel: Kernel) -> str | None:
        """Why this kernel call cannot serve hooks or kept states (None: it can); kinds override it."""
        return None

    def _restart(self, kernel: Kernel) -> str | None:
        """Why this kernel call starts its memory from zeros although its forward continues a cached one
        (None: it does not); kinds override it. Such a call runs as transformers runs it, its hooks, writes
        and kept states see the memory the model really started from, and one `RecurrentHooksWarning` per
        call says so (`_warn_restart`)."""
        return None

    def _warn_restart(self, index: int | None, kernel: str, reason: str) -> None:
        """Say once, for call `index` (it has hooks, writes or kept values), that the model restarted its memory."""
        warnings.warn(f"{self}, call {index} ({kernel}): {reason}", RecurrentHooksWarning, stacklevel=2)

    def _wants(self, index: int | None) -> bool:
        """Whether call `index` has hooks, writes or kept values (None: a recompute of an idle call)."""
        return index is not None and (bool(self.keep) or bool(self.kernel_io)
                                      or any(hook.targets(index) for hook in self._all_hooks()))

    def _wants_some(self) -> bool:
        """Whether some call has hooks, writes or kept values (a compiled graph serves every call)."""
        return bool(self.keep) or bool(self.kernel_io) or any(hook.targets_some for hook in self._all_hooks())

    @classmethod
    def _instances(cls, module: nn.Module, model: nn.Module) -> tuple[Any, ...]:
        """The handles a watch of `model` makes for `module`, as their `cache_index` (`_cache_index` values): one,
        None (every forward), unless the module runs several times per model forward on distinct caches."""
        return (None,)

    def _serves(self, forward: "_Forward") -> bool:
        """Whether this handle takes part in `forward` (its memory is at this handle's cache index)."""
        return self.cache_index is None or forward.cache_index == self.cache_index

    def _sees(self, thread: int | None, recompute: bool) -> bool:
        """Whether this handle takes part in a forward running in `thread` (a recompute runs where autograd runs
        it; None: a compiled forward, whose thread cannot be told)."""
        return recompute or thread is None or self._thread is None or self._thread == thread

    def _begin_call(self, forward: _Forward) -> None:
        self._forward = forward
        self._kernel_calls = {}
        self.head = None
        self.recomputing = forward.recompute
        if _compiled.compiling():
            # counted when the graph runs (`compiled`); a compiled beam search reports no `reorder` (a compiled
            # forward cannot wrap the cache's method), and a compiled backward recomputes no forward of ours
            self.recomputing = False
            _compiled.begin(self, forward.fresh, forward.tokens)
            return
        if forward.recompute:
            self._index, self._current = self._replayed(forward)
            return
        reorder = None
        if self._history:
            reorder, self._reorder = (self._reorder, None) if not forward.fresh else (None, None)
        self._count_call(forward.fresh, forward.tokens, reorder)
        if self._history and forward.cache is not None and self._saw_cache is not None:
            self._saw_cache(forward.cache)
        if forward.hidden is not None and (torch.is_grad_enabled() or self.module.training) \
                and self._wants(self._index):
            # Autograd may recompute this forward (gradient checkpointing): remember how to recognize it.
            self._replays.append(_Replay(self._index, self._current, tuple(forward.hidden.shape),
                                         _fingerprint(forward.hidden)))

    def _count_call(self, fresh: bool, tokens: int, reorder: Tensor | None) -> None:
        """A new call begins (not a recompute): count it and open its record."""
        self._begun += 1
        if self._restart_on_prompt and fresh:
            self._offset = self._begun - 1
        self._index = self._begun - 1 - self._offset
        self._current = None
        if self._history:
            # one counter: a watch's handle never restarts, so call k is self.calls[k]
            self._current = Call(index=self._index, where=repr(self), tokens=tokens, reorder=reorder)
            self.calls.append(self._current)

    def _reordered(self, beam_idx: Tensor) -> None:
        """The cache's rows were reordered (beam search): the next call's row b continues row beam_idx[b]."""
        if not self.REORDERED_BY_CACHE:
            return  # the cache's reordering leaves this kind's memory where it is
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
        primary = self.MEMORIES[0]
        wants = self._wants_some() if _compiled.compiling() else self._wants(self._index)
        if checked and self._kernel_calls.get(primary, 0) == 0 and wants:
            raise RecurrentHooksError(
                f"{self}: call {'?' if _compiled.compiling() else self._index} finished without calling a watched kernel"
                f" ({', '.join(k.name for k in self.KERNELS if k.memory == primary)}) although hooks or kept"
                " values target it; the mixer took a path the library cannot see (a fused kernel, or a forward"
                " this transformers version changed)"
            )

    def _plan(self, kernel: Kernel, tokens: int) -> "_Plan":
        self._tokens = tokens
        part = self._kernel_calls.get(kernel.memory, 0)
        self._kernel_calls[kernel.memory] = part + 1
        self.head = part if self.KERNEL_PER_HEAD and kernel.memory == STATE_MEMORY else None
        compiled = _compiled.compiling()  # a graph traced once for every call: which calls are targeted is
        index = None if compiled else self._index  # told when it runs (`compiled`)
        if index is None and not compiled:
            return _Plan(self, index, [], None)
        wants = self._wants_some() if compiled else self._wants(index)
        if wants and (reason := self._refusal(kernel)) is not None:
            raise Unavailable(f"{self}, call {'?' if compiled else index} ({kernel.name}): {reason}")
        if wants and part == 0 and (reason := self._restart(kernel)) is not None:
            if compiled:  # told when the graph runs, to the calls it serves that want something
                _compiled.restarted(self, kernel.name, reason)
            else:
                self._warn_restart(index, kernel.name, reason)
        hooks: list[tuple[_Hook, frozenset[int] | None]] = []  # registration order, with absolute positions
        for hook in self._all_hooks():
            if hook.memory != kernel.memory or not (hook.targets_some if compiled else hook.targets(index)):
                continue
            if hook.tokens is None:
                hooks.append((hook, None))
                continue
            outside = [t for t in hook.tokens if _position(t, tokens) is None]
            if outside and hook.explicit:
                if compiled:
                    _compiled.outside(self, hook, outside[0], tokens, kernel.name)
                else:
                    self._refuse_outside(hook, outside[0], tokens, kernel.name)
            positions = frozenset(p for t in hook.tokens if (p := _position(t, tokens)) is not None)
            if positions:
                hooks.append((hook, positions))
        keep = None
        if kernel.memory in self.keep:
            wanted = self.keep[kernel.memory]
            keep = frozenset(range(tokens)) if wanted is None else frozenset(
                p for t in wanted if (p := _position(t, tokens)) is not None)
            if wanted is not None and not compiled:
                self._keep_reached.setdefault(kernel.memory, set()).update(
                    t for t in wanted if _position(t, tokens) is not None)
                lengths = self._keep_lengths.setdefault(kernel.memory, [])
                if len(lengths) <= _SHOWN and (not lengths or lengths[-1][0] != index):
                    lengths.append((index, tokens))
        return _Plan(self, index, hooks, keep)

    def _refuse_outside(self, hook: _Hook, token: int, tokens: int, kernel: str) -> None:
        raise InvalidValue(
            f"{self}: {hook.origin} targets token {token}, but call {self._index} ({kernel}) has {tokens}"
            f" token{'s' if tokens != 1 else ''} (valid: 0..{tokens - 1} or -{tokens}..-1)"
        )

    def _store(self, plan: "_Plan", kernel: Kernel, part: KernelCall, tokens: int) -> None:
        inputs = part.inputs if "inputs" in self.kernel_io else None
        output = part.output if "outputs" in self.kernel_io else None
        if _compiled.compiling():
            if self._history:  # filed in the call's record when the graph runs
                _compiled.store(self, kernel.memory, kernel.name, plan.kept, inputs, output, part.path)
            return
        record = self._current
        if record is None:
            return
        if self.recomputing:
            self._store_recomputed(plan, kernel, record)
            return
        # the positions the kernel ran over, per memory: the forward's input's, except where transformers' own
        # bug makes them differ (rwkv's batched decode); the call's tokens are its first memory's
        record._ran[kernel.memory] = tokens
        if kernel.memory == self.MEMORIES[0]:
            record.tokens = tokens
        self._file(kernel.memory, kernel.name, plan.kept, inputs, output, plan.stacked, path=part.path)

    def _file(self, memory: str, kernel: str, kept: "dict[int, State] | None", inputs: dict[str, Any] | None,
              output: dict[str, Any] | None, stacked: State | None = None, path: str = "bound kernel") -> None:
        """File one kernel call in the running call's record: its inputs and outputs, its path, and the states it kept."""
        record = self._current
        if record is None:
            return
        part = KernelCall(kernel, inputs, output, path)
        if memory == CONV_MEMORY:
            record.conv = part
        else:
            record.kernel_calls.append(part)
        if kept is not None:
            record._kept.setdefault(memory, []).append(kept)
            record._buffers.setdefault(memory, []).append(stacked)
            record._positions[memory] = self.keep[memory]
            record._stacked.pop(memory, None)

    def _run_hook(self, hook: _Hook, call: int | None, token: int, state: State, *, replaces: bool = True) -> State:
        """Call hook or write `hook` at `token`; returns the state token+1 continues from (checked)."""
        if hook.write:
            replacement = hook.fn(self, call, token, state)
        else:
            with user_code():
                replacement = hook.fn(self, call, token, state)
        if replacement is None or replacement is state:
            return state
        if not replaces:
            raise RecurrentHooksError(
                f"{self}, call {call}, token {token}: {hook.origin} returned a replacement inside a compiled graph"
                " with gradients on, where hooks can only read (a replacement would cut the gradient); under"
                " torch.no_grad() a hook may replace, and a write (set_state_after) works either way")
        state = _checked(replacement, state, self, hook, call, token)
        self._note_replaced(hook, token)
        return state

    def _note_replaced(self, hook: _Hook, token: int) -> None:
        record = self._current
        if record is not None and not self.recomputing:
            record._replaced.setdefault(hook.memory, set()).add(token)

    def _store_recomputed(self, plan: "_Plan", kernel: Kernel, record: Call) -> None:
        """A recompute keeps nothing new, except where the call's own forward ran without gradients
        (reentrant checkpointing): its kept states are then replaced by the recomputed, differentiable
        ones, whose `.grad` is retained for `loss.backward()`."""
        kept = record._kept.get(kernel.memory)
        part = self._kernel_calls[kernel.memory] - 1
        if plan.kept is None or kept is None or part >= len(kept):
            return
        for token, state in plan.kept.items():
            if _requires_grad(state) and token in kept[part] and not _requires_grad(kept[part][token]):
                map_parts(lambda s: s.retain_grad(), state)
                kept[part][token] = state
                record._buffers[kernel.memory][part] = None  # the recomputed states are read one by one
        record._stacked.pop(kernel.memory, None)


class _Plan:
    """What one attached mixer wants of one kernel call: its hooks (in registration order) and kept tokens."""

    __slots__ = ("mixer", "call", "hooks", "keep", "kept", "stacked", "compiled")

    def __init__(self, mixer: RecurrentMixer, call: int | None, hooks: list[tuple[_Hook, frozenset[int] | None]],
                 keep: frozenset[int] | None):
        self.mixer, self.call, self.hooks, self.keep = mixer, call, hooks, keep
        self.kept: dict[int, Tensor] | None = None if keep is None else {}
        self.stacked: Tensor | None = None  # every token kept in grad mode: the leaf the forward read them through
        self.compiled = _compiled.compiling()  # traced into a graph: hooks run through its ops (`compiled`)

    @property
    def idle(self) -> bool:
        return not self.hooks and not self.keep

    def apply(self, token: int, state: Tensor) -> Tensor:
        for hook, positions in self.hooks:
            if positions is None or token in positions:
                if self.compiled:
                    state = _compiled.run_hook(self.mixer, hook, token, state)
                else:
                    state = self.mixer._run_hook(hook, self.call, token, state)
        return state


def _requires_grad(state: State) -> bool:
    return any(part.requires_grad for _, part in parts_of(state))


def _checked(replacement: Any, state: State, mixer: RecurrentMixer, hook: _Hook, call: int, token: int) -> State:
    where = f"{mixer}, call {call}, token {token}: {hook.origin}"
    if mixer.head is not None:
        where += f" (head {mixer.head} of a kernel run once per head)"
    wanted = type(state) if is_parts(state) else Tensor
    declared = mixer.STATE if hook.memory == STATE_MEMORY else mixer.CONV_STATE
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
                raise InvalidValue(f"{where} gave a {what_part} with {what} {given}, expected {expected} (axes: {axes})")
    return replacement


