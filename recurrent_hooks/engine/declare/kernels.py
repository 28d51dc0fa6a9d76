"""The declaration of a mixer kind's kernels, as data: which module global, the library's loop, roles.

Module contents:
- `STATE_MEMORY`, `CONV_MEMORY`: the two memories of a mixer (its recurrent state, its conv window);
  `KEEPABLE`: what `watch(keep=...)` takes, and which memory each name keeps; `KERNEL_IO`; the former names
  (`RENAMED_KEEP`, `RENAMED_MEMORY`, `memory_name`).
- `Site`: where a kernel is bound, so that the library can rebind it: a global of the modeling module, an
  attribute of one of its classes (a method), or an attribute of an object inside each mixer module.
- `Role`: which calls a kernel serves: prompts, one-token decode steps, or both.
- `Kernel`: one kernel of a kind (name, site, the library's token loop, where the memory goes in, what the
  results are called, where its tokens are counted, how it can run in segments).
- `Segments`: how a prompt kernel can run on consecutive pieces of its tokens, chaining the state;
  `Pieces`: one call cut into such pieces (its arguments per piece, its result from the pieces').
- `state_shape(kind, kernel, arguments)`: a call's state shape, read off the kind's `STATE` and `INPUTS`.
"""

import dataclasses
import enum
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..errors import renamed

STATE_MEMORY, CONV_MEMORY = "state", "window"  # the two memories of a mixer: its state, its convolution window
KEEPABLE = {"inputs": None, "outputs": None, "states": STATE_MEMORY, "windows": CONV_MEMORY}  # keep name -> memory
KEEP_NAMES = {memory: name for name, memory in KEEPABLE.items() if memory is not None}  # memory -> keep name
KERNEL_IO = ("inputs", "outputs")  # the keep names of the kernel's arguments and results
RENAMED_KEEP = {"conv_states": "windows"}  # former keep names (docs/api.md, "Renamed"): they warn
RENAMED_MEMORY = {"conv_state": CONV_MEMORY}  # former memory names (`memory=`, `differentiable`): they warn


def memory_name(memory: object, where: str) -> object:
    """`memory` with a former name replaced by the new one (with a `RecurrentHooksDeprecationWarning`)."""
    if isinstance(memory, str) and memory in RENAMED_MEMORY:
        renamed(f"{where}: the memory {memory!r}", repr(RENAMED_MEMORY[memory]), stacklevel=4)
        return RENAMED_MEMORY[memory]
    return memory


FORWARD = "forward"  # Kernel.seq: the kernel covers the forward's tokens (and maybe a cached prefix before them)


class Site(enum.Enum):
    """Where a kernel is bound: what the library rebinds for the duration of a watch.

    - MODULE: a global of the family's modeling module, looked up by the mixer's forward at call time
      (`torch_chunk_gated_delta_rule`).
    - CLASS: an attribute of a class of the modeling module (a method such as `RecurrentGemmaRglru._rnn_scan`,
      or a whole `forward`); the library's loop takes `self` first.
    - INSTANCE: an attribute of an object inside each mixer module, at a dotted path from the mixer module
      ("" for the mixer itself): a kernel captured when the model was built (a `functools.partial` in an
      attribute). Rebound per module, for the mixers a watch attaches.

    Which class, or which path, is a fact of the family, not of the kind: the family's row says it
    (`Family.owners`, by default the mixer class, or the mixer module itself).
    """

    MODULE = "module global"
    CLASS = "class attribute"
    INSTANCE = "instance attribute"


