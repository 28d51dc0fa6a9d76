"""The memory budget of a busy call's paths: the bytes each path holds beyond the bound kernel's, and the budget.

Each path's bytes beyond the bound kernel's are bounded by `held_bytes` from the call's shape (`costs.Shape`) and
the kind's declared footprint (`Shape.graph`, `Shape.loop_graph`): the token loop's graph under autograd, the
pieces' graphs padded to whole chunks, a block of states, every state of a call bound for another device. Paths
over the budget (`Paths.memory_budget`; default `DEFAULT_BUDGET_SHARE` of the device's memory, `budget_of`) are
passed over where one within it is available, before the rule or the cost model picks (`choose`); where none is,
the one holding least is taken.

Module contents: `held_bytes(shape, tokens, stops, grad, ...)`, `graph_bytes`; `budget_of(paths, device)`,
`device_memory(device)`, `note_device(device)` (read a device's memory once, before torch.compile traces).
"""

import math
import os
from collections.abc import Iterable

import torch

from ..policy import Paths, Strategy
from ..tracing import compiling
from . import blocks
from .costs import STATES_CHUNK, Shape, pieces

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


def held_bytes(
    shape: Shape,
    tokens: int,
    stops: Iterable[int],
    grad: bool,
    kept: int = 0,
    elsewhere: bool = False,
    reducing: bool = False,
) -> dict[Strategy, float]:
    """At most the bytes each path holds on the call's device beyond what the bound kernel holds on the same call
    (measured at real dims, tests/engine/test_path_memory.py), S being one state of the call (batch included, float32):
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
    reduction = 2 * blocks.BLOCK * state if reducing else 0.0
    if grad:
        parts = pieces(stops, tokens)
        loop = max(2 * state, (shape.loop_graph * tokens + kept + 2) * state - graph_bytes(shape, tokens))
        segments = (
            sum(graph_bytes(shape, end - start) for start, end in parts)
            - graph_bytes(shape, tokens)
            + len(parts) * state
        )
        states = STATES_CHUNK * state
    else:
        loop = 2 * state + reduction
        segments = graph_bytes(shape, shape.chunk) + 2 * state
        states = STATES_CHUNK * state + (tokens * state if elsewhere else 0.0)
    return {
        Strategy.SEGMENTS: segments,
        Strategy.STATES: states,
        Strategy.BLOCKS: 1.5 * blocks.BLOCK * state + reduction,
        Strategy.CHUNKS: 2 * STATES_CHUNK * state,
        Strategy.LOOP: loop,
    }
