"""The mLSTM kind (`MatrixLSTM`, xlstm): its token loop against transformers' kernels and the float64
reference from the mLSTM equations, and the bar of tests/kinds/test_families.py at model level (the kind-agnostic
part of the bar: tests/kinds/test_contract.py).

The kernel is the instance attribute `mlstm_backend._inference_fn`, a `functools.partial` of
`wrap_chunkwise_arbitrary_sequence_length` that transformers builds in `xLSTMBackend.__init__`; the tests
call that partial as the original. Its memory is `MLSTMState(C, n, m)`: three parts of different shapes.
"""

import re

import pytest
import torch
from _compare import assert_close, assert_equal
from _contract import ContractReading, family_fixtures
from _models import FAMILIES as BUILDERS
from _models import build, random_ids
from _runs import greedy, logits_of, watched_greedy

import recurrent_hooks as rh
from recurrent_hooks.extend import MatrixLSTM, MLSTMState
from recurrent_hooks.kinds.mlstm import mlstm_inference, mlstm_train

FAMILIES = [name for name, row in rh.FAMILIES.items() if row.kind is MatrixLSTM and name in BUILDERS]
T = 13  # chunk_size 8: 8 tokens chunk-wise, 5 token by token

# -- how the contract reads this kind (tests/kinds/test_contract.py, tests/helpers/_contract.py's ContractReading) -----


def mlstm_state(out, mixer, memory):
    """xLSTM's cache holds (C, n, m) per layer in `rnn_state`."""
    return {"the cache": MLSTMState(*out.cache.rnn_state[mixer.layer])}


def halve_mlstm(state):
    """C and n halved, the stabiliser m (a log scale) kept."""
    return MLSTMState(state.C * 0.5, state.n * 0.5, state.m)


# the loop against transformers' chunk-wise kernel: an mLSTM output divides by max(|n_t q|, e^(-m_t)), which can be
# small (input_grad); a backward through a cached prompt >= chunk_size fails in transformers (grad_use_cache)
CONTRACT = {
    MatrixLSTM: ContractReading(
        input_grad=(1e-3, 1e-6),
        carried=mlstm_state,
        window_in=None,
        scale=halve_mlstm,
        later=1e-3,
        grad_use_cache=False,
        grad_parts=("C",),
        recomputes_once=True,
        whole_memory_tol=dict(rtol=1e-5, atol=1e-6),
        finite_difference=(),
        split_tol=dict(rtol=1e-5, atol=1e-5, relative=True),
    )
}