class Role(str, enum.Enum):
    """Which calls a kernel serves (a str, so `kernel.role == "prompt"` reads as it says)."""

    PROMPT = "prompt"  # a call over the prompt's tokens (or a chunk of them)
    DECODE = "decode"  # a one-token step over a cached memory
    BOTH = "both"  # one kernel for both (RWKV)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segments:
    """How a prompt kernel can be run on consecutive pieces of its tokens, chaining the state.

    - `per_token`: the arguments that have a token axis, and which axis;
    - `state_in`: the argument that takes the state a piece starts from;
    - `final_flag`: the argument that asks the kernel to return its last state;
    - `out_axis`: the token axis of the output;
    - `tuple_without_final`: the kernel returns `(out, None)`, not `out`, when the last state is not asked for;
    - `all_states`: the library's chunk-wise version of the kernel (same signature) that returns
      `(result, states)`, every token's state too (token first: `states[t]`), or None. Used when every state is kept and
      gradients are off, or with gradients where `adjoint` is given too (`paths.adjoint`; else the token loop
      keeps the states the recurrence used). A kind with an adjoint's `all_states` also takes a keyword `out`, the
      float32 buffer `[seq, *state]` to write into (`loops.states_buffer`);
    - `on_chunk`: `all_states` also takes a keyword `on_chunk(start, states)`; given one, it hands it the states of
      each of its chunks in order, `states` `[size, batch, *state]` (token first) for the tokens `start ..
      start + size - 1`, a view of one buffer of one chunk that the next chunk overwrites, and returns None in place
      of every state (it never holds them all). A reduction of every state without gradients runs on it
      (`policy.Strategy.CHUNKS`); False: `all_states` takes no such keyword;
    - `readouts`: 0, or the chunk length C of an `all_states` that also takes `factors=(a, b)` with `on_chunk`, a
      `[heads, r, rows]` and b `[heads, r, cols]` for a state `[batch, heads, rows, cols]`, and then hands `on_chunk`
      each chunk's linear readouts `[size, batch, heads, r]`, sum_ij a[h, r, i] S_t[h, i, j] b[h, r, j], formed
      without the states: the path of a reduction that declares itself linear (`linear_factors`, as `rh.probe`'s
      does). The readouts cost about C r rows multiply-adds a token and head, forming the states 2 rows cols: they
      are taken where r C < 2 cols (counted, not measured).
    - `blocks_below`: a hook on every token runs `all_states` a block at a time (`blocks`) when the call's state
      has at most this many elements (batch included), measured to be where that beats the token loop
      (`benchmarks/blocks.py`); 0: never.
    - `shape`: the call's cost-relevant shape (`costs.Shape`) from its bound arguments, by which `choose` picks the
      cheapest path; None: the fixed rule (`choose`).
    - `kernel`: the library's function (same signature) that runs a piece, for a kernel bound before the watch
      that cannot start from a state (Mamba-1's scan); None: the bound kernel runs the pieces.
    - `adjoint`: the kernel's adjoint recurrence (same arguments, plus keyword-only `grad_output`, the gradient of
      the output, `grad_final`, of the last state, either None for zeros, and `visit`): walks the tokens right
      to left calling `visit(t, mu_t)` with mu_t = d m / d S_t through the tokens after t (the gradient of the
      state a write at t replaces; mu_{T-1} = grad_final), and returns the initial state's gradient. With it, the
      gradients of every state of a piece cost one state-sized Python step a token without autograd
      (`paths.adjoint`: kept states in grad mode; attribution's chunks); None: the token loop under autograd.
    - `chunk_argument`: the bound kernel's chunk-length argument (Mamba-2's `chunk_size`), or None. A piece that a
      backward recomputes under autograd (`backward.piece_leaves`) runs with chunks no longer than itself: a 64-token
      piece through a kernel of chunk 256 pads it to 256 tokens (same maths, other rounding).
    """

    per_token: dict[str, int]
    state_in: str
    final_flag: str
    out_axis: int
    tuple_without_final: bool
    all_states: Callable[..., Any] | None = None
    on_chunk: bool = False
    readouts: int = 0
    blocks_below: int = 0
    shape: Callable[[dict[str, Any]], Any] | None = None
    kernel: Callable[..., Any] | None = None
    adjoint: Callable[..., Any] | None = None
    chunk_argument: str | None = None


class Pieces:
    """A prompt call cut into pieces of its tokens (`Segments`): each piece called as the mixer called the
    kernel, from the state the previous piece ended with; the results put back together as the kernel's.

        pieces = Pieces(kernel, args, kwargs)
        out, state = run(*pieces.call(start, end, state))   # -> (leading, keyword arguments)
        return pieces.result(outputs, state)
    """

    def __init__(self, kernel: "Kernel", args: tuple, kwargs: dict[str, Any]) -> None:
        self.segments = kernel.segments
        self.bound = kernel.layout.bind(args, kwargs)
        self.extra = self.bound.pop("kwargs", {})
        self.positional = list(self.bound)[: len(args)]  # call each piece the way the mixer called the kernel
        self.tokens = kernel.tokens(self.bound, 0)
        self.state = self.bound.get(self.segments.state_in)  # the state the call starts from

    def call(self, start: int, end: int, state: Any) -> tuple[list[Any], dict[str, Any]]:
        """The positional and keyword arguments of the piece of tokens [start, end) from `state`."""
        per_token = self.segments.per_token
        piece = {
            name: (
                value.narrow(per_token[name], start, end - start) if name in per_token and value is not None else value
            )
            for name, value in self.bound.items()
        }
        piece[self.segments.state_in], piece[self.segments.final_flag] = state, True
        leading = [piece.pop(name) for name in self.positional]
        return leading, {**piece, **self.extra}

    def run(self, run: Callable[..., Any], length: int) -> tuple[list[Any], list[Any]]:
        """The call by `run` (the bound kernel, or `Segments.kernel`) in pieces of `length` tokens, each from the
        state the previous one ended with: their outputs, and the states at the boundaries (the call's initial
        state first, its last state last). A backward recomputes each piece from them (`paths.backward`)."""
        state = self.state
        boundaries, outputs = [state], []
        for start in range(0, self.tokens, length):
            leading, named = self.call(start, min(start + length, self.tokens), state)
            out, state = run(*leading, **named)
            outputs.append(out)
            boundaries.append(state)
        return outputs, boundaries

    def result(self, outputs: list[Any], state: Any) -> Any:
        """The pieces' outputs and the last state, as the kernel returns them."""
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=self.segments.out_axis)
        if self.bound.get(self.segments.final_flag, False):
            return out, state
        return (out, None) if self.segments.tuple_without_final else out


