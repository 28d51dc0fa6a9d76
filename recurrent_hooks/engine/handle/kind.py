"""A kind's declaration: the protocol a `RecurrentMixer` subclass fills in, as class constants and class adapters.

    class MyKind(RecurrentMixer):          # recurrent_hooks/kinds/my_kind.py
        KERNELS = (Kernel(name="my_chunk_rule", role=Role.PROMPT, loop=my_loop, state_in="initial_state", ...),)
        STATE = "batch heads key_dim value_dim"
        VALUES = {"beta": "batch seq heads"}

        @classmethod
        def _token_values(cls, kernel_call):   # values() of one kernel call, from its kept inputs and outputs
            return {"beta": kernel_call.inputs["beta"]}

`Kind` is the base of `RecurrentMixer` (the user's handle, `mixer`): what a kind declares is read by the engine
from the class, never from a handle's per-call bookkeeping (`tracker`). A kind declares constants:
- `KERNELS`: the `Kernel`s its modeling modules call (recurrence and convolution, prompt and decode);
- `STATE`: the axes of the state, as a jaxtyping shape string (e.g. "batch heads key_dim value_dim"),
  or, for a state of several parts, a mapping part name -> axes, with `STATE_TYPE` the `NamedTuple`
  of tensors that hooks receive and writes take (see `memory_parts`); `CONV_STATE`: the convolution window's axes;
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
  tokens, and the names its cache may come under (`_parse_forward` reads them);
- `LAYER_ATTRIBUTE`: the mixer module's attribute that holds its decoder layer index (`mixer.layer`);
- `HEADS`: axis 1 of the state (of every part of it) counts heads that run independently, each reading only its
  own slice of the state (with `KERNEL_PER_HEAD`, the kernel calls of one forward are the heads); False: the
  state has no heads, and the studies' `heads=True` refuses the kind.
- `CONTINUES_CACHE`: a prompt call of several tokens over a cached memory continues from it in transformers'
  modeling code (the cached state goes into the prompt kernel, the cached window before the call's inputs), and
  the memories are the cache's tensors `_cached_memory` names: `patching_sweep` then runs the corrupt prompt once
  up to a position and each cell from that cache (False: Mamba-1, whose prompt scan takes no initial state, and
  the kinds whose memory is not in a transformers `Cache`).
- `LEFT_PADDING`: what the pads of a left-padded row do to its memories, one of `PADDING` (the keys): "masked"
  (the default: the modeling code zeroes the mixer's inputs at pads, so a row's memories after pads + t are the
  row's own after t, in any forward), "positions" (the memory restarts at the position id 0 that generate gives
  the row's first real token; a forward without position ids lets the pads in), "enters" (the model passes no mask
  to the mixer: the pads enter the memory, watched or not). `support` lists "left padding" as unavailable for the
  last two, in the kind's `LIMITS["left padding"]` words if it has them.

and may override the adapters (class methods, each with a default that fits most kinds):
- `_parse_forward(module, arguments)`: a forward's token count, cache, freshness and input;
- `_cache_index(module, arguments)`, `_cached(cache, where)`, `_cached_window(cache, where)`,
  `_cached_memory(cache, where, memory)`: where a forward's memory is in the cache, and reading it there;
- `_kernel_arguments(module, kernel, arguments)`: a kernel call's arguments as `inputs` records them;
- `_instances(module, model)`: the handles a watch makes for one module (one per pass of a looped module);
- `_refusal(kernel)`, `_restart(kernel, forward)`: why a kernel call cannot serve hooks, or restarts its memory;
- `_kernel_calls(module)`: the recurrence kernel calls one forward makes: 1, or (`KERNEL_PER_HEAD`) its heads;
- `_head_channels(head, heads, head_state, channels)`: the convolution window channels that feed head `head`
  (a kind with `HEADS` and a window declares them; `patching_sweep(heads=True)` patches them with the head);
- `_token_values(kernel_call)`: `values()` of one kernel call; `_effective_attention(calls, dtype)`: the kind's maths
  (this one reads the handle's records, so it is an instance method).
"""

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..declare.kernels import CONV_MEMORY, STATE_MEMORY, Kernel, Role
from ..errors import Unavailable
from ..tracking.records import Forward, KernelCall

# what the pads of a left-padded row do to a kind's memories (`Kind.LEFT_PADDING`), in support's general words
PADDING = {
    "masked": "the pads leave the memory at zero: a left-padded row's memories after pads + t are the row's own"
              " after t",
    "positions": "the memory restarts at the row's first real token only where the forward gets position ids from"
                 " the mask (generate does); a forward without them lets the pads in",
    "enters": "the model passes no mask to the mixer: the pads of a left-padded row enter its memory, watched or"
              " not (pad on the right, or run rows of one length)",
}


