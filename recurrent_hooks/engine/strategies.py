"""Which path a busy prompt call takes: an estimate of each path's cost from the call's shapes, the cheapest wins.

A call with hooks, writes or kept states ("busy") can run in several ways (`dispatch._Tap._run_kernel`):
- `Strategy.SEGMENTS`: the kernel bound before the watch on the pieces between the stops (the tokens with
  hooks, writes or kept states), chaining the state through its `initial_state` argument. A piece may end
  with a short token loop from its last chunk boundary to its stop (`Choice.tails`, only with `Paths(tails=True)`): a
  chunked kernel pads every call up to a multiple of its chunk, so a stop just past a boundary pays for a whole
  chunk;
- `Strategy.STATES`: the library's chunk-wise all-states kernel (`Segments.all_states`), when every state is
  kept: gradients off (with a hook at a few tokens, in segments around them), or on where the kind has an
  adjoint recurrence (`engine.adjoint`, whole calls only);
- `Strategy.BLOCKS`: a hook at every token, gradients off, with the states computed a block at a time by the
  all-states kernel (`blocks`; estimated like STATES, and available only where `blocks.blocks_apply` says
  blocks were measured to beat the token loop: a state of at most `Segments.blocks_below` elements);
- `Strategy.CHUNKS`: every busy plan reduces every state (`watch(reduce=...)`) and nothing else (no hook, no write,
  no state kept as it is), gradients off, not compiling: the all-states kernel runs once over the call and hands
  each of its chunks' states to the reductions (`Segments.on_chunk`), never writing every state. Taken wherever it
  is available, without an estimate (measured: the cheapest way to see every state, docs/performance.md);
- `Strategy.LOOP`: the library's token loop (`Kernel.loop`), one Python step per token.

The model. Each prompt kernel with `Segments.shape` declares its call's cost-relevant shape (`Shape`: batch,
heads, the two dims of a head's state k x v, the bound kernel's chunk size, and which kernel key its constants are
filed under). Each of three computations costs a sum of terms, each term a count times a fitted constant:
    kernel(T): the bound kernel on T tokens, padded to n = ceil(T / chunk) chunks: per call, per chunk, per
               head-chunk, per head-chunk's chunk^2, per element-product chunk^2 (k + v) + chunk k v;
    loop(T):   the token loop: per call, per token, per head-token, per state element per token;
    states(T): the all-states kernel, in chunks of 16: per call, per chunk, per head-chunk, per head-token
               times 16 k, per state element per token
(`kernel_terms`, `loop_terms`, `states_terms`; a head is one batch row's head, work = batch * heads). SEGMENTS
is the sum over its pieces, each piece kernel(piece) or, with `Paths(tails=True)`, the cheaper of that and kernel(its whole
chunks) + loop(rest);
STATES the sum of states(piece); BLOCKS and CHUNKS states(T); LOOP loop(T). The constants are seconds, fitted by
`benchmarks/paths.py --calibrate --write` per device type and dtype, and read from the data file `costs.json`
next to this module (keyed "cpu/float32": the package ships the CPU one), once, at the first watch or standalone
hook (`costs_for`). Grad mode decides what is available (no BLOCKS or CHUNKS with gradients; STATES only where the kind
declares an adjoint recurrence, `Segments.adjoint`, and no hook or write stops the call) and is not modelled
otherwise: every state kept with gradients takes STATES where it can (measured faster than the token loop under
autograd, docs/performance.md).

The fixed rule: the segments (or the chunk-wise kernel when every state is kept) when there are at most
max(8, T / 32) stops, else the token loop (a hook on every token: blocks where `blocks.blocks_apply` allows them).
A call takes it when its kernel declares no shape (lightning attention's `Kernel.stops`, or a `Segments` without
`shape`), when its device and dtype have no calibration (a GPU: `support()` says which rule a model gets), or
when `Paths(rule="fixed")` asks for it.

Memory: each path's bytes beyond the bound kernel's are bounded by `held_bytes` from the same shape and the kind's
declared footprint (`Shape.graph`, `Shape.loop_graph`): the token loop's graph under autograd, the pieces' graphs
padded to whole chunks, a block of states, every state of a call bound for another device. Paths over the budget
(`Paths.memory_budget`; default `DEFAULT_BUDGET_SHARE` of the device's memory) are passed over where one within it
is available, before the rule or the cost model picks; where none is, the one holding least is taken.

The policy is the user's (`Paths`, an argument of `watch` and `register_state_hook`, carried by each handle to
its calls): the cost model or the fixed rule, the token loop for every busy call (a check), a path forced where
the call can take it, the token-loop tails, the blocks' size limit, constants of one's own.

Module contents:
- `Strategy`, `Choice`: the strategies (a call's path) and a call's choice (its path, its stops, whether every state is kept
  chunk-wise, and the token ranges of SEGMENTS that the token loop runs);
- `Paths`: the policy (public: `recurrent_hooks.Paths`); `DEFAULT`, the shipped one; `LOOP`, the token loop;
- `Shape`, `Constants`: the model's inputs and its constants; `costs_for(device, dtype)`: the calibration of a
  device type and dtype (None: none), from `costs.json`; `calibration_key(device, dtype)`: its key there;
- `held_bytes(shape, tokens, stops, grad, ...)`: each path's bytes; `budget_of(paths, device)`, `device_memory`;
- `costs(shape, tokens, stops, constants)`: each path's estimate; `choose(kernel, busy, tokens, arguments,
  paths=...)`: the choice.
"""

