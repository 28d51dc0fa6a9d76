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

Module contents:
- `causal_conv1d_fn`, `causal_conv1d_update`: token loops with the signatures and results of
  transformers' kernels of the same names, plus a keyword-only `on_token(t, window) -> window`.
- `CONV_KERNELS`: their `Kernel` declarations, shared by every mixer kind.
"""

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from transformers.activations import ACT2FN

from ._mixer import CONV_MEMORY, FORWARD, Kernel

OnToken = Callable[[int, Tensor], Tensor]


def _conv_loop(
    x: Float[Tensor, "batch channels length"],
    window: Float[Tensor, "batch channels kernel_size"],
    weight: Float[Tensor, "channels kernel_size"],
    bias: Float[Tensor, " channels"] | None,
    first_token: int,
    on_token: OnToken | None,
) -> tuple[Float[Tensor, "batch channels length"], Float[Tensor, "batch channels kernel_size"]]:
    """Slide the window over x; positions from `first_token` on are tokens and call `on_token`."""
    outputs = []
    for p in range(x.shape[-1]):
        window = torch.cat([window[..., 1:], x[..., p, None]], dim=-1)  # b c K   shift in x_p
        out = (window * weight).sum(-1)  # b c   sum_k w_k x_{p-K+1+k}
        outputs.append(out if bias is None else out + bias)  # b c
        if on_token is not None and p >= first_token:
            window = on_token(p - first_token, window)  # b c K   what token t+1 shifts into
    return torch.stack(outputs, dim=-1), window


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
    """The prompt kernel, position by position: same arguments and result as transformers' `causal_conv1d_fn`.

    `tokens` (the library's own) says how many of the last positions are the call's tokens (the ones
    before are a cached window the mixer prepended); `on_token(t, window)` is called after each token.
    """
    x = hidden_states.to(weight.dtype)
    batch, channels, length = x.shape
    window = x.new_zeros(batch, channels, weight.shape[-1])
    first_token = length - (length if tokens is None else tokens)
    out, _ = _conv_loop(x, window, weight, bias, first_token, on_token)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


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
    """The decode kernel: same arguments and result as transformers' `causal_conv1d_update`.

    Like transformers, it writes the new window into `conv_state` in place (`copy_`): the mixer never
    writes it back. With `on_token` (called for each token) the window written is the one it returns.
    """
    x = hidden_states.to(weight.dtype)
    out, window = _conv_loop(x, conv_state.to(weight.dtype), weight, bias, 0, on_token)
    conv_state.copy_(window)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


CONV_KERNELS = (
    Kernel("causal_conv1d_fn", causal_conv1d_fn, None, ("output",), "prompt", seq=FORWARD, memory=CONV_MEMORY),
    Kernel("causal_conv1d_update", causal_conv1d_update, "conv_state", ("output",), "decode",
           seq=("hidden_states", 2), in_place=True, memory=CONV_MEMORY),
)
