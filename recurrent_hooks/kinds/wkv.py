"""RWKV-4 time mixing (the WKV recurrence and the token shift): the `WeightedKeyValue` mixer kind and its loops.

Glossary (code name, symbol in Peng et al., "RWKV: Reinventing RNNs for the Transformer Era", 2023 (time
mixing, the WKV operator and its recurrent form), shape as the kernels take it; every channel runs alone):
    batch        b                  batch size
    seq          t (a position), T  tokens of one call
    channels     c                  `attention_hidden_size` (= `hidden_size` wherever use_cache is used: see LIMITS)
    hidden       x'_t  [batch, seq, hidden]      the mixer's input, `ln1(x)` (model dtype)
    (shift)      x'_{t-1}  [batch, hidden]       the previous token's input, which token t mixes with
    time_decay   log w  [channels]               w = exp(time_decay) > 0: the decay per token is e^{-w}
    time_first   u      [channels]               the bonus of the current token
    key          k_t   [batch, seq, channels]    W_k (mu_k x'_t + (1 - mu_k) x'_{t-1})
    value        v_t   [batch, seq, channels]    W_v (mu_v x'_t + (1 - mu_v) x'_{t-1})
    (receptance) r_t   [batch, seq, channels]    sigmoid(W_r (mu_r x'_t + (1 - mu_r) x'_{t-1}))
    output       wkv_t [batch, seq, channels]    the kernel's result; the mixer returns W_o (r_t * wkv_t)
    state        `WkvState(num, den, max)`, three parts, each [batch, channels], float32:
      .num       a_t e^{-p_t}   the numerator sum, scaled: a_t = num·e^max
      .den       b_t e^{-p_t}   the denominator sum, scaled: b_t = den·e^max
      .max       p_t            the running max exponent, the scale of num and den
    window       x'_t  [batch, hidden]           the token shift, which IS rwkv's window (of one input):
                                                 `window_after(t)` is x'_t, the input token t+1 mixes with
                                                 (model dtype)

Recurrence, per channel (a_t, b_t in the paper's form; transformers keeps them scaled by e^{-p_t}):
    wkv_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t})
    a_t = e^{-w} a_{t-1} + e^{k_t} v_t
    b_t = e^{-w} b_{t-1} + e^{k_t}
    a_t = num_t e^{p_t},  b_t = den_t e^{p_t}
with, for stability, each step taking the larger exponent as its scale (`rwkv_linear_attention_cpu`):
    q = max(p_{t-1}, u + k_t):     wkv_t = (e^{p_{t-1}-q} num_{t-1} + e^{u+k_t-q} v_t)
                                           / (e^{p_{t-1}-q} den_{t-1} + e^{u+k_t-q})
    p_t = max(p_{t-1} - w, k_t):   num_t = e^{p_{t-1}-w-p_t} num_{t-1} + e^{k_t-p_t} v_t (den_t alike, with 1 for v_t)
The empty state is num = den = 0 with p = -1e30 (`RwkvModel` with `use_cache`) or -1e38 (the kernel
given no state): e^{p} = 0, so a = b = 0 either way.

The mixer's memory is `Memory(state, window)`: the WKV state above and the token shift, the last
`ln1` output (a window of one input, `[batch, hidden]`, model dtype, transformers' `state[1][:, :, layer]`).
The feed-forward block (`RwkvFeedForward`, channel mixing) has its own token shift (`state[0]`): it is not
part of this mixer, and the library neither reads nor writes it.

Module contents:
- `WkvState`: the WKV state handed to hooks and taken by writes, a NamedTuple (num, den, max).
- `rwkv_linear_attention`: the WKV token loop, with the signature and results of transformers' function of
  that name (and of its CPU path `rwkv_linear_attention_cpu`), plus a keyword-only `on_token`.
- `extract_key_value`: the token shift, as the method `RwkvSelfAttention.extract_key_value` (self first).
- `WeightedKeyValue`: the mixer kind, after its adapter (`WeightedKeyValueAdapter`).
"""