import dataclasses
import enum
import json
import math
import os
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from . import blocks as _blocks
from .errors import InvalidValue
from .kernels import Kernel
from .tracing import compiling


class Strategy(enum.Enum):
    """How a busy kernel call runs; `Paths` picks one. Its value is the word `Paths(force=...)` takes (the token
    loop's, "loop", is `Paths(rule="loop")`), its `label` the `KernelCall.path` a call records."""

    SEGMENTS = "segments"
    STATES = "states"
    BLOCKS = "blocks"
    CHUNKS = "chunks"
    LOOP = "loop"

    @property
    def label(self) -> str:
        """The path as a call records it (`KernelCall.path`): "segments", "chunk-wise states", "blocks",
        "chunk-wise reductions" or "token loop"."""
        return LABELS[self.value]


LABELS = {"segments": "segments", "states": "chunk-wise states", "blocks": "blocks", "chunks": "chunk-wise reductions",
          "loop": "token loop"}  # a strategy's value -> its label


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a busy call runs: its path, the tokens to stop at (sorted), whether every state is kept chunk-wise
    between them, and for SEGMENTS the token ranges `[start, end)` that the token loop runs instead of the
    bound kernel (each one from a piece's last chunk boundary to its end)."""

    path: Strategy
    stops: list[int]
    every_state: bool
    tails: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Shape:
    """A prompt kernel call's cost-relevant shape (declared by its `Segments.shape` from the bound arguments)."""

    constants: str  # its kernel key in a calibration ("delta rule", "ssd": the kernels timed alike)
    batch: int
    heads: int
    key_dim: int  # rows of one head's state (gated DeltaNet: key_dim; Mamba-2: head_dim)
    value_dim: int  # its columns (gated DeltaNet: value_dim; Mamba-2: d_state)
    chunk: int  # the bound kernel's chunk size: each call is padded up to a multiple of it
    # its memory footprint (`held_bytes`), measured at real dims (tests/test_path_memory.py): the bound kernel's
    # autograd graph per chunk, in units of batch * heads * (chunk^2 + chunk (k + v) + k v) float32 elements, and
    # the token loop's graph per token under autograd, in states
    graph: float = 0.0
    loop_graph: float = 0.0


@dataclasses.dataclass(frozen=True)
class Constants:
    """Seconds per unit of each term of each path's cost (`kernel_terms`, `loop_terms`, `states_terms`)."""

    kernel: tuple[float, ...]
    loop: tuple[float, ...]
    states: tuple[float, ...]


STATES_CHUNK = 16  # the all-states kernels' chunk of tokens

COSTS_FILE = pathlib.Path(__file__).with_name("costs.json")  # written by `benchmarks/paths.py --calibrate --write`
_COSTS: dict[str, dict[str, Constants]] = {}  # calibration key -> kernel constants key -> Constants, once read
_READ: list[bool] = []  # [True] once COSTS_FILE was read


def calibration_key(device: torch.device | str, dtype: torch.dtype) -> str:
    """The key of a device type and dtype in `costs.json`: "cpu/float32", "cuda/bfloat16"."""
    return f"{torch.device(device).type}/{str(dtype).removeprefix('torch.')}"


def read_costs(path: pathlib.Path | str = COSTS_FILE) -> dict[str, dict[str, Constants]]:
    """The calibrations of a costs file: key -> the constants of each kernel key ("delta rule", "ssd", ...)."""
    data = json.loads(pathlib.Path(path).read_text())
    return {key: {name: Constants(*(tuple(float(c) for c in fit[part]) for part in ("kernel", "loop", "states")))
                  for name, fit in entry["kernels"].items()} for key, entry in data.items()}


def load_costs() -> None:
    """Read `costs.json` once (the first watch or standalone hook does, so that no trace of torch.compile
    reads a file)."""
    if not _READ:
        _COSTS.update(read_costs())
        _READ.append(True)


def costs_for(device: torch.device | str, dtype: torch.dtype) -> dict[str, Constants] | None:
    """The constants calibrated for a device type and dtype, by kernel key; None: no calibration (the fixed rule)."""
    load_costs()
    return _COSTS.get(calibration_key(device, dtype))


_FORCED = tuple(strategy.value for strategy in Strategy if strategy is not Strategy.LOOP)  # `Paths(force=...)`
RULES = ("cost", "fixed", "loop")


@dataclasses.dataclass(frozen=True)
class Paths:
    """How a busy call (hooks, writes or kept states) picks its path: an argument of `watch` and
    `register_state_hook`.

        with rh.watch(model, keep=("states",), paths=rh.Paths(rule="loop")) as w:   # every busy call token by token
            model(ids)
        w.mixers[0].calls[0].kernel_calls[0].path      # "token loop": the path each kernel call took

    - `rule`: "cost" (the default: the cheapest path by a cost model of the call's shapes, calibrated per device
      type and dtype; a device without calibration takes the fixed rule), "fixed" (segments for at most
      max(8, T / 32) stops, the chunk-wise states when every state is kept, else the token loop), or "loop"
      (every busy call runs the library's token loop: the reference the other paths are checked against);
    - `force`: "segments", "states" (the chunk-wise all-states kernel), "blocks" or "chunks" (the all-states kernel's
      chunks handed to the reductions): taken wherever the call can take it (benchmarks, tests of a path), the rule
      deciding elsewhere;
    - `tails`: with the cost model, a piece of segments may end in a token loop from its last chunk boundary
      where the estimate says it pays (off: measured no gain above the noise, docs/performance.md);
    - `blocks_below`: the largest state (elements, batch included) a hook on every token runs in blocks at
      (None: each kernel's measured `Segments.blocks_below`);
    - `costs`: constants by kernel key ("delta rule", "ssd", "kimi delta") to use instead of the device's
      calibration (`Constants`, or a mapping with "kernel", "loop" and "states" lists as `costs.json` has them);
    - `memory_budget`: the bytes a busy call's path may hold on the call's device beyond what the kernel bound
      before the watch holds (`held_bytes`: the token loop's graph under autograd, the graphs of pieces padded to
      whole chunks, a block of states, the states of the chunk-wise states path before they go to `keep_device`); a
      path over it is not taken where one within it is available (the one holding least where none is). None (the
      default): a quarter of the device's memory (`DEFAULT_BUDGET_SHARE`; CUDA's `total_memory`, the host's
      physical memory for a CPU), `math.inf`: no limit. Forced paths (`force=`) and `rule="loop"` ignore it;
    - `loop_threads`: torch's intra-op threads while the paths with per-token steps (the token loop, and the
      chunk-wise reductions, which form large states token by token) run on a CPU, the loop's hooks included:
      1 (the default: each step's ops are too small to split; on a shared machine a thread another process holds
      stalls every one of them), a number, or None (torch's setting).

    Every path gives the token loop's results (within float rounding); only the time differs. Several handles
    busy in one call (a watch and a standalone hook on one module) take the path their policies agree on; if
    they differ, the token loop.
    """

    rule: str = "cost"
    force: "str | Strategy | None" = None
    tails: bool = False
    blocks_below: int | None = None
    costs: "Mapping[str, Any] | None" = None
    loop_threads: int | None = 1
    memory_budget: float | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise InvalidValue(f"Paths: expected rule= one of {', '.join(map(repr, RULES))}, got rule={self.rule!r}")
        force = self.force
        if isinstance(force, str) and force in _FORCED:
            object.__setattr__(self, "force", Strategy(force))
        elif force is not None and not (isinstance(force, Strategy) and force is not Strategy.LOOP):
            raise InvalidValue(f"Paths: expected force= None or one of {', '.join(map(repr, _FORCED))} (the token"
                               f" loop is rule='loop'), got force={force!r}")
        if self.rule == "loop" and self.force is not None:
            raise InvalidValue(f"Paths: rule='loop' runs every busy call through the token loop; it forces no"
                               f" other path, got force={force!r}")
        if not isinstance(self.tails, bool):
            raise InvalidValue(f"Paths: expected tails=True or tails=False, got tails={self.tails!r}")
        if self.blocks_below is not None and (isinstance(self.blocks_below, bool) or not isinstance(
                self.blocks_below, int) or self.blocks_below < 0):
            raise InvalidValue(f"Paths: expected blocks_below= None or a number of state elements >= 0, got"
                               f" blocks_below={self.blocks_below!r}")
        if self.costs is not None:
            object.__setattr__(self, "costs", _as_constants(self.costs))
        threads = self.loop_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InvalidValue(f"Paths: expected loop_threads= None or a number of threads >= 1, got"
                               f" loop_threads={threads!r}")
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not budget >= 0):
            raise InvalidValue(f"Paths: expected memory_budget= None (a quarter of the device's memory), a number of"
                               f" bytes >= 0 or math.inf (no limit), got memory_budget={budget!r}")

    def __hash__(self) -> int:  # (costs is a dict)
        return hash((self.rule, self.force, self.tails, self.blocks_below,
                     None if self.costs is None else tuple(sorted(self.costs.items())), self.loop_threads,
                     self.memory_budget))


