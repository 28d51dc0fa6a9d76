"""Shared fixtures: every test must leave no kernel rebound, no module hook and no standalone hook behind."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))  # the shared helpers, imported by name

import _device
import _models
import pytest
import torch
from _contract import one_family_per_kind

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as patching
import recurrent_hooks.engine.dispatch.tap as dispatch_impl
import recurrent_hooks.engine.standalone as standalone_impl
import recurrent_hooks.engine.tracking.threads as threads_impl
from recurrent_hooks.engine.handle.mixer import RecurrentMixer

hook_removed = RecurrentMixer.hook_removed  # the last hook removed releases the kernels (test_leak_fixture patches it)


# The test models are tiny: one thread is several times faster than two threads contending for two cores.
torch.set_num_threads(1)


# A test asks for its path through the policy of its watches (`rh.watch(model, paths=rh.Paths(rule="fixed"))`,
# `Paths(rule="loop")`): every other test runs the shipped default, the cost model.


@pytest.fixture(autouse=True)
def nothing_left_patched():
    """Fail the test if it leaves bindings, taps or running mixers behind (and clean up for the next test)."""
    yield
    leaks = _leaks_and_cleanup()
    assert not any(leaks.values()), f"the test left state behind: {leaks}"


def _leaks_and_cleanup() -> dict[str, object]:
    """What a test left behind, measured before anything is cleaned; then every cleanup step, each one run even if
    one before it raised (those errors are reported under "cleanup errors", so the leak's diagnostic still fails the
    test, and the next test starts clean)."""
    leaks: dict[str, object] = {
        "bindings": sorted(patching._BINDINGS),
        "taps": len(dispatch_impl._TAPS),
        "running": len(threads_impl.THREAD.running),
        "inside a hook": threads_impl.THREAD.in_hook,
        "standalone hooks": len(standalone_impl._STANDALONE),
    }
    errors: list[str] = []

    def attempt(step, *args) -> None:
        try:
            step(*args)
        except Exception as error:  # noqa: BLE001 -- reported with the leaks, after the other steps ran
            errors.append(f"{getattr(step, '__name__', step)}: {type(error).__name__}: {error}")

    for mixer in list(standalone_impl._STANDALONE.values()):
        attempt(_remove_standalone_hooks, mixer)
    attempt(threads_impl.THREAD.running.clear)
    attempt(setattr, threads_impl.THREAD, "in_hook", 0)
    if errors:
        leaks["cleanup errors"] = errors
    return leaks


def _remove_standalone_hooks(mixer) -> None:
    """Drop every standalone hook of `mixer`; the last one removed releases its kernels (`hook_removed`)."""
    mixer._hooks.clear()
    hook_removed(mixer)


# -- the device: `pytest --device cuda` (default cpu) --------------------------------------------------------------
#
# tests/helpers/_models.py's `build` and `random_ids` put models and ids on `_models.DEVICE`, set from the option in
# `pytest_configure` (a device this machine lacks is refused there, by name); a test marked
# `cpu_only(reason=...)` is skipped off the CPU with its reason (tests/helpers/_device.py).


# -- the full matrices: one family per kind by default, every family with `pytest --full` ------------------------
#
# A test marked `one_per_kind` runs by default for one family of each kind (`_contract.one_family_per_kind`: the
# registry's first of the kind, but qwen3_5 for gated DeltaNet) and for every family with `--full`; a test marked
# `full` runs only with `--full`. A test left out is reported as skipped, with the reason, in pytest's summary
# (`-ra`), never silently; `--only-full` runs just the tests the default leaves out (`.ci/run` runs the default
# suite, then those). `--one-family-per-kind` deselects the other families' cases of every test over families
# (`.ci/run`'s quick run on the oldest supported transformers).

FULL = "the full matrix: `pytest --full` runs it (README, Tests)"


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="also run the slow matrices on every family")
    parser.addoption("--only-full", action="store_true", help="run only what the default suite leaves out")
    parser.addoption(
        "--one-family-per-kind",
        action="store_true",
        help="deselect every case of a test over families but those of one family of each kind"
        " (.ci/run's quick run on the oldest supported transformers)",
    )
    parser.addoption(
        "--device",
        default="cpu",
        help="where tests/helpers/_models.py's build() and random_ids() put models and ids (default cpu;"
        " cuda on a GPU machine): references stay float64 on the CPU, tests marked cpu_only skip",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "full: a slow case, run only with --full")
    config.addinivalue_line("markers", "one_per_kind: a matrix over families, one family per kind without --full")
    config.addinivalue_line("markers", _device.CPU_ONLY)
    _models.DEVICE = _device.resolve(config.getoption("--device"))


def _representatives() -> set[str]:
    return set(one_family_per_kind())


def _left_out_by_default(item, representatives: set[str]) -> bool:
    if item.get_closest_marker("full"):
        return True
    if item.get_closest_marker("one_per_kind"):
        params = getattr(item, "callspec", None)
        family = params.params.get("family") if params is not None else None
        assert family is not None, f"{item.nodeid} is marked one_per_kind but has no `family` parameter"
        return family not in representatives
    return False


def _another_family_of_its_kind(item, representatives: set[str]) -> bool:
    params = getattr(item, "callspec", None)
    family = params.params.get("family") if params is not None else None
    return isinstance(family, str) and family in rh.FAMILIES and family not in representatives


def pytest_collection_modifyitems(config, items):
    _device.skip_cpu_only(items, _models.DEVICE)
    if config.getoption("--one-family-per-kind"):
        representatives = _representatives()
        others = [item for item in items if _another_family_of_its_kind(item, representatives)]
        if others:  # reported by pytest as deselected
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if not _another_family_of_its_kind(item, representatives)]
    full, only_full = config.getoption("--full"), config.getoption("--only-full")
    if full and not only_full:
        return
    representatives = _representatives()
    skip = pytest.mark.skip(reason=FULL)
    kept, dropped = [], []
    for item in items:
        left_out = _left_out_by_default(item, representatives)
        if only_full:
            (kept if left_out else dropped).append(item)
        else:
            if left_out:
                item.add_marker(skip)
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
