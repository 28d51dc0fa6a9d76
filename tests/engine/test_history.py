"""`watch(history=N)`: each mixer keeps the records of its last N calls, and what a record holds.

- `mix.calls` keeps the last N records, each with its absolute `call.index`; `len(mix.calls)` counts every call;
- reading a dropped call (by index, a slice, `state_after(..., call=i)`, `values`, effective attention) raises
  `rh.Unavailable` naming N and the call; what a dropped call kept is freed (nothing of it stays reachable);
- `history` is checked: None or an int >= 1;
- a watch that keeps nothing holds a few hundred bytes a call (the objects its records reach; tracemalloc of the
  library's own allocations), and with `history=1` neither the record left nor the Python heap grows over a
  30,000-step run of one-token decode forwards with a hook at every step.

Memory is measured in bytes (the objects reachable from the records, the garbage collector's heap, tracemalloc),
never in time.
"""

import copy
import gc
import pickle
import sys
import tracemalloc
import weakref

import numpy as np
import pytest
import torch
from _compare import assert_close, assert_equal
from _models import build, random_ids
from _reachable import python_bytes_reachable, tensor_bytes_reachable
from _runs import greedy

import recurrent_hooks as rh

LIBRARY = tracemalloc.Filter(True, f"{rh.__path__[0]}/*")  # the library's own allocations


@pytest.fixture(scope="module")
def qwen():
    return build("qwen3_5")


def _forwards(model, ids, count):
    """`count` forwards of `ids` (each a prompt: every mixer's call starts from zeros)."""
    with torch.no_grad():
        return [model(ids).logits for _ in range(count)]


# -- what a watch with a history keeps -------------------------------------------------------------------------------


def test_history_keeps_the_last_calls_with_their_indices(qwen):
    ids = random_ids(2, 6)
    with rh.watch(qwen, keep=("states",)) as every:
        greedy(qwen, ids, 5, min_new_tokens=5)
    with rh.watch(qwen, keep=("states",), history=2) as last:
        greedy(qwen, ids, 5, min_new_tokens=5)
    for full, kept in zip(every.mixers, last.mixers):
        calls = kept.calls
        assert [c.index for c in calls] == [3, 4] and len(calls) == 5 and calls.dropped == 3 and calls.history == 2
        assert calls[-1] is calls[4] and calls[3].index == 3 and calls[-2] is calls[3]
        assert [c.index for c in reversed(calls)] == [4, 3] and [c.index for c in calls[3:]] == [3, 4]
        for call in (3, 4):
            assert_equal(
                f"{kept} call {call}: the states of the watch keeping every call",
                full.calls[call].states,
                kept.calls[call].states,
            )
        assert_equal(f"{kept}: the last call's states", full.states, kept.states)
        assert_equal(f"{kept}: state_after(-1, call=3)", full.state_after(-1, call=3), kept.state_after(-1, call=3))
        assert_equal(f"{kept}: state_after(-1, call=-2)", full.state_after(-1, call=3), kept.state_after(-1, call=-2))
    assert "calls 0..2 dropped" in repr(last.mixers[0].calls)


@pytest.mark.parametrize(
    "read",
    [
        lambda mix: mix.calls[1],
        lambda mix: mix.calls[-4],
        lambda mix: mix.calls[1:],
        lambda mix: mix.state_after(0, call=1),
        lambda mix: mix.window_after(0, call=1),
        lambda mix: mix.memory_after(0, call=1),
        lambda mix: mix.after("state", 0, call=-4),
        lambda mix: mix.values(call=1),
    ],
    ids=["calls[1]", "calls[-4]", "calls[1:]", "state_after", "window_after", "memory_after", "after", "values"],
)
def test_reading_a_dropped_call_names_the_history_and_the_call(qwen, read):
    ids = random_ids(1, 5)
    with rh.watch(qwen, keep=("states", "windows", "inputs", "outputs"), history=2) as w:
        greedy(qwen, ids, 5, min_new_tokens=5)
    with pytest.raises(
        rh.Unavailable,
        match=r"call 1 was dropped: watch\(history=2\) keeps the last 2 calls only"
        r" \(calls 3\.\.4 are kept\)",
    ):
        read(w.mixers[0])


