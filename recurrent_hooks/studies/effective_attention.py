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
    Mamba-2 (Mamba2StateSpace), heads, v_s = x_s (head_dim channels):
            A[h, t, s] = (C_t . B_s) exp(sum_{r=s+1..t} Δ_r a_h) Δ_s,   skip = D_h x_t
        Δ after bias, softplus and (prompt kernel only) the dt_limit clamp, as the kernels form it;
        gate = silu(z_t) only for a decode kernel call given z (the prompt kernel ignores z).

Module contents: `effective_attention` (the history of a call, then the kind's own maths:
its adapter's `effective_attention`, in each kind's module); `EffectiveAttention`, the result, and the
decayed inner products are in `engine.declare.effective`.
"""

import torch
from torch import Tensor

from ..engine.declare.effective import EffectiveAttention
from ..engine.declare.kernels import STATE_MEMORY
from ..engine.errors import InvalidValue, Unavailable
from ..engine.handle.arguments import as_index
from ..engine.handle.mixer import RecurrentMixer, record_of
from ..engine.tracking.records import Call, recorded

# -- the history ------------------------------------------------------------------------------------------


def _state_in(mixer: RecurrentMixer, record: Call) -> list[Tensor | None]:
    name = type(mixer).kernel(record.kernel).state_in
    return [None if name is None else kernel_call.inputs.get(name) for kernel_call in record.kernel_calls]


def _continues(mixer: RecurrentMixer, before: Call, record: Call) -> bool:
    """Whether `record` started from exactly the state `before` ended with (same rows, no write since)."""
    if (
        record.reorder is not None
        or before.replaced(STATE_MEMORY)
        or len(before.kernel_calls) != len(record.kernel_calls)
    ):
        return False
    for start, kernel_call in zip(_state_in(mixer, record), before.kernel_calls):
        final = (kernel_call.output or {}).get("final_state")
        if (
            start is None
            or final is None
            or start.shape != final.shape
            or not torch.equal(start.to(torch.float32), final.to(torch.float32))
        ):
            return False
    return True


def _history(mixer: RecurrentMixer, call: int | None) -> range:
    """The calls whose tokens the source axis covers: back from `call` while each continues the one before."""
    record = record_of(mixer, call, "effective_attention")
    where = f"{mixer}.effective_attention, call {record.index}"
    if not record.kernel_calls:
        raise Unavailable(f"{where}: the call made no recurrence kernel call")
    if record.replaced(STATE_MEMORY):
        raise Unavailable(
            f"{where}: a hook or write replaced the state at token(s) {sorted(record.replaced(STATE_MEMORY))};"
            " the call's output is then not a linear map of its values (run it again without replacing hooks)"
        )
    first = record.index
    while first > 0:
        for kernel_call in mixer.calls[first].kernel_calls:
            recorded(record, kernel_call.inputs, "inputs"), recorded(record, kernel_call.output, "outputs")
        if all(start is None for start in _state_in(mixer, mixer.calls[first])):
            break  # it started from no state: it continues no call
        if first - 1 < mixer.calls.dropped:  # whether call `first` continues the one before cannot be told
            raise Unavailable(
                f"{where}: its history runs back to call {first}, which may continue the state of call"
                f" {first - 1}; {mixer.calls.dropped_message(first - 1)}"
            )
        before = mixer.calls[first - 1]
        for kernel_call in before.kernel_calls:
            recorded(record, kernel_call.inputs, "inputs"), recorded(record, kernel_call.output, "outputs")
        if not _continues(mixer, before, mixer.calls[first]):
            break
        first -= 1
    for index in range(first, record.index + 1):
        if mixer.calls[index].split:
            raise Unavailable(
                f"{where}: call {index} of its history ran as {len(mixer.calls[index].kernel_calls)}"
                f" kernel calls ({', '.join(mixer.calls[index].kernels)}: a cache that records its"
                " past split its tokens, as assisted decoding's does), and the effective attention"
                " reads one kernel call a call; run the calls without past recording"
            )
        for kernel_call in mixer.calls[index].kernel_calls:
            recorded(record, kernel_call.inputs, "inputs"), recorded(record, kernel_call.output, "outputs")
    return range(first, record.index + 1)


def effective_attention(
    mixer: RecurrentMixer, call: int | None = None, *, dtype: torch.dtype = torch.float32
) -> EffectiveAttention:
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
    `keep=("inputs", "outputs")`, and not dropped (`watch(history=N)`: a history that reaches a dropped call raises
    `rh.Unavailable`). A call whose own state a hook or write replaced has no such map:
    `rh.Unavailable`. Convolution-window writes are fine (they change the values, which are read as kept).
    Computed in `dtype` (float32, as the kernels; float64 for a reference).
    """
    if not isinstance(mixer, RecurrentMixer):
        raise InvalidValue(f"effective_attention takes a watched mixer (watch.mixers[i]), got {type(mixer).__name__}")
    if call is not None:
        call = as_index(call, "call", f"{mixer}.effective_attention")
    calls = _history(mixer, call)
    with torch.no_grad():
        return mixer.adapter.effective_attention(mixer, calls, dtype)