def _as_constants(costs: Any) -> dict[str, Constants]:
    if not isinstance(costs, Mapping):
        raise InvalidValue(f"Paths: expected costs= a mapping of kernel keys (as 'delta rule', 'ssd') to Constants,"
                           f" got {type(costs).__name__}")
    out = {}
    for name, value in costs.items():
        if isinstance(value, Mapping) and {"kernel", "loop", "states"} <= set(value):
            value = Constants(*(tuple(float(c) for c in value[part]) for part in ("kernel", "loop", "states")))
        if not isinstance(value, Constants):
            raise InvalidValue(f"Paths: costs[{name!r}]: expected Constants or a mapping with 'kernel', 'loop' and"
                               f" 'states' lists, got {value!r}")
        out[name] = value
    return out


DEFAULT = Paths()
LOOP = Paths(rule="loop")


def kernel_terms(shape: Shape, tokens: int) -> list[float]:
    """The bound kernel on `tokens` tokens, padded to n whole chunks: per call, per chunk, per head-chunk (a
    batched matrix op), per head-chunk's chunk^2 (its elementwise decay masks), per element-product of its
    products (chunk^2 (k + v) + chunk k v)."""
    work, k, v, chunk = shape.batch * shape.heads, shape.key_dim, shape.value_dim, shape.chunk
    chunks = math.ceil(tokens / chunk)
    return [1.0, chunks, work * chunks, work * chunks * chunk**2, work * chunks * (chunk**2 * (k + v) + chunk * k * v)]


