"""The short causal convolution every supported mixer runs before its recurrence, and its window.

Glossary (shape as the kernels take it):
    batch          b                             batch size
    channels       c                             the conv channels (gated DeltaNet: q, k and v together)
    kernel_size    K                             taps of the depthwise convolution
    hidden_states  x   [batch, channels, L]      conv inputs; in a prompt over a cache, the cached
                                                 window comes first and the call's tokens are the last positions
    weight         w   [channels, kernel_size]   w[:, K - 1] multiplies the newest input
    window         -   [batch, channels, kernel_size]  the last K inputs, oldest first: the layout of
                                                 transformers' conv cache (`conv_state`)

Per position p: window_p = (x_{p-K+1}, ..., x_p) and out_p = act(sum_k w[:, k] window_p[:, k] + bias).
The window after token t is what token t+1 shifts its own input into; writing it changes the inputs
tokens t+1..t+K-1 read, never token t's own output.

Rounding: the kernels make transformers' own `F.conv1d` call (weight dtype, bias inside) and end as
it does (activation on the same slice of the same result, then the input's dtype), so they equal
transformers' kernels bit for bit in float32, bf16 and fp16 (tests/kinds/test_dtypes.py). A position whose
window was written is recomputed as one `F.conv1d` over that window: PyTorch's convolution gives a
position the same bits whatever the length around it, where a product-and-sum in the model dtype,
or even in float32, rounds differently (and the activation rounds by the strides it runs over).

Module contents:
- `causal_conv1d_fn`, `causal_conv1d_update`: token loops with the signatures and results of
  transformers' kernels of the same names, plus a keyword-only `on_token(t, window) -> window`.
- `CONV_KERNELS`: their `Kernel` declarations, shared by every mixer kind.
- `causal_conv1d_shifted`, `window_terms`: the prompt kernel with a shift before the activation, and the
  window term of attribution patching from the inputs and that shift's gradient (no per-token step).
"""

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from transformers.activations import ACT2FN

from ...engine.declare.kernels import CONV_MEMORY, FORWARD, Kernel, Role, WindowTerms
from ...engine.declare.loops import OnToken, handed_back_changed, refuse_packed, version_of


def _conv_loop(
    x: Float[Tensor, "batch channels length"],
    window: Float[Tensor, "batch channels kernel_size"],
    weight: Float[Tensor, "channels kernel_size"],
    bias: Float[Tensor, " channels"] | None,
    out: Float[Tensor, "batch channels _"],
    offset: int,
    first_token: int,
    on_token: OnToken,
) -> Float[Tensor, "batch channels kernel_size"]:
    """Slide the window over x, handing `on_token` the window after each token (positions from
    `first_token` on), and return the last window.

    `out` holds the convolution over the inputs' own windows (position p in column p + offset), computed
    in one call as transformers does. A window `on_token` replaces or changes in place feeds the next
    K - 1 positions: their columns are recomputed, one `F.conv1d` each, and written into `out` (the same
    bits per position as in the one call). With autograd recording through the inputs or a window (from the
    first window `on_token` hands back with gradients), every position is recomputed from its window, so that
    a kept window is the tensor the later tokens read, and written into `out` at once.
    """
    channels, size = x.shape[1], weight.shape[-1]
    kernel = weight.unsqueeze(1)  # c 1 K   F.conv1d's depthwise layout, as transformers passes it
    recording = torch.is_grad_enabled()
    every = recording and (x.requires_grad or window.requires_grad)
    if first_token:  # the positions before the call's tokens: no window to hand over
        window = torch.cat([window, x[..., :first_token]], dim=-1)[..., -size:]
    dirty = 0  # how many more positions read a written window
    columns = []  # with autograd recording, every position's output, written into `out` at once (per position,
    # each slice assignment's backward would copy the whole gradient of `out`: quadratic in the tokens)
    # (and the inputs from one unbind, whose backward stacks their gradients once: a slice's per position would
    # add a gradient of the whole of x, quadratic too)
    inputs = x.unbind(-1) if every else None
    first_column = first_token
    for p in range(first_token, x.shape[-1]):
        x_p = x[..., p, None] if inputs is None else inputs[p][..., None]  # b c 1
        window = torch.cat([window[..., 1:], x_p], dim=-1)  # b c K   shift in x_p
        if every:
            columns.append(F.conv1d(window, kernel, bias, groups=channels))  # b c 1
        elif dirty:
            out[..., p + offset, None] = F.conv1d(window, kernel, bias, groups=channels)  # b c 1
            dirty -= 1
        version = version_of(window)
        written = on_token(p - first_token, window)  # b c K   what token t+1 shifts into
        if handed_back_changed(window, version, written):
            dirty = size - 1
        window = written
        if recording and not every and window.requires_grad:  # (a window kept with gradients: from here on, too)
            every, first_column = True, p + 1
    if columns:
        out[..., first_column + offset : x.shape[-1] + offset] = torch.cat(columns, dim=-1)  # b c L
    return window


def _finish(out: Tensor, activation: str | None, dtype: torch.dtype) -> Tensor:
    """Activation, then the input's dtype, as transformers' kernels end.

    `out` is laid out as transformers' (the same slice of the same F.conv1d result): an elementwise op
    takes its vectorised or its scalar path by the tensor's strides, and the two can round differently.
    """
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(dtype)


