"""Compressed convolutional attention (zaya's CCA): a q/k conv window and a one-token value delay, inline code.

transformers' `ZayaCCAProjection.forward` (the q/k/v projection of every zaya attention layer) updates two
memories in one forward, inline, with no kernel function to rebind: the window of a causal convolution over
the projected queries and keys, and the previous token's delayed value projection. The library binds a
dispatcher in place of the class's `forward` (a `Site.CLASS` kernel, as for the dynamic convolutions): an idle
call runs transformers' forward, unchanged; a call with hooks, writes or kept memories runs `cca_forward`
below, the same forward, operation for operation, which hands the window to `on_token(t, window)` and the
delay to `on_also(t, delay)` after each token (one kernel that updates two memories, `Kernel.also`).

Glossary (code name, symbol, shape):
    batch          b                                   batch size
    seq            t (a position), T                   tokens of one forward
    heads, kv_heads  H, Hkv                            query and key/value heads (`num_attention_heads`, ...)
    head_dim       D                                   `head_dim`
    hidden_states  x_t    [batch, seq, hidden]         the layer's normed input, zeroed at padding (`conv_mask`)
    qk             c_t    [batch, seq, channels]       [W_q x_t; W_k x_t], channels = (H + Hkv) * D: the conv input
    kernel_size    K                                   (cca_time0 - 1) + (cca_time1 - 1): columns the window keeps
    window         -      [batch, channels, K]         the last K conv inputs, oldest first, model dtype: transformers'
                                                       cache layout (`cache.get_conv_state(layer)`), the `conv_state`
    conv           ĉ_t    [batch, seq, channels]       GroupConv_{t1}(DWConv_{t0}(c))_t: reads c_{t-K} .. c_t
    delayed        W_vd x_t  [batch, seq, delay_channels]  `v_proj_delayed(x)`, delay_channels = Hkv * D / 2
    delay          -      [batch, delay_channels]      the delay after token t: W_vd x_t, what token t + 1 takes as the
                                                       second half of its value (transformers' `recurrent_states[0]`);
                                                       the mixer's `state`
    query, key, value  q_t, k_t, v_t  [batch, seq, heads or kv_heads, head_dim]  the forward's results

Equations (per token; rep repeats each kv head over its H / Hkv query heads, mean_g averages them back):
    q_t = ĉ_q,t + (q~_t + rep(k~_t)) / 2,    k_t = ĉ_k,t + mean_g((q~_t + rep(k~_t)) / 2)
    v_t = [W_vc x_t ; delay_{t-1}],           delay_t = W_vd x_t,   delay_{-1} = W_vd 0 (the bias) for a prompt
The output of token t reads the window after t - 1 and c_t: writing the window after token t changes the
queries and keys of tokens t+1 .. t+K (all K columns reach an output), never token t's. Writing the delay
after token t changes the value of token t + 1 only (token t + 2 takes W_vd x_{t+1}), and the cache after the
call's last token.

Rounding: without writes the forward makes transformers' operations in its order (the two convolutions over
the call's context, one `cat` for the delayed values), so it equals transformers bit for bit; a position
that reads a written window is recomputed by the same two convolutions over its own K + 1 columns (equal
within float32 rounding).

Module contents:
- `cca_forward`: the library's forward (transformers' signature and results, plus `on_token` and `on_also`);
- `CompressedConvolutionalAttention`: the mixer kind (zaya), after its adapter
  (`CompressedConvolutionalAttentionAdapter`).
"""

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from ..engine.binding.upstream import installed_version, is_at_least
from ..engine.declare.kernels import CONV_MEMORY, STATE_MEMORY, Kernel, Role, Site
from ..engine.declare.limits import Caveat, Refused
from ..engine.declare.loops import OnToken, handed_back_changed, version_of
from ..engine.errors import Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracking.records import KernelCall
from .shared.recording import RECORDING

# transformers' own forward runs a cache that records its past (it takes the conv context from the cache) from 5.25
# on; before, it raised at the second decode step, and a watched call with hooks refuses it by name.
PAST_RECORDING_RUNS = is_at_least(5, 25)