@dataclasses.dataclass(frozen=True)
class WindowTerms:
    """Attribution patching's maths of a prompt convolution (`Kernel.window_terms`), so that studies need no kind:

    - `shifted(hidden_states, weight, bias, activation, shift=)`: the kernel's output with `shift` added before its
      activation (a zero leaf whose gradient is d metric / d the convolution's output);
    - `terms(delta, grad, weight, shares)`: the window term of every position from the inputs' change and that
      gradient, without a per-token step.
    """

    shifted: Callable[..., Any]
    terms: Callable[..., Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernel:
    """One kernel of a mixer kind, as data (keyword-only fields).

    - `name`: the name the mixer's forward calls (a module global, or an attribute of an owner: see `site`);
    - `loop`: the library's pure-torch token loop with the same signature and return value, plus a
      keyword-only `on_token(t, memory) -> memory` (and `tokens=` when `seq` is FORWARD; a loop that takes
      a keyword `original` gets the kernel bound before the watch, e.g. a partial whose settings it reads);
    - `state_in`: the argument that carries the memory in (None: the kernel always starts from zeros), or
      a tuple of them for a memory of several parts (`STATE_TYPE`), in the order of its parts;
    - `results`: names of the elements of the returned value (a single tensor is the first name);
    - `role`: a `Role` (or its string): prompt, decode, or both;
    - `seq`: `(argument, axis)` where the tokens of the call are counted, None for one token, or
      FORWARD: the forward's tokens, the last positions of the kernel's input;
    - `in_place`: the kernel writes the new memory into its `state_in` tensor instead of returning it;
    - `memory`: which memory the kernel updates, STATE_MEMORY or CONV_MEMORY;
    - `also`: a second memory the kernel updates too (None: one), for a whole forward that carries two
      (zaya's CCA: its conv window and its value delay). Its loop takes a keyword-only `on_also(t, memory)
      -> memory` for it, called as `on_token` is; `serving(memory)` is the row as that memory's kernel;
    - `segments`: how the kernel bound before the watch can run piece by piece, chaining the state (None:
      it cannot). Then a call with hooks and kept states at a few tokens only runs that kernel on the
      pieces between them, instead of the token loop;
    - `site`: where the name is bound (`Site`): a module global by default (the family's row names the class
      or path of a class or instance attribute, `Family.owners`);
    - `stops`: the loop also takes a keyword-only `stops`, the sorted tokens at which it must call `on_token`
      (None: every token), and runs a faster computation between them (a whole forward whose own block
      loop can start from a state: lightning attention). Used like `segments`, for kernels without them;
    - `window_terms`: a prompt convolution's attribution maths (`WindowTerms`; None: `rh.attribute` takes its
      windows token by token).
    """

    name: str
    role: Role
    loop: Callable[..., Any]
    state_in: str | tuple[str, ...] | None
    results: tuple[str, ...]
    seq: tuple[str, int] | str | None = None
    in_place: bool = False
    memory: str = STATE_MEMORY
    also: str | None = None
    segments: Segments | None = None
    site: Site = Site.MODULE
    stops: bool = False
    window_terms: WindowTerms | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        layout_of(self.loop)  # read now: a compiled forward cannot inspect signatures

    def target(self, modeling_module: ModuleType, owner: str | None, mixer_module: Any = None) -> tuple[Any, str]:
        """The object and attribute name this kernel is bound to: a global of `modeling_module`, an attribute of
        its class `owner`, or (INSTANCE) of the object at the dotted path `owner` inside `mixer_module`. The
        family's row knows the owner: `MixerClass.target(kernel, mixer_module)` calls this."""
        if self.site is Site.MODULE:
            return modeling_module, self.name
        if owner is None:
            raise TypeError(f"Kernel {self.name!r} is a {self.site.value}: give its owner")
        if self.site is Site.CLASS:
            return getattr(modeling_module, owner), self.name
        if mixer_module is None:
            raise TypeError(f"Kernel {self.name!r} is bound per mixer module ({owner!r}): give the module")
        found = mixer_module
        for part in filter(None, owner.split(".")):
            found = getattr(found, part)
        return found, self.name

    @property
    def memories(self) -> tuple[str, ...]:
        """The memories the kernel updates: `memory`, then `also`."""
        return (self.memory,) if self.also is None else (self.memory, self.also)

    def serving(self, memory: str) -> "Kernel":
        """This row as the kernel of `memory`, one of its `memories` (hooks, writes and kept values of that memory)."""
        if memory == self.memory:
            return self
        if memory != self.also:
            raise KeyError(f"kernel {self.name!r} updates {' and '.join(self.memories)}, not {memory}")
        row, view = _SERVING.get((id(self), memory), (None, None))
        if row is not self:  # made once per row (`row` is kept, so that its id is not reused)
            view = dataclasses.replace(self, memory=memory, also=None)
            _SERVING[id(self), memory] = (self, view)
        return view

    @property
    def state_arguments(self) -> tuple[str, ...]:
        """The arguments that carry the memory in (none, one, or one per part)."""
        if self.state_in is None:
            return ()
        return (self.state_in,) if isinstance(self.state_in, str) else self.state_in

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.loop)

    @property
    def layout(self) -> "Layout":
        """How the loop's parameters take a call's arguments (the kernel's own signature, plus the loop's keywords)."""
        return layout_of(self.loop)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by name (extra keyword arguments the kernel ignores are left out)."""
        bound = self.layout.bind(args, kwargs)
        return {k: v for k, v in bound.items() if k not in ("self", "kwargs", "on_token", "tokens", "original")}

    def tokens(self, arguments: dict[str, Any], forward_tokens: int) -> int:
        """How many tokens the call covers."""
        if self.seq is None:
            return 1
        if self.seq == FORWARD:
            return forward_tokens
        name, axis = self.seq
        return arguments[name].shape[axis]

    def name_results(self, result: Any) -> dict[str, Any]:
        values = result if isinstance(result, tuple) else (result,)
        return dict(zip(self.results, values))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a function's parameters take a call's arguments, read once from its signature (eagerly: a compiled
    forward cannot inspect signatures)."""

    positional: tuple[str, ...]  # the parameters a positional argument can fill, in order
    named: frozenset[str]  # every parameter that can be passed by name
    var_keyword: str | None  # the **kwargs parameter, which takes the other names

    @classmethod
    def of(cls, fn: Callable) -> "Layout":
        parameters = inspect.signature(fn).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return cls(
            tuple(p.name for p in parameters if p.kind in kinds),
            frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY),
            next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None),
        )

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments by name, as `Signature.bind_partial(...).arguments` gives them (the positional ones first)."""
        if len(args) > len(self.positional):
            raise TypeError(f"{len(args)} positional arguments, for parameters {self.positional}")
        arguments: dict[str, Any] = dict(zip(self.positional, args))
        for name, value in kwargs.items():
            if name in self.named or self.var_keyword is None:
                arguments[name] = value
            else:
                arguments.setdefault(self.var_keyword, {})[name] = value
        return arguments


_LAYOUTS: dict[Callable, Layout] = {}
_SERVING: dict[tuple[int, str], tuple[Kernel, Kernel]] = {}  # Kernel.serving's rows, made once


def state_shape(kind: Any, kernel: "Kernel", arguments: dict[str, Any]) -> tuple[int, ...] | None:
    """A call's state shape, batch included, from the sizes of the axes of the kind's `STATE` in the kernel's
    arguments (as `INPUTS` declares them); None if an axis is in none of them."""
    sizes: dict[str, int] = {}
    for name, axes in kind.INPUTS.items():
        value = arguments.get(name)
        if name not in kernel.state_arguments and isinstance(value, torch.Tensor) and len(axes.split()) == value.dim():
            sizes.update(zip(axes.split(), value.shape))
    declared = kind.STATE if isinstance(kind.STATE, str) else None
    if declared is None or any(axis not in sizes for axis in declared.split()):
        return None
    return tuple(sizes[axis] for axis in declared.split())


def layout_of(fn: Callable) -> Layout:
    """`fn`'s `Layout`, read once."""
    if fn not in _LAYOUTS:
        _LAYOUTS[fn] = Layout.of(fn)
    return _LAYOUTS[fn]
