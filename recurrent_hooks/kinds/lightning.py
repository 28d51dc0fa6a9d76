"""MiniMax lightning attention: the `LightningAttention` mixer kind, whose kernel is the mixer's whole forward.

transformers' `MiniMaxLightningAttention.forward` computes its recurrence inline (a chunk loop for a prompt,
a per-token loop over a cached state), so there is no kernel function to rebind. The library binds a
dispatcher in place of the class's `forward` (a `Site.CLASS` kernel): an idle call runs transformers' own
forward, unchanged; a call with hooks, writes or kept states runs `lightning_attention_forward` below, the
same forward with a per-token loop that calls `on_token(t, state)` after every token's update. When only a
few tokens of a prompt are asked for (`Kernel.stops`), it runs transformers' chunk computation between them
instead, from the state at each stop.

Glossary (code name, symbol in MiniMax, "MiniMax-01: Scaling Foundation Models with Lightning Attention",
2025, shape; row vectors, as the paper and transformers write them):
    batch        b                                  batch size
    seq          t (a position), T (the length)     tokens of one forward
    heads        h, H                               heads (`num_attention_heads`)
    head_dim     d                                  query/key/value head size (one size for all three)
    layer        l, L                               the mixer's decoder layer (`layer_idx`), `num_hidden_layers`
    hidden_states  x_t   [batch, seq, hidden]       the mixer's input
    query, key, value  q_t, k_t, v_t  [batch, heads, seq, head_dim]
                        [q; k; v] = SiLU(W_qkv x_t) (`qkv_proj`, `act_fn`; no q/k norm), zeroed at padding
    slope_rate   s_h  [heads, 1, 1]                 s_h = 2^(-8 (h+1) / H) (1 - l / (L - 1 + 1e-5) + 1e-5)
    (decay)      λ_h = exp(-s_h)                    per head; about 1 in the last layer (l = L - 1)
    state        S_t  [batch, heads, head_dim, head_dim]  key-major (o_t = q_t S_t), the model dtype, the
                        layout of `MiniMaxCache.linear_cache[l]`
    gate         σ(W_g x_t)  [batch, seq, heads * head_dim]   `output_gate`, applied after the norm
                        (`values()` gives it per head, [batch, seq, heads, head_dim])
    output       W_o(σ(W_g x_t) ⊙ RMSNorm(o_t))  [batch, seq, hidden]   `norm`, `out_proj`

Recurrence, per head (S_{-1} is the cached state, zeros for a prompt):
    S_t = λ_h S_{t-1} + k_t^T v_t
    o_t = q_t S_t
transformers computes a prompt chunk by chunk (`block_size` tokens at once: transformers says "block"; this
library keeps "blocks" for the path of that name, so here they are chunks. The intra-chunk products decayed
by λ^(i-j), plus the decayed state of the previous chunks); the token loop runs the recurrence as written,
with the operations of transformers' own per-token branch, so a decode step is bit for bit transformers'
and a prompt equals its chunk loop to float32 rounding.

The state is assigned to the cache (`MiniMaxCache.set_linear_cache`, a new tensor every forward), never
updated in place, and the forward returns it as its second result: the state after the last token, written
or hooked, is what the cache gets and what the next call starts from.

Module contents:
- `lightning_attention_forward`: the library's forward, `MiniMaxLightningAttention.forward`'s signature and
  results plus keyword-only `on_token` and `stops` (and `tokens`, which it ignores).
- `_per_token`, `_chunks`: its two loops, transformers' per-token branch and its chunk loop from a state.
- `LightningAttention`: the mixer kind, after its adapter (`LightningAttentionAdapter`).
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from ..engine.declare.kernels import FORWARD, STATE_MEMORY, Kernel, Role, Site
from ..engine.declare.limits import Caveat, Refused
from ..engine.declare.loops import OnToken
from ..engine.errors import Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracking.records import KernelCall


def lightning_attention_forward(
    self: nn.Module,
    hidden_states: Float[Tensor, "batch seq hidden"],
    position_embeddings: tuple[Tensor, Tensor] | None,
    attention_mask: Tensor | None,
    cache: Any = None,
    *,
    past_key_values: Any = None,
    on_token: OnToken | None = None,
    stops: Sequence[int] | None = None,
    tokens: int | None = None,
    **kwargs: Any,
) -> tuple[Float[Tensor, "batch seq hidden"], Float[Tensor, "batch heads head_dim head_dim"]]:
    """`MiniMaxLightningAttention.forward` with hooks: same arguments, results and cache update.

    `on_token(t, state)` is called after token t's update (its output is computed already) and returns
    the state token t+1 continues from; the state after the last token is returned and cached. With
    `stops` (sorted tokens), a prompt calls `on_token` at those tokens only and runs transformers' chunk
    computation between them; a call over a cached state runs token by token, as transformers does.
    `past_key_values` is the deprecated name of `cache` (transformers' forward accepts both);
    `position_embeddings` and other keyword arguments are ignored, as transformers' forward ignores them.
    """
    cache = past_key_values if cache is None else cache
    batch, seq, _ = hidden_states.shape
    query, key, value = _qkv(self, hidden_states, attention_mask)  # b h t d each
    state = _cached_state(cache, self.layer_idx) if cache is not None else None
    if state is not None or stops is None:
        if state is None:
            state = value.new_zeros(batch, self.num_attention_heads, self.head_dim, self.head_dim)  # b h d d   S_{-1}
        outputs, state = _per_token(self, query, key, value, state, 0, seq, on_token)
    else:  # a prompt, with stops: chunks between them
        state = value.new_zeros(batch, self.num_attention_heads, self.head_dim, self.head_dim)  # b h d d   S_{-1} = 0
        outputs, start = [], 0
        for end in [*(stop + 1 for stop in stops), seq]:
            if end <= start:
                continue
            span, state = _chunks(self, query, key, value, state, start, end)
            outputs += span
            if on_token is not None and end - 1 in stops:
                state = on_token(end - 1, state)  # b h d d   what token end continues from
            start = end
    out = torch.cat(outputs, dim=-2) if outputs else value.new_zeros(value.shape)  # b h t d
    out = out.transpose(1, 2).reshape(batch, seq, self.num_attention_heads * self.head_dim)  # b t (h d)
    out = self.norm(out)  # b t (h d)   RMSNorm(o)
    out = F.sigmoid(self.output_gate(hidden_states)) * out  # b t (h d)   σ(W_g x) ⊙ RMSNorm(o)
    out = self.out_proj(out)  # b t hidden
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, state)
    return out, state


_BUG_8 = Caveat(
    "transformers' MiniMaxCache: with linear attention at layer 0, get_seq_length() is 0 after a"
    " prefill (cache layer 0 is an empty attention layer), so a multi-token continuation over the cache"
    " and left-padded batched generate get wrong masks and positions, watched or not; full attention at"
    " layer 0 (`layer_types` [full_attention, linear_attention, ...]) is exact"
)


class LightningAttentionAdapter(KindAdapter):
    """Lightning attention's adapter: its state in `MiniMaxCache.linear_cache`, read by its whole forward, and
    its values, recomputed with the handle's module."""

    def cached(self, cache: Any, layer: int) -> Tensor | None:
        return _cached_state(cache, layer)

    def kernel_arguments(self, module: nn.Module, kernel: Kernel, arguments: dict[str, Any]) -> dict[str, Any]:
        arguments = dict(arguments)
        cache = self.pop_cache(arguments)
        cached = None if cache is None else _cached_state(cache, module.layer_idx)
        arguments[self.kind.kernel("forward").state_in] = cached
        return arguments

    def token_values(self, mixer: RecurrentMixer, kernel_call: KernelCall) -> dict[str, Tensor]:
        """q, k, v and the gate, recomputed from the recorded input with the module's projections (the
        weights as they are now), and the forward's output."""
        x = kernel_call.inputs
        module = mixer.module
        if module.qkv_proj.weight.device.type == "meta":
            raise Unavailable(
                f"{mixer}.values(): q, k, v and the gate are recomputed with the module's projections,"
                " whose weights are offloaded (on the meta device) between forwards; read"
                " call.inputs, or keep states, instead"
            )
        with torch.no_grad():
            query, key, value = (v.transpose(1, 2) for v in _qkv(module, x["hidden_states"], x["attention_mask"]))
            gate = F.sigmoid(module.output_gate(x["hidden_states"]))  # b t (h d)
        gate = gate.unflatten(-1, (module.num_attention_heads, module.head_dim))  # b t h d
        return {"query": query, "key": key, "value": value, "gate": gate, "output": kernel_call.output["output"]}


class LightningAttention(RecurrentMixer):
    """A MiniMax lightning attention mixer (minimax).

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states   # Float[Tensor, "batch seq heads head_dim head_dim"]

    The state S_t is `[batch, heads, head_dim, head_dim]`, key-major (o_t = q_t S_t), in the model dtype,
    the layout of `MiniMaxCache.linear_cache`. The kernel is the mixer's whole forward (a class attribute,
    `Site.CLASS`): idle calls run transformers' forward, busy ones the library's, which calls the hooks
    after every token (or, for a few tokens of a prompt, runs the chunk loop between them) and caches the
    state after the last one. The memory is the state alone (no short convolution). `inputs` are the
    forward's arguments, with the cache replaced by the state it held for the layer (`initial_state`, None
    for a prompt); `outputs` are its results, `output` and `final_state`.
    """

    ADAPTER = LightningAttentionAdapter
    KERNELS = (
        # the whole forward; `initial_state`, in the recorded inputs, is the cached state it started from
        Kernel(
            name="forward",
            role=Role.BOTH,
            loop=lightning_attention_forward,
            state_in="initial_state",
            results=("output", "final_state"),
            seq=FORWARD,
            site=Site.CLASS,
            stops=True,
        ),
    )
    MEMORIES = (STATE_MEMORY,)
    REORDERED_BY_CACHE = False  # MiniMaxCache.reorder_cache reorders its attention layers only (see LIMITS)
    FORWARD_CACHE = ("cache", "past_key_values")
    STATE = "batch heads head_dim head_dim"
    HEADS = True
    INPUTS = {
        "hidden_states": "batch seq hidden",
        "attention_mask": "batch seq",
        "initial_state": "batch heads head_dim head_dim",
    }
    OUTPUTS = {"output": "batch seq hidden", "final_state": "batch heads head_dim head_dim"}
    VALUES = {
        "query": "batch seq heads head_dim",
        "key": "batch seq heads head_dim",
        "value": "batch seq heads head_dim",
        "gate": "batch seq heads head_dim",
        "output": "batch seq hidden",
    }
    LIMITS = {
        "windows": Refused(
            Unavailable,
            "lightning attention has no short convolution: its memory is the state alone (reading,"
            " writing or hooking a window raises)",
        ),
        "linear attention at layer 0": _BUG_8,
        "beam search": Caveat(
            "transformers' MiniMaxCache does not reorder its linear states when beam search reorders the cache"
            " (Cache.reorder_cache moves only the attention layers), so each row's state continues the same row, not"
            " its parent beam's, watched or not; call.reorder stays None for this reason"
        ),
        "values of an offloaded mixer": Refused(
            Unavailable,
            "values() recomputes q, k, v and the gate with the module's projections, which accelerate's"
            " offloading leaves on the meta device between forwards",
        ),
        "effective attention": Refused(
            Unavailable,
            "not provided: o_t = sum_s λ_h^(t-s) (q_t . k_s) v_s is linear in the values, but the"
            " forward's output is after an RMSNorm over the heads, which is not",
        ),
    }


def _cached_state(cache: Any, layer: int) -> Tensor | None:
    """The state `cache` holds for `layer` (None: nothing cached, the forward starts from zeros)."""
    get = getattr(cache, "get_linear_cache", None)
    state = get(layer) if get is not None else None
    return state if isinstance(state, Tensor) else None


def _qkv(
    module: nn.Module, hidden_states: Tensor, attention_mask: Tensor | None
) -> tuple[Float[Tensor, "batch heads seq head_dim"], ...]:
    """q, k, v as transformers' forward forms them: SiLU(W_qkv x), zeroed at padding, split per head."""
    batch, seq, _ = hidden_states.shape
    qkv = module.act_fn(module.qkv_proj(hidden_states))  # b t (h 3d)
    if attention_mask is not None:  # transformers' apply_mask_to_padding_states (a 2D mask, 1 = a real token)
        qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
    qkv = qkv.reshape(batch, seq, module.num_attention_heads, 3 * module.head_dim)  # b t h 3d
    return tuple(x.transpose(1, 2) for x in torch.split(qkv, module.head_dim, dim=3))  # b h t d each


def _per_token(
    self: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    state: Tensor,
    start: int,
    end: int,
    on_token: OnToken | None,
) -> tuple[list[Tensor], Tensor]:
    """Tokens start..end-1 one at a time, with the operations of transformers' per-token branch."""
    ratio = torch.exp(-self.slope_rate)  # h 1 1   λ_h = exp(-s_h)
    outputs = []
    # one split of each input into its tokens (a slice a token would make the backward quadratic)
    steps = zip(*(x[:, :, start:end].split(1, dim=2) for x in (query, key, value)))  # b h 1 d each, per token
    for t, (q, k, v) in zip(range(start, end), steps):
        written = torch.matmul(k.transpose(-1, -2), v)  # b h d d   k_t^T v_t
        state = ratio * state + written  # b h d d   S_t = λ S_{t-1} + k_t^T v_t
        outputs.append(torch.matmul(q, state))  # b h 1 d   o_t = q_t S_t
        if on_token is not None:
            state = on_token(t, state)  # b h d d   what token t+1 continues from
    return outputs, state


def _chunks(
    self: nn.Module, query: Tensor, key: Tensor, value: Tensor, state: Tensor, start: int, end: int
) -> tuple[list[Tensor], Tensor]:
    """Tokens start..end-1 chunk by chunk from `state`, with the operations of transformers' chunk loop
    (chunks of `block_size` counted from `start`; from start = 0 and a zero state, bit for bit its loop).
    Within a chunk of n tokens i, j = 1..n: o_i = λ^i q_i S + sum_{j<=i} λ^(i-j) (q_i . k_j) v_j and
    S <- λ^n S + sum_j λ^(n-j) k_j^T v_j."""
    outputs = []
    for first in range(start, end, self.block_size):
        last = min(first + self.block_size, end)
        n = last - first
        q, k, v = (x[:, :, first:last] for x in (query, key, value))  # b h n d each
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * self.diagonal_decay[:, :, :n, :n], v)  # b h n d
        inter = torch.matmul(q * self.query_decay[:, :n], state)  # b h n d   λ^i q_i S
        outputs.append(inter + intra)  # b h n d
        written = torch.matmul((k * self.key_decay[:, -n:]).transpose(-1, -2), v)  # b h d d   sum_j λ^(n-j) k_j^T v_j
        state = state * torch.exp(-self.slope_rate * n) + written  # b h d d   λ^n S + ...
    return outputs, state