def test_a_call_that_never_ran_is_still_no_call(qwen):
    with rh.watch(qwen, history=2) as w:
        _forwards(qwen, random_ids(1, 4), 3)
    mix = w.mixers[0]
    with pytest.raises(IndexError, match="no call 3; 3 calls were recorded"):
        mix.calls[3]
    with pytest.raises(rh.Unavailable, match=r"no call 7; this watch saw 3 calls \(0\.\.2\)"):
        mix.state_after(0, call=7)
    assert mix.calls.get(0) is None and mix.calls.get(2) is mix.calls[2] and mix.calls.get(3) is None


def test_the_default_keeps_every_call(qwen):
    with rh.watch(qwen) as w:
        _forwards(qwen, random_ids(1, 4), 3)
    calls = w.mixers[0].calls
    assert calls.history is None and calls.dropped == 0 and [c.index for c in calls] == [0, 1, 2]
    assert [c.index for c in calls[:2]] == [0, 1] and repr(calls).startswith("[Call(index=0")


def test_a_dropped_call_leaves_nothing_reachable(qwen):
    ids = random_ids(2, 6)
    with rh.watch(qwen, keep=("states", "windows", "inputs", "outputs"), history=1) as w:
        _forwards(qwen, ids, 1)
        first = w.mixers[0].calls[0]
        kept = [weakref.ref(t) for t in (first.states, first.windows, first.inputs["value"], first.output["output"])]
        del first
        _forwards(qwen, ids, 1)
        assert all(ref() is None for ref in kept), "a dropped call's kept tensors are still alive"
        gc.collect()  # (each forward's cache, which the watch holds weakly, is freed by the garbage collector)
        held = tensor_bytes_reachable(w), [python_bytes_reachable(mix.calls) for mix in w.mixers]
        _forwards(qwen, ids, 4)
        gc.collect()
        assert (tensor_bytes_reachable(w), [python_bytes_reachable(mix.calls) for mix in w.mixers]) == held
    gc.collect()
    assert sum(isinstance(obj, rh.Call) for obj in gc.get_objects()) == len(w.mixers), "records beyond the last"


def test_a_recompute_of_a_dropped_call_runs_its_hooks_and_keeps_nothing():
    """Gradient checkpointing recomputes each layer in the backward, after later calls dropped its record: the
    recompute still runs the call's hooks (with its index), and the loss's gradient is the plain one."""
    model = build("qwen3_5")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, other = random_ids(1, 6), random_ids(1, 6, seed=1)  # (a recompute is told by its input)
    weight = model.get_input_embeddings().weight
    plain = torch.autograd.grad(model(ids).logits.square().sum() + model(other).logits.square().sum(), weight)[0]
    seen, grads = [], {}
    for history in (None, 1):
        seen.clear()
        with rh.watch(model, keep=("states",), history=history) as w:
            w.mixers[0].register_state_hook(lambda m, call, token, state: seen.append((call, m.recomputing)), token=-1)
            loss = model(ids).logits.square().sum() + model(other).logits.square().sum()  # calls 0 and 1
            grads[history] = torch.autograd.grad(loss, weight)[0]
        assert sorted(seen) == [(0, False), (0, True), (1, False), (1, True)]
    assert [c.index for c in w.mixers[0].calls] == [1]
    assert_equal("the gradient under a watch keeping one call, and every call", grads[None], grads[1])
    assert_close("the gradient under a watch, and without", plain, grads[1], rtol=1e-4, atol=1e-5)


