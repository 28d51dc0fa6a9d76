"""Several tokens at once: `state_after`, `window_after` and `memory_after` take an int, a list, a tuple, a range or a
slice (stacked on the seq axis, as `mix.states` holds them), and the writers take a list, a range or a bounded slice
with the values stacked the same way (one write per token)."""

import pytest
import torch
from _compare import assert_equal
from _models import build, random_ids

import recurrent_hooks as rh

T = 8


@pytest.fixture(scope="module")
def watched():
    model, ids = build("qwen3_5"), random_ids(2, T)
    with torch.no_grad(), rh.watch(model, keep=("states", "windows")) as w:
        logits = model(ids).logits
    return model, ids, w.mixers[0], logits


@pytest.mark.parametrize(
    "tokens, index",
    [
        ([3, 4], [3, 4]),
        ((0, -1), [0, T - 1]),
        (range(2, 6, 2), [2, 4]),
        (slice(-3, None), [5, 6, 7]),
        (slice(None, None, 3), [0, 3, 6]),
        ([5], [5]),
    ],
    ids=["list", "tuple with a negative token", "range", "slice from the end", "slice with a step", "one in a list"],
)
def test_several_tokens_read_as_the_stacked_states(watched, tokens, index):
    _, _, mix, _ = watched
    assert_equal("states", mix.states[:, index], mix.state_after(tokens))
    assert_equal("windows", mix.windows[:, index], mix.window_after(tokens))
    memory = mix.memory_after(tokens)
    assert_equal("memory: state", mix.states[:, index], memory.state)
    assert_equal("memory: window", mix.windows[:, index], memory.window)
    assert mix.state_after(4).shape == mix.states.shape[:1] + mix.states.shape[2:]  # an int: no seq axis


def test_a_state_of_several_parts_stacks_each_part():
    model, ids = build("rwkv"), random_ids(1, 5)
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        model(ids)
    mix = w.mixers[0]
    several = mix.state_after([1, 3])
    for name, part in zip(type(several)._fields, several):
        assert_equal(f"part {name}", torch.stack([getattr(mix.state_after(t), name) for t in (1, 3)], 1), part)


def test_bad_token_selections_are_refused(watched):
    _, _, mix, _ = watched
    with pytest.raises(rh.InvalidValue, match=r"state_after: expected at least one token, got an empty list"):
        mix.state_after([])
    with pytest.raises(rh.InvalidValue, match=r"state_after: token must be an int, got float 2\.0"):
        mix.state_after([1, 2.0])
    with pytest.raises(rh.Unavailable, match=rf"token {T} is outside call 0, which has {T} tokens"):
        mix.window_after([1, T])


def test_writes_at_several_tokens_equal_one_write_per_token(watched):
    model, ids, mix, _ = watched
    value = mix.states[:, [2, 5]] * 0.5
    with torch.no_grad():
        with rh.watch(model) as w:
            w.mixers[0].set_state_after([2, 5], value)
            together = model(ids).logits
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(2, value[:, 0])
            w.mixers[0].set_state_after(5, value[:, 1])
            apart = model(ids).logits
        windows = mix.windows[:, 2:4] * 0
        with rh.watch(model, keep=("windows",)) as w:
            w.mixers[0].set_window_after(slice(2, 4), windows)
            model(ids)
        assert_equal("the written windows", windows, w.mixers[0].window_after(slice(2, 4)))
        with rh.watch(model, keep=("states", "windows")) as w:
            w.mixers[0].set_memory_after(range(3, 5), mix.memory_after([3, 4]))
            same = model(ids).logits
    assert_equal("two tokens written at once", apart, together)
    assert (together - watched[3]).abs().max() > 0
    assert_equal("the memory written back as it was", watched[3], same)


def test_bad_multi_token_writes_are_refused(watched):
    model, _, mix, _ = watched
    with rh.watch(model) as w:
        with pytest.raises(
            rh.InvalidValue,
            match=r"set_state_after\(\[2, 5\], call=0\): expected the state after"
            r" each of the 2 tokens stacked on axis 1, \[batch, 2, \.\.\.\] \(as state_after\(\[2, 5\]\)"
            r" reads them\), got shapes \[\(2, 3, 4, 8, 8\)\]",
        ):
            w.mixers[0].set_state_after([2, 5], mix.states[:, :3])
        with pytest.raises(rh.InvalidValue, match=r"expected a slice of tokens with a stop and no negative bound"):
            w.mixers[0].set_window_after(slice(2, None), mix.windows[:, 2:])
        with pytest.raises(rh.InvalidValue, match=r"expected a slice of tokens with a stop and no negative bound"):
            w.mixers[0].set_state_after(slice(-2, 8), mix.states[:, -2:])
