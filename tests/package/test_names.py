"""The renamed names. Each former name still works for one release, warns exactly once with a
`RecurrentHooksDeprecationWarning` that names the new name, and gives what the new name gives; a mixer is
reachable by its module path as well as by its layer.

The pytest configuration turns this warning into an error everywhere else, so the library, its docs and the
other tests use the new names only.
"""

import warnings

import pytest
import torch
from _compare import assert_equal
from _models import build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.extend as extend

T = 8


@pytest.fixture(scope="module")
def model():
    return build("qwen3_5")  # gated DeltaNet: a state and a convolution window; linear_attn at layers 0 and 2


def warns_once(new, read, most=1):
    """`read()`, checking that it gave one deprecation warning (up to `most` of the same), naming `new`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = read()
    deprecations = [w for w in caught if issubclass(w.category, rh.RecurrentHooksDeprecationWarning)]
    assert 1 <= len(deprecations) <= most, [str(w.message) for w in deprecations]
    assert all(new in str(w.message) for w in deprecations), [str(w.message) for w in deprecations]
    assert issubclass(rh.RecurrentHooksDeprecationWarning, FutureWarning)
    return value


@pytest.fixture(scope="module")
def kept(model):
    with rh.watch(model, keep=("states", "windows", "inputs", "outputs")) as w, torch.no_grad():
        model(random_ids(2, T))
    return w


def test_call_parts_is_kernel_calls(kept):
    call = kept.mixers[0].calls[0]
    assert warns_once("Call.kernel_calls", lambda: call.parts) is call.kernel_calls
    assert len(call.kernel_calls) == 1 and call.kernel_calls[0].inputs is call.inputs


def test_the_window_readers_are_renamed(kept):
    mixer = kept.mixers[0]
    call = mixer.calls[0]
    assert_equal("Call.conv_states", call.windows, warns_once("Call.windows", lambda: call.conv_states))
    assert_equal("mixer.conv_states", mixer.windows, warns_once("RecurrentMixer.windows", lambda: mixer.conv_states))
    assert_equal(
        "mixer.conv_state_after",
        mixer.window_after(3),
        warns_once("RecurrentMixer.window_after", lambda: mixer.conv_state_after(3)),
    )
    memory = mixer.memory_after(3)
    assert_equal("Memory.conv_state", memory.window, warns_once("Memory.window", lambda: memory.conv_state))
    assert memory._fields == ("state", "window")


def test_keep_conv_states_is_keep_windows(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=("windows",)) as new, torch.no_grad():
        model(ids)
    old = warns_once("keep='windows'", lambda: rh.watch(model, keep=("conv_states",)))
    with old, torch.no_grad():
        model(ids)
    assert_equal("keep=('conv_states',)", new.mixers[0].windows, old.mixers[0].windows)
    some = warns_once("keep='windows'", lambda: rh.watch(model, keep={"conv_states": [2]}))
    with some, torch.no_grad():
        model(ids)
    assert_equal("keep={'conv_states': [2]}", new.mixers[0].window_after(2), some.mixers[0].window_after(2))


def test_set_conv_state_after_is_set_window_after(model, kept):
    ids = random_ids(2, T)
    window = torch.zeros_like(kept.mixers[0].window_after(3))
    with rh.watch(model) as w, torch.no_grad():
        w.mixers[0].set_window_after(3, window)
        expected = model(ids).logits
    with rh.watch(model) as w, torch.no_grad():
        warns_once("RecurrentMixer.set_window_after", lambda: w.mixers[0].set_conv_state_after(3, window))
        got = model(ids).logits
    assert_equal("a window written by its former name", expected, got)


def test_which_conv_state_is_which_window(model):
    ids = random_ids(2, T)
    seen = {"window": [], "conv_state": []}
    with rh.watch(model, keep=("windows",)) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: seen["window"].append(s.clone()), memory="window")
        warns_once(
            "'window'",
            lambda: w.mixers[0].register_state_hook(
                lambda m, c, t, s: seen["conv_state"].append(s.clone()), memory="conv_state"
            ),
        )
        model(ids)
    assert len(seen["window"]) == T
    for t, (a, b) in enumerate(zip(seen["window"], seen["conv_state"], strict=True)):
        assert_equal(f"the window hooked at token {t}", a, b)
        assert_equal(f"the window hooked at token {t} is the kept one", w.mixers[0].window_after(t), a)


def test_which_is_memory(model):
    """`register_state_hook(which=...)` is the former name of `memory=`: it warns and hooks the same memory; both
    at once are refused."""
    ids = random_ids(2, T)
    seen = {"memory": [], "which": []}
    with rh.watch(model) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: seen["memory"].append(s.clone()), memory="window")
        warns_once(
            "memory=",
            lambda: w.mixers[0].register_state_hook(lambda m, c, t, s: seen["which"].append(s.clone()), which="window"),
        )
        with pytest.raises(rh.InvalidValue, match="`which` is the former name of `memory`"):
            w.mixers[0].register_state_hook(lambda *args: None, memory="state", which="state")
        model(ids)
    assert len(seen["memory"]) == T
    for t, (a, b) in enumerate(zip(seen["memory"], seen["which"], strict=True)):
        assert_equal(f"the window hooked at token {t}", a, b)


def test_a_sweeps_what_is_memory(model):
    """`patching_sweep(what=...)` is the former name of `memory=` ("memory": the whole memory, now None)."""
    clean, corrupt = random_ids(1, 8, seed=1)[0], random_ids(1, 8, seed=2)[0]
    metric = lambda logits: logits[:, -1, 3]  # noqa: E731
    for what, memory in (("state", "state"), ("memory", None)):
        new = rh.patching_sweep(model, clean, corrupt, metric, memory=memory, layers=[0], progress=False)
        old = warns_once(
            "memory=", lambda: rh.patching_sweep(model, clean, corrupt, metric, what=what, layers=[0], progress=False)
        )
        assert old.memory == new.memory == what
        assert_equal(f"what={what!r}", new.values, old.values)


def test_a_sweep_results_what_is_memory():
    """`Sweep.what` is the former name of `Sweep.memory`; a dict saved with the former key "what" loads."""
    sweep = rh.Sweep(torch.zeros(2, 3), torch.tensor(1.0), torch.tensor(0.0), (0, 2), (0, 1, 2), "state")
    assert warns_once("Sweep.memory", lambda: sweep.what) == sweep.memory == "state"
    saved = sweep.to_dict()
    assert "memory" in saved and "what" not in saved
    saved["what"] = saved.pop("memory")  # as a sweep saved before the rename
    loaded = rh.Sweep.from_dict(saved)
    assert loaded.memory == "state" and (loaded.layers, loaded.positions, loaded.heads) == ((0, 2), (0, 1, 2), None)
    assert_equal("the loaded values", sweep.values, loaded.values)


def test_attributes_chunks_are_pieces(model):
    """`attribute(method="chunks", chunk=...)` are the former names of `method="pieces", piece=...`."""
    frozen = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(1, 7, seed=1), random_ids(1, 7, seed=2)
    metric = lambda logits: logits[:, -1, 3]  # noqa: E731
    new = rh.attribute(frozen, clean, corrupt, metric, method="pieces", piece=4)
    old = warns_once("piece", lambda: rh.attribute(frozen, clean, corrupt, metric, method="chunks", chunk=4), most=2)
    assert_equal("state terms", new.state, old.state)


def test_a_handles_call_state_is_its_tracker(kept):
    assert warns_once("RecurrentMixer.tracker", lambda: kept.mixers[0].call_state) is kept.mixers[0].tracker


def test_differentiable_conv_state_is_window(model):
    with rh.watch(model, keep=("windows",)) as w:
        model(random_ids(2, T))
    call = w.mixers[0].calls[0]
    new = call.differentiable("window")
    old = warns_once("'window'", lambda: call.differentiable("conv_state"))
    assert len(new) == len(old) == 1 and new[0] is old[0]


def test_record_true_is_keep_inputs_and_outputs(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states", "inputs", "outputs")) as new, torch.no_grad():
        model(ids)
    old = warns_once("keep=('inputs', 'outputs')", lambda: rh.watch(model, keep=("states",), record=True))
    with old, torch.no_grad():
        model(ids)
    for name in new.mixers[0].calls[0].inputs:
        if isinstance(new.mixers[0].calls[0].inputs[name], torch.Tensor):
            assert_equal(
                f"record=True: input {name}", new.mixers[0].calls[0].inputs[name], old.mixers[0].calls[0].inputs[name]
            )
    assert_equal("record=True: the states", new.mixers[0].states, old.mixers[0].states)


@pytest.mark.parametrize("namespace", [rh, extend], ids=["recurrent_hooks", "recurrent_hooks.extend"])
@pytest.mark.parametrize(("old", "new"), [("StateSpace", "Mamba2StateSpace"), ("LinearAttention", "GatedDeltaNet")])
def test_the_kinds_former_names(namespace, old, new):
    assert warns_once(f"{namespace.__name__}.{new}", lambda: getattr(namespace, old)) is getattr(namespace, new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(namespace, old)
    assert [w.filename for w in caught] == [__file__], "the warning points at the line that reads the former name"
    assert old not in namespace.__all__
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchKind'"):
        namespace.NoSuchKind


def test_from_import_of_a_former_name_warns():
    def imported():
        from recurrent_hooks import StateSpace

        return StateSpace

    # the import looks the name up twice (importlib's hasattr, then the import): one warning or two, the same
    assert warns_once("Mamba2StateSpace", imported, most=2) is rh.Mamba2StateSpace


# -- a mixer by its module path ------------------------------------------------------------------------------------


def test_a_mixer_by_module_path_is_the_mixer_by_layer(model):
    paths = [path for path, module in model.named_modules() if type(module).__name__ == "Qwen3_5GatedDeltaNet"]
    assert paths == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        model(random_ids(2, T))
        assert w.mixer("model.layers.0.linear_attn") is w.mixer(0) is w.mixers[0]
        assert w.mixer("model.layers.2.linear_attn") is w.mixer(2) is w.mixers[1]
        assert w.mixer("model.layers.2.linear_attn").module is model.model.layers[2].linear_attn
    assert w.mixer("model.layers.2.linear_attn") is w.mixers[1]  # readable after the block, as w.mixers


def test_a_wrong_module_path_names_the_mixer_paths(model):
    with rh.watch(model) as w:
        with pytest.raises(
            rh.Unavailable,
            match=r"Watch.mixer: no recurrent mixer at module path"
            r" 'model.layers.1.linear_attn'; the mixer paths are"
            r" \['model.layers.0.linear_attn', 'model.layers.2.linear_attn'\]",
        ):
            w.mixer("model.layers.1.linear_attn")
        with pytest.raises(rh.Unavailable, match=r"module path 'model.layers.1.self_attn'"):
            w.mixer("model.layers.1.self_attn")  # a module that is there, but no recurrent mixer
    unentered = rh.watch(model)
    with pytest.raises(rh.Unavailable, match=r"the mixer paths are \[\] \(enter the watch first\)"):
        unentered.mixer("model.layers.0.linear_attn")
