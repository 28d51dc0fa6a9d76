"""Dynamic short convolutions (inkling2, inkling2_loop): a conv window whose taps come from the input, inline code.

transformers' `Inkling2DynamicShortConvolution.forward` (and inkling2_loop's `Inkling2LoopDynamicShortConvolution`,
the same code) computes its convolution inline (an `unfold` over the cached window), so there is no kernel
function to rebind. The library binds a dispatcher in place of the class's `forward` (a `Site.CLASS` kernel,
as for MiniMax): an idle call runs transformers' forward, unchanged; a call with hooks, writes or kept windows
runs `dynamic_conv_forward` below, the same forward, operation for operation, which hands the window to
`on_token(t, window)` after each token and recomputes only the positions that read a written window.

Glossary (code name, symbol, shape):
    batch          b                                   batch size
    seq            t (a position), T                   tokens of one forward
    channels       c                                   kv_heads * head_dim: the k (or v) projection's width
    heads          -                                   `num_heads` (kv heads): the dynamic taps are shared per head
    kernel_size    K                                   taps (`sconv_kernel_size`, 4 by default)
    hidden_states  x_t   [batch, seq, channels]        the convolution's input (the k or v projection), fp32,
                                                       zeroed at padding (`conv_mask`) before the window
    dynamic_input  u_t   [batch, seq, input_size]      the normed layer input the taps are projected from
    static_weight  W_s   [kernel_size, channels]       W_s[j] weights lag j (j = 0: the token itself)
    weight_proj    W_p   u_t -> [heads * kernel_size]  the per-token taps, one set per head
    window         -     [batch, channels, kernel_size]  the last K inputs, oldest first, fp32: transformers'
                                                       cache layout (`cache.get_conv_state(layer, state_idx=conv_idx)`)
    output         y_t   [batch, seq, channels]        in the input's dtype

Convolution, per channel of head h (the window after token t is (x_{t-K+1}, ..., x_t)):
    y_t = (x_t + sum_{j<K} (W_s[j] + (W_p u_t)_{h,j}) x_{t-j}) / sqrt(2K + 1)
Token t reads the whole window after t; token t+1 reads its last K-1 columns and x_{t+1}: writing the window
after t changes tokens t+1..t+K-1, never token t (and its oldest column reaches no later output).

Rounding: the forward makes transformers' operations in its order and dtypes (the one unfold over the call's
context, the product and the sum over the taps), so without writes it equals transformers bit for bit; a
position that reads a written window is recomputed from that window with the same product and sum over one
position (equal to float32 rounding).

Module contents:
- `dynamic_conv_forward`: the library's forward (transformers' signature and results, plus `on_token`);
- `DynamicShortConvolution`: the mixer kind (inkling2), `LoopedDynamicShortConvolution` (inkling2_loop), each
  after its adapter (`DynamicShortConvolutionAdapter`, `LoopedDynamicShortConvolutionAdapter`).
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn

from ..engine.declare.kernels import CONV_MEMORY, Kernel, Role, Site
from ..engine.declare.limits import Caveat, Refused
from ..engine.declare.loops import OnToken, handed_back_changed, version_of
from ..engine.errors import Unavailable
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracking.records import KernelCall
from .short_conv import (
    LoopedShortConvolution,
    LoopedShortConvolutionAdapter,
    ShortConvolution,
    ShortConvolutionAdapter,
)


def dynamic_conv_forward(
    self: nn.Module,
    hidden_states: Float[Tensor, "batch seq channels"],
    dynamic_input: Float[Tensor, "batch seq input_size"],
    cache: Any = None,
    conv_mask: Tensor | None = None,
    cache_offset: int = 0,
    *,
    past_key_values: Any = None,
    on_token: OnToken | None = None,
    **kwargs: Any,
) -> Float[Tensor, "batch seq channels"]:
    """`Inkling2DynamicShortConvolution.forward` with `on_token`: same arguments, result and cache update.

        y = dynamic_conv_forward(module, x, u, cache=cache)   # as module(x, u, cache=cache)

    The cache is updated as transformers does (`cache.update_conv_state`, before the convolution); with
    `on_token`, the window it returns after the last token is cached instead (in place). `past_key_values`
    is the deprecated name of `cache`; `seq_idx` (packed sequences) masks the other sequences' inputs, as
    transformers does.
    """
    cache = past_key_values if cache is None else cache
    input_dtype = hidden_states.dtype
    batch_size, seq_len, hidden_size = hidden_states.shape
    size = self.conv_kernel_size
    dynamic_weights = self.weight_proj(dynamic_input).float()  # b T (H K)   W_p u_t
    dynamic_weights = dynamic_weights.view(batch_size, seq_len, self.num_heads, 1, size)  # b T H 1 K
    weights = self.static_weight.float().T.view(self.num_heads, -1, size) + dynamic_weights  # b T H c/H K

    hidden_states = hidden_states.float()  # b T c
    residual = hidden_states
    if conv_mask is not None:  # transformers' apply_mask_to_padding_states
        hidden_states = (hidden_states * conv_mask[:, :, None]).to(hidden_states.dtype)
    context = hidden_states.transpose(1, 2)  # b c T
    layer = self.layer_idx + cache_offset
    if cache is not None:
        context = cache.update_conv_state(context, layer, state_idx=self.conv_idx, conv_kernel_size=size)
    full = context  # b c L   the cached window (if any), then the call's inputs
    context = F.pad(context, (size - 1, 0))[..., -(seq_len + size - 1) :]  # b c T+K-1
    windows = context.unfold(-1, size, 1).flip(-1).transpose(1, 2)  # b T c K   windows[..., j] = x_{t-j}
    windows = windows.reshape(batch_size, seq_len, self.num_heads, -1, size)  # b T H c/H K
    mask = None
    if (seq_idx := kwargs.get("seq_idx")) is not None:
        seq_idx = seq_idx.to(windows.device)
        context_seq_idx = torch.cat([seq_idx[:, :1].expand(-1, size - 1), seq_idx], dim=1)
        window_seq_idx = context_seq_idx.unfold(-1, size, 1).flip(-1)
        mask = window_seq_idx == seq_idx[..., None]  # b T K
        windows = windows * mask[:, :, None, None, :]
    hidden_states = (windows * weights).sum(-1).reshape(batch_size, seq_len, hidden_size)  # b T c
    if on_token is not None:
        last, hidden_states = _slide(self, full, weights, mask, hidden_states, on_token)  # b c K, b T c
        cached = None if cache is None else cache.get_conv_state(layer, state_idx=self.conv_idx)
        if cached is not None:
            cached[..., -size:].copy_(last)  # the window the next call continues from, written or hooked
    hidden_states = (hidden_states + residual) / math.sqrt(2 * size + 1)  # b T c
    return hidden_states.to(input_dtype)


_PACKED = Caveat(
    "seq_idx (packed sequences) masks the other sequences' inputs out of each position's taps, as"
    " transformers does; the window handed over is the raw last K inputs, across a sequence boundary"
    " too"
)


class DynamicShortConvolutionAdapter(ShortConvolutionAdapter):
    """inkling2's dynamic convolution's adapter: its whole forward records the cached window it read, and its
    values are the forward's input and output."""

    def kernel_arguments(self, module: nn.Module, kernel: Kernel, arguments: dict[str, Any]) -> dict[str, Any]:
        arguments = dict(arguments)
        cache = self.pop_cache(arguments)
        where = self.cache_index(module, arguments)
        arguments[kernel.state_in] = None if cache is None or where is None else self.cached_window(cache, where)
        return arguments

    def token_values(
        self, mixer: RecurrentMixer, kernel_call: KernelCall, tokens: int | None = None
    ) -> dict[str, Tensor]:
        inputs, output = kernel_call.inputs, kernel_call.output
        if inputs is None or output is None:
            raise Unavailable(
                f"{self.kind.__name__}.values: the kernel {'inputs' if inputs is None else 'outputs'}"
                " were not kept: pass keep=('inputs', 'outputs') to watch"
            )
        return {"x": inputs["hidden_states"], "output": output["output"]}


