"""State hooks in a watch, on qwen3_5: `call=` and `token=` pick the calls and the tokens a hook runs at (a negative
token counts from each call's end), hooks run in the order they were registered, each handed the state the one before
returned, with the mixer's handle and the live state (a hook that keeps it clones it); a state a hook returns is what
the next token continues from, exactly as `set_state_after` writes it; and the handles are torch's
`RemovableHandle`s: removed once however often `remove` is called, and context managers."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids
from _qwen3_5 import T, generate, run

import recurrent_hooks as rh


@pytest.fixture
def model():
    return build("qwen3_5")


def test_hooks_target_calls_and_tokens(model):
    seen = {"all": [], "calls 0 and 2": [], "last token": [], "token 5 of every call": []}
    with rh.watch(model) as w:
        mixer = w.mixers[0]
        mixer.register_state_hook(lambda m, c, t, s: seen["all"].append((c, t)))
        mixer.register_state_hook(lambda m, c, t, s: seen["calls 0 and 2"].append((c, t)), call=[0, 2], token=[0, -1])
        mixer.register_state_hook(lambda m, c, t, s: seen["last token"].append((c, t)), token=-1)
        mixer.register_state_hook(lambda m, c, t, s: seen["token 5 of every call"].append((c, t)), token=5)
        generate(model, 4)
    assert seen["all"] == [(0, t) for t in range(T)] + [(1, 0), (2, 0), (3, 0)]
    assert seen["calls 0 and 2"] == [(0, 0), (0, T - 1), (2, 0)]  # in a 1-token call, 0 and -1 are one token
    assert seen["last token"] == [(0, T - 1), (1, 0), (2, 0), (3, 0)]
    assert seen["token 5 of every call"] == [(0, 5)]


def test_hooks_run_in_registration_order(model):
    order = []
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: order.append("last token") or s * 2, token=-1)
        w.mixers[0].register_state_hook(
            lambda m, c, t, s: order.append(("every token", float(s.norm()))) if t == T - 1 else None
        )
        run(model)
    assert order[0] == "last token" and order[1][0] == "every token"
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(
            lambda m, c, t, s: order.append(("before", float(s.norm()))) if t == T - 1 else None
        )
        run(model)
    assert_close(
        "the second hook saw the first one's replacement",
        torch.tensor(order[2][1]),
        torch.tensor(order[1][1] * 0.5),
        rtol=1e-5,
        atol=0,
    )


def test_hooks_receive_the_mixer_and_live_states_to_clone(model):
    """The state is handed over without a copy: a hook that keeps it clones it, and decode steps differ."""
    kept = []

    def keep(mixer, call, token, state):
        assert isinstance(mixer, rh.GatedDeltaNet) and mixer.layer == 0
        kept.append(state.clone())

    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(keep, token=-1)
        generate(model, 4)
    assert len(kept) == 4
    assert all((a - b).abs().max() > 0 for a, b in zip(kept, kept[1:]))


def test_handles_are_removable_handles_idempotent_and_context_managers(model):
    hits = []
    with rh.watch(model) as w:
        handle = w.mixers[0].register_state_hook(lambda m, c, t, s: hits.append(t))
        assert isinstance(handle, torch.utils.hooks.RemovableHandle)
        run(model)
        handle.remove()
        handle.remove()
        run(model)
        with w.mixers[0].register_state_hook(lambda m, c, t, s: hits.append(-t)):
            run(model)
        run(model)
    assert hits == list(range(T)) + [-t for t in range(T)]


def test_a_hook_replacement_is_what_the_next_token_continues_from(model):
    """A hook returning a state at t acts exactly like set_state_after(t, that state)."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states",)) as w:
        run(model, ids)
        value = w.mixers[1].state_after(6) * 3 + 0.01
    with rh.watch(model) as w:
        w.mixers[1].register_state_hook(lambda m, c, t, s: value, token=6)
        by_hook = run(model, ids)
    with rh.watch(model) as w:
        w.mixers[1].set_state_after(6, value)
        by_write = run(model, ids)
    assert_close("hook vs write", by_write, by_hook, rtol=0, atol=0)
