"""What the token loops of every kind share: the `on_token` contract, the starting state, refusals, the
chunk-wise decay mask.

Module contents:
- `OnToken`: `on_token(t, state) -> state`, the library's keyword-only argument of every token loop:
  called after token t's update with the state token t+1 would continue from; it returns the state
  token t+1 continues from (the same one, or a hook's or write's replacement).
- `OnChunk`: `on_chunk(start, states) -> None`, what an all-states kernel that declares `Segments.on_chunk` hands
  each chunk's states to, `[size, batch, *state]` for tokens `start .. start + size - 1`: a view of the kernel's one
  chunk buffer, which the next chunk overwrites (read it, do not keep it); `chunked(on_chunk, tokens)`, an
  `on_token` that gathers a token loop's states into such a buffer and hands it over when full.
- `Visit`: `visit(t, mu) -> None | Tensor`, what a kind's adjoint recurrence (`kernels.Segments.adjoint`) calls right
  to left with mu_t, the gradient of the state after token t through the later tokens (a temporary the walk
  goes on changing in place: read or copy it, do not keep it); a tensor it returns replaces mu_t and is then
  the walk's own (a gradient sent to that state from elsewhere, added);
  `visited(visit, t, mu)` applies that rule.
- `at_least_float32(dtype)`: float32, or the model's dtype where it is wider (float64);
- `starting_state(initial, zeros)`: a float32 copy of the state a call starts from (the cache writes
  into its tensor in place later), or `zeros()` when the call starts from nothing.
- `refuse_packed(kwargs, names, needs)`: packed sequences are refused, naming the package that runs them.
- `states_buffer(out, shape)`: a caller's buffer for a chunk-wise all-states kernel, checked (its first tokens);
- `causal_decay(cum)`: within a chunk, exp(c_i - c_j) for j <= i and 0 above the diagonal; `flushed_exp(x)`:
  exp with the subnormal range flushed to 0 (what the chunk-wise kernels take decays with);
  `rank_one_steps(states, state, decay, left, right)`: a chunk's states S_i = decay_i S_{i-1} + left_i right_i^T,
  token by token into a buffer (how the chunk-wise kernels form the states they hand to `on_chunk`).
- `version_of(window)`, `handed_back_changed(window, version, written)`: whether `on_token` replaced a
  convolution window or changed it in place (then the next positions that read it are recomputed).
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..errors import RecurrentHooksError
from ..tracing import compiling
from .memory_parts import State

OnToken = Callable[[int, State], State]
OnChunk = Callable[[int, Tensor], None]
Visit = Callable[[int, Tensor], "Tensor | None"]


def visited(visit: Visit, t: int, mu: Tensor) -> Tensor:
    """`visit(t, mu)`, and what the adjoint continues from: its returned tensor, or mu."""
    replaced = visit(t, mu)
    return mu if replaced is None else replaced


def chunked(on_chunk: OnChunk, tokens: int, chunk: int = 16) -> OnToken:
    """An `on_token` for a token loop of `tokens` tokens that copies each state into one buffer of `chunk` tokens
    (`[chunk, *state]`, made at the first token) and hands it to `on_chunk` when it is full and at the last token;
    it returns the state unchanged."""
    buffer: list[Tensor] = []

    def on_token(t: int, state: Tensor) -> Tensor:
        if not buffer:
            buffer.append(state.new_empty(min(chunk, tokens), *state.shape))
        i = t % chunk
        buffer[0][i].copy_(state)
        if i == chunk - 1 or t == tokens - 1:
            on_chunk(t - i, buffer[0][: i + 1])  # i b ..   the states of tokens t - i .. t
        return state

    return on_token


def starting_state(initial: Tensor | None, zeros: Callable[[], Tensor], dtype: torch.dtype = torch.float32) -> Tensor:
    """The state a call starts from, in `dtype` (float32 by default) and a copy of the cache's tensor (which is
    written in place later)."""
    return zeros() if initial is None else initial.to(dtype, copy=True)


def states_buffer(out: Tensor, shape: tuple[int, ...]) -> Tensor:
    """`out` as the float32 all-states buffer of `shape` (token first): its leading tokens when it has more."""
    if out.dtype != torch.float32 or tuple(out.shape[1:]) != tuple(shape[1:]) or out.shape[0] < shape[0]:
        raise RecurrentHooksError(
            f"all-states buffer: expected float32 {list(shape)} (or more tokens), got {out.dtype} {list(out.shape)}"
        )
    return out[: shape[0]]


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype a recurrence computes in where transformers' kernel mixes float32 parameters with the model's
    tensors (torch's promotion): float32 for half precision, the model's dtype above it (float64)."""
    return torch.promote_types(dtype, torch.float32)


def refuse_packed(kwargs: dict[str, Any], names: Iterable[str], needs: str) -> None:
    """Raise for packed sequences, which the token loops (one sequence per batch row) cannot run."""
    for name in names:
        if kwargs.get(name) is not None:
            raise RecurrentHooksError(
                f"packed sequences ({name}) need {needs}; the token loop runs one sequence per batch row"
            )