class DynamicShortConvolution(ShortConvolution):
    """inkling2's dynamic short convolution of the keys or values in its full-attention layers (inkling2).

        with recurrent_hooks.watch(model, keep=("windows",)) as w:
            model(input_ids)
        mix = next(m for m in w.mixers if isinstance(m, rh.DynamicShortConvolution))
        mix.windows                          # Float[Tensor, "batch seq channels kernel_size"]
        mix.set_window_after(4, window)      # (in a new watch) tokens 5.. and the cache read `window`

    Its taps are W_s[j] + (W_p u_t)_{head, j}: weights projected from the token's own input, so the
    convolution is computed inline in the module's forward, which the library owns (a `Site.CLASS` kernel).
    As for `ShortConvolution`, the window (`[batch, channels, K]`, fp32, the cache's layout) is the whole
    memory: there is no recurrent state. `inputs` are the forward's arguments, with the cache replaced by
    the window it held (`conv_state`, None for a prompt); `outputs` are its result, `output`.
    """

    ADAPTER = DynamicShortConvolutionAdapter
    KERNELS = (
        # the whole forward; `conv_state`, in the recorded inputs, is the cached window it started from
        Kernel(
            name="forward",
            role=Role.BOTH,
            loop=dynamic_conv_forward,
            memory=CONV_MEMORY,
            state_in="conv_state",
            results=("output",),
            seq=("hidden_states", 1),
            site=Site.CLASS,
        ),
    )
    INPUTS = {
        "hidden_states": "batch seq channels  (the convolution's input x: the k or v projection)",
        "dynamic_input": "batch seq input_size  (u: what the per-token taps are projected from)",
        "conv_mask": "batch seq  (or None: padding, zeroed before the window)",
        "conv_state": "batch channels kernel_size  (the cached window the call started from, None for a prompt)",
    }
    OUTPUTS = {"output": "batch seq channels  (y: (x + the dynamic convolution) / sqrt(2K + 1), the input's dtype)"}
    VALUES = {
        "x": "batch seq channels  (the convolution's input at each token, before the padding mask)",
        "output": "batch seq channels  (the forward's output y at each token)",
    }
    LIMITS = {
        **{k: v for k, v in ShortConvolution.LIMITS.items() if k != "packed sequences"},
        "packed sequences": _PACKED,
        "segments": Caveat(
            "every call with hooks, writes or kept windows runs the token loop (a cheap shift per token; only the"
            " positions that read a written window are recomputed)"
        ),
        "effective attention": Refused(
            Unavailable, "not provided: the taps depend on the token (the convolution is not one kernel)"
        ),
    }