from typing import Any, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..engine.declare.kernels import CONV_MEMORY, Kernel, Role, Site
from ..engine.declare.limits import Caveat, Refused
from ..engine.declare.loops import OnToken
from ..engine.errors import Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracking.records import KernelCall


class WkvState(NamedTuple):
    """The WKV state after a token: transformers' three scaled tensors, as the parts of one state.

    The paper's sums are a_t = num·e^max and b_t = den·e^max; scaling both by c is `max + log(c)`.
    """

    num: Float[Tensor, "batch channels"]  # a_t e^{-p_t}, float32
    den: Float[Tensor, "batch channels"]  # b_t e^{-p_t}, float32 (> 0 once a token has been seen)
    max: Float[Tensor, "batch channels"]  # p_t, the running max exponent, float32


_EMPTY_MAX = -1e30  # the max exponent of the state RwkvModel creates (`state[4] -= 1e30`)


def rwkv_linear_attention(
    time_decay: Float[Tensor, " channels"],
    time_first: Float[Tensor, " channels"],
    key: Float[Tensor, "batch seq channels"],
    value: Float[Tensor, "batch seq channels"],
    state: "tuple[Tensor, Tensor, Tensor] | list[Tensor] | None" = None,
    return_state: bool = False,
    *,
    on_token: OnToken | None = None,
) -> tuple[Float[Tensor, "batch seq channels"], list[Tensor] | None]:
    """The WKV recurrence, token by token: the arguments and results of transformers' `rwkv_linear_attention`.

    `state` is (num, den, max), each `[batch, channels]` float32, or None (the empty state, max = -1e38).
    Returns wkv `[batch, seq, channels]` in key's dtype and, when `return_state` or a state was given,
    the new `[num, den, max]` (else None). `on_token(t, state)` is called after token t's update with
    the state as a `WkvState(num, den, max)`; token t+1 continues from the `WkvState` it returns, and
    the last one returned is the new state. The operations are those of transformers'
    `rwkv_linear_attention_cpu`, in its order.
    """
    _, seq, _ = key.shape
    outputs = []  # wkv_t, stacked once after the loop (a write a token would make the backward quadratic)
    if state is None:
        num = torch.zeros_like(key[:, 0], dtype=torch.float32)  # b c
        den = torch.zeros_like(key[:, 0], dtype=torch.float32)  # b c
        p = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38  # b c
    else:
        num, den, p = state  # b c   each
    decay = -torch.exp(time_decay)  # c   -w
    keys, values = key.float().unbind(1), value.unbind(1)  # T x (b c) each: one unbind (the cast is elementwise)
    for t in range(seq):
        k = keys[t]  # b c   k_t
        v = values[t]  # b c   v_t
        q = torch.maximum(p, k + time_first)  # b c   the scale of wkv_t
        e1 = torch.exp(p - q)  # b c   weight of the past
        e2 = torch.exp(k + time_first - q)  # b c   weight of the current token, e^{u + k_t}
        outputs.append(((e1 * num + e2 * v) / (e1 * den + e2)).to(key.dtype))  # b c   wkv_t
        scale = torch.maximum(p + decay, k)  # b c   p_t
        e1 = torch.exp(p + decay - scale)  # b c   e^{-w}, rescaled
        e2 = torch.exp(k - scale)  # b c   e^{k_t}, rescaled
        num = e1 * num + e2 * v  # b c   a_t e^{-p_t}
        den = e1 * den + e2  # b c   b_t e^{-p_t}
        p = scale  # b c   p_t
        if on_token is not None:
            num, den, p = on_token(t, WkvState(num, den, p))  # b c   each: what token t+1 continues from
    output = torch.stack(outputs, dim=1) if outputs else torch.zeros_like(key)  # b t c
    if return_state or state is not None:
        return output, [num, den, p]
    return output, None


