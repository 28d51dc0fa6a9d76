"""The Mamba-1 and Mamba-2 token loops against transformers' pure-torch kernels and the float64 references.

Kernel level only (no model): outputs and final states equal transformers' kernels (the pure-torch
functions behind each module attribute's hub wrapper, in every family that has a copy), per-token states equal the
float64 recurrences of `_reference_ssm`, a decode call is one more prompt token, the decode loops write
the state into the tensor they are given, a state returned by `on_token` at t changes only later tokens,
and splitting a sequence (prompt + decode steps, or prompt + prompt from a state) changes nothing.
"""

import dataclasses
import math

import pytest
import torch
from _compare import assert_close
from _reference_ssm import selective_scan_reference, ssd_reference
from _upstream import transformers_kernel
from einops import rearrange

import recurrent_hooks as rh
from recurrent_hooks import RecurrentHooksError
from recurrent_hooks.kinds import selective_scan as s6
from recurrent_hooks.kinds import state_space as ssd

# the families of each kind, from the registry (zamba's per-head scan is a Mamba-1 kind)
MAMBA1_FAMILIES = [name for name, row in rh.FAMILIES.items() if issubclass(row.kind, rh.SelectiveScan)]
MAMBA2_FAMILIES = [name for name, row in rh.FAMILIES.items() if issubclass(row.kind, rh.Mamba2StateSpace)]
TOL = dict(rtol=1e-5, atol=1e-6)
EXACT = dict(rtol=0, atol=0)


def hf_kernel(family: str, name: str):
    """transformers' own pure-torch kernel `name` of `family` (under the hub wrapper)."""
    return transformers_kernel(family, name)


def recorder():
    """An on_token that keeps every state it is handed (and replaces none), and the list it fills."""
    seen = []
    return seen, lambda t, state: seen.append(state) or state


# -- Mamba-1 -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class S6Case:
    seq: int
    z: bool = True  # gate
    D: bool = True  # skip
    bias: bool = True  # delta_bias + softplus (without: dt is already a positive step)
    batch: int = 2
    d_inner: int = 6
    d_state: int = 4

    def __str__(self) -> str:
        flags = [name for name, on in (("z", self.z), ("D", self.D), ("bias", self.bias)) if on] or ["bare"]
        return "-".join([f"B{self.batch}-T{self.seq}", *flags])


S6_CASES = [S6Case(1), S6Case(37), S6Case(37, z=False, D=False, bias=False), S6Case(12, z=False), S6Case(5, D=False)]


