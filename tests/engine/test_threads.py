"""A watch sees the forwards of the thread that entered it, and says so when another thread ran its mixers.

- a watched model run by another thread inside the block (`threading.Thread(target=model.generate)`, the streamer
  pattern) fires no hook and keeps nothing, runs untouched, and the watch's exit gives exactly one
  `RecurrentHooksWarning` naming the thread and the rule (enter the watch in that thread);
- reading a mixer that was never called names the thread rule among the reasons (and the thread, where one ran it);
- a watch entered in the other thread sees its own calls, and neither watch warns;
- a watch whose model runs in its own thread only never reaches the per-forward note.
"""

import threading
import warnings

import pytest
import torch
from _compare import assert_equal
from _models import PAD, build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.engine.dispatch.tap as tap

RULE = "a watch sees only the forwards of the thread that entered it: enter the watch in the thread that runs the model"


@pytest.fixture(scope="module")
def qwen():
    return build("qwen3_5")


def _in_thread(target, name):
    """Run `target()` in a thread named `name` and wait for it; what it returned, or the exception it raised."""
    out = {}

    def run():
        try:
            out["result"] = target()
        except BaseException as error:  # re-raised by the caller's assertions
            out["error"] = error

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _generate(model, ids, n=4):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=PAD)


def _thread_warnings(record):
    return [w for w in record if issubclass(w.category, rh.RecurrentHooksWarning) and "thread" in str(w.message)]


def test_a_generate_in_another_thread_warns_once_on_exit_and_runs_untouched(qwen):
    ids = random_ids(1, 5)
    plain = _generate(qwen, ids)
    hooked = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with rh.watch(qwen, keep=("states",)) as w:
            for mix in w.mixers:
                mix.register_state_hook(lambda m, call, token, state: hooked.append(call))
                mix.set_state_after(0, torch.zeros_like(torch.empty(1, 4, 8, 8)), call=None)  # would change it
            generated = _in_thread(lambda: _generate(qwen, ids), "streamer")
    assert_equal("the tokens generated in the other thread", plain, generated)
    assert hooked == [] and all(len(mix.calls) == 0 for mix in w.mixers)
    (warning,) = _thread_warnings(record)
    message = str(warning.message)
    assert (
        "thread 'streamer' ran 8 forwards of GatedDeltaNet(qwen3_5, layer 0), GatedDeltaNet(qwen3_5, layer 2)"
        in message
        and "which this watch did not see: they fired no hook and kept nothing" in message
    )
    assert RULE in message


def test_a_mixer_run_only_by_another_thread_names_the_thread_when_read(qwen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rh.RecurrentHooksWarning)
        with rh.watch(qwen, keep=("states",)) as w:
            _in_thread(lambda: _generate(qwen, random_ids(1, 5), 2), "server-worker")
    with pytest.raises(
        rh.Unavailable,
        match=r"GatedDeltaNet\(qwen3_5, layer 0\) has not been called inside this watch"
        r" yet: its module ran 2 forwards in thread 'server-worker', which this"
        rf" watch does not see \({RULE}",
    ):
        w.mixers[0].states


def test_a_mixer_never_called_names_the_thread_rule_among_the_reasons(qwen):
    with rh.watch(qwen, keep=("states",)) as w:
        pass
    with pytest.raises(
        rh.Unavailable,
        match=r"has not been called inside this watch yet: the model did not run"
        r" inside the block, or it ran in another thread than the one that"
        rf" entered the watch \({RULE}",
    ):
        w.mixers[0].states
    with pytest.raises(rh.Unavailable, match="has not been called inside this watch yet"):
        w.mixers[1].state_after(0, call=0)


def test_a_watch_entered_in_the_other_thread_sees_its_own_calls_and_neither_warns(qwen):
    ids, other = random_ids(1, 5), random_ids(1, 6, seed=1)

    def watched_there():
        with warnings.catch_warnings(record=True) as there:  # (the main thread waits: no other thread warns now)
            warnings.simplefilter("always")
            with rh.watch(qwen, keep=("states",)) as inner:
                with torch.no_grad():
                    qwen(other)
        return inner, there

    with warnings.catch_warnings(record=True) as here:
        warnings.simplefilter("always")
        with rh.watch(qwen, keep=("states",)) as outer:
            inner, there = _in_thread(watched_there, "worker")
            with torch.no_grad():
                qwen(ids)
    assert _thread_warnings(here) == [] and _thread_warnings(there) == []
    assert [len(m.calls) for m in outer.mixers] == [1, 1] and [len(m.calls) for m in inner.mixers] == [1, 1]
    assert outer.mixers[0].calls[0].tokens == 5 and inner.mixers[0].calls[0].tokens == 6
    with rh.watch(qwen, keep=("states",)) as alone:
        with torch.no_grad():
            qwen(other)
    assert_equal("the states the other thread's watch kept", alone.mixers[0].states, inner.mixers[0].states)


def test_the_note_is_off_the_path_of_a_watch_in_its_own_thread(qwen, monkeypatch):
    """The tap compares two lengths per forward; only a forward some handle does not see reaches the note."""
    noted = []
    monkeypatch.setattr(tap, "note_unseen", lambda mixers, thread: noted.append(thread))
    with rh.watch(qwen) as w:
        w.mixers[0].register_state_hook(lambda m, call, token, state: None)
        _generate(qwen, random_ids(1, 5), 3)
    assert noted == [] and len(w.mixers[0].calls) == 3