def cca_forward(
    self: nn.Module,
    hidden_states: Float[Tensor, "batch seq hidden"],
    cache: Any = None,
    conv_mask: Tensor | None = None,
    *,
    past_key_values: Any = None,
    on_token: OnToken | None = None,
    on_also: OnToken | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor, Tensor]:
    """`ZayaCCAProjection.forward` with `on_token` (the window) and `on_also` (the delay): same arguments, results
    and cache updates.

        query, key, value = cca_forward(module, x, cache)   # as module(x, cache)

    The cache is updated as transformers does (`update_conv_state` before the convolution,
    `update_recurrent_state` after); with hooks, the window and the delay they hand back after the last token
    are cached instead (in place). `past_key_values` is the deprecated name of `cache`.
    """
    cache = past_key_values if cache is None else cache
    if conv_mask is not None:
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    if cache is not None:
        cached_qk_states = cache.get_conv_state(self.layer_idx, state_idx=0)  # b c K   or None
        recurrent_v_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)  # b d   or None
    else:
        cached_qk_states, recurrent_v_state = None, None

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    projected_queries = self.q_proj(hidden_states)  # b T (H D)   q~
    projected_keys = self.k_proj(hidden_states)  # b T (Hkv D)   k~
    qk_states = torch.cat([projected_queries, projected_keys], dim=-1)  # b T c   c_t
    query_residual = projected_queries.view(*hidden_shape)  # b T H D
    key_residual = projected_keys.view(*hidden_shape).transpose(1, 2)  # b Hkv T D
    key_residual = _repeat_kv(key_residual, self.num_key_value_groups).transpose(1, 2)  # b T H D   rep(k~)
    query_residual = (query_residual + key_residual) * 0.5  # b T H D
    key_residual = query_residual.view(*input_shape, -1, self.num_key_value_groups, self.head_dim).mean(dim=-2)

    seq, size = input_shape[-1], self.conv_kernel_size
    recording = cache is not None and cache.is_recording_past(self.layer_idx)
    if recording and (on_token is not None or on_also is not None) and not PAST_RECORDING_RUNS:
        raise Unavailable(
            f"ZayaCCAProjection (layer {self.layer_idx}): a cache recording its past (assisted"
            f" decoding): transformers {installed_version()}'s own forward cannot run it (it grows the"
            " window by whole windows and the q/k view raises; from 5.25 on it can)"
        )
    qk_states = qk_states.transpose(1, 2)  # b c T
    if cache is not None:  # the cached window (or, recording, every past column) first: b c K'+T
        qk_states = cache.update_conv_state(qk_states, self.layer_idx, conv_kernel_size=size)
    if cached_qk_states is None:
        qk_states = F.pad(qk_states, (size, 0))  # b c K+T   zeros first
    context = qk_states[..., -(size + seq) :]  # b c K+T   the window before token 0, then the call's columns
    qk_states = _conv(self, qk_states).transpose(1, 2)[:, -seq:]  # b T c   ĉ

    value_current = self.v_proj_current(hidden_states)  # b T d   W_vc x
    delayed_v_state = self.v_proj_delayed(hidden_states)  # b T d   W_vd x
    if recurrent_v_state is not None:
        recurrent_v_state = recurrent_v_state.unsqueeze(1)  # b 1 d
    else:
        recurrent_v_state = self.v_proj_delayed(hidden_states.new_zeros(input_shape[0], 1, self.hidden_size))
    value_delayed = torch.cat([recurrent_v_state, delayed_v_state[:, :-1]], dim=1)  # b T d   delay_{t-1}
    last_delay = delayed_v_state[:, -1, :]
    if on_token is not None or on_also is not None:
        window, last_delay, qk_states, value_delayed = _slide(
            self, context, delayed_v_state, qk_states, value_delayed, on_token, on_also
        )
        cached = None if cache is None else cache.get_conv_state(self.layer_idx, state_idx=0)
        if cached is not None:
            cached[..., -size:].copy_(window)  # the window the next call continues from
    if cache is not None:
        cache.update_recurrent_state(last_delay, self.layer_idx)

    query_hidden_size = query_residual.shape[-2] * query_residual.shape[-1]
    query = qk_states[..., :query_hidden_size].view(*hidden_shape) + query_residual  # b T H D   q
    key = qk_states[..., query_hidden_size:].view(*hidden_shape) + key_residual  # b T Hkv D   k
    value = torch.cat([value_current, value_delayed], dim=-1).view(*hidden_shape)  # b T Hkv D   v
    return query, key, value


