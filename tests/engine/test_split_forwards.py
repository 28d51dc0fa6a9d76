"""A forward that transformers splits over several kernel calls is one call: over a cache that records its past
(`cache.activate_past_recording(recurrent_states_to_keep=N)`, which assisted and prompt-lookup decoding turn on),
transformers 5.25 runs a forward's first tokens through the prompt kernel and its last N as one-token decode-kernel
steps. Token t of the call is the forward's token t across them: hooks, writes and kept states equal the same
forward over a cache that records nothing, per kind, and an idle watch records the call's tokens. Assisted and
prompt-lookup decoding under a watch generate what they generate unwatched. transformers 5.24 has no such cache:
these tests need 5.25's."""

import contextlib
import copy

import pytest
import torch
from _compare import assert_close
from _models import build

import recurrent_hooks as rh
from recurrent_hooks.engine.binding import upstream

pytestmark = pytest.mark.skipif(
    not upstream.is_at_least(5, 25), reason="transformers 5.24 keeps no intermediate recurrent states (5.25 added them)"
)

# one family per kind whose modeling code splits a forward over a recording cache (transformers 5.25)
SPLITTING = ["qwen3_5", "kimi_linear", "mamba2", "falcon_h1", "mamba"]
PROMPT, CONTINUATION = 5, 4


def _cache_after_prompt(model, ids):
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return getattr(out, "cache", None) or out.past_key_values


def _watched_continuation(model, cache, ids, *, hooks=True, write=None):
    """One forward of `ids` over `cache` in a watch that keeps every state, calls a hook at every token (recording
    (call, token) and the state) and, with `write`, replaces the state after token 1 by it: the logits, the kept
    states of the first mixer, the hook's events and the call's record."""
    seen = []
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        mixer = w.mixers[0]
        if hooks:
            mixer.register_state_hook(lambda m, c, t, s: seen.append((c, t, s.clone())) and None, call=0)
        if write is not None:
            mixer.set_state_after(1, write, call=0)
        logits = model(ids, cache=cache, use_cache=True).logits
    record = mixer.calls[0]
    return logits, record.states, seen, record


def _continuation_model(family):
    model = build(family)
    prompt = torch.randint(3, 100, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(3, 100, (2, CONTINUATION), generator=torch.Generator().manual_seed(2))
    return model, _cache_after_prompt(model, prompt), ids


def _reference(family, model, cache, ids, write):
    """The same continuation over a cache that records nothing; for Mamba-1, whose prompt scan takes no cached state
    (transformers' own limit: a multi-token forward over a cache restarts it), one forward per token."""
    if family != "mamba":
        return _watched_continuation(model, copy.deepcopy(cache), ids, write=write)
    cache = copy.deepcopy(cache)
    logits, states, seen = [], [], []
    for t in range(ids.shape[1]):
        with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
            mixer = w.mixers[0]
            mixer.register_state_hook(lambda m, c, tok, s, t=t: seen.append((0, t, s.clone())) and None)
            if write is not None and t == 1:
                mixer.set_state_after(0, write, call=0)
            logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
        states.append(mixer.calls[0].states)
    return torch.cat(logits, 1), torch.cat(states, 1), seen, None


# (family, the tokens the cache records): fewer than the forward's (a prompt kernel call, then steps), as many,
# more. Mamba-1's prompt scan over a cache restarts the state (transformers' own limit, warned): only a forward that
# runs every token as a decode step continues it, so it runs the last two.
CASES = [
    (family, keep_last)
    for family in SPLITTING
    for keep_last in (2, CONTINUATION, CONTINUATION + 3)
    if family != "mamba" or keep_last >= CONTINUATION
]


@pytest.mark.parametrize("family, keep_last", CASES)
def test_a_split_forward_is_one_call_equal_to_the_unsplit_one(family, keep_last):
    model, cache, ids = _continuation_model(family)
    state = _cache_state_like(model, cache)
    write = torch.randn_like(state) * 0.1
    expected_logits, expected_states, expected_seen, _ = _reference(family, model, cache, ids, write)
    recording = copy.deepcopy(cache)
    recording.activate_past_recording(recurrent_states_to_keep=keep_last)
    logits, states, seen, record = _watched_continuation(model, recording, ids, write=write)
    assert record.tokens == CONTINUATION and record.ran("state") == CONTINUATION
    assert len(record.kernel_calls) == 1 + min(keep_last, CONTINUATION) - (
        keep_last >= CONTINUATION and family == "mamba"
    )
    assert (
        [(c, t) for c, t, _ in seen] == [(c, t) for c, t, _ in expected_seen] == [(0, t) for t in range(CONTINUATION)]
    )
    for (_, t, got), (_, _, want) in zip(seen, expected_seen):
        assert_close(f"{family}: the hook's state at token {t}", want, got, rtol=1e-4, atol=1e-5)
    assert_close(f"{family}: the kept states", expected_states, states, rtol=1e-4, atol=1e-5)
    assert_close(f"{family}: the logits", expected_logits, logits, rtol=1e-4, atol=1e-5)
    assert_close(f"{family}: the write at token 1", write, states[:, 1])


def _cache_state_like(model, cache):
    """A tensor shaped like the first mixer's state (what a write must give)."""
    with torch.no_grad(), rh.watch(model, keep={"states": [0]}) as w:
        model(torch.tensor([[5]]).expand(2, 1), cache=copy.deepcopy(cache), use_cache=True)
    return w.mixers[0].state_after(0, call=0)


@pytest.mark.parametrize("family", SPLITTING)
def test_an_idle_watch_records_the_split_forward_as_one_call(family):
    model, cache, ids = _continuation_model(family)
    cache.activate_past_recording(recurrent_states_to_keep=2)
    with torch.no_grad(), rh.watch(model) as w:
        model(ids, cache=cache, use_cache=True)
    record = w.mixers[0].calls[0]
    assert (record.tokens, record.ran("state")) == (CONTINUATION, CONTINUATION)
    assert len(record.kernel_calls) == 3 and record.kernels[1:] == (record.kernels[1],) * 2, record.kernels


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
@pytest.mark.parametrize("watched", ["main", "assistant", "both"])
def test_assisted_decoding_under_a_watch_generates_what_it_does_unwatched(family, watched):
    model, assistant = build(family, seed=0), build(family, seed=1)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=10, do_sample=False, assistant_model=assistant)
    with torch.no_grad():
        expected = model.generate(ids, **settings)
    steps = []
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for watched_model in {"main": [model], "assistant": [assistant], "both": [model, assistant]}[watched]:
            w = stack.enter_context(rh.watch(watched_model, keep=("states",)))
            w.mixers[0].register_state_hook(lambda m, c, t, s: steps.append((c, t)) and None)
        got = model.generate(ids, **settings)
    assert torch.equal(expected, got), (expected, got)
    assert steps and steps[0] == (0, 0)