def s6_inputs(case: S6Case, seed: int = 0) -> dict:
    """`mamba_selective_scan` arguments (channel-major), steps of ~0.1-0.3 so that memory lasts a few tokens."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    b, d, n, t = case.batch, case.d_inner, case.d_state, case.seq
    return dict(
        hidden_states=r(b, d, t),
        dt=r(b, d, t) * 0.5 - 1.5 if case.bias else torch.rand(b, d, t, generator=gen) * 0.3 + 0.05,
        A=-torch.exp(r(d, n) * 0.5),
        B=r(b, n, t),
        C=r(b, n, t),
        D=r(d) if case.D else None,
        z=r(b, d, t) if case.z else None,
        delta_bias=r(d) * 0.3 if case.bias else None,
        delta_softplus=case.bias,
    )


def s6_tokens(x: dict, start: int, stop: int) -> dict:
    """The prompt-kernel arguments of tokens start..stop-1."""
    per_token = ("hidden_states", "dt", "B", "C", "z")
    return {k: (v[..., start:stop] if k in per_token and v is not None else v) for k, v in x.items()}


def s6_decode_args(x: dict, t: int) -> dict:
    """The decode-kernel arguments of token t, as the Mamba-1 mixers pass them."""
    return dict(
        hidden_states=x["hidden_states"][..., t],
        dt=x["dt"][..., t],
        A=x["A"],
        B=x["B"][..., t],
        C=x["C"][..., t],
        D=x["D"],
        dt_bias=x["delta_bias"],
        dt_softplus=x["delta_softplus"],
        z=None if x["z"] is None else x["z"][..., t],
    )


def s6_reference(x: dict, initial_state=None):
    """The float64 reference on the kernel's arguments; outputs back in the kernel's [batch, d_inner, seq]."""
    token_major = lambda v: None if v is None else rearrange(v, "b c t -> b t c")  # noqa: E731
    out, states = selective_scan_reference(
        token_major(x["hidden_states"]),
        token_major(x["dt"]),
        x["A"],
        token_major(x["B"]),
        token_major(x["C"]),
        x["D"],
        token_major(x["z"]),
        dt_bias=x["delta_bias"],
        softplus=x["delta_softplus"],
        initial_state=initial_state,
    )
    return rearrange(out, "b t d -> b d t"), states


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
@pytest.mark.parametrize("case", S6_CASES, ids=str)
def test_mamba1_scan_equals_transformers(family, case):
    x = s6_inputs(case)
    theirs = hf_kernel(family, "mamba_selective_scan")
    out, state = s6.mamba_selective_scan(**x, return_last_state=True, use_associative_scan=True)
    ref_out, ref_state = theirs(**x, return_last_state=True, use_associative_scan=True)
    assert_close("output", ref_out, out, **TOL)
    assert_close("last state", ref_state, state, **TOL)
    assert_close("output without return_last_state", theirs(**x), s6.mamba_selective_scan(**x), **TOL)


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
@pytest.mark.parametrize("case", [S6Case(1), S6Case(1, z=False, D=False, bias=False), S6Case(1, D=False)], ids=str)
def test_mamba1_update_equals_transformers(family, case):
    x = s6_decode_args(s6_inputs(case), 0)
    start = torch.randn(case.batch, case.d_inner, case.d_state, generator=torch.Generator().manual_seed(1))
    ours_state, their_state = start.clone(), start.clone()
    out = s6.mamba_selective_state_update(ours_state, **x)
    ref_out = hf_kernel(family, "mamba_selective_state_update")(their_state, **x)
    assert_close("output", ref_out, out, **TOL)
    assert_close("state written in place", their_state, ours_state, **TOL)


@pytest.mark.parametrize("case", S6_CASES, ids=str)
@pytest.mark.parametrize("start", ["zeros", "h0"])
def test_mamba1_states_equal_float64_reference(case, start):
    x = s6_inputs(case)
    h0 = None if start == "zeros" else torch.randn(case.batch, case.d_inner, case.d_state)
    seen, on_token = recorder()
    out, last = s6.mamba_selective_scan(**x, return_last_state=True, initial_state=h0, on_token=on_token)
    ref_out, ref_states = s6_reference(x, h0)
    assert_close("outputs", ref_out, out, **TOL)
    assert_close("per-token states", ref_states, torch.stack(seen, dim=1), **TOL)
    assert_close("last state", ref_states[:, -1], last, **TOL)


@pytest.mark.parametrize("case", [S6Case(8), S6Case(8, z=False, D=False, bias=False)], ids=str)
def test_mamba1_decode_is_one_more_prompt_token(case):
    x = s6_inputs(case)
    out, last = s6.mamba_selective_scan(**x, return_last_state=True)
    _, before = s6.mamba_selective_scan(**s6_tokens(x, 0, case.seq - 1), return_last_state=True)
    y = s6.mamba_selective_state_update(before, **s6_decode_args(x, case.seq - 1))
    assert_close("decode output", out[..., -1], y, **TOL)
    assert_close("decode state", last, before, **TOL)


@pytest.mark.parametrize("split", [1, 13, 36])
def test_mamba1_split_invariance(split):
    """37 tokens at once == `split` tokens, then the rest as decode steps or as a scan from the state."""
    x = s6_inputs(S6Case(37))
    seen, on_token = recorder()
    out = s6.mamba_selective_scan(**x, on_token=on_token)
    states = torch.stack(seen, dim=1)

    head_seen, on_head = recorder()
    head_out, last = s6.mamba_selective_scan(**s6_tokens(x, 0, split), return_last_state=True, on_token=on_head)
    state = last.clone()  # the scan returns the last state on_token gave back; the decode steps overwrite it
    step_outs, step_states = [], []
    for t in range(split, 37):
        step_outs.append(s6.mamba_selective_state_update(state, **s6_decode_args(x, t)))
        step_states.append(state.clone())
    assert_close("outputs, scan + decode steps", out, torch.cat([head_out, torch.stack(step_outs, -1)], -1), **TOL)
    assert_close("states, scan + decode steps", states, torch.stack(head_seen + step_states, dim=1), **TOL)

    tail_seen, on_tail = recorder()
    tail_out = s6.mamba_selective_scan(**s6_tokens(x, split, 37), initial_state=head_seen[-1], on_token=on_tail)
    assert_close("outputs, scan + scan from the state", out, torch.cat([head_out, tail_out], -1), **TOL)
    assert_close("states, scan + scan from the state", states, torch.stack(head_seen + tail_seen, dim=1), **TOL)


def test_mamba1_replacement_changes_only_later_tokens():
    x = s6_inputs(S6Case(20))
    out, last = s6.mamba_selective_scan(**x, return_last_state=True)
    replacement = torch.randn(2, 6, 4)
    calls = []

    def write(t, state):
        calls.append(t)
        return replacement if t == 7 else state

    patched, patched_last = s6.mamba_selective_scan(**x, return_last_state=True, on_token=write)
    assert calls == list(range(20))
    assert_close("outputs up to token 7", out[..., :8], patched[..., :8], **EXACT)
    assert (out[..., 8] - patched[..., 8]).abs().max() > 1e-3
    cont, cont_last = s6.mamba_selective_scan(**s6_tokens(x, 8, 20), return_last_state=True, initial_state=replacement)
    assert_close("outputs after 7 == a run from the replacement", cont, patched[..., 8:], **TOL)
    assert_close("last state", cont_last, patched_last, **TOL)


def test_mamba1_update_writes_in_place():
    """The state tensor passed in holds the new state afterwards: a replacement, also through a cache view."""
    x = s6_decode_args(s6_inputs(S6Case(1)), 0)
    cache = torch.randn(2, 3, 6, 4)  # zamba: [batch, mamba heads, head_dim, d_state], one head per call
    before = cache.clone()
    seen, on_token = recorder()
    s6.mamba_selective_state_update(cache[:, 1], **x, on_token=on_token)
    assert_close("cache head 1 == the new state", seen[0], cache[:, 1], **EXACT)
    assert_close("cache heads 0 and 2 untouched", before[:, [0, 2]], cache[:, [0, 2]], **EXACT)

    replacement = torch.randn(2, 6, 4)
    state = torch.zeros(2, 6, 4)
    y = s6.mamba_selective_state_update(state, **x, on_token=lambda t, s: replacement)
    assert_close("state == the replacement", replacement, state, **EXACT)
    y_plain = s6.mamba_selective_state_update(torch.zeros(2, 6, 4), **x)
    assert_close("output computed before the replacement", y_plain, y, **EXACT)


# -- Mamba-2 -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SSDCase:
    seq: int
    chunk: int = 8
    D: bool = True
    bias: bool = True  # dt_bias + softplus (without: dt is already a positive step)
    groups: int = 2
    h0: bool = False  # initial_states
    limit: tuple[float, float] = (0.0, math.inf)
    batch: int = 2
    heads: int = 4
    head_dim: int = 3
    d_state: int = 4

    def __str__(self) -> str:
        flags = [
            name
            for name, on in (
                ("D", self.D),
                ("bias", self.bias),
                ("h0", self.h0),
                ("limit", self.limit != (0.0, math.inf)),
            )
            if on
        ] or ["bare"]
        return "-".join([f"B{self.batch}-T{self.seq}-chunk{self.chunk}-G{self.groups}", *flags])


SSD_CASES = [
    SSDCase(1),
    SSDCase(8),
    SSDCase(37),
    SSDCase(37, chunk=16, h0=True),
    SSDCase(20, chunk=16, groups=1, D=False, bias=False),
    SSDCase(13, h0=True, limit=(0.1, 0.2)),
]


def ssd_inputs(case: SSDCase, seed: int = 0) -> dict:
    """`mamba2_chunk_scan` arguments, steps of ~0.1-0.3."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    b, t, h, p, g, n = case.batch, case.seq, case.heads, case.head_dim, case.groups, case.d_state
    return dict(
        hidden_states=r(b, t, h, p),
        dt=r(b, t, h) * 0.5 - 1.5 if case.bias else torch.rand(b, t, h, generator=gen) * 0.3 + 0.05,
        A=-torch.exp(r(h) * 0.5),
        B=r(b, t, g, n),
        C=r(b, t, g, n),
        chunk_size=case.chunk,
        D=r(h) if case.D else None,
        dt_bias=r(h) * 0.3 if case.bias else None,
        initial_states=r(b, h, p, n) if case.h0 else None,
        dt_softplus=case.bias,
        dt_limit=case.limit,
    )


