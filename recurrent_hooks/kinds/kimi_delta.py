"""Kimi delta attention (KDA): the `KimiDeltaAttention` mixer kind and its token loops.

KDA is the gated delta rule of `gated_delta_net` with a decay per key channel instead of per head,
and without grouped value heads. The token loop is the gated DeltaNet one (`delta_rule.gated_delta_rule`), fed
the per-channel decay.

Glossary (code name, symbol in Kimi Team, "Kimi Linear: An Expressive, Efficient Attention
Architecture", 2025, shape):
    batch      b                                       batch size
    seq        t (a position), T (the length)          tokens of one kernel call
    heads      h                                       query/key/value heads (one key head per value head)
    key_dim    d_k                                     query/key head size
    value_dim  d_v                                     value head size
    query      q_t          [batch, seq, heads, key_dim]    L2-normalised in the kernel, scaled by d_k ** -0.5
    key        k_t          [batch, seq, heads, key_dim]    L2-normalised in the kernel
    value      v_t          [batch, seq, heads, value_dim]
    g          log alpha_t  [batch, seq, heads, key_dim]    log of the per-channel decay alpha_t = exp(g_t) in (0, 1]
    beta       beta_t       [batch, seq, heads]             write strength
    state      S_t          [batch, heads, key_dim, value_dim]  key-major, float32, the layout of transformers' cache

Recurrence, per head (Diag(alpha_t) scales row i of S, the memory of key channel i, by alpha_t[i]):
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t
computed as transformers and flash-linear-attention do: decay, read `kv_mem`, write the correction.
transformers' KDA kernels normalise with x / sqrt(|x|^2 + 1e-6) and scale q by 1 / sqrt(d_k), the
gated DeltaNet ones with x * rsqrt(|x|^2 + 1e-6); the loop (`kimi=True`) rounds as the KDA kernels do.

Module contents:
- `chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`: token loops with the signatures of
  transformers' kernels of the same names, plus a keyword-only `on_token`.
- `chunk_kimi_delta_attention_states`, `chunk_kimi_delta_attention_adjoint`: the prompt kernel chunk-wise with every
  token's state, and its adjoint recurrence (gated DeltaNet's, with the decay per key channel).
- `KimiDeltaAttention`: the mixer kind, its kernels and values declared as class constants.
"""

import dataclasses
from typing import Any

from ..engine.declare.kernels import Role
from ..engine.declare.limits import Caveat
from ..engine.paths.costs import Shape
from .gated_delta_net import GatedDeltaNet
from .shared.conv import CONV_KERNELS
from .shared.delta_rule import cost_shape, kernels
from .shared.recording import SPLIT_RECORDING

# the token loops and the chunk-wise kernels, with transformers' signatures (written once: `delta_rule.kernels`)
(
    chunk_kimi_delta_attention,
    chunk_kimi_delta_attention_states,
    chunk_kimi_delta_attention_adjoint,
    recurrent_kimi_delta_attention,
) = kernels("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", __name__, kimi=True)


def _cost_shape(arguments: dict[str, Any]) -> Shape:
    """As gated DeltaNet's, timed by Kimi's constants: transformers' kernel inverts each chunk's system by a
    Python loop over its rows, a larger cost per call, and a graph under autograd many times gated DeltaNet's per
    chunk (measured at Kimi-Linear dims, tests/engine/test_path_memory.py: docs/performance.md, "Paths chosen by
    memory")."""
    return dataclasses.replace(cost_shape(arguments), constants="kimi delta", graph=50.0, loop_graph=1.8)


class KimiDeltaAttention(GatedDeltaNet):
    """A Kimi delta attention mixer (kimi_linear, bailing_hybrid, glm5_next).

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states   # Float[Tensor, "batch seq heads key_dim value_dim"]

    As `GatedDeltaNet` (state `[batch, heads, key_dim, value_dim]`, float32, key-major; both kernels
    return the new state and the mixer copies it into the cache), except that the decay `g` has one value
    per key channel, `[batch, seq, heads, key_dim]`, and query, key and value have the same heads.
    bailing_hybrid hands `g` over in the model dtype (bf16 in a bf16 model); the token loop runs in float32.
    """

    DECAY_PER_KEY_CHANNEL = True
    KERNELS = (  # gated DeltaNet's declarations, with their own names and loops
        dataclasses.replace(
            GatedDeltaNet.kernel_for(Role.PROMPT),
            name="chunk_kimi_delta_attention",
            loop=chunk_kimi_delta_attention,
            segments=dataclasses.replace(
                GatedDeltaNet.kernel_for(Role.PROMPT).segments,
                all_states=chunk_kimi_delta_attention_states,
                adjoint=chunk_kimi_delta_attention_adjoint,
                shape=_cost_shape,
            ),
        ),
        dataclasses.replace(
            GatedDeltaNet.kernel_for(Role.DECODE),
            name="recurrent_kimi_delta_attention",
            loop=recurrent_kimi_delta_attention,
        ),
        *CONV_KERNELS,
    )
    INPUTS = {
        "query": "batch seq heads key_dim",
        "key": "batch seq heads key_dim",
        "value": "batch seq heads value_dim",
        "g": "batch seq heads key_dim",
        "beta": "batch seq heads",
        "initial_state": "batch heads key_dim value_dim",
    }
    VALUES = {
        **GatedDeltaNet.VALUES,
        "query": "batch seq heads key_dim",
        "key": "batch seq heads key_dim",
        "g": "batch seq heads key_dim",
    }
    LIMITS = {
        "packed sequences": Caveat(
            "transformers' KDA mixers pass no cu_seqlens to their recurrence kernels, so a packed row runs as one"
            " sequence, watched or not (the model's behaviour)"
        ),
        **SPLIT_RECORDING,
    }