def mlstm_reference(query, key, value, igate, fgate, c_initial=None, n_initial=None, m_initial=None, eps=1e-6):
    """The mLSTM equations (xLSTM, Beck et al. 2024, as transformers' xlstm writes them) in float64, one head and
    token at a time: m_t = max(log sigmoid(f_t) + m_{t-1}, i_t), i' = exp(i_t - m_t), f' = exp(log sigmoid(f_t) +
    m_{t-1} - m_t), C_t = f' C_{t-1} + i' k_t v_t^T, n_t = f' n_{t-1} + i' k_t, h_t = C_t^T q / (max(|n_t^T q|,
    exp(-m_t)) + eps), q scaled by 1/sqrt(d_qk).

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

        config = transformers.xLSTMConfig(
            hidden_size=hidden, num_heads=heads, chunk_size=chunk_size, qk_dim_factor=1.0, v_dim_factor=1.0
        )
    return xLSTMBackend(config)


def inputs(batch, heads, seq, dk, dv, with_state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    cap = lambda x: 15.0 * torch.tanh(x / 15.0)  # noqa: E731  the layer's gate soft cap
    x = dict(
        query=r(batch, heads, seq, dk),
        key=r(batch, heads, seq, dk),
        value=r(batch, heads, seq, dv),
        igate=cap(3 * r(batch, heads, seq)),
        fgate=cap(3 * r(batch, heads, seq) + 3),
    )
    if with_state:
        x.update(
            c_initial=r(batch, heads, dk, dv) * 0.3, n_initial=r(batch, heads, dk) * 0.3, m_initial=r(batch, heads, 1)
        )
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [case for case in CASES if case.values[0][2] < 8])
def test_loop_equals_the_step_and_sequence_kernels_bit_for_bit_in_half_precision(case, dtype):
    """Below chunk_size, transformers runs its step / sequence kernels, whose operations and dtypes the loop
    repeats (state in float32, reads in the inputs' dtype): the same bits in bf16 and fp16 too."""
    original = backend()._inference_fn
    x = {name: value.to(dtype) for name, value in inputs(*case).items()}
    out, state = mlstm_inference(**x, original=original)
    ref_out, ref_state = original(**x)
    assert out.dtype == dtype
    assert_equal("output", ref_out, out)
    for name, a, b in zip("Cnm", ref_state, state):
        assert_equal(f"last {name}", a, b)


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
    assert_equal("tokens up to the write", plain[:, :, : at + 1], out[:, :, : at + 1])
    assert (plain[:, :, at + 1 :] - out[:, :, at + 1 :]).abs().max() > 1e-3, "the write changed nothing"
    rest = {
        name: value[:, :, at + 1 :] for name, value in x.items() if name in ("query", "key", "value", "igate", "fgate")
    }
    C, n, m = halved["state"]
    continued, continued_last = mlstm_inference(**rest, c_initial=C, n_initial=n, m_initial=m)
    assert_equal("tokens after the write", continued, out[:, :, at + 1 :])
    for name, a, b in zip("Cnm", continued_last, last):
        assert_equal(f"last {name}", a, b)


@pytest.mark.parametrize("padding", [False, True], ids=["train", "train_with_padding"])
def test_train_loop_equals_transformers_train_fn(padding):
    import transformers
    from transformers.models.xlstm.modeling_xlstm import xLSTMBackend

    config = transformers.xLSTMConfig(
        hidden_size=64,
        num_heads=2,
        chunk_size=8,
        qk_dim_factor=1.0,
        v_dim_factor=1.0,
        mode="train_with_padding" if padding else "train",
    )
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
        mlstm_inference(
            **{k: v[:, :, :0] if k in ("query", "key", "value", "igate", "fgate") else v for k, v in x.items()}
        )


# -- the model: the bar of tests/kinds/test_families.py -------------------------------------------------------------

ALL = ("states", "inputs", "outputs")  # the mLSTM has no convolution window
PARTS = MLSTMState._fields


def assert_state_equal(name, expected, got):
    assert isinstance(got, MLSTMState), f"{name}: got a {type(got).__name__}, expected an MLSTMState"
    for part, a, b in zip(PARTS, expected, got):
        assert_equal(f"{name}, part {part}", a, b)


def state_in(mixer, call):
    """The state call `call` started from, as its kernel received it."""
    x = mixer.calls[call].kernel_calls[0].inputs
    return MLSTMState(x["c_initial"], x["n_initial"], x["m_initial"])


def reference_states(mixer, call):
    """Per-token states of `call`, recomputed in float64 from the call's recorded kernel inputs."""
    x = mixer.calls[call].kernel_calls[0].inputs
    return mlstm_reference(
        **{k: x[k] for k in ("query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial")}
    )[1]


family, model = family_fixtures(FAMILIES)


def test_states_equal_float64_reference_at_prompt_and_decode_steps(model):
    w = watched_greedy(model, ALL, T, 4)
    for mixer in w.mixers:
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        for call in range(4):
            reference, kept = reference_states(mixer, call), mixer.calls[call].states
            for part, ref, got in zip(PARTS, reference, kept):
                close(f"{mixer} call {call} part {part}", ref, got)


def test_a_replacing_hook_is_a_write_and_a_read_only_hook_sees_the_kept_states(model):
    ids = random_ids(2, T)
    seen = {}
    with rh.watch(model, keep=ALL) as w:
        w.mixers[1].register_state_hook(lambda m, c, t, s: seen.setdefault(t, MLSTMState(*(p.clone() for p in s))))
        logits_of(model, ids)
    for t, state in seen.items():
        assert_state_equal(f"read-only hook at token {t}", w.mixers[1].state_after(t), state)
    halve = lambda s: MLSTMState(s.C * 0.5, s.n * 0.5, s.m)  # noqa: E731
    with rh.watch(model, keep=ALL) as hooked:
        hooked.mixers[0].register_state_hook(lambda m, c, t, s: halve(s), token=5)
        by_hook = logits_of(model, ids)
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, ids)
        value = halve(w.mixers[0].state_after(5))
    with rh.watch(model, keep=ALL) as written:
        written.mixers[0].set_state_after(5, value)
        by_write = logits_of(model, ids)
    assert_close("hook vs write", by_write, by_hook, rtol=0, atol=0)
    assert_state_equal("state after the hook", value, hooked.mixers[0].state_after(5))


