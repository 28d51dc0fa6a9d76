"""Gated DeltaNet (the gated delta rule): the `GatedDeltaNet` mixer kind and its token loop.

Glossary (code name, symbol in Yang, Kautz & Hatamizadeh, "Gated Delta Networks", 2024, shape):
    batch      b                                       batch size
    seq        t (a position), T (the length)          tokens of one kernel call
    key_heads  -                                       query/key heads (heads % key_heads == 0)
    heads      -                                       value heads; value head j reads key head
                                                       j // (heads // key_heads)
    key_dim    d_k                                     query/key head size
    value_dim  d_v                                     value head size
    query      q_t     [batch, seq, key_heads, key_dim]    L2-normalised in the kernel, scaled by d_k ** -0.5
    key        k_t     [batch, seq, key_heads, key_dim]    L2-normalised in the kernel
    value      v_t     [batch, seq, heads, value_dim]
    g          log a_t [batch, seq, heads]                 log of the decay a_t = exp(g_t) in (0, 1]
    beta       b_t     [batch, seq, heads]                 write strength (olmo_hybrid: in [0, 2])
    state      S_t     [batch, heads, key_dim, value_dim]  key-major, float32, the layout of transformers' cache

Recurrence, per value head (S_t^T k reads the value the state stores under key k):
    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T
    o_t = S_t^T q_t
computed as transformers and flash-linear-attention do: decay, read `kv_mem`, write the correction.

Module contents:
- `chunk_gated_delta_rule`, `recurrent_gated_delta_rule`: token loops with the signatures of transformers'
  `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`, plus a keyword-only `on_token`.
- `chunk_gated_delta_rule_states`: the prompt kernel chunk-wise with every token's state (into `out` when given, or
  a chunk at a time to `on_chunk`); `chunk_gated_delta_rule_adjoint`: its adjoint recurrence, right to left
  (`Segments.adjoint`).
- `GatedDeltaNet`: the mixer kind, its kernels and values declared as class constants, and its adapter
  (`GatedDeltaNetAdapter`: its heads' window channels, its values, its effective attention).

The maths (the token loop, the chunk-wise states, the adjoint), shared with Kimi delta attention, are `delta_rule`'s.
"""

import torch
from torch import Tensor

from ..engine.declare.effective import EffectiveAttention, cat, decayed
from ..engine.declare.kernels import Kernel, Role, Segments
from ..engine.declare.limits import Refused
from ..engine.errors import RecurrentHooksError, Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracking.records import KernelCall
from .shared.conv import CONV_KERNELS
from .shared.delta_rule import cost_shape, kernels, prepare
from .shared.recording import SPLIT_RECORDING

# the token loops and the chunk-wise kernels, with transformers' signatures (written once: `delta_rule.kernels`)
(chunk_gated_delta_rule, chunk_gated_delta_rule_states, chunk_gated_delta_rule_adjoint, recurrent_gated_delta_rule) = (
    kernels("chunk_gated_delta_rule", "recurrent_gated_delta_rule", __name__)
)


class GatedDeltaNetAdapter(KindAdapter):
    """Gated DeltaNet's adapter (and Kimi delta attention's): its heads' window channels, its values and its
    effective attention."""

    def head_channels(self, head: int, heads: int, head_state: tuple[int, ...], channels: int) -> list[int]:
        """The window's channels are `[q | k | v]`, each head-major (`q`, `k`: key_heads x key_dim, `v`: heads x
        value_dim): value head j reads the q and k channels of its key head j // (heads // key_heads) (shared with
        the other value heads of that group) and its own v channels."""
        key_dim, value_dim = head_state
        key_heads, rest = divmod(channels - heads * value_dim, 2 * key_dim)
        if rest or key_heads < 1 or heads % key_heads:
            raise Unavailable(
                f"{self.kind.__name__}: a window of {channels} channels is not [q | k | v] for {heads}"
                f" heads of key_dim {key_dim}, value_dim {value_dim}"
            )
        key_head = head // (heads // key_heads)
        query = range(key_head * key_dim, (key_head + 1) * key_dim)
        return [
            *query,
            *(c + key_heads * key_dim for c in query),
            *range(2 * key_heads * key_dim + head * value_dim, 2 * key_heads * key_dim + (head + 1) * value_dim),
        ]

    def token_values(self, mixer: RecurrentMixer, kernel_call: KernelCall) -> dict[str, Tensor]:
        # the kernel's own arguments are token-major already (before the kernel's l2norm and scaling)
        return {
            **{name: kernel_call.inputs[name] for name in ("query", "key", "value", "g", "beta")},
            "output": kernel_call.output["output"],
        }

    def effective_attention(self, mixer: RecurrentMixer, calls: range, dtype: torch.dtype) -> EffectiveAttention:
        """The delta rule's exact map (the UT transform; see `recurrent_hooks.studies.effective_attention`)."""
        kind, kimi = self.kind, self.kind.DECAY_PER_KEY_CHANNEL
        per_call = []
        for index in calls:
            kernel_call = mixer.calls[index].kernel_calls[0]
            x = kernel_call.inputs
            if x.get("cu_seqlens") is not None:
                raise Unavailable(
                    f"{mixer}, call {index}: packed sequences (cu_seqlens) have no per-row effective attention"
                )
            g = x["g"] if kimi else x["g"][..., None]
            prepared = prepare(
                x["query"],
                x["key"],
                x["value"],
                g,
                x["beta"],
                x["initial_state"],
                x["use_qk_l2norm_in_kernel"],
                {},
                kimi=kimi,
                recurrent=kind.kernel(kernel_call.kernel).role is Role.DECODE,
            )
            per_call.append([v.transpose(1, 2) for v in prepared[:5]] + [prepared[5]])  # b h t ..
        q, k, v, b, log_a = (cat([c[i] for c in per_call], dtype) for i in range(5))
        state = per_call[0][5].to(dtype)  # b h k v   S_0 of the history
        rows = mixer.calls[calls[-1]].kernel_calls[0].inputs["value"].shape[1]
        start = q.shape[2] - rows
        cum = log_a.cumsum(2)  # b h s (1|k)   c_s
        system = decayed(k, k, cum, cum, 0, strict=True) * b[..., None]  # b h s s   strict_lower(diag(b) W(k, k))
        system.diagonal(dim1=-2, dim2=-1).fill_(1)  # T = I + ...
        reads = decayed(q[:, :, start:], k, cum[:, :, start:], cum, start, strict=False)  # b h t s   W(q, k)
        weights = (
            torch.linalg.solve_triangular(system, reads, upper=False, left=False, unitriangular=True) * b[:, :, None]
        )
        from_state = (q[:, :, start:] * cum[:, :, start:].exp()) @ state - weights @ ((k * cum.exp()) @ state)
        return EffectiveAttention(weights, v, from_state, None, None, calls)


