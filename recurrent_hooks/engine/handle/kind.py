"""A kind's declaration: the protocol a `RecurrentMixer` subclass fills in, as class constants and its adapter.

    class MyKind(RecurrentMixer):          # recurrent_hooks/kinds/my_kind.py
        ADAPTER = MyKindAdapter            # its adapter class (`adapter.KindAdapter`), defined right before it
        KERNELS = (Kernel(name="my_chunk_rule", role=Role.PROMPT, loop=my_loop, state_in="initial_state", ...),)
        STATE = "batch heads key_dim value_dim"
        VALUES = {"beta": "batch seq heads"}

`Kind` is the base of `RecurrentMixer` (the user's handle, `mixer`): what a kind declares is read by the engine
from the class, never from a handle's per-call bookkeeping (`tracker`). A kind declares constants:
- `KERNELS`: the `Kernel`s its modeling modules call (recurrence and convolution, prompt and decode);
- `STATE`: the axes of the state, as a jaxtyping shape string (e.g. "batch heads key_dim value_dim"),
  or, for a state of several parts, a mapping part name -> axes, with `STATE_TYPE` the `NamedTuple`
  of tensors that hooks receive and writes take (see `memory_parts`); `CONV_STATE`: the convolution window's axes;
- `INPUTS`, `OUTPUTS`: the recurrence kernels' named values with their axes, for the docs;
- `VALUES`: the per-token values `values()` returns, with their axes;
- `LIMITS`: what works only with a caveat (`Caveat`) or is refused (`Refused`, with the errors raised), what -> why
  (`declare.limits`; `support` lists them in those two sections);
- `FUSED`: names of fused whole-forward kernels (if its module has them) that return the mixer's
  output and skip the kernels above; inside a watch they return None, as their pure-torch
  versions do, for a call that has hooks or kept states, so that the forward goes on;
- `REORDERED_BY_CACHE`: beam search's `cache.reorder_cache` moves this kind's memory rows (True for
  the kinds whose memory is in the cache's layers); False: it leaves them in place, so `call.reorder`
  stays None (each row continues its own row), and `support` lists "beam search" as a caveat
  (in the kind's `LIMITS["beam search"]` if it says why);
- `KERNEL_PER_HEAD`: the forward calls its recurrence kernel once per head (axis 1 of the state):
  hooks run once per head with that head's state, and `mixer.head` says which head is running;
- `ROUTES`: the words `route_kernels` accepts for this kind, each meaning "torch" or "default";
- `MEMORIES`: the memories the kind's mixers carry, the one every watched call updates first
  (`state`, `window`; a short convolution has only `window`);
- `FORWARD_INPUT`, `FORWARD_CACHE`: the mixer forward's argument whose axis 1 counts the call's
  tokens, and the names its cache may come under (its adapter's `parse_forward` reads them);
- `LAYER_ATTRIBUTE`: the mixer module's attribute that holds its decoder layer index (`mixer.layer`);
- `HEADS`: axis 1 of the state (of every part of it) counts heads that run independently, each reading only its
  own slice of the state (with `KERNEL_PER_HEAD`, the kernel calls of one forward are the heads); False: the
  state has no heads, and the studies' `heads=True` refuses the kind.
- `CONTINUES_CACHE`: a prompt call of several tokens over a cached memory continues from it in transformers'
  modeling code (the cached state goes into the prompt kernel, the cached window before the call's inputs), and
  the memories are the cache's tensors its adapter's `cached_memory` names: `patching_sweep` then runs the corrupt
  prompt once up to a position and each cell from that cache (False: Mamba-1, whose prompt scan takes no initial
  state, and the kinds whose memory is not in a transformers `Cache`).
- `LEFT_PADDING`: what the pads of a left-padded row do to its memories, one of `PADDING` (the keys): "masked"
  (the default: the modeling code zeroes the mixer's inputs at pads, so a row's memories after pads + t are the
  row's own after t, in any forward), "positions" (the memory restarts at the position id 0 that generate gives
  the row's first real token; a forward without position ids lets the pads in), "enters" (the model passes no mask
  to the mixer: the pads enter the memory, watched or not). `support` lists "left padding" as a caveat for the
  last two, in the kind's `LIMITS["left padding"]` words if it has them.

and its adapter (`ADAPTER`, a subclass of `adapter.KindAdapter`, whose module docstring lists the protocol: how a
forward, its cache and its kernel calls are read, `values()` and the effective-attention maths), which the engine and
the studies reach as `kind.adapter`, made once per kind class: the handle carries that one name, not the protocol.
"""

from typing import Any, ClassVar

from ..declare.kernels import CONV_MEMORY, STATE_MEMORY, Kernel, Role
from .adapter import KindAdapter

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
    # its adapter (`adapter.KindAdapter`: the protocol the engine and the studies call): the class, which a kind that
    # overrides a method subclasses from its base kind's, and `adapter`, the instance made with the kind once per kind
    # class (`__init_subclass__`), the one name of the protocol on the researcher's handle (`w.mixers[i].adapter`)
    ADAPTER: ClassVar[type[KindAdapter]] = KindAdapter
    adapter: ClassVar[KindAdapter]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make the kind's adapter, once: its `ADAPTER` must extend the adapter class of every kind it extends."""
        super().__init_subclass__(**kwargs)
        for base in cls.__bases__:
            inherited = getattr(base, "ADAPTER", KindAdapter)
            if not issubclass(cls.ADAPTER, inherited):
                raise TypeError(
                    f"{cls.__name__}.ADAPTER is {cls.ADAPTER.__name__}, which does not extend"
                    f" {base.__name__}'s {inherited.__name__}: a kind that extends another subclasses its"
                    " adapter (a kind extending two, both)"
                )
        cls.adapter = cls.ADAPTER(cls)

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


Kind.adapter = KindAdapter(Kind)
