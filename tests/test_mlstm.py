"""The mLSTM kind (`MatrixLSTM`, xlstm): its token loop against transformers' kernels and the float64
reference from the mLSTM equations, and the bar of tests/test_families.py at model level.

The kernel is the instance attribute `mlstm_backend._inference_fn`, a `functools.partial` of
`wrap_chunkwise_arbitrary_sequence_length` that transformers builds in `xLSTMBackend.__init__`; the tests
call that partial as the original. Its memory is `MLSTMState(C, n, m)`: three parts of different shapes.
"""

import functools

import pytest
import torch

import recurrent_hooks as rh
from recurrent_hooks.extend import MatrixLSTM, MLSTMState
from recurrent_hooks._mlstm import mlstm_inference, mlstm_train
from _compare import assert_close, assert_equal
from _models import FAMILIES as BUILDERS
from _models import PAD, build, random_ids

FAMILIES = [name for name, row in rh.FAMILIES.items() if row.kind is MatrixLSTM and name in BUILDERS]
T = 13  # chunk_size 8: 8 tokens chunk-wise, 5 token by token


def mlstm_reference(query, key, value, igate, fgate, c_initial=None, n_initial=None, m_initial=None, eps=1e-6):
    """The mLSTM equations (more-families.md, "mLSTM") in float64, one head and token at a time.

    Returns the outputs `[batch, heads, seq, value_dim]` and the states after every token, an MLSTMState of
    `[batch, seq, heads, ...]` stacks.
    """
    d = lambda x: x.detach().to(torch.float64)  # noqa: E731
    q, k, v, i_pre, f_pre = map(d, (query, key, value, igate, fgate))
    batch, heads, seq, dk = q.shape
    dv = v.shape[-1]
    C = d(c_initial) if c_initial is not None else torch.zeros(batch, heads, dk, dv, dtype=torch.float64)
    n = d(n_initial) if n_initial is not None else torch.zeros(batch, heads, dk, dtype=torch.float64)
    m = d(m_initial)[..., 0] if m_initial is not None else torch.zeros(batch, heads, dtype=torch.float64)
    outs, Cs, ns, ms = [], [], [], []
    for t in range(seq):
        log_f = torch.nn.functional.logsigmoid(f_pre[:, :, t])  # log σ(f̃_t)
        m_new = torch.maximum(log_f + m, i_pre[:, :, t])  # m_t
        i_act, f_act = torch.exp(i_pre[:, :, t] - m_new), torch.exp(log_f + m - m_new)  # i', f'
        C = f_act[..., None, None] * C + i_act[..., None, None] * torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
        n = f_act[..., None] * n + i_act[..., None] * k[:, :, t]
        m = m_new
        q_hat = q[:, :, t] / dk**0.5
        numerator = torch.einsum("bhkv,bhk->bhv", C, q_hat)
        denominator = torch.maximum(torch.einsum("bhk,bhk->bh", n, q_hat).abs(), torch.exp(-m)) + eps
        outs.append(numerator / denominator[..., None])
        Cs.append(C), ns.append(n), ms.append(m[..., None])
    states = MLSTMState(torch.stack(Cs, 1), torch.stack(ns, 1), torch.stack(ms, 1))
    return torch.stack(outs, 2), states


def close(name, expected, got):
    """Within 1e-5 of the tensor's scale. An mLSTM output divides by max(|n_tᵀq̂|, e^(-m_t)), which can be
    small: its float32 rounding is relative to the largest outputs (transformers' own chunk-wise kernel is
    ~3e-6 of the largest output away from the float64 reference on these inputs), not to each element."""
    assert_close(name, expected, got, rtol=1e-5, atol=1e-5 * float(expected.detach().abs().max()))


def backend(chunk_size=8, heads=2, hidden=64):
    from transformers.models.xlstm.modeling_xlstm import xLSTMBackend

    config = BUILDERS["xlstm"]().config if (chunk_size, heads, hidden) == (8, 2, 64) else None
    if config is None:
        import transformers
        config = transformers.xLSTMConfig(hidden_size=hidden, num_heads=heads, chunk_size=chunk_size,
                                          qk_dim_factor=1.0, v_dim_factor=1.0)
    return xLSTMBackend(config)