def causal_conv1d_fn(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    *,
    on_token: OnToken | None = None,
    tokens: int | None = None,
    **kwargs: Any,
) -> Tensor:
    """The prompt kernel: same arguments and result as transformers' `causal_conv1d_fn`, bit for bit.

    `tokens` (the library's own) says how many of the last positions are the call's tokens (the ones
    before are a cached window the mixer prepended); `on_token(t, window)` is called after each token. Packed
    sequences (`seq_idx`) are refused: the windows of one batch row are one sequence's here.
    """
    refuse_packed(kwargs, ("seq_idx",), "the causal_conv1d package (transformers' kernel, unwatched or idle)")
    x = hidden_states.to(weight.dtype)
    batch, channels, length = x.shape
    size = weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=size - 1, groups=channels)  # b c L+K-1   transformers' call
    if on_token is not None:
        first_token = length - (length if tokens is None else tokens)
        _conv_loop(x, x.new_zeros(batch, channels, size), weight, bias, out, 0, first_token, on_token)
    return _finish(out[..., :length], activation, hidden_states.dtype)


def causal_conv1d_update(
    hidden_states: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    *,
    on_token: OnToken | None = None,
    **kwargs: Any,
) -> Tensor:
    """The decode kernel: same arguments and result as transformers' `causal_conv1d_update`, bit for bit.

    Like transformers, it writes the new window into `conv_state` in place (`copy_`): the mixer never
    writes it back. With `on_token` (called for each token) the window written is the one it returns.
    """
    x = hidden_states.to(weight.dtype)
    channels, length = x.shape[1:]
    size = conv_state.shape[-1]
    run = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)  # b c K+L   transformers' input
    out = F.conv1d(run, weight.unsqueeze(1), bias, groups=channels)  # b c L+1   position p in column p + 1
    if on_token is None:
        window = run[..., -size:]
    else:
        window = _conv_loop(x, run[..., :size], weight, bias, out, 1, 0, on_token)
    conv_state.copy_(window)
    return _finish(out[..., -length:], activation, hidden_states.dtype)


def causal_conv1d_shifted(
    hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, *, shift: Tensor
) -> Tensor:
    """`causal_conv1d_fn`'s result (the same ops, so the same bits at shift = 0) with `shift` `[batch, channels,
    length]` added to the convolution before the activation: with a zero leaf as `shift`, its gradient is
    d m / d the convolution's output at every position (what `window_terms` needs)."""
    x = hidden_states.to(weight.dtype)
    channels, length = x.shape[1:]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=channels)  # b c L+K-1
    return _finish(out[..., :length] + shift.to(out.dtype), activation, hidden_states.dtype)


def window_terms(
    delta: Float[Tensor, "batch channels length"],
    grad: Float[Tensor, "batch channels length"],
    weight: Float[Tensor, "channels kernel_size"],
    shares: Float[Tensor, "channels groups"] | None = None,
) -> Float[Tensor, "batch length"] | Float[Tensor, "batch length groups"]:
    """For every position p of a prompt call: sum over channels and columns of (W_p - W'_p) . d m / d W'_p, the
    first-order effect of writing the window after p, from the inputs and the convolution's gradients alone.

    `delta` is x - x' (the convolution's inputs of two runs, the call's own positions from 0), `grad` the
    gradient of m with respect to the convolution's output (before the activation) of the primed run. The window
    after p holds x_{p-K+1..p}; position s = p + d (d = 1..K-1) reads its columns j >= d through tap j - d, so
        d m / d W'_p[:, j] = sum_{d=1}^{j} w[:, j - d] grad_{p+d}
        term_p = sum_{d=1}^{K-1} sum_c grad_{p+d} . sum_{i=0}^{K-1-d} w[:, i] delta_{p+d-K+1+i}
    (the partial convolution of delta at s over the taps that read positions <= p). No per-token step.
    `shares[c, g]`: the share of channel c's term that goes to group g (a head): the terms per group,
    `[batch, length, groups]`, which sum to the total where each channel's shares sum to 1."""
    batch, channels, length = delta.shape
    size = weight.shape[-1]
    delta, grad, weight = delta.float(), grad.float(), weight.float()
    padded = F.pad(delta, (size - 1, size - 1))  # b c L+2K-2   delta_u at column u + K - 1, zeros outside
    terms = delta.new_zeros(batch, length) if shares is None else delta.new_zeros(batch, length, shares.shape[1])
    for d in range(1, size):
        reads = delta.new_zeros(batch, channels, length)  # at p: sum_i w_i delta_{p+d-K+1+i}, the taps i <= K-1-d
        for i in range(size - d):
            start = d + i  # column of delta_{p+d-K+1+i} at p = 0
            reads += weight[:, i, None] * padded[..., start : start + length]
        later = F.pad(grad[..., d:], (0, d))  # b c L   grad_{p+d}, 0 past the call's end
        if shares is None:
            terms += (later * reads).sum(1)
        else:
            terms += torch.einsum("bcl,cg->blg", later * reads, shares.to(terms))
    return terms


CONV_KERNELS = (
    Kernel(
        name="causal_conv1d_fn",
        role=Role.PROMPT,
        loop=causal_conv1d_fn,
        memory=CONV_MEMORY,
        state_in=None,
        results=("output",),
        seq=FORWARD,
        window_terms=WindowTerms(causal_conv1d_shifted, window_terms),
    ),
    Kernel(
        name="causal_conv1d_update",
        role=Role.DECODE,
        loop=causal_conv1d_update,
        memory=CONV_MEMORY,
        state_in="conv_state",
        results=("output",),
        seq=("hidden_states", 2),
        in_place=True,
    ),
)