def ssd_tokens(x: dict, start: int, stop: int, initial_states=None) -> dict:
    per_token = ("hidden_states", "dt", "B", "C")
    sliced = {k: (v[:, start:stop] if k in per_token else v) for k, v in x.items()}
    return sliced | dict(initial_states=initial_states)


def ssd_decode_args(x: dict, t: int, z=None) -> dict:
    """The decode-kernel arguments of token t, per-head parameters expanded over head_dim as the mixers do."""
    _, _, heads, head_dim = x["hidden_states"].shape
    d_state = x["B"].shape[-1]
    per_channel = lambda v: None if v is None else v[:, None].expand(-1, head_dim)  # noqa: E731
    return dict(
        hidden_states=x["hidden_states"][:, t],
        dt=x["dt"][:, t, :, None].expand(-1, -1, head_dim),
        A=x["A"][:, None, None].expand(-1, head_dim, d_state),
        B=x["B"][:, t],
        C=x["C"][:, t],
        D=per_channel(x["D"]),
        dt_bias=per_channel(x["dt_bias"]),
        dt_softplus=x["dt_softplus"],
        z=z,
    )


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
@pytest.mark.parametrize("case", SSD_CASES, ids=str)
def test_mamba2_scan_equals_transformers(family, case):
    x = ssd_inputs(case)
    # z arrives in **kwargs and is ignored by both; so are leaked decoder kwargs
    extra = dict(
        z=torch.randn(case.batch, case.seq, case.heads * case.head_dim),
        position_embeddings=None,
        output_router_logits=False,
    )
    theirs = hf_kernel(family, "mamba2_chunk_scan")
    out, state = ssd.mamba2_chunk_scan(**x, return_final_states=True, **extra)
    ref_out, ref_state = theirs(**x, return_final_states=True, **extra)
    assert ref_out.dtype == out.dtype and ref_state.dtype == state.dtype
    assert_close("output", ref_out, out, **TOL)
    assert_close("final state", ref_state, state, **TOL)
    assert_close("output without return_final_states", theirs(**x), ssd.mamba2_chunk_scan(**x), **TOL)


