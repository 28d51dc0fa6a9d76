"""The state-space discretisation shared by Mamba-1 (`selective_scan`) and Mamba-2 (`state_space`).

Glossary (Gu & Dao, "Mamba", 2023; Dao & Gu, "Transformers are SSMs", 2024):
    dt   Δ_t   the step size, from a kernel's `dt` (bias, softplus, and Mamba-2's prompt clamp: `step_size`)
    A    A     the state matrix (Mamba-1: `[d_inner, d_state]`; Mamba-2: a scalar a_h per head)
    B    B_t   the input projection of token t; x: the token's input
Per token: h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t (zero-order hold for A, Euler for B: `discrete_step`).
Both kinds' decode kernels take transformers' `selective_state_update` signature (`state_update_kernel`).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ..engine.loops import OnToken, refuse_packed, times


def step_size(dt: Tensor, bias: Tensor | None, softplus: bool, limit: tuple[float, float] | None = None,
              dtype: torch.dtype = torch.float32) -> Tensor:
    """Δ from a kernel's `dt`, in `dtype` (float32; Mamba-1's prompt: at least float32, see `at_least_float32`):
    bias added and softplus taken in dt's dtype, as transformers does.

    `limit` clamps Δ after the softplus; only Mamba-2's prompt kernel has one (its decode kernel does not).
    """
    if bias is not None:
        dt = dt + bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    if limit is not None:
        dt = dt.clamp(limit[0], limit[1])
    return dt.to(dtype)


def refuse_mamba_packed(kwargs: dict[str, Any]) -> None:
    """Raise for packed sequences: transformers' own pure-torch kernels refuse them too."""
    refuse_packed(kwargs, ("cu_seqlens", "seq_idx"), "mamba_ssm")


Step = Callable[..., Tensor]  # (state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, on_token) -> y


def state_update_kernel(name: str, module: str, step: Step, doc: str) -> Callable[..., Tensor]:
    """A decode kernel with the signature of transformers' `selective_state_update` kernels (Mamba-1's and
    Mamba-2's share it), written once: packed sequences refused, unknown keyword arguments ignored, the one-token
    step `step(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, on_token)` the kind's. Named `name`
    in `module`, with the docstring `doc`."""

    def kernel(state: Tensor, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
               D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
               z: Tensor | None = None, *, on_token: OnToken | None = None, **kwargs: Any) -> Tensor:
        refuse_mamba_packed(kwargs)
        return step(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, on_token)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__module__, kernel.__doc__ = module, doc
    return kernel


def discrete_step(
    dt: Float[Tensor, "*lead channels"],
    A: Float[Tensor, "channels d_state"],
    B: Float[Tensor, "*lead d_state"],
    x: Float[Tensor, "*lead channels"],
    out: Tensor | None = None,
) -> tuple[Float[Tensor, "*lead channels d_state"], Float[Tensor, "*lead channels d_state"]]:
    """exp(Δ A) (zero-order hold) and Δ x B (Euler), any leading axes; shared by Mamba-1 and Mamba-2. The drive goes
    into `out` when given (a token loop's reused buffer, `loops.scratch_like`).

    Mamba-1: channels is d_inner and A is `[d_inner, d_state]`. Mamba-2 calls it with a trailing head_dim
    axis (dt `[..., heads, 1 | head_dim]`, A `[heads, 1 | head_dim, 1 | d_state]`, B `[..., heads, d_state]`).
    """
    return torch.exp(dt[..., None] * A), times((dt * x)[..., None], B[..., None, :], out)
