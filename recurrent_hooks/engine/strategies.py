"""Which path a busy prompt call takes: an estimate of each path's cost from the call's shapes, the cheapest wins.

A call with hooks, writes or kept states ("busy") can run in several ways (`dispatch._Tap._run_kernel`):
- `Path.SEGMENTS`: the kernel bound before the watch on the pieces between the stops (the tokens with
  hooks, writes or kept states), chaining the state through its `initial_state` argument. A piece may end
  with a short token loop from its last chunk boundary to its stop (`Choice.tails`, only with `TAILS` on): a
  chunked kernel pads every call up to a multiple of its chunk, so a stop just past a boundary pays for a whole
  chunk;
- `Path.STATES`: the library's chunk-wise all-states kernel (`Segments.all_states`), when every state is
  kept and gradients are off (with a hook at a few tokens, in segments around them);
- `Path.BLOCKS`: a hook at every token, gradients off, with the states computed a block at a time by the
  all-states kernel (`blocks`; estimated like STATES, and available only where `blocks.blocks_apply` says
  blocks were measured to beat the token loop: a state of at most `Segments.blocks_below` elements);
- `Path.LOOP`: the library's token loop (`Kernel.loop`), one Python step per token.

The model. Each prompt kernel with `Segments.shape` declares its call's cost-relevant shape (`Shape`: batch,
heads, the two dims of a head's state k x v, the bound kernel's chunk size, and which set of `CONSTANTS` it is
timed by). Each of three computations costs a sum of terms, each term a count times a fitted constant:
    kernel(T): the bound kernel on T tokens, padded to n = ceil(T / chunk) chunks: per call, per chunk, per
               head-chunk, per head-chunk's chunk^2, per element-product chunk^2 (k + v) + chunk k v;
    loop(T):   the token loop: per call, per token, per head-token, per state element per token;
    states(T): the all-states kernel, in blocks of 16: per call, per block, per head-block, per head-token
               times 16 k, per state element per token
(`kernel_terms`, `loop_terms`, `states_terms`; a head is one batch row's head, work = batch * heads). SEGMENTS
is the sum over its pieces, each piece kernel(piece) or, with `TAILS` on, the cheaper of that and kernel(its whole
chunks) + loop(rest);
STATES the sum of states(piece); BLOCKS states(T); LOOP loop(T). The constants are seconds, fitted by
`benchmarks/paths.py --calibrate` on this project's machine (see `CONSTANTS`). Grad mode only decides what is
available (no STATES or BLOCKS with gradients): its cost is not modelled.

A kernel without a declared shape (lightning attention's `Kernel.stops`, or a `Segments` without `shape`)
keeps the fixed rule of before: the segments (or the chunk-wise kernel when every state is kept) when there
are at most max(8, T / 32) stops, else the token loop.

Module contents:
- `Path`, `Choice`: the paths and a call's choice (its path, its stops, whether every state is kept
  chunk-wise, and the token ranges of SEGMENTS that the token loop runs);
- `Shape`, `Constants`, `CONSTANTS`: the model's inputs and its fitted constants;
- `costs(shape, tokens, stops)`: each path's estimate; `choose(kernel, busy, tokens, arguments)`: the choice;
- `BY_COST` (False: the fixed rule for every kernel), `FORCE` (a path to take whenever it is available)
  and `TAILS` (token-loop tails; off by default, see there): internal switches for the tests and the benchmark.
"""

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import blocks as _blocks
from .kernels import Kernel


