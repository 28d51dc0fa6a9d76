"""The state-space maths shared by Mamba-1 (`selective_scan`) and Mamba-2 (`state_space`): the discretisation, and
the signatures of transformers' kernels, each written once, from which every variant of a kind's kernels is made.

Glossary (Gu & Dao, "Mamba", 2023; Dao & Gu, "Transformers are SSMs", 2024):
    dt   Δ_t   the step size, from a kernel's `dt` (bias, softplus, and Mamba-2's prompt clamp: `step_size`)
    A    A     the state matrix (Mamba-1: `[d_inner, d_state]`; Mamba-2: a scalar a_h per head)
    B    B_t   the input projection of token t; x: the token's input
Per token: h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t (zero-order hold for A, Euler for B: `discrete_step`).

Module contents:
- `SelectiveScanCall`, `ChunkScanCall`, `StateUpdateCall`: the arguments of transformers' Mamba-1 prompt kernel
  (`mamba_selective_scan`, the signature of mamba_ssm's `selective_scan_fn`), Mamba-2 prompt kernel
  (`mamba2_chunk_scan`, `mamba_chunk_scan_combined`'s) and decode kernel of both (`selective_state_update`'s), in
  their order: each signature written once.
- `kernel`: a kernel with one of those signatures plus keyword-only extras (a token loop's `on_token`, an
  all-states version's `on_chunk`, ...), its body attached after the kind's declaration (`@kernel.body`).
- `step_size`, `discrete_step`, `refuse_mamba_packed`: the discretisation and the refusal of packed sequences.
"""

import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from ...engine.declare.loops import refuse_packed, times


def step_size(
    dt: Tensor,
    bias: Tensor | None,
    softplus: bool,
    limit: tuple[float, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
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


class SelectiveScanCall(NamedTuple):
    """The arguments of transformers' `mamba_selective_scan` (Mamba-1's prompt kernel), in its order."""

    hidden_states: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Tensor | None = None
    z: Tensor | None = None
    delta_bias: Tensor | None = None
    delta_softplus: bool = False
    return_last_state: bool = False
    use_mambapy: bool = False
    use_associative_scan: bool = False

    def result(self, y: Tensor, state: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """What the kernel returns: y, and the last state when `return_last_state`."""
        return (y, state) if self.return_last_state else y


class ChunkScanCall(NamedTuple):
    """The arguments of transformers' `mamba2_chunk_scan` (Mamba-2's prompt kernel), in its order."""

    hidden_states: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    chunk_size: int
    D: Tensor | None = None
    dt_bias: Tensor | None = None
    initial_states: Tensor | None = None
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    return_final_states: bool = False

    def result(self, y: Tensor, state: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """What the kernel returns: y, and the last state when `return_final_states`."""
        return (y, state) if self.return_final_states else y


class StateUpdateCall(NamedTuple):
    """The arguments of transformers' `selective_state_update` kernels (Mamba-1's and Mamba-2's decode kernels share
    them), in their order."""

    state: Tensor
    hidden_states: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Tensor | None = None
    dt_bias: Tensor | None = None
    dt_softplus: bool = False
    z: Tensor | None = None


REQUIRED = inspect.Parameter.empty  # a keyword-only extra without a default (`kernel`)


def kernel(call: type[NamedTuple], name: str, module: str, **keywords: Any) -> Callable[..., Any]:
    """A kernel named `name` in `module`, with the signature of the transformers kernel whose arguments `call` holds
    (its fields in order, with their defaults), then the keyword-only `keywords` (name=default, or `REQUIRED`), then
    any other keyword argument, ignored; packed sequences are refused (`refuse_mamba_packed`). The signature is
    written once, in `call`; every variant of a kind's kernels is one such line. Its body, which may be defined
    below the kind's declaration, is attached with the kernel's `body` decorator and is called as
    `body(call(...), **keywords)`; the body's docstring is the kernel's:

        mamba_selective_scan = kernel(SelectiveScanCall, "mamba_selective_scan", __name__, on_token=None)
        class SelectiveScan(RecurrentMixer): ...  # its KERNELS name mamba_selective_scan
        @mamba_selective_scan.body
        def _token_loop(call: SelectiveScanCall, on_token: OnToken | None) -> Tensor | tuple[Tensor, Tensor]:
            ...  # the maths, with `call.hidden_states`, ...; `call.result(y, state)` is what the kernel returns
    """
    fields = call._fields
    body: Callable[..., Any] | None = None

    def run(*args: Any, **kwargs: Any) -> Any:
        refuse_mamba_packed(kwargs)
        options = {}
        for key, default in keywords.items():
            if key in kwargs:
                options[key] = kwargs[key]
            elif default is REQUIRED:
                raise TypeError(f"{name}() missing required keyword-only argument: {key!r}")
            else:
                options[key] = default
        if body is None:
            raise NotImplementedError(f"{module}.{name} has no body (ssm.kernel: attach one with @{name}.body)")
        return body(call(*args, **{key: value for key, value in kwargs.items() if key in fields}), **options)

    def attach(fn: Callable[..., Any]) -> Callable[..., Any]:
        nonlocal body
        body = fn
        run.__doc__ = fn.__doc__
        return fn

    positional = [
        p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in inspect.signature(call).parameters.values()
    ]
    extras = [
        inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default) for key, default in keywords.items()
    ]
    rest = inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any)
    run.__signature__ = inspect.Signature([*positional, *extras, rest])  # what `inspect.signature` reads
    run.__name__ = run.__qualname__ = name
    run.__module__ = module
    run.body = attach
    return run


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
