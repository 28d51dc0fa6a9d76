"""`rh.effective_attention`: the exact linear map from a call's values to its kernel output, one family per kind.

For a prompt and for a decode step (whose row covers every token so far), the map reconstructs the
kernel's kept output to float32 rounding, and equals a float64 map computed here from the papers'
recurrences by propagating each source token's contribution through the per-token transitions (no
code of the library's). The delta rule's key removal is what makes it exact: the heuristic without it
does not reconstruct the gated DeltaNet output.
"""

import math

import pytest
import torch
from _compare import assert_close
from _contract import one_family_per_kind
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.extend import KindAdapter

# one per kind that has the maths (its adapter overrides `effective_attention`; zamba: a kernel call per head)
FAMILIES = one_family_per_kind(
    lambda kind: type(kind.adapter).effective_attention is not KindAdapter.effective_attention
)
KEEP = ("inputs", "outputs")
T, NEW = 13, 3  # prompt tokens, generated tokens: calls 0 (prompt), 1, 2 (decode steps)
F64 = torch.float64


def _softplus(u):
    return torch.where(u > 20, u, torch.log1p(torch.exp(u)))


def _silu(u):
    return u / (1 + torch.exp(-u))


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# -- each kernel call's arguments, token-major, float64, one row of parameters per "head" of the map ------------


def _delta_rule_tokens(part):
    """q, k (normalised, q scaled, one key head per value head), v, beta, decay: [b, h, t, ..]."""
    x = part.inputs
    q, k, v = (x[name].to(F64) for name in ("query", "key", "value"))
    if x["use_qk_l2norm_in_kernel"]:
        q, k = _l2(q), _l2(k)
    q = q * q.shape[-1] ** -0.5
    heads = v.shape[2]
    head_of = torch.arange(heads) // (heads // k.shape[2])
    q, k = q[:, :, head_of], k[:, :, head_of]
    alpha = torch.exp(x["g"].to(F64))
    alpha = alpha[..., None] if alpha.dim() == 3 else alpha  # gated DeltaNet: a scalar per head
    return {
        name: value.transpose(1, 2) for name, value in dict(q=q, k=k, v=v, beta=x["beta"].to(F64), alpha=alpha).items()
    }


def _mamba1_tokens(part):
    """x, Δ, A, B, C, D, z of one Mamba-1 kernel call, token-major: heads are the channels."""
    x = part.inputs
    prompt = part.kernel == rh.SelectiveScan.kernel_for("prompt").name
    t = (lambda v: v.to(F64).transpose(1, 2)) if prompt else (lambda v: v.to(F64)[:, None])  # noqa: E731
    delta = t(x["dt"]) + x["delta_bias" if prompt else "dt_bias"].to(F64)
    if x["delta_softplus" if prompt else "dt_softplus"]:
        delta = _softplus(delta)
    return dict(
        x=t(x["hidden_states"]),
        delta=delta,
        A=x["A"].to(F64),
        B=t(x["B"]),
        C=t(x["C"]),
        D=x["D"].to(F64),
        z=None if x["z"] is None else t(x["z"]),
    )


def _mamba2_tokens(part):
    x = part.inputs
    if part.kernel == rh.Mamba2StateSpace.kernel_for("prompt").name:
        hidden, dt, A, B, C, D = x["hidden_states"], x["dt"], x["A"], x["B"], x["C"], x["D"]
        bias, limit, z = x["dt_bias"], x["dt_limit"], None
    else:  # the decode kernel gets the per-head parameters expanded over head_dim: channel 0 is the head's
        hidden, dt, A, B, C, D = (
            x["hidden_states"][:, None],
            x["dt"][:, None, :, 0],
            x["A"][:, 0, 0],
            x["B"][:, None],
            x["C"][:, None],
            x["D"][:, 0],
        )
        bias, limit, z = x["dt_bias"][:, 0], (-math.inf, math.inf), x["z"]
    delta = dt.to(F64) + bias.to(F64)
    if x["dt_softplus"]:
        delta = _softplus(delta)
    delta = delta.clamp(*limit)
    heads = hidden.shape[2]
    group_of = torch.arange(heads) // (heads // B.shape[2])
    return dict(
        x=hidden.to(F64),
        delta=delta,
        A=A.to(F64),
        B=B.to(F64)[:, :, group_of],
        C=C.to(F64)[:, :, group_of],
        D=D.to(F64),
        z=None if z is None else z.to(F64)[:, None],
    )


