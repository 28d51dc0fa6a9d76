"""A kernel call belongs to the mixer whose forward made it, in the thread that made it, for one family of each kind
with chunk-wise maths: a model run inside a hook of a watched model (another model of the family, or the watched model
itself) or from a torch hook inside a watched mixer's forward runs its own kernels, unwatched, and the watch sees its
own calls only; two threads, each watching its own model, get their own states, a state-changing hook of one never
reaching the other; and a thread outside every watch runs the original kernels. (How the owner is found:
test_ownership.py.)"""

import threading

import pytest
import torch
from _compare import assert_close, assert_equal
from _contract import in_segments, one_family_per_kind
from _models import build, random_ids
from _runs import halved, halved_around, states_of
from torch import nn

import recurrent_hooks as rh
import recurrent_hooks.registry as rh_registry

T = 13
ONE_PER_KIND = one_family_per_kind(in_segments)  # the kinds with chunk-wise maths


@pytest.fixture(params=ONE_PER_KIND)
def two_models(request):
    """Two models of one family (one family per kind), with different weights."""
    return build(request.param, seed=0), build(request.param, seed=1)


def test_a_model_run_inside_a_hook_is_not_watched(two_models):
    a, b = two_models
    ids = random_ids(2, T)
    _, plain_a = states_of(a, ids)
    with torch.no_grad():
        plain_b_logits = b(ids).logits
    inner = []

    def run_b(mixer, call, token, state):
        inner.append(b(ids).logits)  # model B, same family, inside a hook of model A
        return None

    with rh.watch(a, keep=("states",)) as w, torch.no_grad():
        w.mixers[0].register_state_hook(run_b, token=[3, 7])
        w.mixers[1].register_state_hook(lambda m, c, t, s: a(ids[:, :4]) and None, token=5)  # A itself, unguarded
        a(ids)
    assert [len(m.calls) for m in w.mixers] == [1] * len(w.mixers)  # neither B nor A's inner run is a call of A's
    for mixer in w.mixers:
        assert_close(f"{mixer} states", plain_a[mixer.layer], mixer.states, rtol=1e-5, atol=1e-6)
    assert len(inner) >= 2  # per-head kinds (zamba) run the hook once per head
    for logits in inner:
        assert_equal("B's logits inside A's hook", plain_b_logits, logits)  # B ran its own kernels, untouched


def test_an_unwatched_model_run_inside_a_watched_forward_runs_its_own_kernels(two_models):
    """Model B run from a torch hook on a submodule of A's mixer: B's kernel calls are not A's."""
    a, b = two_models
    ids = random_ids(2, T)
    _, plain_a = states_of(a, ids)
    plain_b = b(ids).logits.detach()
    first = next(m for m in a.modules() if rh_registry.family_of(m) is not None)
    projection = next(m for m in first.children() if isinstance(m, nn.Linear))  # runs inside the mixer's forward
    w, inner = halved_around(a, b, ids, projection)  # B inside A's no_grad forward: its logits have no graph
    assert len(inner) == 1
    assert_equal("B's logits", plain_b, inner[0])
    assert len(w.mixers[0].calls) == 1 and w.mixers[0].states.shape[1] == T
    assert_close("A's states with the hook", halved(a, ids)[1].mixers[0].states, w.mixers[0].states, rtol=0, atol=0)


def test_two_threads_each_watching_their_own_model_get_their_own_states(two_models):
    a, b = two_models
    ids = {"a": random_ids(2, 70, seed=3), "b": random_ids(2, 70, seed=4)}
    models = {"a": a, "b": b}
    expected = {name: states_of(models[name], ids[name]) for name in models}
    halved_logits, _ = halved(a, ids["a"])
    rounds, barrier, failures = 12, threading.Barrier(2), []
    results = {name: [] for name in models}

    def work(name):
        try:
            for _ in range(rounds):
                barrier.wait()
                with rh.watch(models[name], keep=("states",)) as w, torch.no_grad():
                    if name == "a":  # a state-changing hook on A must not reach B
                        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 0.5, token=None)
                    logits = models[name](ids[name]).logits
                results[name].append((logits, {m.layer: m.states for m in w.mixers}, [len(m.calls) for m in w.mixers]))
        except BaseException as error:  # reported by the main thread
            failures.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(name,)) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for name, runs in results.items():
        assert len(runs) == rounds
        logits, states = expected[name]
        for i, (got_logits, got_states, calls) in enumerate(runs):
            assert calls == [1] * len(calls), f"round {i} of {name}: calls {calls}"
            want_logits = halved_logits if name == "a" else logits
            assert_close(f"round {i} of {name}: logits", want_logits, got_logits, rtol=1e-5, atol=1e-6)
            if name == "b":
                for layer, state in states.items():
                    assert_close(f"round {i} of b: layer {layer}", state, got_states[layer], rtol=1e-5, atol=1e-6)


def test_an_unwatched_thread_runs_the_original_kernels(two_models):
    a, b = two_models
    ids = random_ids(2, 70)
    plain_b = b(ids).logits.detach()
    got, started, done = [], threading.Event(), threading.Event()

    def other():
        started.wait()
        with torch.no_grad():
            for _ in range(5):
                got.append(b(ids).logits)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with rh.watch(a) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 0.5)
        started.set()
        while not done.is_set():
            a(ids)
    thread.join()
    for logits in got:
        assert_equal("B in another thread", plain_b, logits)
