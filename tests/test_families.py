"""Model-level behaviour of the kinds whose mixers carry a state and a convolution window through module-global
kernels: one parametrized matrix, tiny random-weight models.

Each test builds its family's tiny model (tests/_models.py) and checks one promise of the library: states
equal to the float64 reference, split invariance, write semantics (state and window), left padding, gradients
of a kept state, checkpointing, the whole memory and the fast paths. The kind-agnostic part of the bar (parity,
greedy generate under hooks, the call counter, a hook-only watch, the input gradient, bindings restored) is
written once for every family in tests/test_every_family.py.
"""

import math

import pytest
import torch

import recurrent_hooks as rh
import recurrent_hooks.engine.dispatch as rh_dispatch
from _compare import assert_close, assert_equal
from _models import PAD, build, random_ids
from _runs import greedy, logits_of
from _reference import gated_delta_rule_reference, kimi_delta_rule_reference
from _reference_ssm import selective_scan_reference, ssd_reference

ALL = ("states", "conv_states", "inputs", "outputs")  # every state and window, and the kernels' arguments and results
T = 13  # not a multiple of anything


def _gated_delta_part(part):
    x = part.inputs
    reference = gated_delta_rule_reference if x["g"].dim() == 3 else kimi_delta_rule_reference
    return reference(x["query"], x["key"], x["value"], x["g"], x["beta"], initial_state=x["initial_state"],
                     normalize_qk=x["use_qk_l2norm_in_kernel"])[1]


def _selective_scan_part(part):
    x = part.inputs
    if part.kernel == rh.SelectiveScan.kernel_for("prompt").name:
        t = lambda v: v.transpose(1, 2)  # noqa: E731  channel-major -> token-major
        return selective_scan_reference(t(x["hidden_states"]), t(x["dt"]), x["A"], t(x["B"]), t(x["C"]),
                                        dt_bias=x["delta_bias"], softplus=x["delta_softplus"])[1]
    return selective_scan_reference(x["hidden_states"][:, None], x["dt"][:, None], x["A"], x["B"][:, None],
                                    x["C"][:, None], dt_bias=x["dt_bias"], softplus=x["dt_softplus"],
                                    initial_state=x["state"])[1]


def _state_space_part(part):
    x = part.inputs
    if part.kernel == rh.StateSpace.kernel_for("prompt").name:
        return ssd_reference(x["hidden_states"], x["dt"], x["A"], x["B"], x["C"], dt_bias=x["dt_bias"],
                             softplus=x["dt_softplus"], dt_limit=x["dt_limit"], initial_state=x["initial_states"])[1]
    # the decode kernel gets the per-head parameters expanded over head_dim: channel 0 is the head's
    return ssd_reference(x["hidden_states"][:, None], x["dt"][:, None, :, 0], x["A"][:, 0, 0], x["B"][:, None],
                         x["C"][:, None], dt_bias=None if x["dt_bias"] is None else x["dt_bias"][:, 0],
                         softplus=x["dt_softplus"], dt_limit=(-math.inf, math.inf), initial_state=x["state"])[1]


REFERENCES = {rh.GatedDeltaNet: _gated_delta_part, rh.KimiDeltaAttention: _gated_delta_part,
              rh.SelectiveScan: _selective_scan_part, rh.PerHeadSelectiveScan: _selective_scan_part,
              rh.StateSpace: _state_space_part}
# The matrix covers the kinds whose mixers carry a state and a convolution window through module-global
# kernels; each other kind has a test file of its own with the same checks (tests/test_<kind>.py).
FAMILIES = [name for name in rh.FAMILIES if rh.FAMILIES[name].kind in REFERENCES]


def reference_states(mixer: rh.RecurrentMixer, call: int) -> torch.Tensor:
    """Per-token states of `call`, recomputed in float64 from the call's recorded kernel inputs."""
    parts = [REFERENCES[type(mixer)](part) for part in mixer.calls[call].parts]
    return parts[0] if len(parts) == 1 else torch.stack(parts, dim=2)