class Path(enum.Enum):
    SEGMENTS = "segments"
    STATES = "chunk-wise states"
    BLOCKS = "blocks"
    LOOP = "token loop"


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a busy call runs: its path, the tokens to stop at (sorted), whether every state is kept chunk-wise
    between them, and for SEGMENTS the token ranges `[start, end)` that the token loop runs instead of the
    bound kernel (each one from a piece's last chunk boundary to its end)."""

    path: Path
    stops: list[int]
    every_state: bool
    tails: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Shape:
    """A prompt kernel call's cost-relevant shape (declared by its `Segments.shape` from the bound arguments)."""

    constants: str  # the key of its CONSTANTS (the kernels timed alike)
    batch: int
    heads: int
    key_dim: int  # rows of one head's state (gated DeltaNet: key_dim; Mamba-2: head_dim)
    value_dim: int  # its columns (gated DeltaNet: value_dim; Mamba-2: d_state)
    chunk: int  # the bound kernel's chunk size: each call is padded up to a multiple of it


@dataclasses.dataclass(frozen=True)
class Constants:
    """Seconds per unit of each term of each path's cost (`kernel_terms`, `loop_terms`, `states_terms`)."""

    kernel: tuple[float, ...]
    loop: tuple[float, ...]
    states: tuple[float, ...]


# Fitted by `python benchmarks/paths.py --calibrate` (non-negative least squares on relative error, each path
# timed over its grid of shapes, best of 5; float32, no gradients, 1 thread) on this project's 2-core CPU
# machine, 1 December 2026 13:12 UTC (load average about 1-3: other jobs shared the machine), torch 2.13,
# transformers 5.24. The fits' worst relative errors on their own timings were 34-71%: they rank paths that
# differ by more than that; `benchmarks/paths.py` checks the ranking on whole forwards.
CONSTANTS = {
    # transformers' torch_chunk_gated_delta_rule (chunk 64) and the library's delta-rule loop and kernel
    "delta rule": Constants(kernel=(9.7e-05, 0, 0, 2.5e-08, 1.4e-10), loop=(1.8e-05, 5e-05, 5.2e-08, 2.1e-09),
                            states=(0.00019, 0.00021, 3.2e-05, 4.8e-09, 3.4e-09)),
    # transformers' mamba2_chunk_scan (its torch path) and the library's SSD loop and kernel
    "ssd": Constants(kernel=(0.00046, 0, 7.2e-06, 9.9e-09, 1.2e-10), loop=(0.00021, 4.5e-05, 1e-07, 2.3e-09),
                     states=(0.00023, 8.9e-06, 8.6e-06, 0, 4.3e-09)),
    # transformers' chunk_kimi_delta_attention (chunk 64, a Python loop over each chunk's rows) and the library's
    "kimi delta": Constants(kernel=(0, 0, 0, 3.1e-07, 4.5e-09), loop=(8.7e-06, 4.2e-05, 3.4e-07, 2e-09),
                            states=(4.1e-05, 0.0004, 0.00014, 1.6e-09, 4.3e-09)),
}

STATES_BLOCK = 16  # the all-states kernels' block of tokens

BY_COST = True  # False: every kernel takes the fixed rule (the tests of each path use it)
FORCE: Path | None = None  # internal (benchmarks): take this path whenever the call can
# Token-loop tails: off. At the kernel, on a quiet machine, a 65-token Mamba-2 piece (mamba2-130m dims, chunk 256)
# took 35 ms through the token loop and 50 ms through the kernel; in whole forwards (benchmarks/paths.py, T = 1024,
# 8 positions) segments with tails measured 0.98 to 1.12 x the whole pieces over five runs, gdn_small (T = 512)
# 0.81 to 1.12: no gain above the noise (docs/performance.md). True: a piece ends in a tail where the estimate
# says it pays.
TAILS = False


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
    """The all-states kernel, in blocks of 16 tokens: per call, per block, per head-block, per head-token's
    block (its i x j decay masks), per state element per token (each state is written once)."""
    work = shape.batch * shape.heads
    blocks = math.ceil(tokens / STATES_BLOCK)
    return [1.0, blocks, work * blocks, work * tokens * STATES_BLOCK * shape.key_dim,
            work * tokens * shape.key_dim * shape.value_dim]


def _dot(coefficients: tuple[float, ...], terms: list[float]) -> float:
    return sum(c * t for c, t in zip(coefficients, terms, strict=True))


def kernel_cost(shape: Shape, tokens: int) -> float:
    """The bound kernel on `tokens` tokens, padded up to whole chunks."""
    return _dot(CONSTANTS[shape.constants].kernel, kernel_terms(shape, tokens)) if tokens > 0 else 0.0


def loop_cost(shape: Shape, tokens: int) -> float:
    """The token loop on `tokens` tokens."""
    return _dot(CONSTANTS[shape.constants].loop, loop_terms(shape, tokens)) if tokens > 0 else 0.0


def states_cost(shape: Shape, tokens: int) -> float:
    """The all-states kernel on `tokens` tokens."""
    return _dot(CONSTANTS[shape.constants].states, states_terms(shape, tokens)) if tokens > 0 else 0.0


def pieces(stops: Iterable[int], tokens: int) -> list[tuple[int, int]]:
    """The `[start, end)` pieces a call runs in: each ends just after a stop, the last at the call's end."""
    out, start = [], 0
    for end in [*(stop + 1 for stop in sorted(stops)), tokens]:
        if end > start:
            out.append((start, end))
            start = end
    return out


def _piece(shape: Shape, start: int, end: int) -> tuple[float, tuple[int, int] | None]:
    """A piece of SEGMENTS: its cost, and the range the token loop runs at its end (None: the kernel runs all)."""
    whole = kernel_cost(shape, end - start)
    boundary = start + (end - start) // shape.chunk * shape.chunk
    if boundary == end or not TAILS:
        return whole, None
    split = kernel_cost(shape, boundary - start) + loop_cost(shape, end - boundary)
    return (split, (boundary, end)) if split < whole else (whole, None)


def segments_cost(shape: Shape, tokens: int, stops: Iterable[int]) -> tuple[float, tuple[tuple[int, int], ...]]:
    """SEGMENTS: its cost and its tails (the ranges the token loop runs)."""
    total, tails = 0.0, []
    for start, end in pieces(stops, tokens):
        cost, tail = _piece(shape, start, end)
        total += cost
        if tail is not None:
            tails.append(tail)
    return total, tuple(tails)


def _estimates(shape: Shape, tokens: int, stops: Iterable[int]) -> dict[Path, Callable[[], float]]:
    """Each path's estimate, as a function (a choice computes only those of the paths it can take)."""
    return {Path.SEGMENTS: lambda: segments_cost(shape, tokens, stops)[0],
            Path.STATES: lambda: sum(states_cost(shape, end - start) for start, end in pieces(stops, tokens)),
            Path.BLOCKS: lambda: states_cost(shape, tokens),
            Path.LOOP: lambda: loop_cost(shape, tokens)}


def _cheapest(available: list[Path], estimate: dict[Path, Callable[[], float]]) -> Path:
    """The available path of the lowest estimate (the first of equal ones). A plain loop, not `min(key=...)`:
    `choose` runs while torch.compile traces a forward, and dynamo cannot trace `min` with a key."""
    best, lowest = available[0], estimate[available[0]]()
    for path in available[1:]:
        cost = estimate[path]()
        if cost < lowest:
            best, lowest = path, cost
    return best


def costs(shape: Shape, tokens: int, stops: Iterable[int]) -> dict[Path, float]:
    """Each path's estimated seconds for a call of `tokens` tokens stopping at `stops` (available or not)."""
    return {path: estimate() for path, estimate in _estimates(shape, tokens, stops).items()}


def _fixed_rule(stops: set[int], every_state: bool, tokens: int) -> Choice | None:
    """The rule of before: a few stops run the fast path, else the token loop."""
    if len(stops) > max(8, tokens // 32):
        return None
    return Choice(Path.STATES if every_state else Path.SEGMENTS, sorted(stops), every_state)


def choose(kernel: Kernel, busy: list[Any], tokens: int, arguments: dict[str, Any] | None = None,
           grad: bool | None = None) -> Choice | None:
    """The path of a busy call (its plans `busy`, each with `hooks` and `keep`): a `Choice`, or None for the
    token loop. `arguments`: the call's bound arguments, from which the kernel's `Segments.shape` reads its
    shape; `grad`: whether gradients are on (default: `torch.is_grad_enabled()`)."""
    grad = torch.is_grad_enabled() if grad is None else grad
    segments = kernel.segments
    if segments is None and not kernel.stops:
        return None
    all_states = segments is not None and segments.all_states is not None
    stops: set[int] = set()
    every_state = every_token = False
    for plan in busy:
        if any(positions is None for _, positions in plan.hooks):
            if tokens > 1:
                every_token = True
                continue
            stops.add(0)  # every token of a one-token call (a decode step): a stop at it
        stops.update(p for _, positions in plan.hooks if positions is not None for p in positions)
        if plan.keep and len(plan.keep) == tokens and all_states and not grad:
            every_state = True
        elif plan.keep:
            stops.update(plan.keep)
    # blocks where they were measured to beat the token loop (`blocks.blocks_apply`: the state's size)
    blocks = every_token and all_states and not grad and arguments is not None \
        and _blocks.blocks_apply(kernel, type(busy[0].mixer), arguments, grad)
    shape = None
    if BY_COST and segments is not None and segments.shape is not None and arguments is not None:
        shape = segments.shape(arguments)
    if shape is None:  # no cost model for this kernel: the fixed rule
        if every_token:
            return Choice(Path.BLOCKS, list(range(tokens)), False) if blocks else None
        return _fixed_rule(stops, every_state, tokens)
    if every_token:
        available = [Path.LOOP] + ([Path.BLOCKS] if blocks else [])
    else:
        available = [Path.LOOP, Path.STATES if every_state else Path.SEGMENTS]
    path = FORCE if FORCE in available else _cheapest(available, _estimates(shape, tokens, stops))
    if path is Path.LOOP:
        return None
    if path is Path.SEGMENTS:
        tails = segments_cost(shape, tokens, stops)[1]
        if sum(end - start for start, end in tails) == tokens:
            return None  # every piece shorter than a chunk, run by the loop: the token loop itself, in one call
        return Choice(path, sorted(stops), False, tails)
    if path is Path.BLOCKS:
        return Choice(path, list(range(tokens)), False)
    return Choice(path, sorted(stops), True)