def _cat(pieces, name, dim):
    return torch.cat([p[name] for p in pieces], dim=dim)


# -- float64 maps from the recurrences ----------------------------------------------------------------------


def delta_rule_map(parts, initial_state, kimi):
    """A[t, s] = b_s q_t^T (prod_{r=s+1..t} M_r) k_s and F_t = q_t^T (prod_{r<=t} M_r) S_0, with the transition
    M_r = a_r (I - b_r k_r k_r^T) (gated DeltaNet) or (I - b_r k_r k_r^T) Diag(alpha_r) (KDA)."""
    tokens = [_delta_rule_tokens(p) for p in parts]
    q, k, v, beta, alpha = (_cat(tokens, name, 2) for name in ("q", "k", "v", "beta", "alpha"))
    batch, heads, seq, key_dim = q.shape
    columns = torch.zeros(batch, heads, key_dim, seq, dtype=F64)  # column s: prod M_r b_s k_s
    start = (
        torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=F64) if initial_state is None else initial_state.to(F64)
    )

    def transition(m, t):  # M_t m, m: [b, h, key_dim, n]
        kt, bt = k[:, :, t, :, None], beta[:, :, t, None, None]
        if kimi:
            m = alpha[:, :, t, :, None] * m
        m = m - bt * kt * (kt.transpose(-1, -2) @ m)
        return m if kimi else alpha[:, :, t, :, None] * m

    weights = torch.zeros(batch, heads, seq, seq, dtype=F64)
    from_state = torch.zeros(batch, heads, seq, v.shape[-1], dtype=F64)
    for t in range(seq):
        columns = transition(columns, t)
        columns[..., t] = beta[:, :, t, None] * k[:, :, t]
        columns[..., t + 1 :] = 0
        start = transition(start, t)
        weights[:, :, t] = (q[:, :, t, None, :] @ columns)[:, :, 0]
        from_state[:, :, t] = (q[:, :, t, None, :] @ start)[:, :, 0]
    return weights, v, from_state, None, None


def selective_scan_map(parts, initial_state):
    """Mamba-1, per channel c: A[c, t, s] = sum_n C_t[n] exp(sum_{r=s+1..t} Δ_r A[c, n]) Δ_s B_s[n]."""
    tokens = [_mamba1_tokens(p) for p in parts]
    x, delta, B, C = (_cat(tokens, name, 1) for name in ("x", "delta", "B", "C"))  # b s d, b s n
    A, D, z = tokens[-1]["A"], tokens[-1]["D"], tokens[-1]["z"]
    batch, seq, channels = x.shape
    columns = torch.zeros(batch, channels, A.shape[-1], seq, dtype=F64)  # b d n s
    h = torch.zeros(batch, channels, A.shape[-1], dtype=F64) if initial_state is None else initial_state.to(F64)
    weights = torch.zeros(batch, channels, seq, seq, dtype=F64)
    from_state = torch.zeros(batch, channels, seq, dtype=F64)
    for t in range(seq):
        decay = torch.exp(delta[:, t, :, None] * A)  # b d n   exp(Δ_t A)
        columns = columns * decay[..., None]
        columns[..., t] = delta[:, t, :, None] * B[:, t, None, :]  # Δ_t B_t
        h = decay * h
        weights[:, :, t] = (C[:, t, None, :, None] * columns).sum(-2)
        from_state[:, :, t] = (C[:, t, None, :] * h).sum(-1)
    rows = tokens[-1]["x"].shape[1]
    skip = (D * x[:, -rows:]).transpose(1, 2)[..., None]
    gate = None if z is None else _silu(z).transpose(1, 2)[..., None]
    return weights, x.transpose(1, 2)[..., None], from_state[..., None], skip, gate