def test_a_record_copies_and_pickles_as_before(qwen):
    """A record shares its empty bookkeeping with every other one; a copy or a pickle of it reads as the record."""
    ids = random_ids(1, 5)
    with rh.watch(qwen, keep={"states": [2]}, history=2) as w:
        _forwards(qwen, ids, 3)
    mix = w.mixers[0]
    for record in (mix.calls[2], mix.calls[-1]):
        for twin in (copy.deepcopy(record), pickle.loads(pickle.dumps(record))):
            assert (twin.index, twin.tokens, twin.kernel, twin.replaced(), twin.ran("state")) == (
                record.index,
                record.tokens,
                record.kernel,
                frozenset(),
                5,
            )
            assert_equal("the kept state of a copied record", record.after("state", 2), twin.after("state", 2))
    for calls in (copy.deepcopy(mix.calls), pickle.loads(pickle.dumps(mix.calls))):
        assert [c.index for c in calls] == [1, 2] and len(calls) == 3
        with pytest.raises(rh.Unavailable, match=r"call 0 was dropped: watch\(history=2\)"):
            calls[0]


# -- effective attention over a history ------------------------------------------------------------------------------


def test_effective_attention_refuses_a_history_that_reaches_a_dropped_call(qwen):
    ids = random_ids(1, 5)
    with rh.watch(qwen, keep=("inputs", "outputs"), history=2) as w:
        greedy(qwen, ids, 4, min_new_tokens=4)
    with pytest.raises(
        rh.Unavailable,
        match=r"call 3: its history runs back to call 2, which may continue the state"
        r" of call 1; the record of call 1 was dropped: watch\(history=2\)",
    ):
        rh.effective_attention(w.mixers[0], call=3)
    with pytest.raises(rh.Unavailable, match=r"call 0 was dropped: watch\(history=2\)"):
        rh.effective_attention(w.mixers[0], call=0)


def test_effective_attention_of_a_call_whose_history_is_kept(qwen):
    """A prompt after a generate starts from zeros: its history is itself, kept with history=1."""
    ids, prompt = random_ids(1, 5), random_ids(1, 7, seed=1)
    with rh.watch(qwen, keep=("inputs", "outputs")) as every:
        greedy(qwen, ids, 3, min_new_tokens=3)
        _forwards(qwen, prompt, 1)
    with rh.watch(qwen, keep=("inputs", "outputs"), history=1) as last:
        greedy(qwen, ids, 3, min_new_tokens=3)
        _forwards(qwen, prompt, 1)
    full, kept = rh.effective_attention(every.mixers[0], call=3), rh.effective_attention(last.mixers[0])
    assert kept.calls == full.calls == range(3, 4)
    assert_equal("the effective attention of the last call", full.weights, kept.weights)


# -- history is checked ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("history", [0, -1, True, False, 1.5, "2", torch.tensor(2.0), torch.tensor([2]), [2]])
def test_history_refuses_what_is_not_a_count_of_calls(qwen, history):
    with pytest.raises(
        rh.InvalidValue,
        match=r"watch: expected history= None \(keep every call's record\) or a"
        r" number of calls >= 1, got history=",
    ):
        rh.watch(qwen, history=history)


@pytest.mark.parametrize("history", [3, np.int64(3), torch.tensor(3)])
def test_history_takes_an_int_of_any_kind(qwen, history):
    with rh.watch(qwen, history=history) as w:
        _forwards(qwen, random_ids(1, 4), 5)
    assert w.history == 3 and [c.index for c in w.mixers[0].calls] == [2, 3, 4]


# -- what a record holds -----------------------------------------------------------------------------------------------


def _library_growth(run, steps):
    """The bytes the library's own allocations (tracemalloc) grow by over `run(steps)`, after `run(100)` traced too
    (what is alive at the moment of each snapshot, the running call's record, cancels)."""
    gc.collect()
    tracemalloc.start()
    try:
        run(100)
        gc.collect()
        before = tracemalloc.take_snapshot().filter_traces([LIBRARY])
        run(steps)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces([LIBRARY])
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename"))


def _heap():
    """The Python objects the garbage collector tracks: how many, and their bytes (`sys.getsizeof` of each)."""
    gc.collect()
    objects = gc.get_objects()
    return len(objects), sum(sys.getsizeof(obj) for obj in objects)


