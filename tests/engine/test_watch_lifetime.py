"""A watch's life, on qwen3_5: entering it attaches everything or nothing (a failure while the kernels are acquired
leaves no kernel rebound and no module hook), it is entered once at a time and takes hooks only while it is active,
and a watch inside another sees the same calls, the outer one seeing what the inner one wrote."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids
from _qwen3_5 import T, bindings, run

import recurrent_hooks as rh
import recurrent_hooks.engine.attaching as attaching_impl


@pytest.fixture
def model():
    return build("qwen3_5")


def test_hooks_after_the_watch_and_a_second_entry_are_refused(model):
    watcher = rh.watch(model)
    with watcher as w:
        with pytest.raises(rh.RecurrentHooksError, match="this watch is active already"):
            watcher.__enter__()
    with pytest.raises(rh.RecurrentHooksError, match="is detached .*register hooks inside the with block"):
        w.mixers[0].register_state_hook(lambda *a: None)


def test_entry_is_all_or_nothing(model, monkeypatch):
    real = attaching_impl.acquire_kernels
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("second acquisition fails")
        return real(*args)

    monkeypatch.setattr(attaching_impl, "acquire_kernels", failing)
    before = bindings()
    with pytest.raises(RuntimeError, match="second acquisition fails"):
        rh.watch(model).__enter__()
    assert bindings() == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_nested_watches_both_see_the_calls(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states",)) as outer:
        with rh.watch(model, keep=("states",)) as inner:
            inner.mixers[0].set_state_after(2, torch.zeros(2, 4, 8, 8))
            run(model, ids)
        run(model, ids)
    assert len(outer.mixers[0].calls) == 2 and len(inner.mixers[0].calls) == 1
    assert_close(
        "outer saw the inner write", inner.mixers[0].calls[0].states, outer.mixers[0].calls[0].states, rtol=0, atol=0
    )
    assert outer.mixers[0].calls[1].states[:, 2].abs().max() > 0