def version_of(window: Tensor) -> "int | Tensor":
    """What tells an in-place change of the window later: its version counter, or for an inference tensor
    (`torch.inference_mode()`, which has none) a copy of its values."""
    if compiling():
        return 0  # unused: `handed_back_changed` tells a change by identity in a graph
    return window.clone() if window.is_inference() else window._version


def handed_back_changed(window: Tensor, version: "int | Tensor", written: Tensor) -> bool:
    """Whether `on_token` changed the window it was handed (`version`: `version_of` it before the call), in place
    or by returning another tensor; the same values in the same memory and layout count as unchanged."""
    if compiling():  # no version counters in a graph; a hook's result is a new tensor there
        return written is not window
    if window._version != version if isinstance(version, int) else not torch.equal(window, version):
        return True
    return not (written is window or (written.data_ptr() == window.data_ptr() and written.stride() == window.stride()))


def causal_decay(cum: Tensor) -> Tensor:
    """`[i, j, ...]`: exp(cum_i - cum_j) where j <= i (the decay from token j to token i), 0 above the diagonal.

    `cum` is `[i, ...]`, the cumulative log decay from the chunk's start to each token."""
    size = cum.shape[0]
    causal = torch.ones(size, size, dtype=torch.bool, device=cum.device).tril()
    causal = causal.view(size, size, *(1,) * (cum.dim() - 1))
    return flushed_exp((cum[:, None] - cum[None, :]).masked_fill(~causal, -torch.inf))


def chunk_formed(states: Tensor, start: int, on_chunk: OnChunk | None) -> Tensor:
    """A chunk's states are formed (`[size, *state]`, from token `start`): hand them to `on_chunk` if given (they are
    then in the one chunk buffer it reuses) and return the state the next chunk starts from, its own copy there."""
    if on_chunk is None:
        return states[-1]
    last = states[-1].clone()  # (the next chunk overwrites the buffer)
    on_chunk(start, states)
    return last


def scratch_like(state: Tensor) -> Tensor | None:
    """One state-sized buffer a token loop reuses for each token's temporary products, or None with gradients on
    (autograd keeps each product for the backward). A fresh tensor per product costs an allocation of a state's
    size per op, which the allocator can hand back to the system and fault in again (measured: docs/performance.md,
    "Performance, third round")."""
    return None if torch.is_grad_enabled() else torch.empty_like(state)


def times(x: Tensor, y: Tensor, out: Tensor | None) -> Tensor:
    """x * y, into `out` when given (`scratch_like`): the same rounding either way."""
    return x * y if out is None else torch.mul(x, y, out=out)


def plus(state: Tensor, update: Tensor, own: bool) -> Tensor:
    """state + update, in place where `own` (state is a fresh tensor of this token's step, not yet handed to a
    hook): the same rounding either way."""
    return state.add_(update) if own else state + update


def rank_one_steps(states: Tensor, state: Tensor, decay: Tensor, left: Tensor, right: Tensor) -> None:
    """Write S_i = decay_i S_{i-1} + left_i right_i^T into `states[i]` for each token i of a chunk, from S_{-1} =
    `state`: `states` `[chunk, *lead, rows, cols]` (not holding `state`), decay `[chunk, *lead, rows or 1]` (a
    decay per row, or one per state), left `[chunk, *lead, rows]`, right `[chunk, *lead, cols]`.

    Two passes over a state per token (a scaled copy, then a rank-one update in place), each reading the state the
    step before just wrote. Where every state is kept, the chunk-wise kernels form a chunk's states at once instead,
    by a product of inner size chunk (a batched gemm CPUs run far below their speed) and a pass adding the decayed
    start, measured slower per chunk (docs/performance.md, "Keeping a per-token reduction")."""
    # per token from one unbind each: a Python index per token and operand costs as much as a Mamba-2 step
    steps = zip(states.unbind(0), decay[..., None].unbind(0), left[..., None].unbind(0), right[..., None, :].unbind(0))
    for into, decay_i, left_i, right_i in steps:
        torch.mul(state, decay_i, out=into)  # *lead rows cols   decay_i S_{i-1}
        into.addcmul_(left_i, right_i)  # *lead rows cols   + left_i right_i^T
        state = into


FLUSH_BELOW = -60.0  # exp(-60) = 8.7e-27: a decay below it contributes nothing a float32 sum of unit terms can hold


def flushed_exp(x: Tensor) -> Tensor:
    """exp(x), 0 where x < `FLUSH_BELOW`. A decay that small times a key or state lands in the subnormal floats,
    which CPUs multiply several times slower (measured: docs/performance.md, "The studies at real layer dims"); what
    it drops is
    below 1e-26 of the sum's unit-sized terms (the current token's decay is 1), 19 orders under float32's
    resolution."""
    return x.masked_fill(x < FLUSH_BELOW, -torch.inf).exp()