def loop_terms(shape: Shape, tokens: int) -> list[float]:
    """The token loop: per call, per token, per head-token, per state element per token."""
    work = shape.batch * shape.heads
    return [1.0, tokens, tokens * work, tokens * work * shape.key_dim * shape.value_dim]


def states_terms(shape: Shape, tokens: int) -> list[float]:
    """The all-states kernel, in chunks of 16 tokens: per call, per chunk, per head-chunk, per head-token's
    chunk (its i x j decay masks), per state element per token (each state is written once)."""
    work = shape.batch * shape.heads
    chunks = math.ceil(tokens / STATES_CHUNK)
    return [1.0, chunks, work * chunks, work * tokens * STATES_CHUNK * shape.key_dim,
            work * tokens * shape.key_dim * shape.value_dim]


def _dot(coefficients: tuple[float, ...], terms: list[float]) -> float:
    return sum(c * t for c, t in zip(coefficients, terms, strict=True))


def kernel_cost(constants: Constants, shape: Shape, tokens: int) -> float:
    """The bound kernel on `tokens` tokens, padded up to whole chunks."""
    return _dot(constants.kernel, kernel_terms(shape, tokens)) if tokens > 0 else 0.0


def loop_cost(constants: Constants, shape: Shape, tokens: int) -> float:
    """The token loop on `tokens` tokens."""
    return _dot(constants.loop, loop_terms(shape, tokens)) if tokens > 0 else 0.0


