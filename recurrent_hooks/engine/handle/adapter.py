"""A kind's adapter: the protocol by which the engine and the studies reach a kind's modules, cache and maths.

A kind (`kind.Kind`, the base of `RecurrentMixer`) declares constants; what the engine and the studies must ask of it
beyond them is its adapter, one `KindAdapter` per kind class, made with the kind and reached as `kind.adapter`
(`mixer.adapter` on a handle: the same object, the handle's one name for the whole protocol). The adapter reads the
kind's constants from `self.kind` (`FORWARD_CACHE`, `MEMORIES`, `LAYER_ATTRIBUTE`, ...), so one adapter class
serves every kind that extends another (`KimiDeltaAttention` runs `GatedDeltaNetAdapter` with its own constants).
A kind overrides by subclassing, in its own module, right before the kind class, and names its class `ADAPTER`:

    class MyKindAdapter(KindAdapter):                 # recurrent_hooks/kinds/my_kind.py
        def token_values(self, mixer, kernel_call):   # values() of one kernel call, from its kept inputs and outputs
            return {"beta": kernel_call.inputs["beta"]}

    class MyKind(RecurrentMixer):
        ADAPTER = MyKindAdapter
        KERNELS = (Kernel(name="my_chunk_rule", role=Role.PROMPT, loop=my_loop, state_in="initial_state", ...),)
        VALUES = {"beta": "batch seq heads"}

A kind that extends another inherits its `ADAPTER`, and where it overrides, subclasses it (a kind extending two,
`LoopedDynamicShortConvolution`, subclasses both adapters): `Kind.__init_subclass__` refuses an `ADAPTER` that is
no subclass of every base kind's, then makes `kind.adapter = ADAPTER(kind)` once.

The protocol, each method with a default that fits most kinds (override only the difference):
- `parse_forward(module, arguments)`: a forward's token count, cache, freshness and input;
- `cache_index(module, arguments)`, `cached(cache, where)`, `cached_window(cache, where)`,
  `cached_memory(cache, where, memory)`: where a forward's memory is in the cache, and reading it there;
  `pop_cache(arguments)`: the cache taken out of a whole forward's arguments;
- `kernel_arguments(module, kernel, arguments)`: a kernel call's arguments as `inputs` records them;
- `instances(module, model)`: the handles a watch makes for one module (one per pass of a looped module), and
  `serves(mixer, forward)`: whether a handle takes part in a forward (its own pass's);
- `kernel_calls(module)`: the recurrence kernel calls one forward makes: 1, or (`KERNEL_PER_HEAD`) its heads;
- `refusal(kernel)`, `restart(kernel, forward)`: why a kernel call cannot serve hooks, or restarts its memory;
- `head_channels(head, heads, head_state, channels)`: the convolution window channels that feed head `head`
  (a kind with `HEADS` and a window declares them; `patching_sweep(heads=True)` patches them with the head);
- `token_values(mixer, kernel_call)`: `values()` of one kernel call of `mixer`;
- `effective_attention(mixer, calls, dtype)`: the kind's effective-attention maths over `mixer`'s calls.
The methods that read one handle's records, module or cache index take the handle (`mixer`) as their first
argument; the others read only what they are given and the kind's constants. The adapter holds no handle.
"""

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..declare.kernels import CONV_MEMORY, STATE_MEMORY, Kernel
from ..errors import Unavailable
from ..tracking.records import Forward, KernelCall

if TYPE_CHECKING:
    from .kind import Kind


