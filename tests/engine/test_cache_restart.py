"""A watch never makes a forward fail that runs unwatched: Mamba-1's multi-token forward over a cache.

transformers' `mamba_selective_scan` takes no initial state, so in mamba, falcon_mamba, jamba and zamba a
forward of several tokens over a cached state starts the SSM state from zeros (its convolution window does
carry over). transformers' `test_decoder_model_past_with_large_inputs` runs exactly that: a prompt with
`use_cache=True`, then `model(next_tokens, past_key_values=cache, use_cache=True)` with several new tokens.
Watched with a no-op hook on every token, the forward runs as unwatched, the states reported are those the
model computed (from zeros), and one `RecurrentHooksWarning` per mixer and call says that it restarted.
"""

import warnings

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids
from _reference_ssm import selective_scan_reference

import recurrent_hooks as rh

FAMILIES = ["jamba", "zamba"]
PROMPT, NEW = 7, 3  # prompt tokens, then new tokens over the cache (transformers' test uses 3)
F64 = dict(rtol=1e-5, atol=1e-6)  # the library's float32 states against a float64 reference
ALL = ("states", "inputs", "outputs")


def _part_states(part, initial_state=None):
    """The float64 states of one recorded prompt-kernel call (Algorithm 2), from `initial_state` (zeros if None)."""
    x = part.inputs
    t = lambda v: v.transpose(1, 2)  # noqa: E731  channel-major -> token-major
    return selective_scan_reference(
        t(x["hidden_states"]),
        t(x["dt"]),
        x["A"],
        t(x["B"]),
        t(x["C"]),
        dt_bias=x["delta_bias"],
        softplus=x["delta_softplus"],
        initial_state=initial_state,
    )[1]


def _reference(mixer, call, initial_state=None):
    """Per-token float64 states of `call` (heads stacked after seq for zamba), from `initial_state`."""
    parts = mixer.calls[call].kernel_calls
    if len(parts) == 1:
        return _part_states(parts[0], initial_state)
    heads = [_part_states(p, None if initial_state is None else initial_state[:, h]) for h, p in enumerate(parts)]
    return torch.stack(heads, dim=2)


def _continue(model, ids, before=None):
    """transformers' test: a prompt with a cache, then NEW tokens over it; `before(cache)` runs in between."""
    with torch.no_grad():
        cache = model(ids[:, :PROMPT], use_cache=True).past_key_values
        if before is not None:
            before(cache)
        return model(ids[:, PROMPT:], cache=cache, use_cache=True).logits, cache


