"""Model-level behaviour of the kinds whose mixers carry a state and a convolution window through module-global
kernels: one parametrized matrix, tiny random-weight models.

Each test builds its family's tiny model (tests/helpers/_models.py) and checks what is particular to these kinds: states
equal to the float64 reference, conv windows as the kernel's last inputs and the fast paths. The
contract every family meets (parity, generate, hooks, writes, the whole memory, gradients, checkpointing,
left padding, bindings) is written once in tests/kinds/test_contract.py.
"""

import pytest
import torch
from _compare import assert_close, assert_close_per_call
from _kernel_references import REFERENCES
from _models import build, random_ids
from _runs import sparse_generate, watched_greedy

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.runners as rh_busy

ALL = ("states", "windows", "inputs", "outputs")  # every state and window, and the kernels' arguments and results
T = 13  # not a multiple of anything


# The matrix covers the kinds whose mixers carry a state and a convolution window through module-global
# kernels; each other kind has a test file of its own with the same checks (tests/kinds/test_<kind>.py).
FAMILIES = [name for name in rh.FAMILIES if rh.FAMILIES[name].kind in REFERENCES]


def reference_states(mixer: rh.RecurrentMixer, call: int) -> torch.Tensor:
    """Per-token states of `call`, recomputed in float64 from the call's recorded kernel inputs."""
    parts = [REFERENCES[type(mixer)](part) for part in mixer.calls[call].kernel_calls]
    return parts[0] if len(parts) == 1 else torch.stack(parts, dim=2)


def state_in(mixer: rh.RecurrentMixer, call: int) -> torch.Tensor:
    """The state call `call` started from, as its kernel received it (heads stacked for per-head mixers)."""
    record = mixer.calls[call]
    name = type(mixer).kernel(record.kernel).state_in
    states = [part.inputs[name] for part in record.kernel_calls]
    return states[0] if len(states) == 1 else torch.stack(states, dim=1)


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
    w = watched_greedy(model, ALL, T, 4)
    for mixer in w.mixers:
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        for call in range(4):
            assert_close(
                f"{mixer} call {call}", reference_states(mixer, call), mixer.calls[call].states, rtol=1e-4, atol=1e-6
            )


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
    windows = [padded[..., size + p + 1 - size : size + p + 1] for p in range(length - record.tokens, length)]
    return torch.stack(windows, dim=1)


def test_conv_windows_are_the_last_inputs_at_prompt_and_decode_steps(model):
    w = watched_greedy(model, ALL, T, 3)
    for mixer in w.mixers:
        for call in range(3):
            assert_close(
                f"{mixer} call {call} conv windows",
                conv_window_reference(mixer, call),
                mixer.calls[call].windows,
                rtol=0,
                atol=0,
            )


# -- fast paths against the token loop ---------------------------------------------------------------------------


def _sparse_run(model, ids, fast, monkeypatch):
    """Writes, hooks and kept states at a few tokens of the prompt and at a decode step, through one path (`fast`:
    the fixed rule, segments; the cost model picks the token loop at these tiny dims. Else the token loop)."""
    paths = rh.Paths(rule="fixed") if fast else rh.Paths(rule="loop")
    segmented = []
    real = rh_busy.run_in_segments
    monkeypatch.setattr(rh_busy, "run_in_segments", lambda *a: segmented.append(1) or real(*a))
    keep = {"states": [2, 7, -1], "windows": [7], "inputs": None}
    with rh.watch(model, keep=keep, paths=paths) as w, torch.no_grad():
        mixer = w.mixers[0]
        model(ids)
        value = mixer.state_after(7) * 0.5
        window = mixer.window_after(7) * 2
    return (*sparse_generate(model, ids, keep, paths, value, window), segmented)


def test_sparse_fast_path_equals_the_token_loop(model, monkeypatch):
    """Same outputs, kept states, hook inputs and cache contents whether sparse calls run in segments or not."""
    ids = random_ids(2, T)
    fast, fast_out, fast_seen, segmented = _sparse_run(model, ids, True, monkeypatch)
    slow, slow_out, slow_seen, unsegmented = _sparse_run(model, ids, False, monkeypatch)
    assert not unsegmented
    if type(fast.mixers[0]).kernel_for("prompt").segments is not None:
        assert segmented, "the sparse call did not take the fast path"
    assert_close_per_call("logits", slow_out.logits, fast_out.logits, rtol=1e-4, atol=1e-5)
    assert_close("hook inputs", torch.tensor(slow_seen), torch.tensor(fast_seen), rtol=1e-4, atol=1e-7)
    for a, b in zip(slow.mixers, fast.mixers):
        for call in range(4):
            for token in (2, 7, -1) if call == 0 else (0,):
                expected = a.state_after(token, call)
                assert_close(
                    f"{a} call {call} state after {token}",
                    expected,
                    b.state_after(token, call),
                    rtol=1e-4,
                    atol=1e-6 * _scale(expected),
                )
            if call:  # what the cache handed to the decode step
                expected = state_in(a, call)
                assert_close(
                    f"{a} call {call} state in", expected, state_in(b, call), rtol=1e-4, atol=1e-6 * _scale(expected)
                )
                expected = a.calls[call].conv.inputs["conv_state"]
                assert_close(
                    f"{a} call {call} window in",
                    expected,
                    b.calls[call].conv.inputs["conv_state"],
                    rtol=1e-4,
                    atol=1e-6 * _scale(expected),
                )


def _scale(x):
    """The largest magnitude of `x` (at least 1): float32 rounding in a sum of such values is relative to it, also
    where the sum cancels to near 0 (falcon_h1's windows reach 100: an element near 0 was off by 2e-6)."""
    return max(1.0, float(x.abs().max())) if isinstance(x, torch.Tensor) else 1.0


def test_every_state_kept_chunkwise_equals_the_token_loop(model, monkeypatch):
    """keep=ALL without gradients takes the chunk-wise path where a kind has one (with a hook at one
    token, in segments around it): same outputs, states, hook inputs and cache as the token loop."""
    ids = random_ids(2, 70)
    chunkwise = []
    real = rh_busy.run_in_segments
    monkeypatch.setattr(rh_busy, "run_in_segments", lambda *a: chunkwise.append(bool(a[-1])) or real(*a))
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
        assert_close(
            f"{a} cached state",
            slow_out.past_key_values.get_recurrent_state(a.layer),
            fast_out.past_key_values.get_recurrent_state(b.layer),
            rtol=1e-4,
            atol=1e-6,
        )