def test_a_bad_replacement_names_the_part(model):
    ids = random_ids(2, T)
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: MLSTMState(s.C, s.n[:, :1], s.m), token=2)
        with pytest.raises(
            rh.InvalidValue,
            match=r"part 'n' with shape \(2, 1, 32\), expected \(2, 2, 32\)"
            r" \(axes: batch heads key_dim\)",
        ):
            logits_of(model, ids)
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: s.C, token=2)
        with pytest.raises(rh.InvalidValue, match="expected None or a MLSTMState"):
            logits_of(model, ids)
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match="expected a MLSTMState"):
            w.mixers[0].set_state_after(2, torch.zeros(2, 2, 32, 32))


def test_gradient_with_respect_to_a_state(model):
    """d metric / d state after token t, part by part: the kept state is the tensor the recurrence used."""
    ids = random_ids(1, T)
    token = 5
    with rh.watch(model, keep=ALL) as w:
        metric = model(ids, use_cache=False).logits[0, -1].logsumexp(-1)
    state = w.mixers[0].state_after(token)
    leaf = MLSTMState(*(part.detach().clone().requires_grad_() for part in state))
    with rh.watch(model, keep=ALL) as w:  # every layer through the token loop, as in the run above
        w.mixers[0].set_state_after(token, leaf)
        model(ids, use_cache=False).logits[0, -1].logsumexp(-1).backward()
    grads = torch.autograd.grad(metric, list(state))
    for part, through_leaf, through_kept in zip(PARTS, leaf, grads):
        assert through_leaf.grad.abs().max() > 0, f"no gradient reaches part {part}"
        assert_close(
            f"grad of kept part {part}",
            through_leaf.grad,
            through_kept,
            rtol=1e-4,
            atol=1e-6 * float(through_leaf.grad.abs().max()),
        )
    # and the gradient predicts a small change (finite differences along it, part by part). C feeds the
    # output through a ratio and a multi-head layer norm, so it is far from linear: the step is 1e-4 of
    # its norm. n's gradient is ~0 at init: where |n_tᵀq̂_t| wins the max it only rescales a head's output,
    # which the layer norm undoes; it is checked above against the leaf, not here.
    for part in (0, 2):
        step = 1e-4 * state[part].norm() / grads[part].norm()
        values = []
        for sign in (1, -1):
            moved = [p.detach().clone() for p in state]
            moved[part] = moved[part] + sign * step * grads[part]
            with rh.watch(model) as w, torch.no_grad():
                w.mixers[0].set_state_after(token, MLSTMState(*moved))
                values.append(model(ids, use_cache=False).logits[0, -1].logsumexp(-1))
        slope = (values[0] - values[1]) / (2 * step)
        assert_close(
            f"directional derivative along part {PARTS[part]}", (grads[part] ** 2).sum(), slope, rtol=2e-2, atol=1e-9
        )


def test_every_kept_state_is_differentiable_as_one_stack(model):
    """With frozen weights, one backward gives the gradient at every token through `mix.states`."""
    ids = random_ids(1, T)
    model.requires_grad_(False)
    try:
        with rh.watch(model, keep=("states",)) as w:
            metric = model(ids, use_cache=False).logits[0, -1].logsumexp(-1)
        grads = torch.autograd.grad(metric, list(w.mixers[0].states))
    finally:
        model.requires_grad_(True)
    with rh.watch(model, keep=ALL) as w:
        metric = model(ids, use_cache=False).logits[0, -1].logsumexp(-1)
    one = torch.autograd.grad(metric, list(w.mixers[0].state_after(3)))
    for part, stacked, single in zip(PARTS, grads, one):
        assert stacked.shape[1] == T
        assert_close(f"part {part} at token 3", single, stacked[:, 3], rtol=1e-4, atol=1e-6 * float(single.abs().max()))


def first_mixer_outputs(model, ids, memory=None, token=None):
    """The first mLSTM layer's output, optionally with its whole memory written after `token`."""
    outputs = []
    with rh.watch(model, keep=ALL) as w, torch.no_grad():
        handle = w.mixers[0].module.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
        try:
            if memory is not None:
                w.mixers[0].set_memory_after(token, memory)
            model(ids, use_cache=False)
        finally:
            handle.remove()
    return outputs[0], w.mixers[0]


def test_one_part_of_the_state_is_not_the_whole_memory(model):
    """Run A's C after token t, with run B's own n and m, written into B (which shares A's tokens after t): the
    first layer's outputs after t are not A's (the whole-memory identity, C, n and m together:
    tests/kinds/test_contract.py)."""
    token = 6
    run_a = random_ids(2, T, seed=5)
    run_b = run_a.clone()
    run_b[:, : token + 1] = random_ids(2, token + 1, seed=6)
    out_a, mixer_a = first_mixer_outputs(model, run_a)
    assert mixer_a.layer == 0
    _, mixer_b = first_mixer_outputs(model, run_b)
    memory, own = mixer_a.memory_after(token), mixer_b.state_after(token)
    c_only, _ = first_mixer_outputs(model, run_b, rh.Memory(MLSTMState(memory.state.C, own.n, own.m), None), token)
    assert (c_only[:, token + 1 :] - out_a[:, token + 1 :]).abs().max() > 1e-3