def states_cost(constants: Constants, shape: Shape, tokens: int) -> float:
    """The all-states kernel on `tokens` tokens."""
    return _dot(constants.states, states_terms(shape, tokens)) if tokens > 0 else 0.0


def pieces(stops: Iterable[int], tokens: int) -> list[tuple[int, int]]:
    """The `[start, end)` pieces a call runs in: each ends just after a stop, the last at the call's end."""
    out, start = [], 0
    for end in [*(stop + 1 for stop in sorted(stops)), tokens]:
        if end > start:
            out.append((start, end))
            start = end
    return out


def _piece(constants: Constants, shape: Shape, start: int, end: int, tails: bool
           ) -> tuple[float, tuple[int, int] | None]:
    """A piece of SEGMENTS: its cost, and the range the token loop runs at its end (None: the kernel runs all;
    always, without `tails`)."""
    whole = kernel_cost(constants, shape, end - start)
    boundary = start + (end - start) // shape.chunk * shape.chunk
    if boundary == end or not tails:
        return whole, None
    split = kernel_cost(constants, shape, boundary - start) + loop_cost(constants, shape, end - boundary)
    return (split, (boundary, end)) if split < whole else (whole, None)


def segments_cost(constants: Constants, shape: Shape, tokens: int, stops: Iterable[int], tails: bool = False
                  ) -> tuple[float, tuple[tuple[int, int], ...]]:
    """SEGMENTS: its cost and its tails (the ranges the token loop runs; none without `tails`)."""
    total, looped = 0.0, []
    for start, end in pieces(stops, tokens):
        cost, tail = _piece(constants, shape, start, end, tails)
        total += cost
        if tail is not None:
            looped.append(tail)
    return total, tuple(looped)


def _estimates(constants: Constants, shape: Shape, tokens: int, stops: Iterable[int], tails: bool
               ) -> dict[Strategy, Callable[[], float]]:
    """Each path's estimate, as a function (a choice computes only those of the paths it can take)."""
    return {Strategy.SEGMENTS: lambda: segments_cost(constants, shape, tokens, stops, tails)[0],
            Strategy.STATES: lambda: sum(states_cost(constants, shape, end - start) for start, end in pieces(stops, tokens)),
            Strategy.BLOCKS: lambda: states_cost(constants, shape, tokens),
            Strategy.CHUNKS: lambda: states_cost(constants, shape, tokens),
            Strategy.LOOP: lambda: loop_cost(constants, shape, tokens)}


# -- memory ------------------------------------------------------------------------------------------------------

DEFAULT_BUDGET_SHARE = 0.25  # `Paths(memory_budget=None)`: this share of the device's memory
_DEVICE_MEMORY: dict[str, float] = {}  # device ("cuda:0", "cpu:None") -> its bytes, read once (`note_device`)


