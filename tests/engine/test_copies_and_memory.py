"""A copy of a watched model is the plain model; what a watch kept is freed without the garbage collector and
held once."""

import contextlib
import copy
import gc
import io
import weakref

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.memory_parts import map_parts, parts_of

COPIED = ["qwen3_5", "mamba2", "mamba", "xlstm", "rwkv", "recurrent_gemma"]


def _library_objects(model: torch.nn.Module) -> list[str]:
    """What of the library a model holds: module hooks, and attributes of its modules that are the library's."""
    found = []
    for path, module in model.named_modules():
        hooks = {**module._forward_pre_hooks, **module._forward_hooks}
        found += [f"{path}: hook {hook!r}" for hook in hooks.values()]
        for owner in (module, *(value for value in vars(module).values() if not isinstance(value, torch.Tensor))):
            found += (
                [
                    f"{path}.{name}"
                    for name, value in vars(owner).items()
                    if getattr(value, "__recurrent_hooks__", False)
                ]
                if hasattr(owner, "__dict__")
                else []
            )
    return found


@contextlib.contextmanager
def _watched_with_write(model, ids):
    """Inside a watch of `model` that keeps states, counts its hook's calls and writes ones after token 2 of every
    call: the watch, the hook's counter and the model's logits under the write (the watch is left on the way out)."""
    w = rh.watch(model, keep=("states",)).__enter__()
    try:
        seen = []
        mix = w.mixers[0]
        mix.register_state_hook(lambda m, call, token, state: seen.append(call))
        model(ids)
        mix.set_state_after(2, map_parts(torch.ones_like, mix.state_after(2)), call=None)
        yield w, seen, model(ids).logits
    finally:
        w.__exit__(None, None, None)


@pytest.mark.parametrize("family", COPIED)
def test_deepcopy_inside_a_watch_is_the_plain_model(family):
    model, ids = build(family), random_ids(2, 6)
    with torch.no_grad():
        plain = model(ids).logits
        with _watched_with_write(model, ids) as (w, seen, written):
            assert (written - plain).abs().max() > 1e-3, "the write should change the watched model's logits"
            twin = copy.deepcopy(model)
            assert _library_objects(twin) == []
            calls, hooked = len(w.mixers[0].calls), len(seen)
            assert_close("the copy inside the block", plain, twin(ids).logits)
            assert (len(w.mixers[0].calls), len(seen)) == (calls, hooked), "the copy ran the watch's hooks"
        assert_close("the model after the block", plain, model(ids).logits)
        assert_close("the copy after the block", plain, twin(ids).logits)
        assert _library_objects(twin) == []


def _pickled(model):
    """`model` through `torch.save` and `torch.load` (a pickle of the whole model)."""
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    return torch.load(saved, weights_only=False)


def _mixer_module(model):
    return next(module for module in model.modules() if rh.registry.mixer_of(module) is not None)


@pytest.mark.parametrize("family", ["qwen3_5", "xlstm", "recurrent_gemma"])
def test_a_copy_of_a_model_with_a_standalone_hook_is_the_plain_model(family):
    """A deep copy or a pickle of a model whose mixer has a standalone hook (no watch) is the plain model: its
    forward runs none of the hooks, and it holds none of the library's objects, while the hook is live and after."""
    model, ids = build(family), random_ids(2, 6)
    with torch.no_grad():
        plain = model(ids).logits
        seen = []
        handle = rh.register_state_hook(
            _mixer_module(model),
            lambda m, c, t, s: seen.append(t) or map_parts(torch.zeros_like, s) if t == 2 else None,
        )
        try:
            hooked = model(ids).logits
            assert seen and (hooked - plain).abs().max() > 0, "the standalone hook did not run"
            twin, loaded = copy.deepcopy(model), _pickled(model)
            calls = len(seen)
            assert_close("the copy while the hook is live", plain, twin(ids).logits)
            assert_close("the unpickled model while the hook is live", plain, loaded(ids).logits)
            assert len(seen) == calls, "a copy ran the standalone hook"
        finally:
            handle.remove()
        for name, copied in (("the copy", twin), ("the unpickled model", loaded)):
            assert_close(f"{name} after the hook", plain, copied(ids).logits)
            assert _library_objects(copied) == [], name


@pytest.mark.parametrize("family", ["qwen3_5", "xlstm", "rwkv"])
def test_pickled_watched_model_is_the_plain_model(family):
    model, ids = build(family), random_ids(2, 6)
    with torch.no_grad():
        plain = model(ids).logits
        with _watched_with_write(model, ids) as (_, seen, _):
            loaded = _pickled(model)
            hooked = len(seen)
            assert_close("the unpickled model inside the block", plain, loaded(ids).logits)
            assert len(seen) == hooked, "the unpickled model ran the watch's hooks"
        assert _library_objects(loaded) == []  # its inert hooks went at its first forward
        assert_close("the unpickled model after the block", plain, loaded(ids).logits)


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _kept_tensor(mix):
    return parts_of(mix.calls[0]._kept["state"][0][1])[0][1]


@pytest.mark.parametrize("family", ["qwen3_5", "xlstm"])
@pytest.mark.parametrize("run", ["forward", "generate"])
def test_a_dropped_watch_is_freed_without_the_garbage_collector(family, run, no_gc):
    model, ids = build(family), random_ids(1, 5)
    with torch.no_grad():
        with rh.watch(model, keep=("states",)) as w:
            w.mixers[0].register_state_hook(lambda m, call, token, state: None)
            if run == "generate":
                model.generate(ids, max_new_tokens=3, do_sample=False)
            else:
                model(ids)
        w.mixers[0].states  # read after the block: still there
        dead = [weakref.ref(_kept_tensor(w.mixers[0])), weakref.ref(w.mixers[0]), weakref.ref(w)]
        del w
    assert [ref() is None for ref in dead] == [True, True, True]


def test_a_removed_standalone_hook_is_freed_without_the_garbage_collector(no_gc):
    model, ids = build("qwen3_5"), random_ids(1, 5)

    class Hook:
        def __call__(self, mixer, call, token, state):
            return None

    hook = Hook()
    module = model.model.layers[0].linear_attn
    handle = rh.register_state_hook(module, hook)
    dead = [weakref.ref(hook), weakref.ref(rh.engine.standalone._STANDALONE[module])]
    with torch.no_grad():
        model(ids)
    handle.remove()
    del hook, handle
    assert [ref() is None for ref in dead] == [True, True]


def _storage(tensor):
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "family,memory",
    [("qwen3_5", "state"), ("qwen3_5", "window"), ("xlstm", "state"), ("rwkv", "state"), ("zamba", "state")],
)
def test_reading_states_keeps_one_copy(family, memory):
    model, ids = build(family), random_ids(2, 5)
    name = "states" if memory == "state" else "windows"
    with torch.no_grad(), rh.watch(model, keep=(name,)) as w:
        model(ids)
    mix = w.mixers[0]
    call = mix.calls[-1]
    stacked = getattr(call, name)
    assert getattr(call, name) is stacked
    after = mix.state_after if memory == "state" else mix.window_after
    for per_kernel_call in call._kept[memory]:
        for token, kept in per_kernel_call.items():
            for (part, value), (_, whole) in zip(parts_of(kept), parts_of(stacked)):
                assert _storage(value) == _storage(whole), f"token {token} part {part!r}: a second copy"
    for token in range(ids.shape[1]):
        for (part, value), (_, whole) in zip(parts_of(after(token)), parts_of(stacked)):
            assert_close(f"{name} after token {token} {part}", whole[:, token], value)