def extract_key_value(
    self: nn.Module,
    hidden: Float[Tensor, "batch seq hidden"],
    state: list[Tensor] | None = None,
    *,
    on_token: OnToken | None = None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor] | None]:
    """`RwkvSelfAttention.extract_key_value` with the token shift handed over token by token.

    Mixes each token's input with the previous one's (the token shift) and projects receptance, key and
    value, as transformers' method does. `on_token(t, shift)` gets `hidden[:, t]` (`[batch, hidden]`, a
    copy) after token t; token t+1 mixes with what it returns, and the last one returned is stored in the
    model's state (`state[1][:, :, layer]`), where the next call starts from. Without a state the shift
    of token 0 is zero. A one-token call over a state mixes as transformers does, `[batch, hidden]`
    against `[batch, 1, hidden]`: right for batch 1, broadcast to `[batch, batch, hidden]` otherwise
    (transformers' bug, reproduced).
    """
    batch, seq, size = hidden.shape
    cached = state[1][:, :, self.layer_id] if state is not None else None  # b h   x'_{-1}
    previous = cached if cached is not None else hidden.new_zeros(batch, size)  # b h   what token 0 mixes with
    columns = []
    inputs = hidden.unbind(1)  # T x (b h): one unbind (a slice a token would make the backward quadratic)
    for t in range(seq):
        columns.append(previous)  # b h   x'_{t-1}
        previous = inputs[t].clone()  # b h   x'_t
        if on_token is not None:
            previous = on_token(t, previous)  # b h   what token t+1 mixes with
    if seq == 1 and state is not None:
        shifted = columns[0]  # b h   transformers' decode path (broadcast against b 1 h)
    else:
        shifted = torch.stack(columns, dim=1) if columns else torch.zeros_like(hidden)  # b t h
    key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)  # b t h
    value = hidden * self.time_mix_value + shifted * (1 - self.time_mix_value)  # b t h
    receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)  # b t h
    key = self.key(key)  # b t c
    value = self.value(value)  # b t c
    receptance = torch.sigmoid(self.receptance(receptance))  # b t c
    if state is not None and seq:
        state[1][:, :, self.layer_id] = previous  # b h   the shift the next call starts from
    return receptance, key, value, state


class WeightedKeyValueAdapter(KindAdapter):
    """RWKV-4's adapter: a forward's freshness read from the model's state list (there is no Cache), and its values."""

    def parse_forward(self, module: nn.Module, arguments: dict[str, Any]) -> tuple[int, Any, bool, Tensor]:
        """`forward(hidden, state=None, use_cache=False)`: no Cache; the model-level state list, if any.

        A prompt (fresh) is a call with no state, or whose layer holds the empty state RwkvModel creates
        (num = den = 0, max = -1e30)."""
        hidden, state = arguments[self.kind.FORWARD_INPUT], arguments.get("state")
        return hidden.shape[1], None, state is None or _empty(state, module.layer_id), hidden

    def token_values(self, mixer: RecurrentMixer, kernel_call: KernelCall) -> dict[str, Tensor]:
        inputs = kernel_call.inputs
        return {"key": inputs["key"], "value": inputs["value"], "wkv": kernel_call.output["output"]}