def state_in(mixer: rh.RecurrentMixer, call: int) -> torch.Tensor:
    """The state call `call` started from, as its kernel received it (heads stacked for per-head mixers)."""
    record = mixer.calls[call]
    name = type(mixer).kernel(record.kernel).state_in
    states = [part.inputs[name] for part in record.parts]
    return states[0] if len(states) == 1 else torch.stack(states, dim=1)


def perturbation(state: torch.Tensor, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return state + torch.randn(state.shape, generator=gen) * (state.abs().max() + 1)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def shared_model(family):
    """One model per family for the whole file (the tests only read it; building one per test was a tenth of the
    file's time)."""
    return build(family)


@pytest.fixture
def model(shared_model):
    yield shared_model
    shared_model.zero_grad(set_to_none=True)
    assert not shared_model.training, "a test left the model in train mode"


def test_states_equal_float64_reference_at_prompt_and_decode_steps(model):
    """The kept state after every token equals the float64 recurrence over the call's own kernel inputs."""
    with rh.watch(model, keep=ALL) as w:
        greedy(model, random_ids(2, T), 4)
    for mixer in w.mixers:
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        for call in range(4):
            assert_close(f"{mixer} call {call}", reference_states(mixer, call), mixer.calls[call].states,
                         rtol=1e-4, atol=1e-6)


def test_decode_states_continue_the_prompt_states(model):
    """Split invariance: the state at decode step k is the state after token T+k-1 of one long prompt."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=ALL) as w:
        sequence = greedy(model, ids, 5)
    with rh.watch(model, keep=ALL) as whole:
        logits_of(model, sequence[:, :-1], use_cache=False)
    for mixer, long in zip(w.mixers, whole.mixers):
        decoded = torch.cat([c.states for c in mixer.calls], dim=1)
        assert_close(f"{mixer} prompt + decode vs one prompt", long.states, decoded, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("token", [0, 4, T - 1])
def test_write_changes_only_later_tokens_and_the_cache(model, token):
    ids = random_ids(2, T)
    plain = logits_of(model, ids)
    with rh.watch(model, keep=ALL) as w:
        mixer = w.mixers[0]
        logits_of(model, ids)
        value = perturbation(mixer.state_after(token))
    with rh.watch(model, keep=ALL) as w:
        mixer = w.mixers[0]
        mixer.set_state_after(token, value)
        with torch.no_grad():
            out = model(ids, use_cache=True)
    assert_close("logits at tokens <= t", plain[:, : token + 1], out.logits[:, : token + 1], rtol=1e-5, atol=1e-5)
    if token < T - 1:
        change = (out.logits[:, token + 1:] - plain[:, token + 1:]).abs().amax(dim=(0, 2))
        assert change.min() > 1e-6, f"a write at token {token} left later logits unchanged: {change}"
    assert_close("state after the write", value, mixer.state_after(token), rtol=0, atol=0)
    cache_state = out.past_key_values.get_recurrent_state(mixer.layer)
    assert_close("cache holds the continued state", mixer.states[:, -1], cache_state, rtol=0, atol=0)


def test_write_at_the_last_prompt_token_steers_generation(model):
    """A write after the last prompt token is what the first decode step continues from."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, ids)
        value = perturbation(w.mixers[0].state_after(-1))
    with rh.watch(model, keep=ALL) as w:
        w.mixers[0].set_state_after(T - 1, value)
        greedy(model, ids, 3)
    assert_close("decode step 1 started from the write", value, state_in(w.mixers[0], 1),
                 rtol=0, atol=0)


def test_write_at_a_decode_step(model):
    """A write at call k leaves the logits of calls <= k unchanged and changes the later ones."""
    ids = random_ids(2, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    plain = greedy(model, ids, 5, **kwargs)
    with rh.watch(model, keep=ALL) as w:
        greedy(model, ids, 5, **kwargs)
        value = perturbation(w.mixers[0].state_after(0, call=2))
    with rh.watch(model, keep=ALL) as w:
        w.mixers[0].set_state_after(0, value, call=2)
        steered = greedy(model, ids, 5, **kwargs)
    for step in range(3):
        assert_close(f"logits of call {step}", plain.logits[step], steered.logits[step], rtol=1e-5, atol=1e-5)
    change = max((plain.logits[step] - steered.logits[step]).abs().max() for step in range(3, 5))
    assert change > 1e-6, f"a write at decode call 2 changed no later logits ({change})"
    assert_close("call 3 continued from the write", value, state_in(w.mixers[0], 3),
                 rtol=0, atol=0)


def test_left_padded_batch(model):
    """A left-padded row computes the same states and logits as the same tokens alone."""
    pads = 4
    short = random_ids(1, T - pads, seed=3)
    full = random_ids(1, T, seed=4)
    ids = torch.cat([torch.cat([torch.full((1, pads), PAD), short], dim=1), full])
    mask = (ids != PAD).long()
    mask[1] = 1
    with rh.watch(model, keep=ALL) as w:
        padded = logits_of(model, ids, attention_mask=mask)
    with rh.watch(model, keep=ALL) as alone:
        single = logits_of(model, short)
    for mixer, ref in zip(w.mixers, alone.mixers):
        assert_close(f"{mixer} padded row states", ref.states[0], mixer.states[0, pads:], rtol=1e-4, atol=1e-6)
    assert_close("padded row logits", single[0], padded[0, pads:], rtol=1e-4, atol=1e-5)
    plain = greedy(model, ids, 4, attention_mask=mask)
    with rh.watch(model, keep=ALL):
        assert_equal("padded greedy generate, keep states", plain, greedy(model, ids, 4, attention_mask=mask))
    with rh.watch(model) as w:
        for mixer in w.mixers:
            mixer.register_state_hook(lambda m, c, t, s: None)
        assert_equal("padded greedy generate, hooks", plain, greedy(model, ids, 4, attention_mask=mask))


def test_gradient_with_respect_to_a_state(model):
    """d metric / d state after token t: the kept state is the tensor the recurrence used."""
    ids = random_ids(1, T)
    token = 5
    with rh.watch(model, keep=ALL) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    state = w.mixers[0].state_after(token)
    # the gradient through a leaf written at the same token
    leaf = state.detach().clone().requires_grad_()
    with rh.watch(model) as w:
        w.mixers[0].set_state_after(token, leaf)
        model(ids).logits[0, -1].logsumexp(-1).backward()
    grad = leaf.grad
    assert grad.abs().max() > 0
    if type(w.mixers[0]).KERNEL_PER_HEAD:  # documented: state_after stacks the heads' states, a new tensor
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(metric, state)
    else:  # the kept state is the tensor the recurrence used
        assert_close("grad of the kept state", grad, torch.autograd.grad(metric, state)[0], rtol=1e-4, atol=1e-7)
    # and the gradient predicts a small change of the state (finite difference along the gradient)
    eps = 1e-2 * state.norm() / grad.norm()  # a step of 1% of the state: small, yet well above float32 noise
    values = []
    for sign in (1, -1):
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].set_state_after(token, state.detach() + sign * eps * grad)
            values.append(model(ids).logits[0, -1].logsumexp(-1))
    slope = (values[0] - values[1]) / (2 * eps)
    assert_close("directional derivative", (grad * grad).sum(), slope, rtol=2e-2, atol=1e-6)


CHECKPOINTING = {"off": None, "reentrant": True, "non-reentrant": False}


@pytest.mark.one_per_kind
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_gradient_checkpointing_gives_the_gradients_of_the_plain_backward(model, checkpointing):
    """A recompute repeats its call: a write at call 0, a replacing hook and kept states give the same loss,
    parameter gradients and state gradients with checkpointing (reentrant or not) as without."""
    ids = random_ids(2, T)
    state = _kept_state(model, ids, token=3)
    write = perturbation(state, seed=2).detach()

    def backward(mode):
        model.train()
        model.zero_grad(set_to_none=True)
        if mode is None:
            model.activation_checkpointing_disable()
        else:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": mode})
        seen = []
        try:
            with rh.watch(model, keep={"states": [5, -1]}) as w:
                first, last = w.mixers[0], w.mixers[-1]
                first.set_state_after(3, write)
                last.register_state_hook(lambda m, c, t, s: s * 0.5, token=4)
                last.register_state_hook(lambda m, c, t, s: seen.append((c, t, m.recomputing)), token=6)
                loss = model(ids, use_cache=False).logits.square().mean()
                kept = first.state_after(5)
                if kept.requires_grad:
                    kept.retain_grad()  # reentrant: the forward ran without grad; its recompute retains it
                loss.backward()
            state_grad = None if type(first).KERNEL_PER_HEAD else first.state_after(5).grad
            assert [c.index for c in first.calls] == [0], "a recompute counted as a new call"
        finally:
            model.activation_checkpointing_disable()
            model.eval()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, state_grad, seen

    loss, grads, state_grad, seen = backward(None)
    got_loss, got_grads, got_state_grad, got_seen = backward(CHECKPOINTING[checkpointing])
    assert_close("loss", loss, got_loss, rtol=1e-6, atol=0)
    assert sorted(got_grads) == sorted(grads)
    scale = max(g.abs().max() for g in grads.values())
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, got_grads[name], rtol=1e-4, atol=1e-5 * scale)
    if state_grad is not None:
        assert state_grad.abs().max() > 0
        assert_close("grad of the kept state", state_grad, got_state_grad, rtol=1e-4, atol=1e-5 * state_grad.abs().max())
    # a read-only hook runs again in the recompute, with the same call and `recomputing` set
    assert seen and all(hook == (0, 6, False) for hook in seen)  # once per head for per-head kinds
    assert got_seen[:len(seen)] == seen
    recomputed = got_seen[len(seen):]  # zamba and zamba2 nest checkpointed layers: reentrant recomputes twice
    assert all(hook == (0, 6, True) for hook in recomputed)
    assert (len(recomputed) == 0) == (checkpointing == "off") and len(recomputed) % len(seen) == 0


