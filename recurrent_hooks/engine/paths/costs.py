"""The cost model of a busy prompt call's paths: each path's estimated seconds from the call's shapes.

The model. Each prompt kernel with `Segments.shape` declares its call's cost-relevant shape (`Shape`: batch,
heads, the two dims of a head's state k x v, the bound kernel's chunk size, and which kernel key its constants are
filed under). Each of three computations costs a sum of terms, each term a count times a fitted constant:
    kernel(T): the bound kernel on T tokens, padded to n = ceil(T / chunk) chunks: per call, per chunk, per
               head-chunk, per head-chunk's chunk^2, per element-product chunk^2 (k + v) + chunk k v;
    loop(T):   the token loop: per call, per token, per head-token, per state element per token;
    states(T): the all-states kernel, in chunks of `STATES_CHUNK`: per call, per chunk, per head-chunk, per
               head-token times STATES_CHUNK k, per state element per token
(`kernel_terms`, `loop_terms`, `states_terms`; a head is one batch row's head, work = batch * heads). The paths
(`policy.Strategy`): SEGMENTS is the sum over its pieces, each piece kernel(piece) or, with `Paths(tails=True)`,
the cheaper of that and kernel(its whole chunks) + loop(rest); STATES the sum of states(piece); BLOCKS and CHUNKS
states(T); LOOP loop(T). The constants (`policy.Constants`) are seconds, fitted by
`benchmarks/paths.py --calibrate --write` per device type and dtype, and read from the data file `costs.json`
next to this module (keyed "cpu/float32": the package ships the CPU one), once, at the first watch or standalone
hook (`costs_for`). Grad mode is not modelled: it decides which paths are available (`choose`).

Module contents:
- `Shape`: the model's input, declared per kernel call; `STATES_CHUNK`;
- `costs_for(device, dtype)`: the calibration of a device type and dtype (None: none), from `costs.json`
  (`COSTS_FILE`, `read_costs`, `load_costs`); `calibration_key(device, dtype)`: its key there;
- `kernel_terms`, `loop_terms`, `states_terms` and `kernel_cost`, `loop_cost`, `states_cost`, `segments_cost`:
  the terms and the costs; `pieces(stops, tokens)`: the pieces a call runs in;
- `estimates(shape, tokens, stops, constants)`: each path's estimate; `estimators(...)`: the same, each as a
  function (a choice computes only those of the paths it can take).
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Iterable

import torch

from ..policy import Constants, Strategy


@dataclasses.dataclass(frozen=True)
class Shape:
    """A prompt kernel call's cost-relevant shape (declared by its `Segments.shape` from the bound arguments)."""

    constants: str  # its kernel key in a calibration ("delta rule", "ssd": the kernels timed alike)
    batch: int
    heads: int
    key_dim: int  # rows of one head's state (gated DeltaNet: key_dim; Mamba-2: head_dim)
    value_dim: int  # its columns (gated DeltaNet: value_dim; Mamba-2: d_state)
    chunk: int  # the bound kernel's chunk size: each call is padded up to a multiple of it
    # its memory footprint (`memory.held_bytes`), measured at real dims (tests/engine/test_path_memory.py): the bound
    # kernel's autograd graph per chunk, in units of batch * heads * (chunk^2 + chunk (k + v) + k v) float32
    # elements, and the token loop's graph per token under autograd, in states
    graph: float = 0.0
    loop_graph: float = 0.0


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
    return {
        key: {
            name: Constants(*(tuple(float(c) for c in fit[part]) for part in ("kernel", "loop", "states")))
            for name, fit in entry["kernels"].items()
        }
        for key, entry in data.items()
    }


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
    return [
        1.0,
        chunks,
        work * chunks,
        work * tokens * STATES_CHUNK * shape.key_dim,
        work * tokens * shape.key_dim * shape.value_dim,
    ]


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


def _piece(
    constants: Constants, shape: Shape, start: int, end: int, tails: bool
) -> tuple[float, tuple[int, int] | None]:
    """A piece of SEGMENTS: its cost, and the range the token loop runs at its end (None: the kernel runs all;
    always, without `tails`)."""
    whole = kernel_cost(constants, shape, end - start)
    boundary = start + (end - start) // shape.chunk * shape.chunk
    if boundary == end or not tails:
        return whole, None
    split = kernel_cost(constants, shape, boundary - start) + loop_cost(constants, shape, end - boundary)
    return (split, (boundary, end)) if split < whole else (whole, None)


def segments_cost(
    constants: Constants, shape: Shape, tokens: int, stops: Iterable[int], tails: bool = False
) -> tuple[float, tuple[tuple[int, int], ...]]:
    """SEGMENTS: its cost and its tails (the ranges the token loop runs; none without `tails`)."""
    total, looped = 0.0, []
    for start, end in pieces(stops, tokens):
        cost, tail = _piece(constants, shape, start, end, tails)
        total += cost
        if tail is not None:
            looped.append(tail)
    return total, tuple(looped)


def estimators(
    constants: Constants, shape: Shape, tokens: int, stops: Iterable[int], tails: bool
) -> dict[Strategy, Callable[[], float]]:
    """Each path's estimate, as a function (a choice computes only those of the paths it can take)."""
    return {
        Strategy.SEGMENTS: lambda: segments_cost(constants, shape, tokens, stops, tails)[0],
        Strategy.STATES: lambda: sum(
            states_cost(constants, shape, end - start) for start, end in pieces(stops, tokens)
        ),
        Strategy.BLOCKS: lambda: states_cost(constants, shape, tokens),
        Strategy.CHUNKS: lambda: states_cost(constants, shape, tokens),
        Strategy.LOOP: lambda: loop_cost(constants, shape, tokens),
    }


def estimates(
    shape: Shape, tokens: int, stops: Iterable[int], constants: Constants, tails: bool = False
) -> dict[Strategy, float]:
    """Each path's estimated seconds for a call of `tokens` tokens stopping at `stops` (available or not)."""
    return {path: estimate() for path, estimate in estimators(constants, shape, tokens, stops, tails).items()}
