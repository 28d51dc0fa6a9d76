"""Which path a busy prompt call takes (`choose`): the paths it can take, those within the memory budget, then the
policy's force, a measured preference, the fixed rule or the cost model's cheapest.

The paths are listed in `policy.Strategy`. Grad mode decides what is available: no BLOCKS or CHUNKS with
gradients, STATES with gradients only where the kind declares an adjoint recurrence (`Segments.adjoint`) and no
hook or write stops the call; every state kept with gradients takes STATES where it can (measured faster than the
token loop under autograd, docs/performance.md). Within the memory budget (`budget`), the cost model (`costs`)
picks the cheapest, or the fixed rule: the segments (or the chunk-wise kernel when every state is kept) when there
are at most max(8, T / 32) stops, else the token loop (a hook on every token: blocks where `blocks.blocks_apply`
allows them). A call takes the fixed rule when its kernel declares no shape (lightning attention's `Kernel.stops`,
or a `Segments` without `shape`), when its device and dtype have no calibration (a GPU: `support()` says which rule
a model gets), or when `Paths(rule="fixed")` asks for it.
"""

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import Kernel
from ..policy import DEFAULT, Choice, Constants, Paths, Strategy
from ..tracing import compiling
from .blocks import blocks_apply
from .budget import budget_of, held_bytes
from .costs import Shape, costs_for, estimators, segments_cost


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


def _held(
    shape: Shape, busy: list[Any], tokens: int, stops: set[int], grad: bool, arguments: dict[str, Any] | None
) -> dict[Strategy, float]:
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
            elsewhere |= (
                target is not None
                and device is not None
                and not (target.type == device.type and target.index in (None, device.index))
            )
    return held_bytes(shape, tokens, stops, grad, kept, elsewhere, reducing)


def _reduces_every_state(plan: Any, tokens: int) -> bool:
    """Whether `plan` keeps a reduction (`watch(reduce=...)`) of every state of a call of `tokens` > 1 tokens."""
    return bool(plan.keep) and getattr(plan, "reduce", None) is not None and len(plan.keep) == tokens > 1


def choose(
    kernel: Kernel,
    busy: list[Any],
    tokens: int,
    arguments: dict[str, Any] | None = None,
    grad: bool | None = None,
    paths: Paths = DEFAULT,
) -> Choice | None:
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
    blocks = (
        every_token
        and all_states
        and not grad
        and arguments is not None
        and blocks_apply(kernel, busy[0].kind, arguments, grad, sys.maxsize if only_reducing else paths.blocks_below)
    )
    # only reductions of every state, no gradients: the all-states kernel hands them its chunks (`Segments.on_chunk`)
    chunks = (
        all_states
        and segments.on_chunk
        and not grad
        and not compiling()
        and all(_reduces_every_state(plan, tokens) and not plan.hooks for plan in busy)
    )
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
    fitting = (
        available
        if shape is None
        else _within(
            available, _held(shape, busy, tokens, stops, grad, arguments), budget_of(paths, _device_of(arguments))
        )
    )
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
        path = _cheapest(fitting, estimators(constants, shape, tokens, stops, paths.tails))
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