def _kept_state(model, ids, token):
    with rh.watch(model, keep={"states": [token]}) as w, torch.no_grad():
        model(ids, use_cache=False)
    return w.mixers[0].state_after(token)


# -- the convolution window and the whole memory ---------------------------------------------------------------


def conv_window_reference(mixer: rh.RecurrentMixer, call: int) -> torch.Tensor:
    """The window after every token, rebuilt from the conv kernel's recorded inputs: the last K inputs."""
    record = mixer.calls[call]
    x = record.conv.inputs["hidden_states"]
    if "conv_state" in record.conv.inputs:  # decode: the cached window, then the new input
        x = torch.cat([record.conv.inputs["conv_state"], x], dim=-1)
    size = record.conv.inputs["weight"].shape[-1]
    padded = torch.nn.functional.pad(x, (size, 0))
    length = x.shape[-1]
    windows = [padded[..., size + p + 1 - size: size + p + 1] for p in range(length - record.tokens, length)]
    return torch.stack(windows, dim=1)


def test_conv_windows_are_the_last_inputs_at_prompt_and_decode_steps(model):
    with rh.watch(model, keep=ALL) as w:
        greedy(model, random_ids(2, T), 3)
    for mixer in w.mixers:
        for call in range(3):
            assert_close(f"{mixer} call {call} conv windows", conv_window_reference(mixer, call),
                         mixer.calls[call].conv_states, rtol=0, atol=0)


