"""How a busy kernel call runs: one runner per path (`policy.Strategy`, where the paths are described), all with one
signature (`RUNNERS`).

A kernel call that some plan wants something of (hooks, writes, kept states: "busy") gets its path from
`choose.choose` under its handles' policy (`tap._fast_path`); `tap._Tap` then looks its runner up here
and calls it with the call (`BusyCall`): `run_loop` (on `Paths.loop_threads`), `run_segments` (`run_in_segments`),
`run_states` (with gradients: `keep_every_state`, `adjoint`), `run_blocks` (`blocks.run_in_blocks`),
`run_chunks` (`reduce_in_chunks`). The tests check each against the token loop.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import Kernel, Pieces, state_shape
from ..declare.memory_parts import map_parts, stack_parts
from ..errors import RecurrentHooksError
from ..policy import Choice, Strategy
from ..tracking.threads import loop_threads
from ..tracking.tracker import Plan
from . import adjoint as _adjoint
from . import blocks as _blocks
from . import visitor as _visitor


@dataclasses.dataclass
class BusyCall:
    """One busy kernel call, as every runner takes it."""

    kernel: Kernel
    original: Callable[..., Any]  # the kernel bound before the watch
    args: tuple
    kwargs: dict
    busy: list[list[Plan]]  # per memory the kernel updates, its busy plans
    takers: list[Any]  # per memory, the `visitor.Taker` that calls the plans and keeps what they keep
    arguments: dict[str, Any]  # the call's bound arguments
    choice: Choice | None  # `choose.choose`'s (None: the token loop)
    extra: dict[str, Any]  # the loop's extra keywords (`tokens`, `on_also`, `original`)

    def loop(self, **more: Any) -> Any:
        """The library's token loop over the call, on the policy's threads."""
        with threads_of(self.busy, self.arguments):
            return self.kernel.loop(*self.args, on_token=self.takers[0].on_token, **more, **self.extra, **self.kwargs)


def run_loop(call: BusyCall) -> Any:
    return call.loop()


def run_segments(call: BusyCall) -> Any:
    if call.kernel.segments is None:  # the loop computes fast between the stops itself (`Kernel.stops`)
        return call.loop(stops=call.choice.stops)
    return run_in_segments(
        call.kernel,
        call.original,
        call.args,
        call.kwargs,
        call.choice.stops,
        call.choice.tails,
        call.takers[0].on_token,
        [],
    )


def run_states(call: BusyCall) -> Any:
    if call.takers[0].differentiable:  # every state with gradients, no stop: all-states forward, adjoint backward
        return keep_every_state(call.kernel, call.original, call.args, call.kwargs, call.takers[0].storing)
    return run_in_segments(
        call.kernel,
        call.original,
        call.args,
        call.kwargs,
        call.choice.stops,
        call.choice.tails,
        call.takers[0].on_token,
        call.takers[0].storing,
    )


def run_blocks(call: BusyCall) -> Any:
    call.takers[0].borrowed = True  # the hooks get views of a block's states
    return _blocks.run_in_blocks(call.kernel, call.args, call.kwargs, call.takers[0].on_token)


def run_chunks(call: BusyCall) -> Any:
    with threads_of(call.busy, call.arguments):  # (its states formed token by token, then fn per chunk)
        held = _visitor.held_heads(call.busy[0][0])
        if held is not None and not held.held:  # a kernel run once per head (zamba), no head's states held yet
            return reduce_heads_in_chunks(call.kernel, call.original, call.args, call.kwargs, call.takers[0])
        return reduce_in_chunks(
            call.kernel, call.args, call.kwargs, call.takers[0], call.busy[0][0].kind, call.arguments
        )


RUNNERS: dict[Strategy, Callable[[BusyCall], Any]] = {
    Strategy.LOOP: run_loop,
    Strategy.SEGMENTS: run_segments,
    Strategy.STATES: run_states,
    Strategy.BLOCKS: run_blocks,
    Strategy.CHUNKS: run_chunks,
}


def threads_of(busy: list[list[Plan]], arguments: dict[str, Any]) -> Any:
    """`threads.loop_threads` for a call's path with per-token steps, by the policy of its first busy plan, on the
    device of its first tensor argument."""
    policy = next(plan.owner.policy for per_memory in busy for plan in per_memory)
    device = next((value.device for value in arguments.values() if isinstance(value, Tensor)), torch.device("cpu"))
    return loop_threads(policy.paths.loop_threads, device)


def reduce_in_chunks(
    kernel: Kernel, args: tuple, kwargs: dict, taker: Any, kind: type, arguments: dict[str, Any]
) -> Any:
    """A prompt call whose busy plans only reduce every state, without gradients (`policy.Strategy.CHUNKS`):
    the kernel's `all_states` runs once over the call and hands each of its chunks' states to `on_chunk`
    (`Segments.on_chunk`), which the reductions take as `[batch, chunk, *state]`, a view of the kernel's one
    chunk buffer (`fn` must not keep it: the next chunk overwrites it; a result in its memory is copied).
    Nothing holds more than one chunk of states, and no state is copied on the way to `fn`. A linear reduction
    (`linear_factors`) gets its readouts from the kernel instead, which forms no state (`Segments.readouts`)."""
    factors = linear_factors(kernel, kind, arguments, taker)

    def on_chunk(start: int, states: Tensor) -> None:  # states: [size, batch, *state], the kernel's buffer
        chunk = states.movedim(0, 1)  # batch size *state   a view: no copy (readouts: batch size heads r)
        tokens = range(start, start + states.shape[0])
        for reduction in taker.reducing:
            if factors is None:
                reduction.reduce(tokens, chunk, taker, buffer=states)
            else:
                reduction.keep(tokens, chunk, taker)

    pieces = Pieces(kernel, args, kwargs)
    leading, named = pieces.call(0, pieces.tokens, pieces.state)
    extra = {} if factors is None else {"factors": factors}
    (out, last), _ = kernel.segments.all_states(*leading, **named, on_chunk=on_chunk, **extra)
    return pieces.result([out], last)


def reduce_heads_in_chunks(kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict, taker: Any) -> Any:
    """`reduce_in_chunks` on a kind that runs its kernel once per head, head after head (`KERNEL_PER_HEAD`: zamba):
    the earlier heads' kernel calls run the bound kernel and hold their arguments (`visitor.HeldHeads.calls`: views
    of the tensors the forward holds anyway); the last head's call forms every head's states again, `Reduction.CHUNK`
    tokens at a time, and hands each chunk `[batch, chunk, heads, *head_state]` to the reductions. At most one chunk
    of every head's states is held (an earlier head's states are formed twice: once by the bound kernel, for its
    output, and once here)."""
    held = [_visitor.held_heads(reduction.plan) for reduction in taker.reducing]
    owner = taker.reducing[0].plan.owner
    head, heads = owner.head, owner.forward.kernel_calls
    pieces = Pieces(kernel, args, kwargs)
    if head < heads - 1:
        for each in held:
            each.calls.append(pieces)
        return original(*args, **kwargs)
    every = [*held[0].calls, pieces]
    if len(every) != heads:
        raise RecurrentHooksError(
            f"{owner.where}: the last head's kernel call ({head + 1} of {heads}) found"
            f" {len(every) - 1} earlier heads' calls on the chunk-wise reductions' path"
        )
    states = [each.state for each in every]
    outputs = []
    for start in range(0, pieces.tokens, _visitor.Reduction.CHUNK):
        end = min(start + _visitor.Reduction.CHUNK, pieces.tokens)
        formed = []
        for h, each in enumerate(every):
            leading, named = each.call(start, end, states[h])
            (out, states[h]), per_token = kernel.segments.all_states(*leading, **named)  # per_token: size batch ...
            formed.append(per_token)
        outputs.append(out)  # the last head's: the result of this call
        chunk = map_parts(lambda s: s.movedim(0, 1), stack_parts(formed, dim=2))  # batch size heads *head_state
        del formed
        for reduction in taker.reducing:
            reduction.reduce(range(start, end), chunk, taker, every_head=True)
        del chunk
    for each in held:
        each.calls.clear()
    return pieces.result(outputs, states[-1])


def linear_factors(kernel: Kernel, kind: type, arguments: dict[str, Any], taker: Any) -> tuple | None:
    """The factors (a, b) of the one reduction of a call when it declares itself linear, sum_ij a S b per head and
    rank (`linear_factors`, as `rh.probe`'s), the kernel forms readouts (`Segments.readouts`), the factors fit
    the call's state `[batch, heads, rows, cols]` and their rank is low enough that readouts cost less; else None
    (the reduction is called on the states, which raises what does not fit)."""
    if not kernel.segments.readouts or len(taker.reducing) != 1:
        return None
    factors = getattr(taker.reducing[0].plan.reduce, "linear_factors", None)
    shape = state_shape(kind, kernel, arguments)
    if factors is None or shape is None or len(shape) != 4:
        return None
    a, b = factors
    if a.dim() != 3 or b.dim() != 3 or (a.shape[0], a.shape[2], b.shape[2]) != shape[1:] or a.shape[:2] != b.shape[:2]:
        return None
    if a.shape[1] * kernel.segments.readouts >= 2 * b.shape[2]:  # a high rank: forming the states costs less
        return None
    device = next(value.device for value in arguments.values() if isinstance(value, Tensor))
    return a.to(device, torch.float32), b.to(device, torch.float32)


def keep_every_state(
    kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict, keeping: list[Plan]
) -> Any:
    """A prompt call keeping every state with gradients (`adjoint`): its states go to the `keeping`
    plans, per token and stacked (the tensor `autograd.grad(metric, mix.states)` differentiates)."""
    where = f"{keeping[0].where}, call {keeping[0].call}"
    result, states, per_token = _adjoint.keep_every_state(kernel, original, args, kwargs, where)
    states.retain_grad()  # (`loss.backward()` then fills `.states.grad`, as the token loop's leaf does)
    for plan in keeping:
        plan.kept.update(enumerate(per_token))
        plan.stacked = states
    return result


def run_in_segments(
    kernel: Kernel,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    stops: list[int],
    tails: tuple[tuple[int, int], ...],
    on_token: Callable[[int, Tensor], Tensor],
    keeping_all: list[Plan],
) -> Any:
    """Run `original` on the tokens between the stops, chaining the state through `on_token` at each stop.

    The token ranges `tails` (`[start, end)`, each inside one piece and ending it) run through the library's
    token loop instead, from the piece's last chunk boundary to its stop (`policy.Choice.tails`). With
    `keeping_all`, the pieces run through the kernel's chunk-wise `all_states` version instead, and the
    states of the tokens between the stops go to those plans (`visitor.Taker.finish` moves them to their keep device).
    `Segments.kernel`, when given, runs the pieces in place of `original` (which cannot start from a state).
    """
    segments = kernel.segments
    run = segments.all_states if keeping_all else segments.kernel or original
    pieces = Pieces(kernel, args, kwargs)
    state = pieces.state
    looped = dict(tails)  # start -> end of each range the token loop runs
    outputs = []
    start = 0
    for end in sorted({*(stop + 1 for stop in stops), *looped, pieces.tokens}):
        if end <= start:
            continue
        leading, named = pieces.call(start, end, state)
        if keeping_all:
            (out, state), states = run(*leading, **named)
            for plan in keeping_all:
                plan.kept.update((start + i, states[i]) for i in range(end - start))
        elif looped.get(start) == end:
            out, state = kernel.loop(*leading, **named)
        else:
            out, state = run(*leading, **named)
        outputs.append(out)
        if end - 1 in stops:
            state = on_token(end - 1, state)  # the state after the stop, as the token loop would hand it over
        start = end
    return pieces.result(outputs, state)