UPDATE_CASES = [
    pytest.param(SSDCase(1), True, id="G2-D-bias-z"),
    pytest.param(SSDCase(1), False, id="G2-D-bias"),
    pytest.param(SSDCase(1, groups=1, D=False, bias=False), False, id="G1-bare"),
    pytest.param(SSDCase(1, groups=4, batch=1), True, id="B1-G4-D-bias-z"),
]


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
@pytest.mark.parametrize(("case", "gated"), UPDATE_CASES)
def test_mamba2_update_equals_transformers(family, case, gated):
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(case.batch, case.heads, case.head_dim, generator=gen) if gated else None
    x = ssd_decode_args(ssd_inputs(case), 0, z=z)
    start = torch.randn(case.batch, case.heads, case.head_dim, case.d_state, generator=gen)
    ours_state, their_state = start.clone(), start.clone()
    out = ssd.mamba2_selective_state_update(ours_state, **x, position_embeddings=None)
    ref_out = hf_kernel(family, "mamba2_selective_state_update")(their_state, **x, position_embeddings=None)
    assert_close("output", ref_out, out, **TOL)
    assert_close("state written in place", their_state, ours_state, **TOL)


@pytest.mark.parametrize("case", SSD_CASES, ids=str)
def test_mamba2_states_equal_float64_reference(case):
    x = ssd_inputs(case)
    seen, on_token = recorder()
    out, final = ssd.mamba2_chunk_scan(**x, return_final_states=True, on_token=on_token)
    ref_out, ref_states = ssd_reference(
        x["hidden_states"],
        x["dt"],
        x["A"],
        x["B"],
        x["C"],
        x["D"],
        dt_bias=x["dt_bias"],
        softplus=x["dt_softplus"],
        dt_limit=x["dt_limit"],
        initial_state=x["initial_states"],
    )
    assert_close("outputs", ref_out, out, **TOL)
    assert_close("per-token states", ref_states, torch.stack(seen, dim=1), **TOL)
    assert_close("final state", ref_states[:, -1], final, **TOL)