def test_support_lists_the_values_and_the_limits(model):
    rows = [row for row in rh.support(model) if row.family is not None]
    assert [row.layer for row in rows] == [0, 1] and {row.kind for row in rows} == {"MatrixLSTM"}
    assert "windows" not in rows[0].available and "states" in rows[0].available
    assert set(rows[0].unavailable) == set(MatrixLSTM.LIMITS)
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, random_ids(2, T))
    values = w.mixers[0].values()
    assert sorted(values) == sorted(MatrixLSTM.VALUES)
    assert values["query"].shape == (2, T, 2, 32) and values["igate"].shape == (2, T, 2)
    with pytest.raises(rh.Unavailable, match="has no window"):
        w.mixers[0].window_after(0)
    with pytest.raises(rh.Unavailable, match="captured by each module when the model is built"):
        rh.route_kernels(model, "torch")


def test_train_mode_runs_the_train_kernel_through_the_loop(family):
    """config.mode "train": the forward calls `_train_fn` (chunk-wise only, seq % chunk_size == 0)."""
    torch.manual_seed(0)
    model = BUILDERS[family]()
    model.config.mode = "train"
    model.eval()
    ids = random_ids(2, 16)
    plain = logits_of(model, ids, use_cache=False)
    with rh.watch(model, keep=ALL) as w:
        close("keep states", plain, logits_of(model, ids, use_cache=False))  # all 16 tokens chunk-wise unwatched
    assert [c.kernel for c in w.mixers[0].calls] == ["_train_fn"]
    for part, ref, got in zip(PARTS, reference_states(w.mixers[0], 0), w.mixers[0].states):
        close(f"train-mode part {part}", ref, got)


def test_transformers_backward_through_a_cached_prompt_fails_and_the_token_loop_does_not(model):
    """transformers 5.24: a backward through a prompt of >= chunk_size tokens with use_cache=True raises
    (the chunk-wise kernel saves the cache's zero state for backward, then xLSTMModel copy_s the new state
    into that tensor). The token loop, which clones as the step kernel does, has no such problem; a watch
    whose every mixer runs it gives the gradients of use_cache=False. If this starts passing unwatched,
    transformers fixed it: drop the limit."""
    ids = random_ids(1, T)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(ids, use_cache=True).logits[0, -1].logsumexp(-1).backward()
    model.zero_grad(set_to_none=True)
    model(ids, use_cache=False).logits[0, -1].logsumexp(-1).backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with rh.watch(model, keep=("states",)):
        model(ids, use_cache=True).logits[0, -1].logsumexp(-1).backward()
    for name, grad in plain.items():
        assert_close(
            f"grad of {name}",
            grad,
            dict(model.named_parameters())[name].grad,
            rtol=1e-4,
            atol=1e-5 * float(grad.abs().max()),
        )