def test_conv_write_changes_only_later_tokens_and_the_cache(model):
    ids, token = random_ids(2, T), 5
    plain = logits_of(model, ids)
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, ids)
        value = perturbation(w.mixers[0].conv_state_after(token))
    with rh.watch(model, keep=ALL) as w:
        w.mixers[0].set_conv_state_after(token, value)
        with torch.no_grad():
            out = model(ids, use_cache=True)
    assert_close("logits at tokens <= t", plain[:, : token + 1], out.logits[:, : token + 1], rtol=1e-5, atol=1e-5)
    change = (out.logits[:, token + 1:] - plain[:, token + 1:]).abs().amax(dim=(0, 2))
    assert change.max() > 1e-6, f"a conv write at token {token} left later logits unchanged: {change}"
    mixer = w.mixers[0]
    assert_close("conv window after the write", value, mixer.conv_state_after(token), rtol=0, atol=0)
    cached = out.past_key_values.get_conv_state(mixer.layer)
    assert_close("cache holds the continued window", mixer.conv_states[:, -1].to(cached.dtype), cached, rtol=0, atol=0)


def test_conv_write_at_a_decode_step(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=ALL) as w:
        greedy(model, ids, 4)
        value = perturbation(w.mixers[0].conv_state_after(0, call=1))
    with rh.watch(model, keep=ALL) as w:
        w.mixers[0].set_conv_state_after(0, value, call=1)
        greedy(model, ids, 4)
    assert_close("call 2 read the written window", value, w.mixers[0].calls[2].conv.inputs["conv_state"],
                 rtol=0, atol=0)


