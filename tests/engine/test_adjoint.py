"""The kinds' adjoint recurrences (`Segments.adjoint`): mu_t = d m / d S_t through the tokens after t.

Each is compared with a float64 reference written here from the papers' recurrences (tests/_reference*.py): the
reference run from S_t over the later tokens, m = <dO, outputs after t> + <dS, final state>, differentiated by
autograd with respect to that starting state. The adjoint is what attribution's "chunks" and the gradients of
kept states use, so a wrong mu is a wrong attribution: each kind, with and without an initial state, grouped
heads, and a final-state gradient or none.
"""

import pytest
import torch
from _compare import assert_close
from _reference import gated_delta_rule_reference, kimi_delta_rule_reference
from _reference_ssm import ssd_reference

from recurrent_hooks.kinds.gated_delta_net import chunk_gated_delta_rule_adjoint
from recurrent_hooks.kinds.kimi_delta import chunk_kimi_delta_attention_adjoint
from recurrent_hooks.kinds.state_space import mamba2_chunk_scan_adjoint

F64 = torch.float64


def _delta_rule(kimi, batch, seq, key_heads, heads, key_dim, value_dim, with_state, gen):
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    decay_shape = (batch, seq, heads, key_dim) if kimi else (batch, seq, heads)
    return dict(
        query=r(batch, seq, key_heads, key_dim),
        key=r(batch, seq, key_heads, key_dim),
        value=r(batch, seq, heads, value_dim),
        g=-torch.nn.functional.softplus(r(*decay_shape)),
        beta=torch.sigmoid(r(batch, seq, heads)),
        initial_state=r(batch, heads, key_dim, value_dim) * 0.3 if with_state else None,
    )


def _reference_mu(run, arguments, per_token, state_name, grad_output, grad_final, seq):
    """mu_t for t in -1..seq-1 (mu_{-1}: the initial state's gradient) by autograd through the float64 reference."""
    _, states = run(**arguments)
    mus = []
    for t in range(-1, seq):
        start = arguments[state_name] if t < 0 else states[:, t]
        start = (torch.zeros_like(states[:, 0]) if start is None else start).detach().to(F64).requires_grad_()
        later = {name: (value[:, t + 1 :] if name in per_token else value) for name, value in arguments.items()}
        later[state_name] = start
        if t + 1 < seq:
            outputs, after = run(**later)
            final = after[:, -1]
            value = (outputs * grad_output[:, t + 1 :].to(F64)).sum()
        else:
            final, value = start, (start * 0).sum()
        if grad_final is not None:
            value = value + (final * grad_final.to(F64)).sum()
        mus.append(torch.autograd.grad(value, start, allow_unused=True)[0])
    return mus


DELTA_CASES = [
    pytest.param(False, (2, 9, 1, 2, 4, 3, True, True), id="gdn-grouped-state-final"),
    pytest.param(False, (1, 6, 2, 2, 5, 4, False, False), id="gdn-no-state-no-final"),
    pytest.param(True, (2, 7, 2, 2, 4, 3, True, True), id="kimi-state-final"),
    pytest.param(True, (1, 5, 1, 1, 3, 5, False, False), id="kimi-no-state-no-final"),
]


@pytest.mark.parametrize("kimi, case", DELTA_CASES)
def test_delta_rule_adjoint_equals_float64_reference(kimi, case):
    batch, seq, key_heads, heads, key_dim, value_dim, with_state, with_final = case
    gen = torch.Generator().manual_seed(7)
    arguments = _delta_rule(kimi, batch, seq, key_heads, heads, key_dim, value_dim, with_state, gen)
    grad_output = torch.randn(batch, seq, heads, value_dim, generator=gen)
    grad_final = torch.randn(batch, heads, key_dim, value_dim, generator=gen) if with_final else None
    reference = kimi_delta_rule_reference if kimi else gated_delta_rule_reference
    per_token = ("query", "key", "value", "g", "beta")
    expected = _reference_mu(reference, arguments, per_token, "initial_state", grad_output, grad_final, seq)
    seen = {}
    adjoint = chunk_kimi_delta_attention_adjoint if kimi else chunk_gated_delta_rule_adjoint
    initial = adjoint(
        **arguments,
        use_qk_l2norm_in_kernel=True,
        grad_output=grad_output,
        grad_final=grad_final,
        visit=lambda t, mu: seen.__setitem__(t, mu.clone()),
    )
    assert sorted(seen) == list(range(seq))
    for t in range(seq):
        assert_close(f"mu_{t}", seen[t], expected[t + 1], rtol=1e-4, atol=1e-5)
    assert_close("initial state's gradient", initial, expected[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_state, with_final, groups", [(True, True, 1), (False, False, 2)])
def test_ssd_adjoint_equals_float64_reference(with_state, with_final, groups):
    batch, seq, heads, head_dim, d_state = 2, 8, 4, 3, 5
    gen = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    arguments = dict(
        x=r(batch, seq, heads, head_dim),
        dt=r(batch, seq, heads),
        A=-torch.rand(heads, generator=gen),
        B=r(batch, seq, groups, d_state),
        C=r(batch, seq, groups, d_state),
        D=r(heads),
        dt_bias=r(heads),
        softplus=True,
        dt_limit=(0.0, float("inf")),
        initial_state=r(batch, heads, head_dim, d_state) * 0.3 if with_state else None,
    )
    grad_output = r(batch, seq, heads, head_dim)
    grad_final = r(batch, heads, head_dim, d_state) if with_final else None
    expected = _reference_mu(
        ssd_reference, arguments, ("x", "dt", "B", "C"), "initial_state", grad_output, grad_final, seq
    )
    seen = {}
    initial = mamba2_chunk_scan_adjoint(
        arguments["x"],
        arguments["dt"],
        arguments["A"],
        arguments["B"],
        arguments["C"],
        4,
        D=arguments["D"],
        dt_bias=arguments["dt_bias"],
        initial_states=arguments["initial_state"],
        dt_softplus=True,
        grad_output=grad_output,
        grad_final=grad_final,
        visit=lambda t, mu: seen.__setitem__(t, mu.clone()),
    )
    for t in range(seq):
        assert_close(f"mu_{t}", seen[t], expected[t + 1], rtol=1e-4, atol=1e-5)
    assert_close("initial state's gradient", initial, expected[0], rtol=1e-4, atol=1e-5)


def test_flushed_exp_drops_only_the_subnormal_range():
    from recurrent_hooks.engine.declare.loops import FLUSH_BELOW, causal_decay, flushed_exp

    x = torch.tensor([0.0, -1.0, FLUSH_BELOW + 1, FLUSH_BELOW - 1, -100.0, -torch.inf])
    assert_close("flushed_exp", flushed_exp(x), torch.where(x < FLUSH_BELOW, 0.0, x.exp()), rtol=0, atol=0)
    cum = torch.tensor([0.0, -30.0, -70.0])
    decay = causal_decay(cum)
    assert decay[2, 0] == 0 and decay[2, 1] == torch.tensor(-40.0).exp() and decay[0, 1] == 0
