"""Independent float64 references for the state-space recurrences, written from the papers' equations.

Deliberately naive (one Python step per token, explicit outer products, token-major inputs rather than
the kernels' layouts), so that each can be checked by reading it against the paper. Nothing here is
derived from an optimised kernel or from the library's loops. Conventions as in `_reference.py`:
float64, a loop over t, per-token outputs and per-token states returned.

Mamba-1 selective scan (Gu & Dao 2023, "Mamba", arXiv:2312.00752, Algorithm 2 and Section 3.5)
--------------------------------------------------------------------------------------------------
Per batch element and channel d, with the state h_t[d] a d_state-vector (h_0 = initial state, zeros
by default):

    Δ_t = softplus(dt_t + dt_bias)        (softplus(u) = log(1 + e^u); without softplus Δ_t = dt_t + dt_bias)
    h_t = exp(Δ_t A[d]) * h_{t-1} + Δ_t B_t x_t      (A[d] the channel's row of A; * elementwise)
    y_t = <C_t, h_t> + D[d] x_t,     y_t <- y_t * silu(z_t) when z is given (silu(u) = u / (1 + e^-u))

Glossary (code name <-> paper symbol <-> shape):
    x        x_t        [batch, seq, d_inner]
    dt       dt_t       [batch, seq, d_inner]      (Δ_t after bias / softplus)
    A        A          [d_inner, d_state]
    B, C     B_t, C_t   [batch, seq, d_state]
    D        D          [d_inner]
    z        z_t        [batch, seq, d_inner]
    states   h_t        [batch, seq, d_inner, d_state]

SSD / Mamba-2 (Dao & Gu 2024, "Transformers are SSMs", arXiv:2405.21060, Section 7 / Mamba-2 block)
--------------------------------------------------------------------------------------------------
Per batch element and head h, with the state h_t a [head_dim, d_state] matrix and a scalar decay
rate a_h per head:

    Δ_t = clamp(softplus(dt_t + dt_bias), dt_limit)   (the clamp is the Mamba-2 code's, not the paper's)
    h_t = exp(Δ_t a_h) h_{t-1} + Δ_t x_t B_t^T
    y_t = h_t C_t + D_h x_t,         y_t <- y_t * silu(z_t) when z is given

Glossary:
    x        x_t        [batch, seq, heads, head_dim]
    dt       dt_t       [batch, seq, heads]
    A        a_h        [heads]
    B, C     B_t, C_t   [batch, seq, groups, d_state]; head h reads group h // (heads // groups)
    D        D_h        [heads]
    z        z_t        [batch, seq, heads, head_dim]
    states   h_t        [batch, seq, heads, head_dim, d_state]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["selective_scan_reference", "ssd_reference"]

F64 = torch.float64


def _softplus(u: Tensor) -> Tensor:
    """log(1 + e^u), written out (stable for large u)."""
    return torch.where(u > 20, u, torch.log1p(torch.exp(u)))


def _silu(u: Tensor) -> Tensor:
    return u / (1 + torch.exp(-u))


def _step(dt: Tensor, dt_bias: Tensor | None, softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    delta = dt.to(F64)
    if dt_bias is not None:
        delta = delta + dt_bias.to(F64)
    if softplus:
        delta = _softplus(delta)
    return delta.clamp(dt_limit[0], dt_limit[1])


def _scan(seq: int, h: Tensor, step, x: Tensor, D: Tensor | None, z: Tensor | None) -> tuple[Tensor, Tensor]:
    """The token loop both references share: h_t, y_t = step(t, h_{t-1}) from h_0 = `h`, then the skip
    (y_t + D x_t, `D` shaped to broadcast over x_t) and the gate (y_t * silu(z_t)) where given. Returns
    ``(outputs, states)`` stacked over the tokens."""
    outputs, states = [], []
    for t in range(seq):
        h, y = step(t, h)
        if D is not None:
            y = y + D * x[:, t]
        if z is not None:
            y = y * _silu(z[:, t].to(F64))
        outputs.append(y)
        states.append(h)
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1)


def selective_scan_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    *,
    dt_bias: Tensor | None = None,
    softplus: bool = False,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Mamba-1 token by token in float64 (token-major inputs, see the module docstring).

    Returns ``(outputs [batch, seq, d_inner], states [batch, seq, d_inner, d_state])``, states[:, t] = h_t.
    """
    batch, seq, d_inner = x.shape
    d_state = A.shape[-1]
    if dt.shape != x.shape or A.shape != (d_inner, d_state) or B.shape != (batch, seq, d_state) or C.shape != B.shape:
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
            f"B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    x, A, B, C = x.to(F64), A.to(F64), B.to(F64), C.to(F64)
    delta = _step(dt, dt_bias, softplus, (-math.inf, math.inf))  # Δ_t, [B, T, D]
    h = torch.zeros(batch, d_inner, d_state, dtype=F64) if initial_state is None else initial_state.to(F64)

    def step(t, h):
        a_bar = torch.exp(delta[:, t, :, None] * A)  # exp(Δ_t A), [B, D, N]
        b_bar_x = delta[:, t, :, None] * x[:, t, :, None] * B[:, t, None, :]  # Δ_t x_t B_t, [B, D, N]
        h = a_bar * h + b_bar_x  # h_t, [B, D, N]
        return h, (h * C[:, t, None, :]).sum(-1)  # h_t, <C_t, h_t> [B, D]

    return _scan(seq, h, step, x, None if D is None else D.to(F64), z)  # D [D]


def ssd_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    *,
    dt_bias: Tensor | None = None,
    softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Mamba-2 (SSD, scalar decay per head) token by token in float64 (see the module docstring).

    Returns ``(outputs [batch, seq, heads, head_dim], states [batch, seq, heads, head_dim, d_state])``.
    """
    batch, seq, heads, head_dim = x.shape
    groups, d_state = B.shape[-2:]
    if (
        dt.shape != (batch, seq, heads)
        or A.shape != (heads,)
        or B.shape != (batch, seq, groups, d_state)
        or C.shape != B.shape
        or heads % groups
    ):
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
            f"B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    group_of = torch.arange(heads) // (heads // groups)  # [H]
    x, A = x.to(F64), A.to(F64)
    B, C = B.to(F64)[:, :, group_of], C.to(F64)[:, :, group_of]  # [B, T, H, N]
    delta = _step(dt, dt_bias, softplus, dt_limit)  # Δ_t, [B, T, H]
    h = torch.zeros(batch, heads, head_dim, d_state, dtype=F64) if initial_state is None else initial_state.to(F64)

    def step(t, h):
        decay = torch.exp(delta[:, t] * A)[:, :, None, None]  # exp(Δ_t a_h), [B, H, 1, 1]
        outer = x[:, t, :, :, None] * B[:, t, :, None, :]  # x_t B_t^T, [B, H, P, N]
        h = decay * h + delta[:, t, :, None, None] * outer  # h_t, [B, H, P, N]
        return h, (h @ C[:, t, :, :, None])[..., 0]  # h_t, h_t C_t [B, H, P]

    return _scan(seq, h, step, x, None if D is None else D.to(F64)[:, None], z)  # D [H, 1]