def ssd_map(parts, initial_state):
    """Mamba-2, per head: A[h, t, s] = (C_t . B_s) exp(sum_{r=s+1..t} Δ_r a_h) Δ_s."""
    tokens = [_mamba2_tokens(p) for p in parts]
    x, delta, B, C = (_cat(tokens, name, 1) for name in ("x", "delta", "B", "C"))  # b s h p, b s h, b s h n
    A, D, z = tokens[-1]["A"], tokens[-1]["D"], tokens[-1]["z"]
    batch, seq, heads, head_dim = x.shape
    h = torch.zeros(batch, heads, head_dim, B.shape[-1], dtype=F64) if initial_state is None else initial_state.to(F64)
    weights = torch.zeros(batch, heads, seq, seq, dtype=F64)
    from_state = torch.zeros(batch, heads, seq, head_dim, dtype=F64)
    for t in range(seq):
        for s in range(t + 1):
            decay = torch.exp(delta[:, s + 1 : t + 1].sum(1) * A)  # b h   prod_{r=s+1..t} exp(Δ_r a_h)
            weights[:, :, t, s] = (C[:, t] * B[:, s]).sum(-1) * decay * delta[:, s]
        h = torch.exp(delta[:, t] * A)[..., None, None] * h
        from_state[:, :, t] = (h @ C[:, t, :, :, None])[..., 0]
    rows = tokens[-1]["x"].shape[1]
    skip = (D[:, None] * x[:, -rows:]).transpose(1, 2)
    gate = None if z is None else _silu(z).transpose(1, 2)
    return weights, x.transpose(1, 2), from_state, skip, gate


def reference_map(mixer, calls, initial_state):
    """The float64 map of the last of `calls` over all their tokens: (weights, values, from_state, skip, gate),
    each mixer head (zamba: each kernel call) computed separately and concatenated on the heads axis."""
    heads = []
    for head in range(len(mixer.calls[calls[-1]].kernel_calls)):
        parts = [mixer.calls[c].kernel_calls[head] for c in calls]
        per_head = initial_state is not None and len(mixer.calls[calls[-1]].kernel_calls) > 1
        start = initial_state[:, head] if per_head else initial_state
        if isinstance(mixer, rh.GatedDeltaNet):
            heads.append(delta_rule_map(parts, start, kimi=isinstance(mixer, rh.KimiDeltaAttention)))
        elif isinstance(mixer, rh.SelectiveScan):
            heads.append(selective_scan_map(parts, start))
        else:
            heads.append(ssd_map(parts, start))
    joined = [None if f[0] is None else torch.cat(f, dim=1) for f in zip(*heads)]
    rows = mixer.calls[calls[-1]].tokens
    weights, values, from_state, skip, gate = joined
    return weights[:, :, -rows:], values, from_state[:, :, -rows:], skip, gate


def kernel_output(mixer, call):
    """The call's kept kernel output in the map's layout [batch, heads, tokens, value_dim] (heads of zamba's
    per-head kernel calls concatenated)."""
    outs = []
    for part in mixer.calls[call].kernel_calls:
        y = part.output["output"]
        if isinstance(mixer, rh.GatedDeltaNet):  # b t h v
            y = y.transpose(1, 2)
        elif isinstance(mixer, rh.SelectiveScan):  # prompt b d t, decode b d
            y = (y if y.dim() == 3 else y[..., None])[..., None]
        else:  # prompt b t h p, decode b h p
            y = (y if y.dim() == 4 else y[:, None]).transpose(1, 2)
        outs.append(y)
    return torch.cat(outs, dim=1)


def reconstruct(weights, values, from_state, skip, gate):
    y = weights @ values + from_state
    y = y if skip is None else y + skip
    return y if gate is None else y * gate


def _close(name, expected, got, rtol=1e-4):
    assert_close(name, expected, got, rtol=rtol, atol=1e-5 * float(expected.detach().abs().max()) + 1e-12)


def check_call(mixer, call, calls, initial_state):
    ea = rh.effective_attention(mixer, call)
    assert ea.calls == calls, f"{mixer} call {call}: history {ea.calls}, expected {calls}"
    rows, total = mixer.calls[call].tokens, sum(mixer.calls[c].tokens for c in calls)
    assert ea.weights.shape[2:] == (rows, total)
    y = kernel_output(mixer, call)
    _close(f"{mixer} call {call}: gate * (A v + from_state + skip) = kernel output", y, ea.output())
    reference = reference_map(mixer, calls, initial_state)
    _close(f"{mixer} call {call}: float64 map reconstructs the kernel output", y, reconstruct(*reference))
    for name, expected, got in zip(("weights", "values", "from_state", "skip", "gate"), reference, ea[:5]):
        assert (expected is None) == (got is None), f"{mixer} call {call}: {name} is {got!r}, expected {expected!r}"
        if expected is not None:
            _close(f"{mixer} call {call}: {name} equals the float64 map", expected, got)
    causal = torch.ones(rows, total, dtype=torch.bool).tril(total - rows)
    assert not ea.weights[..., ~causal].any(), f"{mixer} call {call}: weight on a later token"
    return ea