def test_mamba2_gate_equals_float64_reference():
    """The decode kernel's z gate: y_t * silu(z_t)."""
    case = SSDCase(1, h0=True)
    x = ssd_inputs(case)
    z = torch.randn(case.batch, case.heads, case.head_dim)
    state = x["initial_states"].clone()
    y = ssd.mamba2_selective_state_update(state, **ssd_decode_args(x, 0, z=z))
    ref_out, ref_states = ssd_reference(
        x["hidden_states"],
        x["dt"],
        x["A"],
        x["B"],
        x["C"],
        x["D"],
        z[:, None],
        dt_bias=x["dt_bias"],
        softplus=True,
        initial_state=x["initial_states"],
    )
    assert_close("gated output", ref_out[:, 0], y, **TOL)
    assert_close("state", ref_states[:, 0], state, **TOL)


@pytest.mark.parametrize("case", [SSDCase(9), SSDCase(17, chunk=16, groups=1, D=False, bias=False)], ids=str)
def test_mamba2_decode_is_one_more_prompt_token(case):
    x = ssd_inputs(case)
    out, final = ssd.mamba2_chunk_scan(**x, return_final_states=True)
    _, before = ssd.mamba2_chunk_scan(**ssd_tokens(x, 0, case.seq - 1), return_final_states=True)
    y = ssd.mamba2_selective_state_update(before, **ssd_decode_args(x, case.seq - 1))
    assert_close("decode output", out[:, -1], y, **TOL)
    assert_close("decode state", final, before, **TOL)


@pytest.mark.parametrize("split", [1, 8, 13, 36])
def test_mamba2_split_invariance(split):
    """37 tokens at once == `split` tokens, then the rest as decode steps or as a chunk scan from the state."""
    x = ssd_inputs(SSDCase(37))
    seen, on_token = recorder()
    out = ssd.mamba2_chunk_scan(**x, on_token=on_token)
    states = torch.stack(seen, dim=1)

    head_seen, on_head = recorder()
    head_out, final = ssd.mamba2_chunk_scan(**ssd_tokens(x, 0, split), return_final_states=True, on_token=on_head)
    state = final.clone()  # the scan returns the last state on_token gave back; the decode steps overwrite it
    step_outs, step_states = [], []
    for t in range(split, 37):
        step_outs.append(ssd.mamba2_selective_state_update(state, **ssd_decode_args(x, t)))
        step_states.append(state.clone())
    assert_close("outputs, scan + decode steps", out, torch.cat([head_out, torch.stack(step_outs, 1)], 1), **TOL)
    assert_close("states, scan + decode steps", states, torch.stack(head_seen + step_states, dim=1), **TOL)

    tail_seen, on_tail = recorder()
    tail = ssd_tokens(x, split, 37, initial_states=head_seen[-1])
    tail_out = ssd.mamba2_chunk_scan(**tail, on_token=on_tail)
    assert_close("outputs, scan + scan from the state", out, torch.cat([head_out, tail_out], 1), **TOL)
    assert_close("states, scan + scan from the state", states, torch.stack(head_seen + tail_seen, dim=1), **TOL)
    assert_close("transformers' own split", hf_kernel("mamba2", "mamba2_chunk_scan")(**tail), tail_out, **TOL)


def test_mamba2_replacement_changes_only_later_tokens():
    x = ssd_inputs(SSDCase(20))
    out, final = ssd.mamba2_chunk_scan(**x, return_final_states=True)
    replacement = torch.randn(2, 4, 3, 4)
    calls = []

    def write(t, state):
        calls.append(t)
        return replacement if t == 7 else state

    patched, patched_final = ssd.mamba2_chunk_scan(**x, return_final_states=True, on_token=write)
    assert calls == list(range(20))
    assert_close("outputs up to token 7", out[:, :8], patched[:, :8], **EXACT)
    assert (out[:, 8] - patched[:, 8]).abs().max() > 1e-3
    cont, cont_final = ssd.mamba2_chunk_scan(
        **ssd_tokens(x, 8, 20, initial_states=replacement), return_final_states=True
    )
    assert_close("outputs after 7 == a run from the replacement", cont, patched[:, 8:], **TOL)
    assert_close("final state", cont_final, patched_final, **TOL)


