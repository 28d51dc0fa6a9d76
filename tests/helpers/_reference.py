"""Independent float64 reference recurrences, written from the papers' equations.

These are deliberately naive (one Python step per token, explicit matrices) so
that they can be checked by reading them against the paper. They are the ground
truth the library's kernels and hooks are tested against; nothing here is
derived from an optimised kernel.

Gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", arXiv:2412.06464)
---------------------------------------------------------------------------
Per batch element and value head, with the state S_t a [d_k, d_v] matrix that
maps keys to values (S_0 = initial state, zeros by default):

    q_t <- q_t / sqrt(||q_t||^2 + 1e-6) * d_k^(-1/2)     (if normalize_qk;
    k_t <- k_t / sqrt(||k_t||^2 + 1e-6)                    the d_k^(-1/2) always)
    alpha_t = exp(g_t)                                     (decay in (0, 1])
    S_t = alpha_t * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

Equivalently S_t = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T:
the decayed memory's prediction for key k_t is moved a fraction beta_t towards
v_t (the delta rule), after forgetting by alpha_t (the gate).

Glossary (code name <-> paper symbol <-> shape):

    query          q_t        [batch, seq, key_heads, key_dim]
    key            k_t        [batch, seq, key_heads, key_dim]
    value          v_t        [batch, seq, value_heads, value_dim]
    g              log alpha_t  [batch, seq, value_heads]   (alpha_t = exp(g_t))
    beta           beta_t     [batch, seq, value_heads]       (writing strength)
    initial_state  S_0        [batch, value_heads, key_dim, value_dim]
    states[:, t]   S_t        [batch, seq, value_heads, key_dim, value_dim]
    outputs[:, t]  o_t        [batch, seq, value_heads, value_dim]
    key_dim        d_k;  value_dim  d_v

Grouped value heads: value head j reads query/key head j // (value_heads //
key_heads), i.e. each query/key head serves a block of consecutive value heads.

Kimi delta attention (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient
Attention Architecture", arXiv:2510.26692)
---------------------------------------------------------------------------
The gated delta rule with one decay per key channel (alpha_t a d_k-vector) and
one query/key head per value head; q_t, k_t normalised and scaled as above:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

Diag(alpha_t) S scales row i of S (what key channel i holds) by alpha_t[i].
Here g is [batch, seq, heads, key_dim] and alpha_t = exp(g_t).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gated_delta_rule_reference", "kimi_delta_rule_reference"]

_L2_EPS = 1e-6


def _l2_normalize(x: Tensor) -> Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def _prepared(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, normalize_qk: bool):
    """q, k, v and beta in float64, q and k L2-normalised (if normalize_qk) and q scaled by d_k^(-1/2)."""
    f64 = torch.float64
    q, k, v = query.to(f64), key.to(f64), value.to(f64)
    if normalize_qk:
        q = _l2_normalize(q)
        k = _l2_normalize(k)
    return q * key.shape[-1] ** -0.5, k, v, beta.to(f64)


def _delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor | None, transition
) -> tuple[Tensor, Tensor]:
    """The delta rule token by token in float64, the loop both references share:

        S_t = transition(t, I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

    where `transition` applies token t's decay to the erasing matrix. q, k ``[batch, seq, heads, key_dim]`` and v
    ``[batch, seq, heads, value_dim]`` (one query/key head per value head), beta ``[batch, seq, heads]``, all prepared
    (`_prepared`); S_0 = initial_state, zeros if None. Returns ``(outputs, states)`` as the references do.
    """
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    state_shape = (batch, heads, key_dim, value_dim)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be {state_shape}")

    f64 = torch.float64
    if initial_state is None:
        S = torch.zeros(state_shape, dtype=f64, device=v.device)
    else:
        S = initial_state.to(f64)
    eye = torch.eye(key_dim, dtype=f64, device=v.device)  # I, [dk, dk]

    outputs = []
    states = []
    for t in range(seq):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, dk], [B, H, dk], [B, H, dv]
        beta_t = beta[:, t, :, None, None]  # [B, H, 1, 1]

        k_kT = k_t[..., :, None] * k_t[..., None, :]  # k_t k_t^T, [B, H, dk, dk]
        k_vT = k_t[..., :, None] * v_t[..., None, :]  # k_t v_t^T, [B, H, dk, dv]
        S = transition(t, eye - beta_t * k_kT) @ S + beta_t * k_vT  # S_t, [B, H, dk, dv]
        o_t = (S.transpose(-1, -2) @ q_t[..., None])[..., 0]  # S_t^T q_t, [B, H, dv]

        outputs.append(o_t)
        states.append(S)

    if seq == 0:
        return (
            torch.zeros(batch, 0, heads, value_dim, dtype=f64, device=v.device),
            torch.zeros(batch, 0, *state_shape[1:], dtype=f64, device=v.device),
        )
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1)


def gated_delta_rule_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Tensor | None = None,
    normalize_qk: bool = True,
) -> tuple[Tensor, Tensor]:
    """Run the gated delta rule token by token in float64.

    Returns ``(outputs, states)``: outputs ``[batch, seq, value_heads, value_dim]``
    with outputs[:, t] = o_t, and states ``[batch, seq, value_heads, key_dim,
    value_dim]`` with states[:, t] = S_t, the state after token t (so
    states[:, -1] is the final state). Both float64. See the module docstring.
    """
    batch, seq, key_heads, key_dim = key.shape
    value_heads = value.shape[-2]
    if query.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must have the same shape")
    if value.shape[:2] != (batch, seq):
        raise ValueError(f"value {tuple(value.shape)} must start with (batch, seq) = {(batch, seq)}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (batch, seq, value_heads):
            raise ValueError(f"{name} {tuple(t.shape)} must be {(batch, seq, value_heads)}")
    if value_heads % key_heads != 0:
        raise ValueError(f"value_heads={value_heads} must be a multiple of key_heads={key_heads}")

    q, k, v, beta = _prepared(query, key, value, beta, normalize_qk)  # beta [B, T, Hv]
    alpha = torch.exp(g.to(torch.float64))  # [B, T, Hv]

    # Grouped heads: give every value head its own copy of its query/key head.
    key_head_of = torch.arange(value_heads) // (value_heads // key_heads)  # [Hv]
    q = q[:, :, key_head_of]  # [B, T, Hv, dk]
    k = k[:, :, key_head_of]  # [B, T, Hv, dk]

    # alpha_t (I - beta_t k_t k_t^T)
    return _delta_rule(q, k, v, beta, initial_state, lambda t, erase: alpha[:, t, :, None, None] * erase)


def kimi_delta_rule_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Tensor | None = None,
    normalize_qk: bool = True,
) -> tuple[Tensor, Tensor]:
    """Run Kimi delta attention token by token in float64.

    query, key ``[batch, seq, heads, key_dim]``; value ``[batch, seq, heads,
    value_dim]``; g ``[batch, seq, heads, key_dim]`` (log of the per-channel
    decay); beta ``[batch, seq, heads]``. Returns ``(outputs, states)``: outputs
    ``[batch, seq, heads, value_dim]``, states ``[batch, seq, heads, key_dim,
    value_dim]`` with states[:, t] = S_t. Both float64. See the module docstring.
    """
    batch, seq, heads, key_dim = key.shape
    if query.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must have the same shape")
    if value.shape[:3] != (batch, seq, heads):
        raise ValueError(f"value {tuple(value.shape)} must start with (batch, seq, heads) = {(batch, seq, heads)}")
    if g.shape != key.shape:
        raise ValueError(f"g {tuple(g.shape)} must be {tuple(key.shape)} (one decay per key channel)")
    if beta.shape != (batch, seq, heads):
        raise ValueError(f"beta {tuple(beta.shape)} must be {(batch, seq, heads)}")

    q, k, v, beta = _prepared(query, key, value, beta, normalize_qk)  # beta [B, T, H]
    alpha = torch.exp(g.to(torch.float64))  # [B, T, H, dk]

    # (I - beta_t k_t k_t^T) Diag(alpha_t), Diag(alpha_t) [B, H, dk, dk]
    return _delta_rule(q, k, v, beta, initial_state, lambda t, erase: erase @ torch.diag_embed(alpha[:, t]))


# ---------------------------------------------------------------------------
# Further references go below, one function per recurrence, same conventions
# (float64, loop over t, return per-token outputs and per-token states):
#   * Mamba-1 selective scan (Gu & Dao 2023): h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,
#     y_t = C_t h_t + D x_t.
#   * SSD / Mamba-2 (Dao & Gu 2024): scalar-per-head decay, h_t = exp(dt_t a) h_{t-1}
#     + dt_t x_t B_t^T, y_t = h_t C_t + D x_t.
# ---------------------------------------------------------------------------
