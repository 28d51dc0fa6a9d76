"""The autouse leak fixture `nothing_left_patched` (tests/conftest.py): what a test leaves behind is reported, and
the cleanup releases it even when one of its steps raises, so that one leaking test does not fail the next ones.

Each test leaks on purpose, then calls the fixture's body, `conftest._leaks_and_cleanup()`, itself (it returns the
leaks instead of failing) and leaves nothing behind for the fixture to find.
"""

import conftest
from _models import build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as patching
import recurrent_hooks.engine.standalone as standalone_impl
import recurrent_hooks.engine.tracking.threads as threads_impl


def test_a_leaked_standalone_hook_is_reported_then_released():
    model = build("qwen3_5")
    seen = []
    handle = rh.register_state_hook(
        model.model.layers[0].linear_attn, lambda mixer, call, token, state: seen.append(token), token=0
    )  # never removed by the test: a leak
    assert standalone_impl._STANDALONE and patching._BINDINGS, "the standalone hook bound no kernel"
    leaks = conftest._leaks_and_cleanup()
    assert leaks["standalone hooks"] == 1 and leaks["bindings"], f"the leak was not reported: {leaks}"
    assert "cleanup errors" not in leaks, leaks
    assert not any(conftest._leaks_and_cleanup().values()), "the cleanup left state behind"
    model(random_ids(1, 4))
    assert seen == [], "the released hook still ran"
    handle.remove()  # a handle of a released hook: a no-op
    assert not standalone_impl._STANDALONE and not patching._BINDINGS


def test_every_cleanup_step_runs_when_one_raises(monkeypatch):
    model = build("qwen3_5")
    mixers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    for module in mixers[:2]:
        rh.register_state_hook(module, lambda *args: None)
    threads_impl.THREAD.in_hook = 1  # as if a hook had raised past its bookkeeping
    real = conftest.hook_removed
    calls = []

    def fails_once(mixer):
        calls.append(mixer)
        if len(calls) == 1:
            raise RuntimeError("a cleanup step that fails")
        real(mixer)

    with monkeypatch.context() as patch:
        patch.setattr(conftest, "hook_removed", fails_once)
        leaks = conftest._leaks_and_cleanup()
    assert leaks["standalone hooks"] == 2 and leaks["inside a hook"] == 1, f"the leaks were not reported: {leaks}"
    assert leaks["cleanup errors"] == ["_remove_standalone_hooks: RuntimeError: a cleanup step that fails"], leaks
    assert len(calls) == 2 and len(standalone_impl._STANDALONE) == 1, "the step after the failing one did not run"
    assert threads_impl.THREAD.in_hook == 0, "the steps after the standalone hooks did not run"
    again = conftest._leaks_and_cleanup()  # the mixer whose step failed: still reported, and released now
    assert again["standalone hooks"] == 1 and "cleanup errors" not in again, again
    assert not any(conftest._leaks_and_cleanup().values()), "the cleanup left state behind"