class KindAdapter:
    """The protocol a kind's adapter answers (see the module docstring), with the defaults that fit most kinds.

    rh.GatedDeltaNet.adapter                    # GatedDeltaNetAdapter(GatedDeltaNet)
    rh.GatedDeltaNet.adapter.cache_index(module, {})   # the module's layer_idx
    """

    def __init__(self, kind: "type[Kind]") -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind.__name__})"

    def parse_forward(self, module: nn.Module, arguments: dict[str, Any]) -> tuple[int, Any, bool, Tensor]:
        """From a mixer forward's arguments by name: its token count, its cache (or None), whether it starts
        from no cached memory (a prompt), and the input a checkpointed recompute is matched by."""
        extra = arguments.get("kwargs", {})
        cache = next(
            (found for name in self.kind.FORWARD_CACHE if (found := arguments.get(name, extra.get(name))) is not None),
            None,
        )
        hidden = arguments[self.kind.FORWARD_INPUT]
        where = self.cache_index(module, arguments)
        fresh = cache is None or where is None or self.cached(cache, where) is None
        return hidden.shape[1], cache, fresh, hidden

    def cache_index(self, module: nn.Module, arguments: dict[str, Any]) -> Any:
        """Where a forward's memory is in the cache, as `cached` takes it (None: nowhere): by default the module's
        layer (`LAYER_ATTRIBUTE`). A kind whose mixers share a cache layer (several windows per layer) or whose
        forward picks its cache layer returns more, e.g. `(cache_layer, state_index)`."""
        return getattr(module, self.kind.LAYER_ATTRIBUTE, None)

    def cached(self, cache: Any, where: Any) -> Tensor | None:
        """The cache's memory at `where` (`cache_index`; None: nothing cached yet)."""
        if self.kind.MEMORIES[0] == CONV_MEMORY:
            return self.cached_window(cache, where)
        return cache.get_recurrent_state(where)

    def cached_window(self, cache: Any, where: Any) -> Tensor | None:
        """The cache's convolution window at `where` (`cache_index`; None: nothing cached yet)."""
        return cache.get_conv_state(where)

    def cached_memory(self, cache: Any, where: Any, memory: str) -> Tensor | None:
        """The cache's tensor of `memory` at `where` (`cache_index`; None: nothing cached yet), the tensor itself:
        writing into it changes what the next call over the cache continues from."""
        if memory == CONV_MEMORY:
            return self.cached_window(cache, where)
        return self.cached(cache, where) if self.kind.MEMORIES[0] == STATE_MEMORY else cache.get_recurrent_state(where)

    def pop_cache(self, arguments: dict[str, Any]) -> Any:
        """Take the cache out of an owned forward's arguments (a kernel that is a whole forward): it comes under
        one of `FORWARD_CACHE`'s names, the first one given wins; the arguments kept do not hold it."""
        found = [arguments.pop(name, None) for name in self.kind.FORWARD_CACHE]
        return next((cache for cache in found if cache is not None), None)

    def kernel_arguments(self, module: nn.Module, kernel: Kernel, arguments: dict[str, Any]) -> dict[str, Any]:
        """A kernel call's arguments by name, as `inputs` records them and `Kernel.state_in` names them: the
        kernel's own, by default. A kind whose kernel reads its memory from elsewhere (a whole forward that
        reads the cache) overrides it to name that memory, and may leave out what should not be kept."""
        return arguments

    def instances(self, module: nn.Module, model: nn.Module) -> tuple[Any, ...]:
        """The handles a watch of `model` makes for `module`, as their `cache_index` (`cache_index` values): one,
        None (every forward), unless the module runs several times per model forward on distinct caches."""
        return (None,)

    def serves(self, mixer: Any, forward: Forward) -> bool:
        """Whether the handle `mixer` takes part in `forward`: its memory is at the handle's `cache_index` (a
        handle made with None, the default of `instances`, serves every forward of its module)."""
        return mixer.cache_index is None or forward.cache_index == mixer.cache_index

    def kernel_calls(self, module: nn.Module) -> int:
        """The recurrence kernel calls one forward of `module` makes: 1, or its heads for a `KERNEL_PER_HEAD` kind
        (a reduction of its states waits for the last head's kernel call, `visitor.HeldHeads`)."""
        return 1

    def refusal(self, kernel: Kernel) -> str | None:
        """Why this kernel call cannot serve hooks or kept states (None: it can)."""
        return None

    def restart(self, kernel: Kernel, forward: Forward) -> str | None:
        """Why this kernel call of `forward` starts its memory from zeros although the forward continues a cached
        one (None: it does not). Such a call runs as transformers runs it, its hooks, writes and kept states see
        the memory the model really started from, and one `RecurrentHooksWarning` per call says so."""
        return None

    def head_channels(self, head: int, heads: int, head_state: tuple[int, ...], channels: int) -> range | list[int]:
        """The window channels (of `channels`) that feed head `head` of `heads`, whose state is `head_state`
        (one head's state without the batch and head axes). A kind with `HEADS` and a window overrides it."""
        raise Unavailable(f"{self.kind.__name__} does not declare which window channels feed each head")

    def token_values(self, mixer: Any, kernel_call: KernelCall) -> dict[str, Tensor]:
        """`values()` of one kernel call of the handle `mixer`; each kind derives them from its kernel's arguments
        (lightning attention recomputes them with the handle's module)."""
        raise NotImplementedError(f"{self.kind.__name__}'s adapter declares no token_values")

    def effective_attention(self, mixer: Any, calls: range, dtype: torch.dtype) -> Any:
        """The exact effective attention (`effective.EffectiveAttention`) over the history `calls` of the handle
        `mixer`, from their kept inputs and outputs; a kind with the maths overrides this (`rh.effective_attention`
        checks the history)."""
        raise Unavailable(f"{mixer}: no effective attention for the kind {self.kind.__name__}")
