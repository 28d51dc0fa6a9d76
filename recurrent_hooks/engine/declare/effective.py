"""What the kinds' effective attention share: the result, and the decayed inner products they are built of.

Each kind that has an exact effective attention computes it in its own module (its adapter's
`effective_attention`, from the call records of a history of calls); the public function that checks the
history and calls it is `recurrent_hooks.studies.effective_attention.effective_attention`. The maths of each
kind is in the study's module docstring.

Glossary (code name, paper symbol, shape; `query` = the call's tokens, `source` = the history's tokens):
    weights     A[t, s]   [batch, heads, query, source]      zero for s after t (causal)
    values      v_s       [batch, heads, source, value_dim]  the kind's value input
    from_state  -         [batch, heads, query, value_dim]   what the state the history started from adds
    skip        D x_t     [batch, heads, query, value_dim]   Mamba's skip; None for the delta rules
    gate        silu(z_t) [batch, heads, query, value_dim]   when the kernel itself gates; else None
    (cum)       c_t       sum_{r<=t} log a_r over the history (per key channel for KDA, per state channel for Mamba-1)
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

ROWS = 32  # query rows at a time of the per-channel decayed products


class EffectiveAttention(NamedTuple):
    """The exact linear map of one call of a recurrent mixer (see the module docstring for each kind).

        ea = rh.effective_attention(mix, call=k)
        ea.output()        # gate * (weights @ values + from_state + skip): the kernel's output of call k

    The source axis covers the tokens of `calls`, in order; the query axis covers call `calls[-1]`'s
    tokens, which are the last `weights.shape[-2]` source tokens.
    """

    weights: Float[Tensor, "batch heads query source"]
    values: Float[Tensor, "batch heads source value_dim"]
    from_state: Float[Tensor, "batch heads query value_dim"]
    skip: Float[Tensor, "batch heads query value_dim"] | None
    gate: Float[Tensor, "batch heads query value_dim"] | None
    calls: range

    def output(self) -> Float[Tensor, "batch heads query value_dim"]:
        """gate * (sum_s weights[..., t, s] values[..., s, :] + from_state + skip)."""
        y = self.weights @ self.values + self.from_state
        if self.skip is not None:
            y = y + self.skip
        return y if self.gate is None else y * self.gate


def decayed(
    x: Float[Tensor, "*b rows d"],
    k: Float[Tensor, "*b source d"],
    cx: Float[Tensor, "*b rows e"],
    ck: Float[Tensor, "*b source e"],
    start: int,
    strict: bool,
) -> Float[Tensor, "*b rows source"]:
    """W[i, j] = sum_d x_i[d] k_j[d] exp(cx_i[d] - ck_j[d]) for j <= start + i (j < when `strict`), else 0.

    Rows are the source positions start, start + 1, ...; c is a non-increasing cumulative log decay, so
    every factor kept is at most 1. e is 1 (a scalar decay: one matmul) or d (a decay per channel: blocks of
    rows, each measured from its first row, so that no exp(-c) overflows on a long history).
    """
    rows, source = x.shape[-2], k.shape[-2]
    limit = torch.arange(start, start + rows, device=x.device)[:, None] - int(strict)
    causal = torch.arange(source, device=x.device)[None, :] <= limit  # rows source
    if cx.shape[-1] == 1:
        decay = (cx - ck.transpose(-1, -2)).masked_fill(~causal, -torch.inf).exp()
        return (x @ k.transpose(-1, -2)) * decay
    shape = torch.broadcast_shapes(x.shape[:-2], k.shape[:-2], cx.shape[:-2], ck.shape[:-2])
    out = x.new_zeros(*shape, rows, source)
    for r0 in range(0, rows, ROWS):
        r1 = min(rows, r0 + ROWS)
        ref = start + r0  # the block's first position: decays are measured from it
        near_end = min(source, start + r1)  # sources inside the block's own positions
        c_ref = ck[..., ref : ref + 1, :]
        if ref > 0:  # sources before the block: x_i exp(c_i - c_ref) . k_j exp(c_ref - c_j), both factors <= 1
            xs = x[..., r0:r1, :] * (cx[..., r0:r1, :] - c_ref).exp()
            ks = k[..., :ref, :] * (c_ref - ck[..., :ref, :]).exp()
            out[..., r0:r1, :ref] = xs @ ks.transpose(-1, -2)
        mask = causal[r0:r1, ref:near_end, None]
        diff = (cx[..., r0:r1, None, :] - ck[..., None, ref:near_end, :]).masked_fill(~mask, -torch.inf)
        out[..., r0:r1, ref:near_end] = (x[..., r0:r1, None, :] * k[..., None, ref:near_end, :] * diff.exp()).sum(-1)
    return out


def cat(pieces: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.cat([p.to(dtype) for p in pieces], dim=2)