def device_memory(device: torch.device | str) -> float:
    """The memory of a device in bytes: CUDA's (or XPU's) `total_memory`, MPS's recommended maximum, the host's
    physical memory for a CPU; `math.inf` where it cannot be read."""
    device = torch.device(device)
    try:
        if device.type == "cpu":
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        if device.type == "mps":
            return float(torch.mps.recommended_max_memory())
        return float(getattr(torch, device.type).get_device_properties(device).total_memory)
    except (AttributeError, ValueError, OSError, RuntimeError):
        return math.inf


def note_device(device: torch.device | str) -> None:
    """Read a device's memory once (a watch does as it attaches, rather than while torch.compile traces)."""
    device = torch.device(device)
    if _device_key(device) not in _DEVICE_MEMORY:
        _DEVICE_MEMORY[_device_key(device)] = device_memory(device)


def _device_key(device: torch.device) -> str:
    return f"{device.type}:{device.index}"


def budget_of(paths: Paths, device: torch.device | None) -> float:
    """The bytes a path of a call on `device` may hold (`Paths.memory_budget`; None: `DEFAULT_BUDGET_SHARE` of
    the device's memory; a device not read yet, inside a compiled trace: no limit)."""
    if paths.memory_budget is not None:
        return float(paths.memory_budget)
    if device is None:
        return math.inf
    if not compiling():
        note_device(device)
    return DEFAULT_BUDGET_SHARE * _DEVICE_MEMORY.get(_device_key(device), math.inf)


def graph_bytes(shape: Shape, tokens: int) -> float:
    """The bound kernel's autograd graph on `tokens` tokens, padded to whole chunks (`Shape.graph`)."""
    k, v, chunk = shape.key_dim, shape.value_dim, shape.chunk
    per_chunk = shape.batch * shape.heads * (chunk**2 + chunk * (k + v) + k * v)
    return 4.0 * shape.graph * math.ceil(tokens / chunk) * per_chunk if tokens > 0 else 0.0


def held_bytes(shape: Shape, tokens: int, stops: Iterable[int], grad: bool, kept: int = 0,
               elsewhere: bool = False, reducing: bool = False) -> dict[Strategy, float]:
    """At most the bytes each path holds on the call's device beyond what the bound kernel holds on the same call
    (measured at real dims, tests/test_path_memory.py), S being one state of the call (batch included, float32):
        token loop        gradients: (Shape.loop_graph T + kept + 2) S, its graph and a copy of each kept state,
                          less the bound kernel's graph, which it replaces (at least 2 S);
                          else 2 S (+ 2 x 64 S: a chunk of states a reduction of every state stacks);
        segments          gradients: the graphs of the pieces, each padded to whole chunks, less the call's,
                          + one S a piece; else one chunk's graph + 2 S;
        chunk-wise states 16 S (its chunk), + T S without gradients where the states go to another device
                          (`elsewhere`: they reach `keep_device` when the call is over);
        blocks            1.5 x 64 S (a block and its inputs) (+ the reduction's chunk);
        chunk-wise reductions  2 x 16 S.
    `kept`: the states kept as they are; `reducing`: a reduction of every state."""
    state = 4.0 * shape.batch * shape.heads * shape.key_dim * shape.value_dim
    reduction = 2 * _blocks.BLOCK * state if reducing else 0.0
    if grad:
        parts = pieces(stops, tokens)
        loop = max(2 * state, (shape.loop_graph * tokens + kept + 2) * state - graph_bytes(shape, tokens))
        segments = sum(graph_bytes(shape, end - start) for start, end in parts) - graph_bytes(shape, tokens) \
            + len(parts) * state
        states = STATES_CHUNK * state
    else:
        loop = 2 * state + reduction
        segments = graph_bytes(shape, shape.chunk) + 2 * state
        states = STATES_CHUNK * state + (tokens * state if elsewhere else 0.0)
    return {Strategy.SEGMENTS: segments, Strategy.STATES: states,
            Strategy.BLOCKS: 1.5 * _blocks.BLOCK * state + reduction, Strategy.CHUNKS: 2 * STATES_CHUNK * state,
            Strategy.LOOP: loop}