def _restarts(caught):
    return [w for w in caught if issubclass(w.category, rh.RecurrentHooksWarning) and "restart" in str(w.message)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_no_op_hook_runs_a_multi_token_forward_over_the_cache_as_unwatched(family):
    """The watched forward gives the unwatched logits, warns once per mixer for the continuation only, and
    its kept states are the model's own: a scan from zeros, not from the cached state."""
    model, ids = build(family), random_ids(2, PROMPT + NEW)
    plain, _ = _continue(model, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rh.watch(model, keep=ALL) as w:
            for mixer in w.mixers:
                mixer.register_state_hook(lambda m, c, t, s: None)
            watched, cache = _continue(model, ids)
    assert_close("continuation logits, watched", plain, watched, rtol=1e-6, atol=1e-6)
    restarts = _restarts(caught)
    assert len(restarts) == len(w.mixers), [str(r.message) for r in restarts]
    for mixer, warning in zip(w.mixers, restarts):
        message = str(warning.message)
        assert repr(mixer) in message and "call 1" in message and "multi-token continuation" in message, message
        assert mixer.calls[1].tokens == NEW and mixer.calls[1].kernel == rh.SelectiveScan.kernel_for("prompt").name
        # the states reported are those the model computed: from zeros ...
        assert_close(f"{mixer} call 1 states", _reference(mixer, 1), mixer.calls[1].states, **F64)
        assert_close(
            f"{mixer} cached state",
            mixer.state_after(-1, call=1),
            cache.get_recurrent_state(mixer.layer).float(),
            rtol=0,
            atol=0,
        )
        # ... which is not where the cached state would have led (the restart is real at these dims)
        continued = _reference(mixer, 1, mixer.state_after(-1, call=0))
        assert (continued - mixer.calls[1].states.double()).abs().max() > 1e-3, f"{mixer}: no restart to see"


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_states_alone_and_an_idle_watch(family):
    """Keeping the states (no hook) runs and warns too; an idle watch runs the kernel untouched and says nothing."""
    model, ids = build(family), random_ids(2, PROMPT + NEW)
    plain, _ = _continue(model, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rh.watch(model, keep={"states": [0, -1]}) as w:
            kept, _ = _continue(model, ids)
        with rh.watch(model):
            idle, _ = _continue(model, ids)
    assert len(_restarts(caught)) == len(w.mixers)
    assert_close("logits, states kept", plain, kept, rtol=1e-6, atol=1e-6)
    assert_close("logits, idle", plain, idle, rtol=0, atol=0)
    assert w.mixers[0].state_after(-1, call=1).shape == w.mixers[0].state_after(-1, call=0).shape


@pytest.mark.parametrize("family", FAMILIES)
def test_a_write_into_a_restarted_call_is_applied_from_where_the_model_started(family):
    """set_state_after(1, value, call=1): the continuation's tokens 0..1 are unchanged, token 2 continues from
    `value` (float64 reference from `value`), and the cache holds the state the written scan ended with."""
    model, ids = build(family), random_ids(2, PROMPT + NEW)
    plain, _ = _continue(model, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rh.watch(model, keep=ALL) as w:
            mixer = w.mixers[0]
            value = torch.full_like(mixer.module.A_log.float().exp(), 0.5)  # [d_inner | heads head_dim, d_state]
            value = value.reshape(1, *_state_shape(mixer)).expand(2, *_state_shape(mixer)).contiguous()
            mixer.set_state_after(1, value, call=1)
            written, cache = _continue(model, ids)
    assert len(_restarts(caught)) >= 1
    assert_close("tokens 0..1 unchanged", plain[:, :2], written[:, :2], rtol=1e-6, atol=1e-6)
    assert (plain[:, 2:] - written[:, 2:]).abs().max() > 1e-3, "the write changed nothing"
    record = mixer.calls[1]
    assert_close("state after the written token", value, mixer.state_after(1, call=1), rtol=0, atol=0)
    # from token 2 on the states continue from `value`: the reference run on tokens 2.. from it
    states = record.states
    for h, part in enumerate(record.kernel_calls):
        x = part.inputs
        t = lambda v: v.transpose(1, 2)[:, 2:]  # noqa: E731
        start = value if len(record.kernel_calls) == 1 else value[:, h]
        expected = selective_scan_reference(
            t(x["hidden_states"]),
            t(x["dt"]),
            x["A"],
            t(x["B"]),
            t(x["C"]),
            dt_bias=x["delta_bias"],
            softplus=x["delta_softplus"],
            initial_state=start,
        )[1]
        got = states[:, 2:] if len(record.kernel_calls) == 1 else states[:, 2:, h]
        assert_close(f"{mixer} head {h} states after the write", expected, got, **F64)
    assert_close(
        "cache after the written call",
        mixer.state_after(-1, call=1),
        cache.get_recurrent_state(mixer.layer).float(),
        rtol=0,
        atol=0,
    )


def _state_shape(mixer):
    module = mixer.module
    d_state = module.A_log.shape[-1]
    if isinstance(mixer, rh.PerHeadSelectiveScan):
        return (module.n_mamba_heads, module.mamba_head_dim, d_state)
    return (module.intermediate_size, d_state)


@pytest.mark.parametrize("family", FAMILIES)
def test_support_describes_the_restart(family):
    row = rh.support(build(family))[0]
    text = row.unavailable["multi-token continuation"]
    assert "from zero" in text and "RecurrentHooksWarning" in text, text


@pytest.mark.full  # 27 s of compiling a zamba model, for the rare compiled continuation
def test_compiled_a_multi_token_forward_over_the_cache_runs_and_warns_when_the_graph_runs():
    """Under torch.compile the restart is told when the graph runs (it raised while tracing before): the
    compiled continuation gives the unwatched logits, one warning per mixer names call 1, and the kept state
    is the model's own, from zeros."""
    model, ids = build("zamba"), random_ids(2, PROMPT + NEW)
    plain, _ = _continue(model, ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rh.watch(model, keep={"states": [-1], "inputs": None}) as w, torch.no_grad():
            cache = model(ids[:, :PROMPT], use_cache=True).cache
            got = compiled(ids[:, PROMPT:], cache=cache).logits
    assert_close("compiled continuation logits", plain, got, rtol=1e-6, atol=1e-6)
    restarts = _restarts(caught)
    assert [str(r.message).split(" (")[0] for r in restarts] == [f"{m}, call 1" for m in w.mixers], [
        str(r.message) for r in restarts
    ]
    for mixer in w.mixers:
        assert_close(f"{mixer} last state of call 1", _reference(mixer, 1)[:, -1], mixer.state_after(-1, call=1), **F64)