def first_mixer_outputs(model, ids, mixer_module, memory=None, token=None):
    """The first recurrent layer's module output, optionally with its whole memory written after `token`."""
    outputs = []
    handle = mixer_module.register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                                else out))
    try:
        with rh.watch(model, keep=ALL) as w, torch.no_grad():
            if memory is not None:
                w.mixers[0].set_memory_after(token, memory)
            model(ids, use_cache=False)
    finally:
        handle.remove()
    return outputs[0], w.mixers[0]


def test_writing_the_whole_memory_makes_a_layer_continue_as_in_the_other_run(model):
    """Record run A's memory (state and conv window) after token t of the first recurrent layer, write it
    into run B, which shares A's tokens after t: the layer's outputs after t equal A's. The identity shows
    that the memory is complete: nothing else carries over from tokens <= t."""
    token = 6
    run_a = random_ids(2, T, seed=5)
    run_b = run_a.clone()
    run_b[:, : token + 1] = random_ids(2, token + 1, seed=6)
    with rh.watch(model) as w:
        first = w.mixers[0]
    assert first.layer == 0, f"the first recurrent mixer is at layer {first.layer}: its inputs are not only tokens"
    out_a, mixer_a = first_mixer_outputs(model, run_a, first.module)
    out_b, _ = first_mixer_outputs(model, run_b, first.module)
    patched, _ = first_mixer_outputs(model, run_b, first.module, mixer_a.memory_after(token), token)
    assert (out_b[:, token + 1:] - out_a[:, token + 1:]).abs().max() > 1e-6, "the two runs did not differ"
    assert_close("layer output after t, memory written", out_a[:, token + 1:], patched[:, token + 1:],
                 rtol=1e-4, atol=1e-6)
    # the recurrent state alone is not the whole memory: the conv window still holds B's last inputs
    own_window = _conv_window_of(model, run_b, token)
    state_only, _ = first_mixer_outputs(model, run_b, first.module,
                                        rh.Memory(mixer_a.state_after(token), own_window), token)
    assert (state_only[:, token + 1:] - out_a[:, token + 1:]).abs().max() > 1e-6


def _conv_window_of(model, ids, token):
    with rh.watch(model, keep=ALL) as w, torch.no_grad():
        model(ids, use_cache=False)
    return w.mixers[0].conv_state_after(token)


# -- fast paths against the token loop ---------------------------------------------------------------------------


def _sparse_run(model, ids, fast, monkeypatch):
    """Writes, hooks and kept states at a few tokens of the prompt and at a decode step, through one path (`fast`:
    the fixed rule, segments; the cost model picks the token loop at these tiny dims. Else the token loop)."""
    paths = rh.Paths(rule="fixed") if fast else rh.Paths(rule="loop")
    segmented = []
    real = rh_dispatch._run_in_segments
    monkeypatch.setattr(rh_dispatch, "_run_in_segments", lambda *a: segmented.append(1) or real(*a))
    seen = []
    with rh.watch(model, keep={"states": [2, 7, -1], "conv_states": [7], "inputs": None}, paths=paths) as w, \
            torch.no_grad():
        mixer = w.mixers[0]
        model(ids)
        value = mixer.state_after(7) * 0.5
        window = mixer.conv_state_after(7) * 2
    with rh.watch(model, keep={"states": [2, 7, -1], "conv_states": [7], "inputs": None}, paths=paths) as w, \
            torch.no_grad():
        w.mixers[0].set_state_after(7, value)
        w.mixers[0].set_conv_state_after(7, window)
        w.mixers[-1].register_state_hook(lambda m, c, t, s: seen.append(float(s.norm())) or s * 0.9, token=[3, -2])
        w.mixers[0].set_state_after(0, value, call=2)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD, output_logits=True,
                             return_dict_in_generate=True)
    return w, out, seen, segmented