def _within(available: list[Strategy], held: dict[Strategy, float] | None, budget: float) -> list[Strategy]:
    """The available paths that hold at most `budget` bytes; none: the one that holds least."""
    if held is None:
        return available
    fitting = [path for path in available if held[path] <= budget]
    if fitting:
        return fitting
    least = available[0]
    for path in available[1:]:
        if held[path] < held[least]:
            least = path
    return [least]


def _cheapest(available: list[Strategy], estimate: dict[Strategy, Callable[[], float]]) -> Strategy:
    """The available path of the lowest estimate (the first of equal ones). A plain loop, not `min(key=...)`:
    `choose` runs while torch.compile traces a forward, and dynamo cannot trace `min` with a key."""
    best, lowest = available[0], estimate[available[0]]()
    for path in available[1:]:
        cost = estimate[path]()
        if cost < lowest:
            best, lowest = path, cost
    return best


def costs(shape: Shape, tokens: int, stops: Iterable[int], constants: Constants, tails: bool = False
          ) -> dict[Strategy, float]:
    """Each path's estimated seconds for a call of `tokens` tokens stopping at `stops` (available or not)."""
    return {path: estimate() for path, estimate in _estimates(constants, shape, tokens, stops, tails).items()}


def _fixed_rule(stops: set[int], every_state: bool, tokens: int) -> Strategy:
    """The rule without a cost model: a few stops run the fast path, else the token loop."""
    if len(stops) > max(8, tokens // 32):
        return Strategy.LOOP
    return Strategy.STATES if every_state else Strategy.SEGMENTS


def _constants_of(shape: Shape, arguments: dict[str, Any], paths: Paths) -> Constants | None:
    """The constants for a call (None: none, the fixed rule): the policy's own, else the calibration of the
    device type and dtype of the call's first floating-point tensor argument."""
    if paths.costs is not None:
        return paths.costs.get(shape.constants)
    first = _first_float(arguments)
    table = None if first is None else costs_for(first.device, first.dtype)
    return None if table is None else table.get(shape.constants)


def _first_float(arguments: dict[str, Any] | None) -> Tensor | None:
    """A call's first floating-point tensor argument (its device and dtype are the call's)."""
    for value in (arguments or {}).values():
        if isinstance(value, Tensor) and value.is_floating_point():
            return value
    return None


def _device_of(arguments: dict[str, Any] | None) -> torch.device | None:
    first = _first_float(arguments)
    return None if first is None else first.device


def _held(shape: Shape, busy: list[Any], tokens: int, stops: set[int], grad: bool,
          arguments: dict[str, Any] | None) -> dict[Strategy, float]:
    """`held_bytes` for a busy call: the states its plans keep as they are, whether they go to another device,
    whether one reduces every state."""
    device = _device_of(arguments)
    kept, elsewhere, reducing = 0, False, False
    for plan in busy:
        if _reduces_every_state(plan, tokens):
            reducing = True
        elif plan.keep:
            kept += len(plan.keep)
            target = getattr(plan, "device", None)
            elsewhere |= target is not None and device is not None and not (
                target.type == device.type and target.index in (None, device.index))
    return held_bytes(shape, tokens, stops, grad, kept, elsewhere, reducing)


def _reduces_every_state(plan: Any, tokens: int) -> bool:
    """Whether `plan` keeps a reduction (`watch(reduce=...)`) of every state of a call of `tokens` > 1 tokens."""
    return bool(plan.keep) and getattr(plan, "reduce", None) is not None and len(plan.keep) == tokens > 1


def choose(kernel: Kernel, busy: list[Any], tokens: int, arguments: dict[str, Any] | None = None,
           grad: bool | None = None, paths: Paths = DEFAULT) -> Choice | None:
    """The path of a busy call (its plans `busy`, each with `hooks` and `keep`) under the policy `paths`: a
    `Choice`, or None for the token loop. `arguments`: the call's bound arguments, from which the kernel's
    `Segments.shape` reads its shape; `grad`: whether gradients are on (default: `torch.is_grad_enabled()`)."""
    grad = torch.is_grad_enabled() if grad is None else grad
    segments = kernel.segments
    if paths.rule == "loop" or segments is None and not kernel.stops:
        return None
    all_states = segments is not None and segments.all_states is not None
    # every state kept with gradients: chunk-wise where the kind has an adjoint (`adjoint`), outside compile
    states_with_grad = all_states and segments.adjoint is not None and not compiling()
    stops: set[int] = set()
    every_state = every_token = False
    reducing = False  # a reduction of every state: handed over by chunks, blocks or tokens, never all at once
    for plan in busy:
        reduces_all = _reduces_every_state(plan, tokens)
        reducing |= reduces_all
        every_token |= reduces_all
        if any(positions is None for _, positions in plan.hooks):
            if tokens > 1:
                every_token = True
                continue
            stops.add(0)  # every token of a one-token call (a decode step): a stop at it
        stops.update(p for _, positions in plan.hooks if positions is not None for p in positions)
        if reduces_all:
            continue
        if plan.keep and len(plan.keep) == tokens and all_states and (not grad or states_with_grad):
            every_state = True
        elif plan.keep:
            stops.update(plan.keep)
    if every_state and grad and stops:  # (with gradients, all-states runs whole calls only: no hook between)
        every_state = False
        stops.update(range(tokens))
    # blocks where they were measured to beat the token loop (`blocks.blocks_apply`: the state's size)
    # (blocks at any size for a reduction alone: its on_token costs next to nothing, unlike a hook's)
    only_reducing = reducing and not any(positions is None for plan in busy for _, positions in plan.hooks)
    blocks = every_token and all_states and not grad and arguments is not None \
        and _blocks.blocks_apply(kernel, type(busy[0].mixer), arguments, grad,
                                 sys.maxsize if only_reducing else paths.blocks_below)
    # only reductions of every state, no gradients: the all-states kernel hands them its chunks (`Segments.on_chunk`)
    chunks = all_states and segments.on_chunk and not grad and not compiling() \
        and all(_reduces_every_state(plan, tokens) and not plan.hooks for plan in busy)
    if every_token:
        available = [Strategy.LOOP] + ([Strategy.BLOCKS] if blocks else []) + ([Strategy.CHUNKS] if chunks else [])
    else:
        available = [Strategy.LOOP, Strategy.STATES if every_state else Strategy.SEGMENTS]
    constants = shape = None
    if segments is not None and segments.shape is not None and arguments is not None:
        shape = segments.shape(arguments)
        if paths.rule == "cost" and shape is not None:
            constants = _constants_of(shape, arguments, paths)
    # the paths within the memory budget (`held_bytes`; all of them for a kernel that declares no shape)
    fitting = available if shape is None else _within(available, _held(shape, busy, tokens, stops, grad, arguments),
                                                       budget_of(paths, _device_of(arguments)))
    if paths.force in available:
        path = paths.force
    elif every_state and grad and Strategy.STATES in fitting:  # measured: the adjoint's backward beats the loop's
        path = Strategy.STATES
    elif chunks and Strategy.CHUNKS in fitting:  # measured: the reductions' cheapest path (docs/performance.md)
        path = Strategy.CHUNKS
    elif only_reducing and Strategy.BLOCKS in fitting:  # measured: half the loop's time at Qwen3.5 dims
        path = Strategy.BLOCKS
    elif constants is None:  # no cost model for this call: the fixed rule, within the budget
        path = available[-1] if every_token else _fixed_rule(stops, every_state, tokens)
        path = path if path in fitting else fitting[0]
    else:
        path = _cheapest(fitting, _estimates(constants, shape, tokens, stops, paths.tails))
    if path is Strategy.LOOP:
        return None
    if path is Strategy.BLOCKS:
        return Choice(path, list(range(tokens)), False)
    if path is Strategy.CHUNKS:
        return Choice(path, [], False)
    if path is Strategy.STATES:
        return Choice(path, sorted(stops), True)
    tails = () if constants is None else segments_cost(constants, shape, tokens, stops, paths.tails)[1]
    if tails and sum(end - start for start, end in tails) == tokens:
        return None  # every piece shorter than a chunk, run by the loop: the token loop itself, in one call
    return Choice(path, sorted(stops), False, tails)
