"""The gated DeltaNet token loops against transformers' own pure-torch kernels and the float64 reference."""

import pytest
import torch
from _compare import assert_close
from _reference import gated_delta_rule_reference
from _upstream import transformers_kernel
from hypothesis import given, settings
from hypothesis import strategies as st

import recurrent_hooks as rh
from recurrent_hooks.kinds.gated_delta_net import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_states,
    recurrent_gated_delta_rule,
)
from recurrent_hooks.kinds.shared import delta_rule

FAMILY_MODULES = [name for name, row in rh.FAMILIES.items() if row.kind is rh.GatedDeltaNet]

# (batch, seq, key_heads, heads, key_dim, value_dim, with an initial state)
CASES = [
    pytest.param((2, 12, 2, 4, 8, 8, False), id="B2-T12-Hk2-Hv4-fresh"),
    pytest.param((2, 37, 2, 4, 16, 32, True), id="B2-T37-Hk2-Hv4-state"),
    pytest.param((1, 1, 1, 1, 8, 8, True), id="B1-T1-H1-state"),
    pytest.param((3, 70, 2, 2, 8, 4, True), id="B3-T70-H2-2chunks"),
    pytest.param((2, 64, 1, 4, 8, 8, False), id="B2-T64-Hk1-Hv4-one-chunk"),
]


def inputs(batch, seq, key_heads, heads, key_dim, value_dim, with_state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return dict(
        query=r(batch, seq, key_heads, key_dim),
        key=r(batch, seq, key_heads, key_dim),
        value=r(batch, seq, heads, value_dim),
        g=-torch.nn.functional.softplus(r(batch, seq, heads)),
        beta=torch.sigmoid(r(batch, seq, heads)),
        initial_state=r(batch, heads, key_dim, value_dim) * 0.3 if with_state else None,
    )


def hf_kernels(family):
    return (
        transformers_kernel(family, "torch_chunk_gated_delta_rule"),
        transformers_kernel(family, "torch_recurrent_gated_delta_rule"),
    )


@pytest.mark.parametrize("family", FAMILY_MODULES)
@pytest.mark.parametrize("case", CASES)
def test_loops_equal_transformers_kernels(family, case):
    """Output and final state of both loops equal transformers' chunk and recurrent kernels."""
    x = inputs(*case)
    hf_chunk, hf_recurrent = hf_kernels(family)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    for name, ours, theirs in (
        ("chunk", chunk_gated_delta_rule, hf_chunk),
        ("recurrent", recurrent_gated_delta_rule, hf_recurrent),
    ):
        out, state = ours(**x, **kw)
        ref_out, ref_state = theirs(**x, **kw)
        assert_close(f"{name} output", ref_out, out, rtol=1e-5, atol=1e-6)
        assert_close(f"{name} final state", ref_state, state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("normalize", [True, False], ids=["l2norm", "raw-qk"])
def test_per_token_states_equal_float64_reference(case, normalize):
    """The state after every token (seen by on_token) equals the independent float64 recurrence."""
    x = inputs(*case)
    if not normalize:  # keep the unnormalised delta rule stable: ||k|| <= 1
        x["key"] = x["key"] / x["key"].norm(dim=-1, keepdim=True)
    seen = []
    out, final = chunk_gated_delta_rule(
        **x, output_final_state=True, use_qk_l2norm_in_kernel=normalize, on_token=lambda t, s: seen.append(s) or s
    )
    ref_out, ref_states = gated_delta_rule_reference(**x, normalize_qk=normalize)
    assert_close("outputs", ref_out, out, rtol=1e-5, atol=1e-6)
    assert_close("per-token states", ref_states, torch.stack(seen, dim=1), rtol=1e-5, atol=1e-6)
    assert_close("final state", ref_states[:, -1], final, rtol=1e-5, atol=1e-6)


def test_replacing_the_state_changes_only_later_tokens():
    """A state returned by on_token at t is what t+1 continues from; outputs up to t are unchanged."""
    x = inputs(2, 20, 2, 4, 8, 8, True)
    out, final = recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    replacement = torch.randn(2, 4, 8, 8)
    patched, patched_final = recurrent_gated_delta_rule(
        **x, output_final_state=True, use_qk_l2norm_in_kernel=True, on_token=lambda t, s: replacement if t == 7 else s
    )
    assert_close("outputs <= 7", out[:, :8], patched[:, :8], rtol=0, atol=0)
    assert (out[:, 8:] - patched[:, 8:]).abs().amax(dim=(0, 2, 3)).min() > 1e-4
    # and the continuation is exactly a fresh run from the replacement
    rest = {k: (v[:, 8:] if k != "initial_state" else replacement) for k, v in x.items()}
    cont, cont_final = recurrent_gated_delta_rule(**rest, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close("outputs after 7", cont, patched[:, 8:], rtol=1e-6, atol=1e-7)
    assert_close("final state", cont_final, patched_final, rtol=1e-6, atol=1e-7)


def test_input_dtype_is_kept_and_state_is_float32():
    x = {k: (v.to(torch.bfloat16) if v is not None else None) for k, v in inputs(1, 5, 1, 2, 8, 8, False).items()}
    out, state = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert chunk_gated_delta_rule(**x)[1] is None  # output_final_state=False: no state, like transformers


def test_packed_sequences_are_refused():
    import recurrent_hooks as rh

    with pytest.raises(rh.RecurrentHooksError, match="cu_seqlens"):
        chunk_gated_delta_rule(**inputs(1, 4, 1, 1, 8, 8, False), cu_seqlens=torch.tensor([0, 2, 4]))


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 40),
    key_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    key_dim=st.integers(1, 9),
    value_dim=st.integers(1, 9),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_shape_matches_the_float64_reference(batch, seq, key_heads, group, key_dim, value_dim, with_state, seed):
    """Property: for any shape (grouped value heads included), the loop's states are the reference's."""
    x = inputs(batch, seq, key_heads, key_heads * group, key_dim, value_dim, with_state, seed=seed)
    seen = []
    out, _ = recurrent_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True, on_token=lambda t, s: seen.append(s) or s)
    ref_out, ref_states = gated_delta_rule_reference(**x, normalize_qk=True)
    assert_close("outputs", ref_out, out, rtol=1e-5, atol=1e-6)
    assert_close("states", ref_states, torch.stack(seen, dim=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strong_decay", [False, True], ids=["decay", "strong-decay"])
@pytest.mark.parametrize("row_steps_from", [10**9, 0], ids=["product", "row-steps"])
def test_chunkwise_states_equal_float64_reference(case, strong_decay, row_steps_from, monkeypatch):
    """The chunk-wise all-states path (used when every state is kept) against the float64 recurrence, with a
    chunk's states formed at once (small states) and token by token (`ROW_STEPS_FROM`: large states)."""
    monkeypatch.setattr(delta_rule, "ROW_STEPS_FROM", row_steps_from)
    x = inputs(*case)
    if strong_decay:
        x["g"] = x["g"] * 8
    (out, final), states = chunk_gated_delta_rule_states(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_states = gated_delta_rule_reference(**x, normalize_qk=True)
    assert_close("outputs", ref_out, out, rtol=1e-5, atol=1e-6)
    assert_close("every state", ref_states, states.movedim(0, 1), rtol=1e-5, atol=1e-6)
    assert_close("final state", ref_states[:, -1], final, rtol=1e-5, atol=1e-6)