def test_sparse_fast_path_equals_the_token_loop(model, monkeypatch):
    """Same outputs, kept states, hook inputs and cache contents whether sparse calls run in segments or not."""
    ids = random_ids(2, T)
    fast, fast_out, fast_seen, segmented = _sparse_run(model, ids, True, monkeypatch)
    slow, slow_out, slow_seen, unsegmented = _sparse_run(model, ids, False, monkeypatch)
    assert not unsegmented
    if type(fast.mixers[0]).kernel_for("prompt").segments is not None:
        assert segmented, "the sparse call did not take the fast path"
    for step, (a, b) in enumerate(zip(slow_out.logits, fast_out.logits)):
        assert_close(f"logits of call {step}", a, b, rtol=1e-4, atol=1e-5)
    assert_close("hook inputs", torch.tensor(slow_seen), torch.tensor(fast_seen), rtol=1e-4, atol=1e-7)
    for a, b in zip(slow.mixers, fast.mixers):
        for call in range(4):
            for token in (2, 7, -1) if call == 0 else (0,):
                assert_close(f"{a} call {call} state after {token}", a.state_after(token, call),
                             b.state_after(token, call), rtol=1e-4, atol=1e-6)
            if call:  # what the cache handed to the decode step
                assert_close(f"{a} call {call} state in", state_in(a, call), state_in(b, call), rtol=1e-4, atol=1e-6)
                assert_close(f"{a} call {call} window in", a.calls[call].conv.inputs["conv_state"],
                             b.calls[call].conv.inputs["conv_state"], rtol=1e-4, atol=1e-6)


def test_every_state_kept_chunkwise_equals_the_token_loop(model, monkeypatch):
    """keep=ALL without gradients takes the chunk-wise path where a kind has one (with a hook at one
    token, in segments around it): same outputs, states, hook inputs and cache as the token loop."""
    ids = random_ids(2, 70)
    chunkwise = []
    real = rh_dispatch._run_in_segments
    monkeypatch.setattr(rh_dispatch, "_run_in_segments", lambda *a: chunkwise.append(bool(a[-1])) or real(*a))
    runs = {}
    for fast in (True, False):  # the fixed rule: chunk-wise (the cost model may pick the token loop at tiny dims)
        seen = []
        with rh.watch(model, keep=ALL, paths=rh.Paths(rule="fixed" if fast else "loop")) as w, torch.no_grad():
            w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append(s.clone()) or s * 0.5, token=40)
            out = model(ids, use_cache=True)
        runs[fast] = (w, out, seen)
    (fast, fast_out, fast_seen), (slow, slow_out, slow_seen) = runs[True], runs[False]
    segments = type(fast.mixers[0]).kernel_for("prompt").segments
    assert any(chunkwise) == (segments is not None and segments.all_states is not None)
    assert_close("logits", slow_out.logits, fast_out.logits, rtol=1e-4, atol=1e-5)
    assert_close("hook input", torch.stack(slow_seen), torch.stack(fast_seen), rtol=1e-4, atol=1e-6)
    for a, b in zip(slow.mixers, fast.mixers):
        assert_close(f"{a} every state", a.states, b.states, rtol=1e-4, atol=1e-6)
        assert_close(f"{a} cached state", slow_out.past_key_values.get_recurrent_state(a.layer),
                     fast_out.past_key_values.get_recurrent_state(b.layer), rtol=1e-4, atol=1e-6)