def test_mamba2_update_writes_in_place():
    x = ssd_decode_args(ssd_inputs(SSDCase(1)), 0)
    state = torch.randn(2, 4, 3, 4)
    seen, on_token = recorder()
    ssd.mamba2_selective_state_update(state, **x, on_token=on_token)
    assert seen[0] is not state
    assert_close("state == the new state", seen[0], state, **EXACT)

    replacement = torch.randn(2, 4, 3, 4)
    state = torch.zeros(2, 4, 3, 4)
    y = ssd.mamba2_selective_state_update(state, **x, on_token=lambda t, s: replacement)
    assert_close("state == the replacement", replacement, state, **EXACT)
    y_plain = ssd.mamba2_selective_state_update(torch.zeros(2, 4, 3, 4), **x)
    assert_close("output computed before the replacement", y_plain, y, **EXACT)


# -- both ----------------------------------------------------------------------------------------------


def test_discretize_rebuilds_the_states():
    """h_t = decay_t h_{t-1} + drive_t, with the values `discretize` derives from the kernels' arguments."""
    x = s6_inputs(S6Case(12))
    seen, on_token = recorder()
    s6.mamba_selective_scan(**x, on_token=on_token)
    dt, decay, drive = s6.discretize(x["hidden_states"], x["dt"], x["A"], x["B"], x["delta_bias"], True)
    assert_close(
        "Mamba-1 step", torch.nn.functional.softplus(x["dt"] + x["delta_bias"][:, None]).transpose(1, 2), dt, **TOL
    )
    state = torch.zeros(2, 6, 4)
    for t in range(12):
        state = decay[:, t] * state + drive[:, t]
        assert_close(f"Mamba-1 state {t}", seen[t], state, **TOL)

    x = ssd_inputs(SSDCase(12, h0=True, limit=(0.1, 0.2)))
    seen, on_token = recorder()
    ssd.mamba2_chunk_scan(**x, on_token=on_token)
    dt, decay, drive = ssd.discretize(x["hidden_states"], x["dt"], x["A"], x["B"], x["dt_bias"], True, x["dt_limit"])
    state = x["initial_states"]
    for t in range(12):
        state = decay[:, t, :, None, None] * state + drive[:, t]
        assert_close(f"Mamba-2 state {t}", seen[t], state, **TOL)


def test_discretize_from_decode_arguments():
    """The recipes of the `discretize` docstrings for the decode kernels' arguments."""
    x = s6_decode_args(s6_inputs(S6Case(1)), 0)
    h0 = torch.randn(2, 6, 4)
    state = h0.clone()
    s6.mamba_selective_state_update(state, **x)
    _, decay, drive = s6.discretize(
        x["hidden_states"][..., None], x["dt"][..., None], x["A"], x["B"][..., None], x["dt_bias"], x["dt_softplus"]
    )
    assert_close("Mamba-1 decode state", state, decay[:, 0] * h0 + drive[:, 0], **TOL)

    x = ssd_decode_args(ssd_inputs(SSDCase(1)), 0)
    h0 = torch.randn(2, 4, 3, 4)
    state = h0.clone()
    ssd.mamba2_selective_state_update(state, **x)
    _, decay, drive = ssd.discretize(
        x["hidden_states"][:, None],
        x["dt"][:, None, :, 0],
        x["A"][:, 0, 0],
        x["B"][:, None],
        x["dt_bias"][:, 0],
        x["dt_softplus"],
        (-math.inf, math.inf),
    )
    assert_close("Mamba-2 decode state", state, decay[:, 0, :, None, None] * h0 + drive[:, 0], **TOL)