class Kind:
    """The declaration every mixer kind fills in (see the module docstring); `RecurrentMixer` is its handle."""

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
    HEADS: ClassVar[bool] = False
    CONTINUES_CACHE: ClassVar[bool] = False
    LEFT_PADDING: ClassVar[str] = "masked"  # a key of PADDING
    # the adapters: what the engine and the studies call on a kind, each kind overriding what it must; their names
    # begin with an underscore so that they stay off the researcher's handle (`w.mixers[i]`), and they are the only
    # underscore names one module of the package uses of another (tests/package/test_layout.py)
    ADAPTERS: ClassVar[tuple[str, ...]] = (
        "_parse_forward", "_cache_index", "_cached", "_cached_window", "_cached_memory", "_pop_cache",
        "_kernel_arguments", "_instances", "_refusal", "_restart", "_head_channels", "_token_values",
        "_effective_attention", "_serves", "_kernel_calls")

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
    def _cached_memory(cls, cache: Any, where: Any, memory: str) -> Tensor | None:
        """The cache's tensor of `memory` at `where` (`_cache_index`; None: nothing cached yet), the tensor itself:
        writing into it changes what the next call over the cache continues from."""
        if memory == CONV_MEMORY:
            return cls._cached_window(cache, where)
        return cls._cached(cache, where) if cls.MEMORIES[0] == STATE_MEMORY else cache.get_recurrent_state(where)

    @classmethod
    def _pop_cache(cls, arguments: dict[str, Any]) -> Any:
        """Take the cache out of an owned forward's arguments (a kernel that is a whole forward): it comes under
        one of `FORWARD_CACHE`'s names, the first one given wins; the arguments kept do not hold it."""
        found = [arguments.pop(name, None) for name in cls.FORWARD_CACHE]
        return next((cache for cache in found if cache is not None), None)

    @classmethod
    def _kernel_arguments(cls, module: nn.Module, kernel: Kernel, arguments: dict[str, Any]) -> dict[str, Any]:
        """A kernel call's arguments by name, as `inputs` records them and `Kernel.state_in` names them: the
        kernel's own, by default. A kind whose kernel reads its memory from elsewhere (a whole forward that
        reads the cache) overrides it to name that memory, and may leave out what should not be kept."""
        return arguments

    @classmethod
    def _instances(cls, module: nn.Module, model: nn.Module) -> tuple[Any, ...]:
        """The handles a watch of `model` makes for `module`, as their `cache_index` (`_cache_index` values): one,
        None (every forward), unless the module runs several times per model forward on distinct caches."""
        return (None,)

    @classmethod
    def _kernel_calls(cls, module: nn.Module) -> int:
        """The recurrence kernel calls one forward of `module` makes: 1, or its heads for a `KERNEL_PER_HEAD` kind
        (a reduction of its states waits for the last head's kernel call, `visitor.HeldHeads`)."""
        return 1

    @classmethod
    def _refusal(cls, kernel: Kernel) -> str | None:
        """Why this kernel call cannot serve hooks or kept states (None: it can)."""
        return None

    @classmethod
    def _restart(cls, kernel: Kernel, forward: "Forward") -> str | None:
        """Why this kernel call of `forward` starts its memory from zeros although the forward continues a cached
        one (None: it does not). Such a call runs as transformers runs it, its hooks, writes and kept states see
        the memory the model really started from, and one `RecurrentHooksWarning` per call says so."""
        return None

    @classmethod
    def _head_channels(cls, head: int, heads: int, head_state: tuple[int, ...], channels: int) -> range | list[int]:
        """The window channels (of `channels`) that feed head `head` of `heads`, whose state is `head_state`
        (one head's state without the batch and head axes). A kind with `HEADS` and a window overrides it."""
        raise Unavailable(f"{cls.__name__} does not declare which window channels feed each head")

    @classmethod
    def _token_values(cls, kernel_call: KernelCall) -> dict[str, Tensor]:
        """`values()` of one kernel call; each kind derives them from its kernel's arguments."""
        raise NotImplementedError

    def _effective_attention(self, calls: range, dtype: torch.dtype) -> Any:
        """The exact effective attention (`effective.EffectiveAttention`) over the history `calls`, from their
        kept inputs and outputs; a kind with the maths overrides this (`rh.effective_attention` checks the history)."""
        raise Unavailable(f"{self}: no effective attention for the kind {type(self).__name__}")