class WeightedKeyValue(RecurrentMixer):
    """An RWKV-4 time-mixing mixer (rwkv): the WKV state and the token shift.

        with recurrent_hooks.watch(model, keep=("states", "windows")) as w:
            model(input_ids)
        w.mixers[0].states.den             # [batch, seq, channels]: den after every token (a WkvState of stacks)
        w.mixers[0].window_after(4)    # [batch, hidden]: the ln1 output of token 4, which token 5 mixes with

    The state is transformers' (num, den, max) as a `WkvState`, three `[batch, channels]` float32 parts
    (`STATE_TYPE`); the paper's a_t = num e^{max}, b_t = den e^{max}. Hooks get a `WkvState` and may
    return one, writes take one; to edit one part, build a new one: `WkvState(s.num, s.den * 2, s.max)`
    doubles b_t, and scaling a_t and b_t by c is `s._replace(max=s.max + log(c))`. The token shift
    is its window (the memory "window"), of one input: `window_after(t)` is the input token t+1 mixes with.
    The kernels return the new WKV state and write the shift into the model's state list (`state=`,
    there is no Cache), so writes at the last token of a call are what the next call continues from.
    """

    ADAPTER = WeightedKeyValueAdapter
    KERNELS = (
        # prompt and decode: one module global; it takes (num, den, max) and returns the new ones
        Kernel(
            name="rwkv_linear_attention",
            role=Role.BOTH,
            loop=rwkv_linear_attention,
            state_in="state",
            results=("output", "final_state"),
            seq=("key", 1),
        ),
        # the token shift, a method of RwkvSelfAttention (its state argument is the model's state list)
        Kernel(
            name="extract_key_value",
            role=Role.BOTH,
            loop=extract_key_value,
            memory=CONV_MEMORY,
            state_in="state",
            results=("receptance", "key", "value", "model_state"),
            seq=("hidden", 1),
            site=Site.CLASS,
        ),
    )
    STATE_TYPE = WkvState
    LEFT_PADDING = "enters"  # RwkvModel ignores attention_mask (LIMITS)
    STATE = {"num": "batch channels", "den": "batch channels", "max": "batch channels"}
    CONV_STATE = "batch hidden"
    INPUTS = {
        "time_decay": "channels",
        "time_first": "channels",
        "key": "batch seq channels",
        "value": "batch seq channels",
        "state": "(num, den, max), each batch channels",
    }
    OUTPUTS = {"output": "batch seq channels", "final_state": "[num, den, max], each batch channels"}
    VALUES = {"key": "batch seq channels", "value": "batch seq channels", "wkv": "batch seq channels"}
    LIMITS = {
        "batched decode": Caveat(
            "transformers' token shift mixes a [batch, hidden] state with a [batch, 1, hidden] input at a one-token"
            " step over a state, which broadcasts to [batch, batch, hidden] for batch > 1 (its bug): cached decoding"
            " is right for batch 1 only, watched or not; prompts are right for any batch. Such a step's WKV kernel"
            " runs over batch positions, and the record says so: call.tokens and the kept states have batch"
            " positions, the windows (the shift saw one input) one"
        ),
        "left padding": Caveat(
            "RwkvModel ignores attention_mask: the pads of a left-padded row enter its state, watched or not (the"
            " model's behaviour; pad on the right)"
        ),
        "eval rescaling": Caveat(
            "in eval mode RwkvModel divides attention.output and feed_forward.value weights in place by"
            " 2^(layer // rescale_every) (and back in train mode): compare runs in the same mode"
        ),
        "gradients with a state": Refused(
            RuntimeError,
            "with use_cache=True transformers' forward overwrites its state list in place after its"
            " kernels saved views of it for backward, so backward raises (modified by an inplace operation), watched"
            " or not: take gradients with use_cache=False (the kept states are then differentiable as usual)",
        ),
        "attention_hidden_size": Refused(
            RuntimeError,
            "RwkvModel sizes its state with hidden_size, so attention_hidden_size != hidden_size"
            " raises a size mismatch with use_cache=True (transformers' bug), watched or not; such models run with"
            " use_cache=False only",
        ),
        "effective attention": Refused(Unavailable, "rh.effective_attention is not derived for this kind yet"),
        "feed-forward shift": Caveat(
            "the channel mix (RwkvFeedForward) has its own token shift, state[0]: not part of this mixer's memory,"
            " not read or written"
        ),
    }
    FORWARD_INPUT = "hidden"
    LAYER_ATTRIBUTE = "layer_id"


def _empty(state: list[Tensor], layer: int) -> bool:
    """Whether `layer`'s WKV state in the model's state list is the empty one RwkvModel starts from."""
    num, den, p = (s[:, :, layer] for s in state[2:5])
    return bool(
        ((num == 0) & (den == 0) & (p == torch.tensor(_EMPTY_MAX, dtype=p.dtype, device=p.device))).all()
    )  # one sync