class GatedDeltaNet(RecurrentMixer):
    """A gated DeltaNet mixer (qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid, qwen4_exp, lara_mini).

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states   # Float[Tensor, "batch seq heads key_dim value_dim"]

    The state S_t is `[batch, heads, key_dim, value_dim]`, float32, key-major (o_t = S_t^T q_t), the
    layout of transformers' cache. Both kernels return the new state and the mixer copies it into the
    cache, so a write at the last token of a call reaches the cache.
    """

    ADAPTER = GatedDeltaNetAdapter
    # the words of this kind's documentation: prompts token by token ("recurrent") or chunk-wise ("chunked")
    ROUTES = {**RecurrentMixer.ROUTES, "recurrent": "torch", "chunked": "default"}
    DECAY_PER_KEY_CHANNEL = False  # Kimi delta attention: a decay per key channel, Diag(alpha_t)
    KERNELS = (
        # both kernels take the state in `initial_state` and return the new one
        Kernel(
            name="torch_chunk_gated_delta_rule",
            role=Role.PROMPT,
            loop=chunk_gated_delta_rule,
            state_in="initial_state",
            results=("output", "final_state"),
            seq=("value", 1),
            segments=Segments(
                per_token={name: 1 for name in ("query", "key", "value", "g", "beta")},
                state_in="initial_state",
                final_flag="output_final_state",
                out_axis=1,
                tuple_without_final=True,
                all_states=chunk_gated_delta_rule_states,
                on_chunk=True,
                readouts=16,
                adjoint=chunk_gated_delta_rule_adjoint,
                blocks_below=2048,  # 4 heads of 16 x 16 at batch 2 (docs/performance.md)
                shape=cost_shape,
            ),
        ),
        # a decode step with a hook or write runs transformers' kernel, then the hook on the state it returns
        # (one segment: the token loop's order, whose output at a token is computed before its hook)
        Kernel(
            name="torch_recurrent_gated_delta_rule",
            role=Role.DECODE,
            loop=recurrent_gated_delta_rule,
            state_in="initial_state",
            results=("output", "final_state"),
            seq=("value", 1),
            segments=Segments(
                per_token={name: 1 for name in ("query", "key", "value", "g", "beta")},
                state_in="initial_state",
                final_flag="output_final_state",
                out_axis=1,
                tuple_without_final=True,
            ),
        ),
        *CONV_KERNELS,
    )
    STATE = "batch heads key_dim value_dim"
    HEADS = True  # value heads; value head j reads query/key head j // (heads // key_heads)
    CONTINUES_CACHE = True  # the chunked rule takes the cached state, the conv the cached window
    INPUTS = {
        "query": "batch seq key_heads key_dim",
        "key": "batch seq key_heads key_dim",
        "value": "batch seq heads value_dim",
        "g": "batch seq heads",
        "beta": "batch seq heads",
        "initial_state": "batch heads key_dim value_dim",
    }
    OUTPUTS = {"output": "batch seq heads value_dim", "final_state": "batch heads key_dim value_dim"}
    VALUES = {
        "query": "batch seq key_heads key_dim",
        "key": "batch seq key_heads key_dim",
        "value": "batch seq heads value_dim",
        "g": "batch seq heads",
        "beta": "batch seq heads",
        "output": "batch seq heads value_dim",
    }
    LIMITS = {
        "packed sequences": Refused(
            (ValueError, RecurrentHooksError),
            "cu_seqlens (packed batches) need flash-linear-attention: without it"
            " transformers' pure-torch fallback raises ValueError, watched or not, and a watched call that runs the"
            " library's loops (hooks, writes, kept states) raises rh.RecurrentHooksError (they run one sequence per"
            " batch row)",
        ),
        **SPLIT_RECORDING,
    }
