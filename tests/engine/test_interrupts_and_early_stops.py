"""Runs that end before their time, on qwen3_5: a KeyboardInterrupt raised in a hook, or after the kernels and
before the mixer's post-forward hooks, leaves no running mixer and no entry behind, in a watch and under a standalone
hook, and later watches work; a generation that stops before calls a hook or a write targets is not an error: hooks
on calls that never run are silent (`call=slice(1, None)` is every decode step), and writes whose calls never ran give
one short warning when the watch ends."""

import warnings

import pytest
import torch
from _models import build, random_ids
from _qwen3_5 import KERNELS, MODULE, T, bindings, generate
from _runs import greedy_exactly as greedy
from _runs import states_of

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as rh_patching
import recurrent_hooks.engine.tracking.threads as rh_threads


@pytest.fixture
def model():
    return build("qwen3_5")


# -- interrupts -------------------------------------------------------------------------------------------------------


def test_an_interrupt_from_a_hook_leaves_nothing_behind():
    model = build("qwen3_5")
    ids = random_ids(2, T)

    def interrupt(mixer, call, token, state):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with rh.watch(model) as w:
            w.mixers[0].register_state_hook(interrupt, call=2)
            greedy(model, ids, 4)
    assert rh_threads.THREAD.running == [] and rh_threads.THREAD.in_hook == 0
    handle = rh.register_state_hook(model.model.layers[0].linear_attn, interrupt, call=1)
    with pytest.raises(KeyboardInterrupt):
        greedy(model, ids, 4)
    handle.remove()
    assert rh_threads.THREAD.running == []
    logits, states = states_of(model, ids)  # and later watches work
    assert states[0].shape[1] == T


def test_an_interrupt_outside_a_kernel_leaves_no_entry():
    """A KeyboardInterrupt skips torch's post-forward hooks: the mixer's `__call__` pops its entry anyway."""
    model = build("qwen3_5")
    ids = random_ids(2, T)
    mixer_module = model.model.layers[0].linear_attn
    seen = []
    handle = rh.register_state_hook(mixer_module, lambda m, c, t, s: seen.append(c), token=-1)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    # runs after the kernels and before the tap's post-forward hook, which the interrupt then skips
    projection = mixer_module.register_forward_hook(interrupt, prepend=True)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(ids)
    projection.remove()
    assert rh_threads.THREAD.running == []  # at once (tests/engine/test_ownership.py)
    with torch.no_grad():
        model(ids)
    handle.remove()
    assert rh_threads.THREAD.running == [] and seen == [0, 0]


# -- generation that stops early is not an error ----------------------------------------------------------------------


def test_hooks_on_calls_that_never_run_are_not_an_error():
    model = build("qwen3_5")
    ids = random_ids(2, T)
    steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rh.watch(model) as w:
            w.mixers[0].register_state_hook(lambda m, c, t, s: steps.append(c), call=range(1, 1000))
            greedy(model, ids, 4)
    assert steps == [1, 2, 3]


def test_every_decode_step_is_slice_1_none():
    model = build("qwen3_5")
    ids = random_ids(2, T)
    seen = []
    value = torch.zeros(2, 4, 8, 8)
    with rh.watch(model, keep={"states": [-1]}) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append((c, t)), call=slice(1, None))
        w.mixers[1].set_state_after(0, value, call=slice(2, None, 2))  # decode steps 2, 4, ...
        greedy(model, ids, 6)
    assert seen == [(c, 0) for c in range(1, 6)]
    for call in range(6):
        is_written = call in (2, 4)
        assert bool((w.mixers[1].state_after(-1, call=call) == 0).all()) == is_written, call


def test_a_write_whose_call_never_happens_is_one_warning_when_the_watch_ends(model):
    with pytest.warns(
        rh.RecurrentHooksWarning,
        match=r"^1 write never ran: set_state_after\(0, call=5\) on "
        r"GatedDeltaNet\(qwen3_5, layer 0\) \(call 5; it saw 4 calls\)\. The calls they target did"
        r" not happen: generation may have stopped early",
    ):
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(0, torch.zeros(2, 4, 8, 8), call=5)
            generate(model, 4)
    assert bindings()[KERNELS[0]] is rh_patching.import_default(MODULE, KERNELS[0])


def test_writes_on_calls_that_never_run_give_one_short_warning():
    model = build("qwen3_5")
    with pytest.warns(rh.RecurrentHooksWarning) as record:
        with rh.watch(model) as w:
            for mixer in w.mixers:
                mixer.set_state_after(0, torch.zeros(2, 4, 8, 8), call=range(1, 1000))
            greedy(model, random_ids(2, T), 4)
    (warning,) = record
    message = str(warning.message)
    assert len(message) < 500, message
    assert message.startswith(
        "2 writes never ran: set_state_after(0, call=slice(1, 1000)) on GatedDeltaNet"
        "(qwen3_5, layer 0) (call 4, 5, 6, ...; it saw 4 calls)"
    )
    assert "generation may have stopped early" in message