def _decode_steps(model, mixers):
    """A function running one-token decode forwards of `model` over one cache (a hook at every step on `mixers`)."""
    for mix in mixers:
        mix.register_state_hook(lambda m, call, token, state: None)
    cache = model(random_ids(1, 4), use_cache=True).past_key_values
    step = random_ids(1, 1)

    def run(steps):
        for _ in range(steps):
            model(step, past_key_values=cache)

    run(300)  # (past the ints Python shares, and the bounded bookkeeping of the last calls filled)
    return run


def test_a_watch_that_keeps_nothing_holds_a_few_hundred_bytes_a_call():
    """Mamba-2 (its recurrence and convolution kernels: two kernel calls a call), a hook at every decode step: a
    call's record holds its index, its token count and its kernels' shared records (docs/performance.md has the
    figures), both as the objects the records reach and as what the library allocates."""
    model = build("mamba2")
    with torch.no_grad(), rh.watch(model) as w:
        run = _decode_steps(model, w.mixers)
        before = [python_bytes_reachable(mix.calls) for mix in w.mixers]
        run(300)
        per_record = [(python_bytes_reachable(mix.calls) - held) / 300 for mix, held in zip(w.mixers, before)]
        per_call = _library_growth(run, 250) / (250 * len(w.mixers))
    assert all(100 < each < 300 for each in per_record), f"{per_record} bytes a record"
    assert 100 < per_call < 320, f"{per_call:.0f} bytes a call allocated by a watch that keeps nothing"


def test_history_one_holds_one_record_a_mixer():
    model = build("mamba2")
    with torch.no_grad(), rh.watch(model, history=1) as w:
        run = _decode_steps(model, w.mixers)
        records, heap = [python_bytes_reachable(mix.calls) for mix in w.mixers], _heap()
        run(300)
        assert [python_bytes_reachable(mix.calls) for mix in w.mixers] == records
        objects, size = (now - then for now, then in zip(_heap(), heap))
    assert [len(list(mix.calls)) for mix in w.mixers] == [1, 1] and len(w.mixers[0].calls) == 1 + 300 + 300
    assert objects < 50 and size < 300 * 8, f"{objects} more objects, {size} more bytes after 300 more steps"


def test_history_one_is_flat_over_30000_decode_steps():
    """30,000 one-token forwards of an lfm2 short convolution (the cheapest watched mixer forward: the mixer module
    over the model's cache, with a hook at every step, which runs its token loop), measured at 3,000, 10,000 and
    30,000 steps: the one record left holds the same bytes, and so does the whole Python heap the garbage collector
    tracks (its objects and their bytes), where keeping every record adds about 240 bytes a step (the test above)."""
    model = build("lfm2")
    with torch.no_grad(), rh.watch(model, history=1) as w:
        mix = w.mixers[0]
        hooked = []
        mix.register_state_hook(
            lambda m, call, token, state: hooked.append(call) if call % 10_000 == 0 else None, call=slice(1, None)
        )
        cache = model(random_ids(1, 4), use_cache=True).past_key_values
        hidden = torch.randn(1, 1, model.config.hidden_size)
        held, done = {}, 0
        for steps in (3_000, 10_000, 30_000):
            for _ in range(steps - done):
                mix.module(hidden, cache=cache)
            done = steps
            held[steps] = (python_bytes_reachable(mix.calls), *_heap())
    assert len(mix.calls) == 30_001 and [c.index for c in mix.calls] == [30_000]
    assert hooked == [10_000, 20_000, 30_000], "the hook did not run at every step"
    assert held[10_000][0] == held[30_000][0] == held[3_000][0], f"the record's bytes changed: {held}"
    for steps in (10_000, 30_000):
        objects, size = (now - then for now, then in zip(held[steps][1:], held[3_000][1:]))
        assert objects < 100 and size < steps - 3_000, (
            f"from step 3,000 to {steps:,}: {objects} more objects, {size} more bytes ({held})"
        )