class CompressedConvolutionalAttentionAdapter(KindAdapter):
    """zaya's CCA adapter: its whole forward records the cached window and delay it read, and its values are
    the forward's query, key and value."""

    def kernel_arguments(self, module: nn.Module, kernel: Kernel, arguments: dict[str, Any]) -> dict[str, Any]:
        arguments = dict(arguments)
        cache = self.pop_cache(arguments)
        layer = getattr(module, self.kind.LAYER_ATTRIBUTE, None)
        found = cache is not None and layer is not None
        arguments["conv_state"] = cache.get_conv_state(layer) if found else None
        arguments["delay"] = cache.get_recurrent_state(layer) if found else None
        return arguments

    def token_values(
        self, mixer: RecurrentMixer, kernel_call: KernelCall, tokens: int | None = None
    ) -> dict[str, Tensor]:
        if kernel_call.output is None or kernel_call.inputs is None:
            raise Unavailable(
                f"{self.kind.__name__}.values: the kernel"
                f" {'inputs' if kernel_call.inputs is None else 'outputs'}"
                " were not kept: pass keep=('inputs', 'outputs') to watch"
            )
        return {name: kernel_call.output[name] for name in self.kind.VALUES}


class CompressedConvolutionalAttention(RecurrentMixer):
    """zaya's CCA projection: a conv window over the queries and keys, and a one-token value delay (zaya).

        with recurrent_hooks.watch(model, keep=("windows", "states")) as w:
            model(input_ids)
        mix = w.mixers[0]
        mix.windows                          # Float[Tensor, "batch seq channels kernel_size"]: the q/k window
        mix.states                               # Float[Tensor, "batch seq delay_channels"]: the value delay
        mix.set_state_after(4, delay)            # (in a new watch) token 5's delayed value half is `delay`

    Its two memories: the conv window (the memory "window"; transformers' `conv_state`, `[batch, (H + Hkv) * D, K]`,
    the cache's layout and model dtype), and the value delay, the mixer's `state` (`[batch, Hkv * D / 2]`): the
    previous token's `v_proj_delayed` output, which transformers caches as the layer's recurrent state. Both are
    computed inline in the module's forward, which the library owns (a `Site.CLASS` kernel that updates both memories);
    hooks on the window are the default (`MEMORIES[0]`), `memory="state"` hooks the delay. `inputs` are the
    forward's arguments, with the cache replaced by the window and the delay it held (None for a prompt);
    `outputs` are its results, `query`, `key`, `value` (before zaya's q/k norm and rotary embedding).
    """

    ADAPTER = CompressedConvolutionalAttentionAdapter
    KERNELS = (
        # the whole forward, for both memories; `conv_state` and `delay`, in the recorded inputs, are what it read
        Kernel(
            name="forward",
            role=Role.BOTH,
            loop=cca_forward,
            memory=CONV_MEMORY,
            also=STATE_MEMORY,
            state_in=("conv_state", "delay"),
            results=("query", "key", "value"),
            seq=("hidden_states", 1),
            site=Site.CLASS,
        ),
    )
    MEMORIES = (CONV_MEMORY, STATE_MEMORY)
    CONTINUES_CACHE = True  # both memories are the cache layer's conv and recurrent states
    STATE = "batch delay_channels"
    CONV_STATE = "batch channels kernel_size"
    FORWARD_CACHE = ("cache", "past_key_values")
    INPUTS = {
        "hidden_states": "batch seq hidden  (x: the layer's normed input)",
        "conv_mask": "batch seq  (or None: padding, zeroed before the projections)",
        "conv_state": "batch channels kernel_size  (the cached window the call started from, None for a prompt)",
        "delay": "batch delay_channels  (the cached delay the call started from, None for a prompt)",
    }
    OUTPUTS = {
        "query": "batch seq heads head_dim  (q: the convolved queries plus their residual)",
        "key": "batch seq kv_heads head_dim  (k: the convolved keys plus their residual)",
        "value": "batch seq kv_heads head_dim  (v: [W_vc x_t ; delay_{t-1}] per head)",
    }
    VALUES = {
        "query": "batch seq heads head_dim  (the forward's q at each token)",
        "key": "batch seq kv_heads head_dim  (the forward's k at each token)",
        "value": "batch seq kv_heads head_dim  (the forward's v at each token; its second half is the delay read)",
    }
    LIMITS = {
        **(
            {}
            if PAST_RECORDING_RUNS
            else {
                RECORDING: Refused(
                    Unavailable,
                    f"transformers {installed_version()}: under cache.activate_past_recording() zaya's own"
                    " forward fails at the second decode step (the cache grows the window by whole windows, and the"
                    " q/k view"
                    " raises a RuntimeError); generate never records the past for zaya (_is_stateful blocks assisted"
                    " decoding), and a watched call with hooks refuses such a window by name",
                )
            }
        ),
        "effective attention": Refused(
            Unavailable,
            "not provided: CCA projects the inputs of softmax attention; it is no linear recurrence over the values",
        ),
        "segments": Caveat(
            "every call with hooks, writes or kept memories runs the token loop (a cheap shift per token; only the"
            " positions that read a written window are recomputed)"
        ),
    }

    def values(self, call: int | None = None) -> dict[str, Tensor]:
        """The forward's query, key and value at every token of call `call` (default: the last), token-major.

        with rh.watch(model, keep=("inputs", "outputs")) as w:
            model(ids)
        w.mixers[0].values()["value"]   # [batch, seq, kv_heads, head_dim]
        """
        record = self._call(call, "values")
        if record.conv is None:
            raise Unavailable(f"{self}: call {record.index} made no CCA forward call")
        return self.adapter.token_values(self, record.conv)