def test_prompt_lookup_decoding_under_a_watch_generates_what_it_does_unwatched():
    model = build("qwen3_5")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    settings = dict(max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
    with torch.no_grad():
        expected = model.generate(ids, **settings)
    calls = []
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: calls.append(c) and None)
        got = model.generate(ids, **settings)
    assert torch.equal(expected, got), (expected, got)
    assert sorted(set(calls)) == list(range(len(w.mixers[0].calls)))


def test_a_call_after_a_rollback_says_which_token_it_continues():
    """Assisted decoding rolls the cache back to the last accepted token (`cache.crop`): the next call's record names
    the (call, token) whose state it starts from, which is the kept state there."""
    model, assistant = build("qwen3_5", seed=0), build("qwen3_5", seed=1)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), rh.watch(model, keep=("states", "inputs")) as w:
        model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    calls = w.mixers[0].calls
    rolled = [record for record in calls if record.continues_from is not None]
    assert rolled, "the assistant's candidates were never rejected: no rollback to check"
    for record in list(calls)[1:]:
        call, token = record.continues_from or (record.index - 1, -1)
        start = record.kernel_calls[0].inputs["initial_state"]
        assert_close(
            f"call {record.index}'s starting state, the state after token {token} of call {call}",
            calls[call].states[:, token],
            start,
        )


def test_effective_attention_refuses_a_split_call_by_name():
    model, cache, ids = _continuation_model("qwen3_5")
    cache.activate_past_recording(recurrent_states_to_keep=2)
    with torch.no_grad(), rh.watch(model, keep=("inputs", "outputs")) as w:
        model(ids, cache=cache, use_cache=True)
    with pytest.raises(rh.Unavailable, match="call 0 of its history ran as 3 kernel calls"):
        rh.effective_attention(w.mixers[0], call=0)
    with pytest.raises(rh.Unavailable, match=r"read call.kernel_calls\[i\].inputs"):
        w.mixers[0].calls[0].inputs


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_reductions_and_memories_of_a_split_forward_equal_the_unsplit_ones(family):
    model, cache, ids = _continuation_model(family)
    recording = copy.deepcopy(cache)
    recording.activate_past_recording(recurrent_states_to_keep=2)
    runs = []
    for over in (copy.deepcopy(cache), recording):
        with (
            torch.no_grad(),
            rh.watch(model, keep=("states", "windows"), reduce={"states": lambda s: s.flatten(2).norm(dim=-1)}) as w,
        ):
            model(ids, cache=over, use_cache=True)
        mixer = w.mixers[0]
        runs.append((mixer.calls[0].states, [mixer.memory_after(t, call=0) for t in range(CONTINUATION)]))
    (expected, expected_memories), (got, memories) = runs
    assert got.shape == (2, CONTINUATION)
    assert_close(f"{family}: the reduced states", expected, got, rtol=1e-4, atol=1e-5)
    for t, (want, have) in enumerate(zip(expected_memories, memories)):
        assert_close(f"{family}: the state of memory_after({t})", want.state, have.state, rtol=1e-4, atol=1e-5)
        assert_close(f"{family}: the window of memory_after({t})", want.window, have.window)


def test_a_split_call_in_grad_mode_keeps_the_states_the_forward_read():
    """With gradients on, each kept state of a split call is the tensor the forward continued from, and reading them
    stacked leaves them so; no one tensor holds them all for autograd. (A backward through a recording cache fails in
    transformers itself, watched or not: the cache copies each step's state into one tensor in place.)"""
    model, cache, ids = _continuation_model("qwen3_5")
    cache.activate_past_recording(recurrent_states_to_keep=2)
    with rh.watch(model, keep=("states",)) as w:
        model(ids, cache=cache, use_cache=True)
    record = w.mixers[0].calls[0]
    states = [record.after("state", t) for t in range(CONTINUATION)]
    assert all(state.requires_grad for state in states)
    assert record.states.shape[1] == CONTINUATION
    assert all(record.after("state", t) is states[t] for t in range(CONTINUATION))
    with pytest.raises(rh.Unavailable, match="no one tensor holds its kept states"):
        record.differentiable("state")