def test_dtypes_follow_transformers():
    """bf16 inputs as the mixers pass them: output dtypes as transformers' (prompt float32, decode bf16).

    States stay float32. Values only loosely: transformers rounds intermediates to bf16 where the loops do not.
    """
    bf16 = torch.bfloat16
    loose = dict(rtol=2e-2, atol=2e-2)
    x = s6_inputs(S6Case(6))
    x = {
        k: (v.to(bf16) if isinstance(v, torch.Tensor) and k not in ("A", "D", "delta_bias") else v)
        for k, v in x.items()
    }  # the mixer: A, D.float() and the dt bias in float32
    out, state = s6.mamba_selective_scan(**x, return_last_state=True)
    ref_out, ref_state = hf_kernel("mamba", "mamba_selective_scan")(**x, return_last_state=True)
    assert (out.dtype, state.dtype) == (ref_out.dtype, ref_state.dtype) == (torch.float32, torch.float32)
    assert_close("Mamba-1 bf16 prompt output", ref_out, out, **loose)
    step = s6_decode_args(x, 0) | dict(D=x["D"].to(bf16))  # the mixer passes self.D as it is
    ours_state, their_state = torch.zeros(2, 6, 4), torch.zeros(2, 6, 4)
    y = s6.mamba_selective_state_update(ours_state, **step)
    ref_y = hf_kernel("mamba", "mamba_selective_state_update")(their_state, **step)
    assert y.dtype == ref_y.dtype == bf16 and ours_state.dtype == torch.float32
    assert_close("Mamba-1 bf16 decode output", ref_y, y, **loose)
    assert_close("Mamba-1 bf16 decode state", their_state, ours_state, **loose)

    x = ssd_inputs(SSDCase(6))
    x = {k: (v.to(bf16) if isinstance(v, torch.Tensor) and k != "A" else v) for k, v in x.items()}
    out, state = ssd.mamba2_chunk_scan(**x, return_final_states=True)
    ref_out, ref_state = hf_kernel("mamba2", "mamba2_chunk_scan")(**x, return_final_states=True)
    assert (out.dtype, state.dtype) == (ref_out.dtype, ref_state.dtype) == (torch.float32, torch.float32)
    assert_close("Mamba-2 bf16 prompt output", ref_out, out, **loose)
    step = ssd_decode_args(x, 0, z=torch.randn(2, 4, 3).to(bf16))
    ours_state, their_state = torch.zeros(2, 4, 3, 4), torch.zeros(2, 4, 3, 4)
    y = ssd.mamba2_selective_state_update(ours_state, **step)
    ref_y = hf_kernel("mamba2", "mamba2_selective_state_update")(their_state, **step)
    assert y.dtype == ref_y.dtype == bf16 and ours_state.dtype == torch.float32
    assert_close("Mamba-2 bf16 decode output", ref_y, y, **loose)
    assert_close("Mamba-2 bf16 decode state", their_state, ours_state, **loose)


@pytest.mark.parametrize("packed", ["seq_idx", "cu_seqlens"])
def test_packed_sequences_are_refused(packed):
    flag = {packed: torch.zeros(1, 4, dtype=torch.int32)}
    with pytest.raises(RecurrentHooksError, match=packed):
        s6.mamba_selective_scan(**s6_inputs(S6Case(4)), **flag)
    with pytest.raises(RecurrentHooksError, match=packed):
        ssd.mamba2_chunk_scan(**ssd_inputs(SSDCase(4)), **flag)


@pytest.mark.parametrize("seq", [1, 13, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "from-state"])
@pytest.mark.parametrize("row_steps_from", [10**9, 0], ids=["product", "row-steps"])
def test_mamba2_chunkwise_states_equal_float64_reference(seq, with_state, row_steps_from, monkeypatch):
    """The chunk-wise all-states path of the Mamba-2 prompt kernel (used when every state is kept), with a chunk's
    states formed at once (small states) and token by token (`ROW_STEPS_FROM`: large states)."""
    from recurrent_hooks.kinds import state_space
    from recurrent_hooks.kinds.state_space import mamba2_chunk_scan_states

    monkeypatch.setattr(state_space, "ROW_STEPS_FROM", row_steps_from)
    gen = torch.Generator().manual_seed(seq)
    batch, heads, head_dim, groups, d_state = 2, 4, 8, 2, 6
    x = torch.randn(batch, seq, heads, head_dim, generator=gen)
    dt = torch.randn(batch, seq, heads, generator=gen)
    A = -torch.rand(heads, generator=gen) * 2
    B, C = (torch.randn(batch, seq, groups, d_state, generator=gen) for _ in range(2))
    D, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    h0 = torch.randn(batch, heads, head_dim, d_state, generator=gen) if with_state else None
    (y, final), states = mamba2_chunk_scan_states(
        x, dt, A, B, C, 8, D=D, dt_bias=dt_bias, initial_states=h0, dt_softplus=True, return_final_states=True
    )
    ref_y, ref_states = ssd_reference(x, dt, A, B, C, D, dt_bias=dt_bias, softplus=True, initial_state=h0)
    assert_close("outputs", ref_y, y, rtol=1e-5, atol=1e-5)
    # states are O(10) here: absolute float32 rounding of a few 1e-6
    assert_close("every state", ref_states, states.movedim(0, 1), rtol=1e-5, atol=1e-5)
    assert_close("final state", ref_states[:, -1], final, rtol=1e-5, atol=1e-5)