class LoopedDynamicShortConvolutionAdapter(DynamicShortConvolutionAdapter, LoopedShortConvolutionAdapter):
    """inkling2_loop's: the dynamic convolution's adapter with a handle per pass of a looped module."""


class LoopedDynamicShortConvolution(DynamicShortConvolution, LoopedShortConvolution):
    """inkling2_loop's dynamic short convolutions: `DynamicShortConvolution` with a mixer per pass of a looped
    layer (`LoopedShortConvolution`).

        with recurrent_hooks.watch(model, keep=("windows",)) as w:
            model.generate(input_ids, max_new_tokens=4)
        [m.cache_index for m in w.mixers if isinstance(m, rh.LoopedDynamicShortConvolution)]
    """

    ADAPTER = LoopedDynamicShortConvolutionAdapter
    LIMITS = {
        **DynamicShortConvolution.LIMITS,
        "hooks without a watch on a looped module": LoopedShortConvolution.LIMITS[
            "hooks without a watch on a looped module"
        ],
    }


def _slide(
    self: nn.Module,
    context: Float[Tensor, "batch channels length"],
    weights: Float[Tensor, "batch seq heads per_head kernel_size"],
    mask: Bool[Tensor, "batch seq kernel_size"] | None,
    out: Float[Tensor, "batch seq channels"],
    on_token: OnToken,
) -> tuple[Float[Tensor, "batch channels kernel_size"], Float[Tensor, "batch seq channels"]]:
    """Slide the window over the call's tokens (the last `seq` columns of `context`, which may start with the
    cached window), handing `on_token` the window after each; a position that reads a window `on_token`
    replaced or changed is recomputed. Returns the last window and `out` with those positions replaced (a new
    tensor, stacked once: nothing is written a token at a time, so that the backward stays linear in T)."""
    batch, seq, channels = out.shape
    size = self.conv_kernel_size
    context = F.pad(context, (size, 0))[..., -(seq + size) :]  # b c K+T   the window before token 0, then x
    window = context[..., :size]  # b c K   zeros for a prompt, the cached window over a cache
    columns = context[..., size:].unbind(-1)  # T x (b c): one unbind (a slice a token: a quadratic backward)
    recomputed: dict[int, Tensor] = {}  # position -> its output recomputed from a written window
    dirty = 0  # how many more positions read a written window
    for t in range(seq):
        window = torch.cat([window[..., 1:], columns[t][..., None]], dim=-1)  # b c K   shift in x_t
        if dirty:
            lags = window.flip(-1).reshape(batch, self.num_heads, -1, size)  # b H c/H K   lags[..., j] = x_{t-j}
            if mask is not None:
                lags = lags * mask[:, t, None, None, :]  # b H c/H K   packed sequences: other sequences' inputs out
            recomputed[t] = (lags * weights[:, t]).sum(-1).reshape(batch, channels)  # b c   sum_j w_j x_{t-j}
            dirty -= 1
        version = version_of(window)
        written = on_token(t, window)  # b c K   what token t+1 shifts its input into
        if handed_back_changed(window, version, written):
            dirty = size - 1  # positions t+1 .. t+K-1 read a column of it
        window = written
    if recomputed:
        out = torch.stack([recomputed.get(t, column) for t, column in enumerate(out.unbind(1))], dim=1)  # b T c
    return window, out
