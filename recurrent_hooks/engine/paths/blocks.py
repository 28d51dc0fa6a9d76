"""The blocks path: a hook on every token of a prompt, with the states computed a block of tokens at a time.

A hook over every token needs every token's state, in order, and may replace any of them. The token loop
(`Kernel.loop`) gives them one Python step per token. A prompt kernel whose `Segments` has `all_states`
(the library's chunk-wise version of the kernel, which returns every token's state too: gated DeltaNet,
Kimi delta attention, Mamba-2) can compute them `BLOCK` tokens at a time instead, vectorized inside each
of its chunks, and hand them to the hooks one by one afterwards:

    block [s, s + BLOCK):  (out, _), states = all_states(<the per-token arguments narrowed to the block>,
                                                        initial_state=<the state token s-1 ended with>)
    for t in the block:    returned = on_token(t, states[t - s])
                           if returned is not states[t - s] (or it was changed in place):
                               keep out[s..t], start the next block at t + 1 from `returned`

The token loop computes o_t before it calls `on_token(t, .)`, so a replacement at token t changes the outputs
from token t + 1 on: the outputs of the block up to t stand and the rest of the block is recomputed. With no
replacement, a call of T tokens costs ceil(T / BLOCK) chunk-wise calls and T calls of `on_token` (the hooks);
each replacement costs one more call. Memory is O(BLOCK): one block's states at a time, never the call's.

What counts as a replacement: `on_token` returns another tensor whose values differ from the state it was
handed, or it changed that state in place (its `_version` moved; the states of a block are views of one
buffer, which share a version counter, so an in-place change anywhere in the block counts: conservative).
A returned copy with the same values (the dispatcher hands back a kept state as a tensor of its own) is no
replacement. Only without gradients (the kept states must be the tensors the recurrence used) and outside
`torch.inference_mode()` (inference tensors have no version counter); `blocks_apply` checks both.

When: `blocks_apply`, a call whose state has at most `Segments.blocks_below` elements (batch included; the
size is read off the kind's `STATE` and `INPUTS` declarations). Measured (`benchmarks/blocks.py`;
docs/performance.md, "The blocks path", has the numbers): at small states blocks beat the token loop, at larger
ones they lose, since `all_states` writes every state through memory and computes each from its chunk's start,
while the loop finds the state it just computed in the cache.

`BLOCK` = 64, by measurement (the same section). The per-block Python cost (one chunk-wise call: binding,
`narrow`s, the buffer) is spread over 64 tokens, a block is a few of the chunk-wise kernels' own 16-token chunks, a
replacement recomputes at most one block, and the buffer stays small (64 states of 4 heads x 16 x 16 are 256 KB).

Glossary (code name, symbol, shape):
    tokens      T                       tokens of the call
    block       -                       tokens computed per chunk-wise call (`BLOCK` by default)
    start, end  s, e                    the block's first token and one past its last
    states      S_s .. S_{e-1}          [end - start, *state]: the block's states, token first (one buffer)
    state       S_{s-1}                 the state the block starts from (what `on_token` returned at s-1)
"""

import math
from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import Kernel, Pieces, state_shape
from ..declare.loops import OnToken
from ..tracing import compiling

BLOCK = 64  # tokens per chunk-wise call (see the module docstring)


def replaced(handed: Tensor, version: int, returned: Tensor) -> bool:
    """Whether `on_token` gave back another state than `handed` (whose `_version` was `version` before the call):
    changed in place, or another tensor with other values (the same memory and layout, or equal values, is the
    same state)."""
    if handed._version != version:
        return True
    if returned is handed or (
        returned.data_ptr() == handed.data_ptr()
        and returned.stride() == handed.stride()
        and returned.shape == handed.shape
        and returned.dtype == handed.dtype
    ):
        return False
    return not (returned.shape == handed.shape and returned.dtype == handed.dtype and torch.equal(returned, handed))


def run_in_blocks(kernel: Kernel, args: tuple, kwargs: dict, on_token: OnToken, block: int | None = None) -> Any:
    """Run a prompt call of `kernel` (called as `kernel(*args, **kwargs)`) through `kernel.segments.all_states`,
    `block` tokens at a time (default `BLOCK`), handing every token's state to `on_token` in order; a state it
    replaces restarts the computation at the next token from the replacement. Returns what the kernel returns."""
    block = BLOCK if block is None else block
    segments = kernel.segments
    if segments is None or segments.all_states is None:
        raise TypeError(f"kernel {kernel.name!r} has no chunk-wise all_states version: it cannot run in blocks")
    pieces = Pieces(kernel, args, kwargs)
    tokens, state = pieces.tokens, pieces.state
    outputs: list[Tensor] = []
    start = 0
    while start < tokens or not outputs:  # an empty call still runs once, for its (empty) output
        end = min(start + block, tokens)
        leading, named = pieces.call(start, end, state)
        (out, last), states = segments.all_states(*leading, **named)
        if end == start:
            state = last
        done = end - start  # tokens of this block whose outputs stand
        for i in range(end - start):
            handed = states[i]  # *state   S_{start+i}, a view of the block's buffer
            version = handed._version
            state = on_token(start + i, handed)  # *state   what token start+i+1 continues from
            if replaced(handed, version, state):
                done = i + 1
                break
        outputs.append(out if done == end - start else out.narrow(segments.out_axis, 0, done))
        del states  # this block's buffer lives on only through `state`, until the next block has read it
        start += done
    if isinstance(state, Tensor) and state.untyped_storage().nbytes() > state.nbytes:
        state = state.clone()  # a view of the last block's buffer: the cache must not hold the whole block
    return pieces.result(outputs, state)


def state_size(kind: Any, kernel: Kernel, arguments: dict[str, Any]) -> int | None:
    """The number of elements of a call's state, batch included (`state_shape`'s product)."""
    shape = state_shape(kind, kernel, arguments)
    return None if shape is None else math.prod(shape)


def blocks_apply(
    kernel: Kernel, kind: Any, arguments: dict[str, Any], grad: bool | None = None, limit: int | None = None
) -> bool:
    """Whether a prompt call of `kernel` with a hook on every token runs in blocks: the kernel has `all_states`,
    gradients are off (`grad`, default: torch's grad mode), no inference mode, not compiling, and the call's
    state is small enough that blocks beat the token loop
    (`Segments.blocks_below`, measured: at larger states writing and reading every state of a block through
    memory costs more than the token loop's per-token Python steps, which find the state in the cache; measured on
    a CPU: `limit`, from `Paths(blocks_below=...)`, overrides it)."""
    segments = kernel.segments
    if (
        compiling()
        or segments is None
        or segments.all_states is None
        or (torch.is_grad_enabled() if grad is None else grad)
        or torch.is_inference_mode_enabled()
    ):
        return False  # (a compiled graph has no version counters, and would unroll every block)
    limit = segments.blocks_below if limit is None else limit
    size = state_size(kind, kernel, arguments)
    return size is not None and size <= limit