def _repeat_kv(
    x: Float[Tensor, "batch kv_heads seq head_dim"], groups: int
) -> Float[Tensor, "batch heads seq head_dim"]:
    """transformers' `repeat_kv`: each kv head repeated `groups` times, in place of its position."""
    batch, kv_heads, seq, head_dim = x.shape
    if groups == 1:
        return x
    return x[:, :, None].expand(batch, kv_heads, groups, seq, head_dim).reshape(batch, kv_heads * groups, seq, head_dim)


def _conv(self: nn.Module, context: Float[Tensor, "batch channels length"]) -> Float[Tensor, "batch channels _"]:
    """GroupConv_{t1}(DWConv_{t0}(context)), no padding: K fewer positions than columns."""
    return self.conv_qk_grouped(self.conv_qk_depthwise(context))


def _slide(
    self: nn.Module,
    context: Float[Tensor, "batch channels length"],
    delayed: Float[Tensor, "batch seq delay_channels"],
    conv: Float[Tensor, "batch seq channels"],
    value_delayed: Float[Tensor, "batch seq delay_channels"],
    on_token: OnToken | None,
    on_also: OnToken | None,
) -> tuple[
    Float[Tensor, "batch channels kernel_size"],
    Float[Tensor, "batch delay_channels"],
    Float[Tensor, "batch seq channels"],
    Float[Tensor, "batch seq delay_channels"],
]:
    """Slide both memories over the call's tokens (the last `seq` columns of `context`, after the K columns of the
    window it started from), handing each hook its memory after each token. A position that reads a window
    `on_token` replaced or changed is recomputed in `conv`; a delay `on_also` replaced is the next token's
    delayed value in `value_delayed`. Returns the window and the delay after the last token, and `conv` and
    `value_delayed` with those positions replaced (new tensors, stacked once: the inputs are unbound once and
    nothing is written a token at a time, so that the backward stays linear in the tokens)."""
    seq, size = conv.shape[1], self.conv_kernel_size
    window = context[..., :size]  # b c K   the window before token 0 (zeros for a prompt)
    delay = value_delayed[:, 0]  # b d   the delay before token 0
    columns, delays = context[..., size:].unbind(-1), delayed.unbind(1)  # T x (b c), T x (b d)
    recomputed: dict[int, Tensor] = {}  # position -> ĉ_t recomputed from a written window
    taken: dict[int, Tensor] = {}  # position -> the delayed value a written delay gives it
    dirty = 0  # how many more positions read a written window
    for t in range(seq):
        column = columns[t][..., None]  # b c 1   c_t
        if dirty:
            recomputed[t] = _conv(self, torch.cat([window, column], dim=-1))[..., 0]  # b c   ĉ_t from K + 1 columns
            dirty -= 1
        window = torch.cat([window[..., 1:], column], dim=-1)  # b c K   shift in c_t
        if on_token is not None:
            version = version_of(window)
            written = on_token(t, window)  # b c K   what token t+1 reads with c_{t+1}
            if handed_back_changed(window, version, written):
                dirty = size  # positions t+1 .. t+K read a column of it
            window = written
        delay = delays[t]  # b d   W_vd x_t
        if on_also is not None:
            version = version_of(delay)
            written = on_also(t, delay)  # b d   what token t+1 takes as its delayed value
            if t + 1 < seq and handed_back_changed(delay, version, written):
                taken[t + 1] = written
            delay = written
    if recomputed:
        conv = torch.stack([recomputed.get(t, c) for t, c in enumerate(conv.unbind(1))], dim=1)  # b T c
    if taken:
        value_delayed = torch.stack([taken.get(t, v) for t, v in enumerate(value_delayed.unbind(1))], dim=1)
    return window, delay, conv, value_delayed