def inputs(batch, heads, seq, dk, dv, with_state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    cap = lambda x: 15.0 * torch.tanh(x / 15.0)  # noqa: E731  the layer's gate soft cap
    x = dict(query=r(batch, heads, seq, dk), key=r(batch, heads, seq, dk), value=r(batch, heads, seq, dv),
             igate=cap(3 * r(batch, heads, seq)), fgate=cap(3 * r(batch, heads, seq) + 3))
    if with_state:
        x.update(c_initial=r(batch, heads, dk, dv) * 0.3, n_initial=r(batch, heads, dk) * 0.3,
                 m_initial=r(batch, heads, 1))
    return x


# (batch, heads, seq, key_dim, value_dim, with an initial state); chunk_size 8
CASES = [
    pytest.param((2, 2, 1, 32, 32, False), id="T1-fresh"),
    pytest.param((2, 2, 1, 32, 32, True), id="T1-state"),
    pytest.param((2, 2, 5, 32, 32, False), id="T5-below-chunk-fresh"),
    pytest.param((2, 2, 5, 32, 32, True), id="T5-below-chunk-state"),
    pytest.param((2, 2, 16, 32, 32, True), id="T16-two-chunks-state"),
    pytest.param((2, 2, 19, 32, 32, False), id="T19-two-chunks-and-3-fresh"),
    pytest.param((1, 2, 27, 32, 32, True), id="T27-three-chunks-and-3-state"),
]


@pytest.mark.parametrize("case", CASES)
def test_loop_equals_transformers_inference_fn(case):
    """Output and last state equal the model's own partial: bit for bit where transformers runs its step
    and sequence kernels (T < chunk), within 1e-5 where it runs the chunk-wise kernel."""
    original = backend()._inference_fn
    x = inputs(*case)
    out, state = mlstm_inference(**x, original=original)
    ref_out, ref_state = original(**x)
    assert isinstance(state, tuple) and len(state) == 3
    if case[2] < 8:
        assert_equal("output", ref_out, out)
        for name, a, b in zip("Cnm", ref_state, state):
            assert_equal(f"last {name}", a, b)
    else:
        close("output", ref_out, out)
        for name, a, b in zip("Cnm", ref_state, state):
            close(f"last {name}", a, b)


@pytest.mark.parametrize("case", CASES)
def test_states_after_every_token_equal_float64_reference(case):
    x = inputs(*case)
    seen = []
    out, last = mlstm_inference(**x, on_token=lambda t, s: seen.append(s) or s)
    ref_out, ref_states = mlstm_reference(**x)
    close("outputs", ref_out, out)
    assert all(isinstance(s, MLSTMState) for s in seen) and len(seen) == case[2]
    for name, ref in zip("Cnm", ref_states):
        got = torch.stack([getattr(s, name) for s in seen], dim=1)
        close(f"per-token {name}", ref, got)
    for name, ref, got in zip("Cnm", ref_states, last):
        close(f"last {name}", ref[:, -1], got)


def test_replacing_the_state_changes_only_later_tokens():
    """A state returned by on_token at t is what t+1 continues from; outputs up to t are unchanged, and the
    rest are what a call starting from that state computes."""
    x = inputs(2, 2, 11, 32, 32, True)
    at = 4
    halved = {}

    def hook(t, s):
        if t == at:
            halved["state"] = MLSTMState(s.C * 0.5, s.n * 0.5, s.m - 1.0)
            return halved["state"]
        return s

    plain, _ = mlstm_inference(**x)
    out, last = mlstm_inference(**x, on_token=hook)
    assert_equal("tokens up to the write", plain[:, :, :at + 1], out[:, :, :at + 1])
    assert (plain[:, :, at + 1:] - out[:, :, at + 1:]).abs().max() > 1e-3, "the write changed nothing"
    rest = {name: value[:, :, at + 1:] for name, value in x.items() if name in ("query", "key", "value", "igate", "fgate")}
    C, n, m = halved["state"]
    continued, continued_last = mlstm_inference(**rest, c_initial=C, n_initial=n, m_initial=m)
    assert_equal("tokens after the write", continued, out[:, :, at + 1:])
    for name, a, b in zip("Cnm", continued_last, last):
        assert_equal(f"last {name}", a, b)


@pytest.mark.parametrize("padding", [False, True], ids=["train", "train_with_padding"])
def test_train_loop_equals_transformers_train_fn(padding):
    import transformers
    from transformers.models.xlstm.modeling_xlstm import xLSTMBackend

    config = transformers.xLSTMConfig(hidden_size=64, num_heads=2, chunk_size=8, qk_dim_factor=1.0,
                                      v_dim_factor=1.0, mode="train_with_padding" if padding else "train")
    original = xLSTMBackend(config)._train_fn
    seq = 13 if padding else 16
    x = inputs(2, 2, seq, 32, 32, not padding)
    last = not padding
    ours = mlstm_train(**x, return_last_states=last, original=original)
    theirs = original(**x, return_last_states=last)
    if last:
        (out, state), (ref_out, ref_state) = ours, theirs
        for name, a, b in zip("Cnm", ref_state, state):
            close(f"last {name}", a, b)
    else:
        out, ref_out = ours, theirs
    close("output", ref_out, out)
    with pytest.raises(ValueError, match="divisible by chunk size" if not padding else "cannot return last states"):
        mlstm_train(**inputs(1, 2, 13, 32, 32, False), return_last_states=True, original=original)


def test_empty_and_partial_initial_states_are_refused():
    x = inputs(1, 2, 3, 32, 32, True)
    with pytest.raises(rh.RecurrentHooksError, match="must be given together"):
        mlstm_inference(**{**x, "n_initial": None})
    with pytest.raises(ValueError, match="empty sequence"):
        mlstm_inference(**{k: v[:, :, :0] if k in ("query", "key", "value", "igate", "fgate") else v
                           for k, v in x.items()})
