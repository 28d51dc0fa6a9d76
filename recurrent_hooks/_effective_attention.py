"""Exact effective attention of a recurrent mixer: the linear map from its value inputs to its outputs.

Every kind's recurrence is linear in its value input once the gates, keys and steps are fixed, so a
call's output is
    y_t = gate_t * (sum_s A[t, s] v_s + from_state_t + skip_t)
over the tokens s of the calls so far (the history; see `effective_attention`). A is computed exactly
from the kernel's own kept arguments, normalised and scaled as the kernels do, with no Python loop over
tokens.

Glossary (code name, paper symbol, shape; `query` = the call's tokens, `source` = the history's tokens):
    weights     A[t, s]   [batch, heads, query, source]      zero for s after t (causal)
    values      v_s       [batch, heads, source, value_dim]  the kind's value input (below)
    from_state  -         [batch, heads, query, value_dim]   what the state the history started from adds
    skip        D x_t     [batch, heads, query, value_dim]   Mamba's skip; None for the delta rules
    gate        silu(z_t) [batch, heads, query, value_dim]   when the kernel itself gates; else None
    (cum)       c_t       sum_{r<=t} log a_r over the history (per key channel for KDA, per state channel for Mamba-1)

Per kind (heads axis, value v_s):
    gated DeltaNet (GatedDeltaNet), value heads, v_s = `value`; q, k l2-normalised and q scaled as the
        kernels do (`_prepare`), key head j // (heads // key_heads) for value head j:
            S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t
            A[t, s] = b_s q_t^T (prod_{r=s+1..t} a_r (I - b_r k_r k_r^T)) k_s
        computed with the UT transform: with W_ij = exp(c_i - c_j) (x_i . k_j) for j <= i,
            T = I + strict_lower(diag(b) W(k, k)),   A = W(q, k) T^{-1} diag(b)
            from_state = (diag(exp c) Q - A diag(exp c) K) S_0
    Kimi delta attention (KimiDeltaAttention), heads, v_s = `value`: the same with Diag(alpha_t):
            A[t, s] = b_s q_t^T (prod_{r=s+1..t} (I - b_r k_r k_r^T) Diag(alpha_r)) k_s
        and W_ij = sum_d x_i[d] k_j[d] exp(c_i[d] - c_j[d]).
    Mamba-1 (SelectiveScan), heads = the d_inner channels, v_s = x_s[c] (value_dim 1):
            A[c, t, s] = sum_n C_t[n] exp(sum_{r=s+1..t} Δ_r[c] A[c, n]) Δ_s[c] B_s[n],   skip = D[c] x_t[c]
        gate = silu(z_t) (both Mamba-1 kernels take z and apply it).
    zamba (PerHeadSelectiveScan): one Mamba-1 kernel call per mamba head; the channels of the heads are
        concatenated, channel = head * head_dim + p (the order of d_inner in zamba's mixer).
    Mamba-2 (StateSpace), heads, v_s = x_s (head_dim channels):
            A[h, t, s] = (C_t . B_s) exp(sum_{r=s+1..t} Δ_r a_h) Δ_s,   skip = D_h x_t
        Δ after bias, softplus and (prompt kernel only) the dt_limit clamp, as the kernels form it;
        gate = silu(z_t) only for a decode kernel call given z (the prompt kernel ignores z).

Module contents: `EffectiveAttention` (the result) and `effective_attention`.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import repeat
from jaxtyping import Float
from torch import Tensor

from ._errors import InvalidValue, Unavailable
from ._kimi_delta import KimiDeltaAttention
from ._gated_delta_net import GatedDeltaNet, _prepare
from ._arguments import as_index
from ._calls import Call
from ._kernels import STATE_MEMORY, Role
from ._mixer import RecurrentMixer
from ._selective_scan import SelectiveScan
from ._state_space import StateSpace

_BLOCK = 32  # query rows per block of the per-channel decayed products


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


# -- the history ------------------------------------------------------------------------------------------

def _state_in(mixer: RecurrentMixer, record: Call) -> list[Tensor | None]:
    name = type(mixer).kernel(record.kernel).state_in
    return [None if name is None else part.inputs.get(name) for part in record.parts]


def _continues(mixer: RecurrentMixer, before: Call, record: Call) -> bool:
    """Whether `record` started from exactly the state `before` ended with (same rows, no write since)."""
    if record.reorder is not None or before._replaced.get(STATE_MEMORY) or len(before.parts) != len(record.parts):
        return False
    for start, part in zip(_state_in(mixer, record), before.parts):
        final = (part.output or {}).get("final_state")
        if start is None or final is None or start.shape != final.shape \
                or not torch.equal(start.to(torch.float32), final.to(torch.float32)):
            return False
    return True


def _history(mixer: RecurrentMixer, call: int | None) -> range:
    """The calls whose tokens the source axis covers: back from `call` while each continues the one before."""
    record = mixer._call(call, "effective_attention")
    where = f"{mixer}.effective_attention, call {record.index}"
    if not record.parts:
        raise Unavailable(f"{where}: the call made no recurrence kernel call")
    if record._replaced.get(STATE_MEMORY):
        raise Unavailable(
            f"{where}: a hook or write replaced the state at token(s) {sorted(record._replaced[STATE_MEMORY])};"
            " the call's output is then not a linear map of its values (run it again without replacing hooks)")
    first = record.index
    while first > 0:
        before = mixer.calls[first - 1]
        for part in (*before.parts, *mixer.calls[first].parts):
            record._recorded(part.inputs, "inputs"), record._recorded(part.output, "outputs")
        if not _continues(mixer, before, mixer.calls[first]):
            break
        first -= 1
    for index in range(first, record.index + 1):
        for part in mixer.calls[index].parts:
            record._recorded(part.inputs, "inputs"), record._recorded(part.output, "outputs")
    return range(first, record.index + 1)


# -- decayed inner products ---------------------------------------------------------------------------------

def _decayed(
    x: Float[Tensor, "*b rows d"], k: Float[Tensor, "*b source d"],
    cx: Float[Tensor, "*b rows e"], ck: Float[Tensor, "*b source e"], start: int, strict: bool,
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
    for r0 in range(0, rows, _BLOCK):
        r1 = min(rows, r0 + _BLOCK)
        ref = start + r0  # the block's first position: decays are measured from it
        near_end = min(source, start + r1)  # sources inside the block's own positions
        c_ref = ck[..., ref:ref + 1, :]
        if ref > 0:  # sources before the block: x_i exp(c_i - c_ref) . k_j exp(c_ref - c_j), both factors <= 1
            xs = x[..., r0:r1, :] * (cx[..., r0:r1, :] - c_ref).exp()
            ks = k[..., :ref, :] * (c_ref - ck[..., :ref, :]).exp()
            out[..., r0:r1, :ref] = xs @ ks.transpose(-1, -2)
        mask = causal[r0:r1, ref:near_end, None]
        diff = (cx[..., r0:r1, None, :] - ck[..., None, ref:near_end, :]).masked_fill(~mask, -torch.inf)
        out[..., r0:r1, ref:near_end] = (x[..., r0:r1, None, :] * k[..., None, ref:near_end, :] * diff.exp()).sum(-1)
    return out


# -- per kind -------------------------------------------------------------------------------------------------

def _cat(pieces: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.cat([p.to(dtype) for p in pieces], dim=2)


def _delta_rule(mixer: RecurrentMixer, calls: range, dtype: torch.dtype) -> EffectiveAttention:
    kind, kimi = type(mixer), isinstance(mixer, KimiDeltaAttention)
    per_call = []
    for index in calls:
        part = mixer.calls[index].parts[0]
        x = part.inputs
        if x.get("cu_seqlens") is not None:
            raise Unavailable(f"{mixer}, call {index}: packed sequences (cu_seqlens) have no per-row"
                              " effective attention")
        g = x["g"] if kimi else x["g"][..., None]
        prepared = _prepare(x["query"], x["key"], x["value"], g, x["beta"], x["initial_state"],
                            x["use_qk_l2norm_in_kernel"], {}, kimi=kimi, recurrent=kind.kernel(part.kernel).role is Role.DECODE)
        per_call.append([v.transpose(1, 2) for v in prepared[:5]] + [prepared[5]])  # b h t ..
    q, k, v, b, log_a = (_cat([c[i] for c in per_call], dtype) for i in range(5))
    state = per_call[0][5].to(dtype)  # b h k v   S_0 of the history
    rows = mixer.calls[calls[-1]].parts[0].inputs["value"].shape[1]
    start = q.shape[2] - rows
    cum = log_a.cumsum(2)  # b h s (1|k)   c_s
    system = _decayed(k, k, cum, cum, 0, strict=True) * b[..., None]  # b h s s   strict_lower(diag(b) W(k, k))
    system.diagonal(dim1=-2, dim2=-1).fill_(1)  # T = I + ...
    reads = _decayed(q[:, :, start:], k, cum[:, :, start:], cum, start, strict=False)  # b h t s   W(q, k)
    weights = torch.linalg.solve_triangular(system, reads, upper=False, left=False, unitriangular=True) * b[:, :, None]
    from_state = (q[:, :, start:] * cum[:, :, start:].exp()) @ state - weights @ ((k * cum.exp()) @ state)
    return EffectiveAttention(weights, v, from_state, None, None, calls)


def _mamba1_part(mixer: RecurrentMixer, calls: range, head: int, dtype: torch.dtype) -> EffectiveAttention:
    kind = type(mixer)
    xs, steps, Bs, Cs = [], [], [], []
    for index in calls:
        part = mixer.calls[index].parts[head]
        values = SelectiveScan._token_values(part)  # token-major x, Δ, B, C
        xs.append(values["x"]), steps.append(values["dt"]), Bs.append(values["B"]), Cs.append(values["C"])
    last = mixer.calls[calls[-1]].parts[head]
    first = mixer.calls[calls[0]].parts[head]
    x, delta, B, C = (torch.cat([p.to(dtype) for p in pieces], dim=1) for pieces in (xs, steps, Bs, Cs))
    A = last.inputs["A"].to(dtype)  # d n
    rows = xs[-1].shape[1]
    start = x.shape[1] - rows
    cum = (delta[..., None] * A).cumsum(1).transpose(1, 2)  # b d s n   c_s per channel and state entry
    B, C = B[:, None], C[:, None, start:]  # b 1 s n, b 1 t n
    weights = _decayed(C, B, cum[:, :, start:], cum, start, strict=False) * delta.transpose(1, 2)[:, :, None]
    state = first.inputs.get(kind.kernel(first.kernel).state_in) if kind.kernel(first.kernel).role is Role.DECODE else None  # the scan starts from 0
    x_rows = x[:, start:].transpose(1, 2)[..., None]  # b d t 1
    if state is None:
        from_state = torch.zeros_like(x_rows)
    else:
        from_state = ((C * cum[:, :, start:].exp()) * state.to(dtype)[:, :, None]).sum(-1)[..., None]
    inputs = last.inputs
    D, z = inputs.get("D"), inputs.get("z")
    skip = None if D is None else D.to(dtype)[:, None, None] * x_rows
    if z is not None:
        z = (z if kind.kernel(last.kernel).role is Role.PROMPT else z[..., None]).to(dtype)  # b d t
        z = F.silu(z)[..., None]
    return EffectiveAttention(weights, x.transpose(1, 2)[..., None], from_state, skip, z, calls)


def _mamba1(mixer: RecurrentMixer, calls: range, dtype: torch.dtype) -> EffectiveAttention:
    heads = len(mixer.calls[calls[-1]].parts)
    parts = [_mamba1_part(mixer, calls, head, dtype) for head in range(heads)]
    if heads == 1:
        return parts[0]
    fields = [torch.cat(f, dim=1) if f[0] is not None else None for f in zip(*(p[:5] for p in parts))]
    return EffectiveAttention(*fields, calls)


def _mamba2(mixer: RecurrentMixer, calls: range, dtype: torch.dtype) -> EffectiveAttention:
    kind = type(mixer)
    xs, steps, Bs, Cs = [], [], [], []
    for index in calls:
        values = kind._token_values(mixer.calls[index].parts[0])  # token-major x, Δ (clamped as the kernel), B, C
        xs.append(values["x"]), steps.append(values["dt"]), Bs.append(values["B"]), Cs.append(values["C"])
    last, first = mixer.calls[calls[-1]].parts[0], mixer.calls[calls[0]].parts[0]
    x, delta, B, C = (torch.cat([p.to(dtype) for p in pieces], dim=1) for pieces in (xs, steps, Bs, Cs))
    heads = x.shape[2]
    B, C = (repeat(v, "b s g n -> b (g r) s n", r=heads // v.shape[2]) for v in (B, C))  # head h reads group h // r
    decode = kind.kernel(last.kernel).role is Role.DECODE
    A = last.inputs["A"]
    A = (A[:, 0, 0] if decode else A).to(dtype)  # h   (the decode kernel gets it expanded over head_dim, d_state)
    rows = xs[-1].shape[1]
    start = x.shape[1] - rows
    delta = delta.transpose(1, 2)  # b h s
    cum = (delta * A[:, None]).cumsum(2)[..., None]  # b h s 1
    weights = _decayed(C[:, :, start:], B, cum[:, :, start:], cum, start, strict=False) * delta[:, :, None]
    values = x.transpose(1, 2)  # b h s p
    state = first.inputs["state" if kind.kernel(first.kernel).role is Role.DECODE else "initial_states"]
    if state is None:
        from_state = torch.zeros_like(values[:, :, start:])
    else:
        from_state = torch.einsum("bhpn,bhtn->bhtp", state.to(dtype), C[:, :, start:]) * cum[:, :, start:].exp()
    D = last.inputs.get("D")
    skip = None
    if D is not None:
        D = (D[:, 0] if decode else D).to(dtype)
        skip = D[:, None, None] * values[:, :, start:]
    z = last.inputs.get("z") if decode else None
    gate = None if z is None else F.silu(z.to(dtype))[:, :, None]
    return EffectiveAttention(weights, values, from_state, skip, gate, calls)


def effective_attention(mixer: RecurrentMixer, call: int | None = None, *,
                        dtype: torch.dtype = torch.float32) -> EffectiveAttention:
    """The exact effective attention of `call` (default: the last) of a watched mixer.

        with rh.watch(model, keep=("inputs", "outputs")) as w:
            model.generate(ids, max_new_tokens=4)
        ea = rh.effective_attention(w.mixers[0], call=3)   # decode step 3's row over every token so far
        ea.weights            # [batch, heads, 1, prompt + 3 + 1]
        ea.output()           # equals the kernel's output of call 3 (to float32 rounding)

    The source axis is the history: the calls `ea.calls` = first..call, where `first` is the latest call
    that did not start exactly from the state the call before it ended with (a prompt from zeros, a prompt
    over a cache filled outside the watch, a decode step after the cache rows were reordered by beam
    search, or the call after one whose state a hook or write replaced). What the state `first` started
    from contributes is `ea.from_state`. Needs every call of the history kept with
    `keep=("inputs", "outputs")`. A call whose own state a hook or write replaced has no such map:
    `rh.Unavailable`. Convolution-window writes are fine (they change the values, which are read as kept).
    Computed in `dtype` (float32, as the kernels; float64 for a reference).
    """
    if not isinstance(mixer, RecurrentMixer):
        raise InvalidValue(f"effective_attention takes a watched mixer (watch.mixers[i]), got {type(mixer).__name__}")
    if call is not None:
        call = as_index(call, "call", f"{mixer}.effective_attention")
    calls = _history(mixer, call)
    with torch.no_grad():
        if isinstance(mixer, GatedDeltaNet):
            return _delta_rule(mixer, calls, dtype)
        if isinstance(mixer, SelectiveScan):
            return _mamba1(mixer, calls, dtype)
        if isinstance(mixer, StateSpace):
            return _mamba2(mixer, calls, dtype)
    raise Unavailable(f"{mixer}: no effective attention for the kind {type(mixer).__name__}")