def test_a_prompt_longer_than_max_inference_chunksize_is_one_call_per_chunk(family):
    """An eval prompt longer than config.max_inference_chunksize runs chunk by chunk: each chunk is a call.
    With use_cache=False, transformers makes the cache the chunks share in bf16 (transformers bug 7): the
    chunks after the first continue from the bf16-rounded state, and the watch changes nothing of that."""
    model = build(family)
    whole = logits_of(model, random_ids(2, T), use_cache=False)
    model.config.max_inference_chunksize = 5
    ids = random_ids(2, T)
    with rh.watch(model, keep=ALL) as w:  # use_cache=True: a float32 cache, no rounding
        close("chunks over a float32 cache vs one forward", whole, logits_of(model, ids))
    assert [c.tokens for c in w.mixers[0].calls] == [5, 5, 3] and state_in(w.mixers[0], 1).C.dtype == torch.float32
    plain = logits_of(model, ids, use_cache=False)
    assert (plain - whole).abs().max() > 1e-4, "bug 7 is gone: drop the max_inference_chunksize limit"
    with rh.watch(model, keep=ALL) as w:
        close("keep states", plain, logits_of(model, ids, use_cache=False))
    mixer = w.mixers[0]
    assert [c.tokens for c in mixer.calls] == [5, 5, 3] and [c.index for c in mixer.calls] == [0, 1, 2]
    assert state_in(mixer, 1).C.dtype == torch.bfloat16
    assert_state_equal(
        "chunk 2 continued from the last state of chunk 1, rounded to bf16",
        MLSTMState(*(p.to(torch.bfloat16) for p in mixer.state_after(-1, call=0))),
        state_in(mixer, 1),
    )
    seen = []
    module = mixer.module
    handle = rh.register_state_hook(module, lambda m, c, t, s: seen.append(c), token=-1)
    try:
        logits_of(model, ids, use_cache=False)
    finally:
        handle.remove()
    assert seen == [0, 1, 2], "a chunk over a cached state was taken for a prompt"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_decode_hooks_leave_generate_unchanged(family, dtype):
    """In bf16 and fp16, a hook at every decode step runs the token loop there, the step kernel's bits: greedy
    generate is unchanged. (A watched prompt runs the loop in float32 where transformers' chunk-wise kernel
    computes in the model dtype: its logits move by less than transformers' own prompt-versus-token-by-token
    difference, measured here as the yardstick, within twice it.)"""
    model = build(family).to(dtype)
    ids = random_ids(2, T)
    plain = greedy(model, ids, 6)
    with rh.watch(model) as w:
        for mixer in w.mixers:
            mixer.register_state_hook(lambda m, c, t, s: MLSTMState(*(p.clone() for p in s)), call=slice(1, None))
        assert_equal("tokens, hooks at every decode step", plain, greedy(model, ids, 6))
    prompt = logits_of(model, ids)
    cache = None
    one_by_one = []
    with torch.no_grad():
        for t in range(T):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            one_by_one.append(out.logits)
    yardstick = (torch.cat(one_by_one, dim=1).float() - prompt.float()).abs().max()
    with rh.watch(model, keep=("states",)):
        watched = logits_of(model, ids)
    assert (watched.float() - prompt.float()).abs().max() <= 2 * yardstick  # measured: 0.76 (bf16), 1.07 (fp16)


def test_a_patching_sweep_cell_is_the_memory_write_it_stands_for(model):
    """rh.patching_sweep over the three-part memory: a cell equals one forward with that write."""
    clean = random_ids(1, 10, seed=1)
    corrupt = clean.clone()
    corrupt[0, 3] = (clean[0, 3] + 5) % 128
    metric = lambda logits: logits[:, -1, 7]  # noqa: E731
    sweep = rh.patching_sweep(model, clean[0], corrupt[0], metric, progress=False, forward_kwargs={"use_cache": False})
    assert sweep.values.shape == (2, 10)
    with rh.watch(model, keep=("states",)) as a, torch.no_grad():
        model(clean, use_cache=False)
    for layer, position in ((0, 5), (1, 3), (1, 8)):
        with rh.watch(model) as b, torch.no_grad():
            b.mixer(layer).set_memory_after(position, a.mixer(layer).memory_after(position))
            expected = metric(model(corrupt, use_cache=False).logits)[0]
        assert_close(f"cell ({layer}, {position})", expected, sweep.values[layer, position], rtol=1e-5, atol=1e-6)
    # from the changed token on, up to the last but one (a write after the last token reaches no logit)
    assert (sweep.values[0, 3:-1] - sweep.values[0, 0]).abs().min() > 1e-3, "patching after the change did nothing"


def test_with_the_xlstm_package_the_model_is_refused_with_the_reason(monkeypatch, request):
    """The xlstm package is not installed here; with it, transformers builds xlstm's mLSTMBlock (as the
    xLSTMBlock of modeling_xlstm), which the kind cannot watch. The registry then lists that class as
    unsupported, and a watch names it with the reason. Simulated: the availability check, and a module of
    that class name in that modeling module."""
    import importlib

    import transformers.utils
    from torch import nn

    import recurrent_hooks.registry as registry

    assert (
        not registry._external_xlstm()
        and not importlib.import_module("transformers.models.xlstm.modeling_xlstm").external_xlstm
    )
    assert registry._external_xlstm_rows() == ()
    monkeypatch.setattr(transformers.utils, "is_xlstm_available", lambda: True)
    (row,) = registry._external_xlstm_rows()  # the row UNSUPPORTED holds then
    reason = row.reason
    assert row.mixer_class == "xLSTMBlock" and "uninstall xlstm" in reason
    registry.register(row)
    request.addfinalizer(lambda: registry.unregister(row))
    block = type("xLSTMBlock", (nn.Module,), {"__module__": "transformers.models.xlstm.modeling_xlstm"})
    model = nn.Sequential(block())
    with pytest.raises(rh.Unavailable, match=re.escape(f"xLSTMBlock ({reason})")):
        with rh.watch(model):
            pass
    assert rh.support(model)[0].unavailable == {"everything": reason}
