"""Shared fixtures: every test must leave no kernel rebound, no module hook and no standalone hook behind."""

import pytest
import torch

import recurrent_hooks._dispatch as dispatch_impl
import recurrent_hooks._paths as paths_impl
import recurrent_hooks._patching as patching
import recurrent_hooks._threads as threads_impl
import recurrent_hooks._watch as watch_impl


# The test models are tiny: one thread is several times faster than two threads contending for two cores.
torch.set_num_threads(1)


@pytest.fixture
def fixed_path_rule(monkeypatch):
    """The fixed rule picks the paths (a few stops: segments; every state kept: chunk-wise), for the tests of a
    particular fast path, which ask for it (`pytest.mark.usefixtures("fixed_path_rule")`): at the test models'
    tiny dims the cost model picks the token loop nearly always, and they would not test their path. Every other
    test runs the shipped default, the cost model (`_paths.BY_COST = True`)."""
    monkeypatch.setattr(paths_impl, "BY_COST", False)


@pytest.fixture(autouse=True)
def nothing_left_patched():
    """Fail the test if it leaves bindings, taps or running mixers behind (and clean up for the next test)."""
    yield
    leaks = {
        "bindings": sorted(patching._BINDINGS),
        "taps": len(dispatch_impl._TAPS),
        "running": len(threads_impl.THREAD.running),
        "inside a hook": threads_impl.THREAD.in_hook,
        "standalone hooks": len(watch_impl._STANDALONE),
    }
    for mixer in list(watch_impl._STANDALONE.values()):
        for key in list(mixer._hooks):
            del mixer._hooks[key]
        mixer._hook_removed()
    threads_impl.THREAD.running.clear()
    threads_impl.THREAD.in_hook = 0
    assert not any(leaks.values()), f"the test left state behind: {leaks}"