@pytest.fixture(scope="module", params=FAMILIES)
def generated(request):
    model = build(request.param)
    with rh.watch(model, keep=KEEP) as w, torch.no_grad():
        model.generate(random_ids(2, T), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return model, w


def test_prompt_and_decode_rows_are_exact(generated):
    """A prompt (call 0) and decode step 2, whose row covers the prompt and both decode steps."""
    _, w = generated
    mixer = w.mixers[0]
    assert [c.tokens for c in mixer.calls] == [T, 1, 1]
    ea = check_call(mixer, 0, range(0, 1), None)
    assert not ea.from_state.any(), "a prompt from zeros got a contribution from a state"
    check_call(mixer, 2, range(0, 3), None)
    check_call(mixer, -2, range(0, 2), None)


@pytest.mark.parametrize("family", ["kimi_linear", "mamba"])
def test_a_prompt_longer_than_a_block_of_per_channel_decays(family):
    """Per-channel decays (KDA, Mamba-1) are measured in blocks of rows: a 70-token prompt spans three."""
    model = build(family)
    with rh.watch(model, keep=KEEP) as w, torch.no_grad():
        model(random_ids(1, 70), use_cache=False)
    check_call(w.mixers[0], 0, range(0, 1), None)


def test_a_write_is_refused_and_the_next_call_starts_the_history(generated):
    """A call whose state a write replaced has no linear map; the history of the later calls starts after it,
    with the written state's contribution in from_state."""
    model, _ = generated
    ids = random_ids(2, T, seed=1)
    with rh.watch(model, keep={"states": [-1]}) as w, torch.no_grad():
        model(ids, use_cache=False)
    state = w.mixers[0].state_after(-1)
    written = state + torch.randn(state.shape, generator=torch.Generator().manual_seed(3)) * (state.abs().max() + 0.1)
    with rh.watch(model, keep=KEEP) as w, torch.no_grad():
        w.mixers[0].set_state_after(-1, written, call=0)
        model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    mixer = w.mixers[0]
    with pytest.raises(rh.Unavailable, match="replaced the state at token"):
        rh.effective_attention(mixer, 0)
    ea = check_call(mixer, 2, range(1, 3), written)
    assert float(ea.from_state.abs().max()) > 1e-3 * float(ea.output().abs().max()), "the written state added nothing"


def test_without_the_key_removal_the_map_is_wrong():
    """A_heur[t, s] = b_s q_t^T (prod_{r=s+1..t} a_r) k_s (the decay, not the delta rule's I - b k k^T) does not
    reconstruct the gated DeltaNet output: the key removal is a large part of it."""
    model = build("qwen3_5")
    with rh.watch(model, keep=KEEP) as w, torch.no_grad():
        model(random_ids(2, T), use_cache=False)
    mixer = w.mixers[0]
    x = _delta_rule_tokens(mixer.calls[0].kernel_calls[0])
    q, k, v, beta, alpha = x["q"], x["k"], x["v"], x["beta"], x["alpha"][..., 0]
    cum = torch.log(alpha).cumsum(-1)  # b h t
    decay = (cum[..., :, None] - cum[..., None, :]).tril().exp().tril()  # prod_{r=s+1..t} a_r, s <= t
    heuristic = (q @ k.transpose(-1, -2)) * decay * beta[..., None, :]
    y = kernel_output(mixer, 0).to(F64)
    error = float(torch.linalg.vector_norm(heuristic @ v - y) / torch.linalg.vector_norm(y))
    exact = rh.effective_attention(mixer, 0, dtype=F64)
    _close("the exact map reconstructs the output", y, exact.output())
    assert error > 0.1, f"the heuristic map is off by only {error:.3g} (relative): the test does not tell them apart"


def test_refusals(generated):
    model, _ = generated
    with rh.watch(model) as w, torch.no_grad():
        model(random_ids(1, 4), use_cache=False)
    with pytest.raises(rh.Unavailable, match="inputs"):
        rh.effective_attention(w.mixers[0])
    with pytest.raises(rh.InvalidValue, match="watched mixer"):
        rh.effective_attention(model)
