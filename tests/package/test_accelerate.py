"""Watching models that accelerate runs with offloaded weights: big-model inference with
``device_map="auto"`` and disk offload, and ``accelerate.cpu_offload``.

accelerate moves weights in and out around each forward with its own hooks (``module._hf_hook``, a
wrapped ``forward``); the library adds torch forward hooks on the mixer modules and rebinds the
family's kernels. Each test runs the same thing on the plain model and on the offloaded one, reloaded
from the same ``save_pretrained`` directory, and compares: kept states and windows, a
``set_state_after`` write, a ``register_state_hook`` that changes the state, and greedy generate.
No GPU is involved: the execution device is the CPU and the offloaded weights live on disk (or in a
CPU state dict for ``cpu_offload``), so a module's parameters are on the meta device between forwards.

accelerate is a test dependency (the ``test`` extra): without it this module fails, it does not skip.
"""

import pytest
import torch

try:
    import accelerate
except ImportError as error:  # fail, not skip: CI installs the test extra, which has accelerate
    raise ImportError("tests/package/test_accelerate.py needs accelerate: pip install -e '.[test]'") from error

from _compare import assert_close, assert_equal
from _models import PAD, build, random_ids

import recurrent_hooks as rh

T = 13
ALL = ("states", "windows", "inputs", "outputs")
# A CPU budget per family for device_map="auto" that leaves some of the decoder layers in memory and
# offloads the rest to disk (accelerate 1.15; the test below checks what the map really is).
CPU_BUDGET = {"qwen3_5": "150KB", "mamba2": "80KB", "mamba": "60KB"}
FAMILIES = list(CPU_BUDGET)  # gated DeltaNet, Mamba-2, Mamba-1
pytestmark = pytest.mark.cpu_only(
    reason="the execution device here is the CPU (accelerate offloads to the CPU and the"
    " disk): on a GPU the execution device would be the GPU, which these tests do"
    " not build"
)


def _device_of(model, path: str) -> str:
    """The device `hf_device_map` assigns to the module at `path` (its longest matching prefix)."""
    matches = [name for name in model.hf_device_map if name == "" or path == name or path.startswith(name + ".")]
    return str(model.hf_device_map[max(matches, key=len)])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a directory holding its tiny model, written with save_pretrained."""
    root = tmp_path_factory.mktemp("saved")
    paths = {}
    for family in FAMILIES:
        paths[family] = root / family
        build(family).save_pretrained(paths[family])
    return paths


def _load(family, path, how, tmp_path):
    cls = type(build(family))
    if how == "disk":
        model = cls.from_pretrained(
            path,
            device_map="auto",
            offload_folder=tmp_path / "offload",
            max_memory={"cpu": CPU_BUDGET[family], "disk": "1GB"},
        )
    else:
        model = accelerate.cpu_offload(cls.from_pretrained(path), execution_device="cpu")
    return model.eval()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=["disk", "cpu_offload"])
def models(request, family, saved, tmp_path):
    """(plain, offloaded): the same weights, loaded as they are and loaded offloaded."""
    plain = type(build(family)).from_pretrained(saved[family]).eval()
    return plain, _load(family, saved[family], request.param, tmp_path)


def _offloaded_mixers(model):
    """Paths of the mixer modules whose weights are not in memory between forwards."""
    with rh.watch(model) as w:
        modules = {m.module: m for m in w.mixers}
    paths = [path for path, module in model.named_modules() if module in modules]
    offloaded = [
        p
        for p, module in model.named_modules()
        if module in modules and all(param.device.type == "meta" for param in module.parameters())
    ]
    return paths, offloaded


def test_weights_are_really_offloaded(models, family):
    plain, model = models
    paths, offloaded = _offloaded_mixers(model)
    assert offloaded, f"no mixer of {family} is offloaded: {paths}"
    if hasattr(model, "hf_device_map"):  # device_map="auto": what the map says is what happened
        disk = [p for p in paths if _device_of(model, p) == "disk"]
        assert disk == offloaded, f"hf_device_map {model.hf_device_map}: mixers on disk {disk}, meta {offloaded}"
        if family != "mamba":  # mamba's two layers are grouped: all on disk
            assert len(disk) < len(paths), f"every mixer is on disk: {model.hf_device_map}"
    else:  # cpu_offload: every weight on the meta device, accelerate's hook on the model
        assert offloaded == paths and hasattr(model, "_hf_hook")
    ids = random_ids(2, T)
    with torch.no_grad():
        assert_close("offloaded logits", plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


def test_kept_states_equal_the_plain_model(models):
    plain, model = models
    ids = random_ids(2, T)
    runs = []
    for m in (plain, model):
        with rh.watch(m, keep=ALL) as w, torch.no_grad():
            logits = m(ids).logits
        runs.append((w, logits))
    (w0, logits0), (w1, logits1) = runs
    assert_close("logits under a watch", logits0, logits1, rtol=1e-5, atol=1e-6)
    assert [m.layer for m in w0.mixers] == [m.layer for m in w1.mixers]
    for a, b in zip(w0.mixers, w1.mixers):
        assert_close(f"{b} states", a.states, b.states, rtol=1e-5, atol=1e-6)
        assert_close(f"{b} conv windows", a.windows, b.windows, rtol=1e-5, atol=1e-6)
        for name, value in a.values().items():  # computed from inputs recorded while the weights were loaded
            assert_close(f"{b} value {name}", value, b.values()[name], rtol=1e-5, atol=1e-6)


def test_a_write_equals_the_plain_model(models):
    """set_state_after on the prompt: same later logits, same continued states and the same cache."""
    plain, model = models
    ids = random_ids(2, T)
    with rh.watch(plain, keep=ALL) as w, torch.no_grad():
        plain(ids)
    value = w.mixers[-1].state_after(4) * 3 + 0.1
    runs = []
    for m in (plain, model):
        with rh.watch(m, keep=ALL) as w, torch.no_grad():
            w.mixers[-1].set_state_after(4, value)
            out = m(ids, use_cache=True)
        runs.append((w, out))
    (w0, out0), (w1, out1) = runs
    change = (out0.logits[:, 5:] - plain(ids).logits[:, 5:]).abs().max()
    assert change > 1e-6, f"the write changed nothing ({change})"
    assert_close("logits after a write", out0.logits, out1.logits, rtol=1e-5, atol=1e-6)
    for a, b in zip(w0.mixers, w1.mixers):
        assert_close(f"{b} states after a write", a.states, b.states, rtol=1e-5, atol=1e-6)
        assert_close(
            f"{b} cached state",
            out0.past_key_values.get_recurrent_state(a.layer),
            out1.past_key_values.get_recurrent_state(b.layer),
            rtol=1e-5,
            atol=1e-6,
        )
    assert_close("the written state", value, w1.mixers[-1].state_after(4), rtol=0, atol=0)


def _hooked_generate(model, ids):
    """Greedy generate with a hook on every token of the first mixer that records and damps its state."""
    seen = []

    def damp(mixer, call, token, state):
        seen.append((call, token, state.clone()))
        return state * 0.8

    with rh.watch(model, keep=ALL) as w, torch.no_grad():
        w.mixers[0].register_state_hook(damp)
        tokens = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    return w, tokens, seen


def test_hooks_and_greedy_generate_equal_the_plain_model(models):
    plain, model = models
    ids = random_ids(2, T)
    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    with rh.watch(model, keep=ALL) as w1, torch.no_grad():
        assert_equal(
            "greedy generate, states kept",
            expected,
            model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=PAD),
        )
    with rh.watch(plain, keep=ALL) as w0, torch.no_grad():
        plain.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    for a, b in zip(w0.mixers, w1.mixers):
        assert len(b.calls) == 5
        for call in range(5):
            assert_close(f"{b} call {call} states", a.calls[call].states, b.calls[call].states, rtol=1e-5, atol=1e-6)

    w0, tokens0, seen0 = _hooked_generate(plain, ids)
    w1, tokens1, seen1 = _hooked_generate(model, ids)
    assert_equal("greedy generate with a hook", tokens0, tokens1)
    assert [(c, t) for c, t, _ in seen1] == [(0, t) for t in range(T)] + [(k, 0) for k in range(1, 5)]
    assert [(c, t) for c, t, _ in seen0] == [(c, t) for c, t, _ in seen1]
    assert_close(
        "hook inputs", torch.stack([s for *_, s in seen0]), torch.stack([s for *_, s in seen1]), rtol=1e-5, atol=1e-6
    )
    assert_close(
        "kept states with a hook", w0.mixers[0].calls[0].states, w1.mixers[0].calls[0].states, rtol=1e-5, atol=1e-6
    )


def test_a_standalone_hook_equals_the_plain_model(models):
    plain, model = models
    ids = random_ids(2, T)
    results = []
    for m in (plain, model):
        with rh.watch(m) as w:
            module = w.mixers[0].module
        seen = []
        handle = rh.register_state_hook(module, lambda mixer, c, t, s: seen.append(s.clone()) or s * 0.5, token=6)
        try:
            with torch.no_grad():
                results.append((m(ids).logits, seen))
        finally:
            handle.remove()
    (logits0, seen0), (logits1, seen1) = results
    assert len(seen1) == 1
    assert_close("standalone hook input", seen0[0], seen1[0], rtol=1e-5, atol=1e-6)
    assert_close("logits with a standalone hook", logits0, logits1, rtol=1e-5, atol=1e-6)


def test_accelerate_hooks_survive_the_watch(models):
    """After the block: no torch hook of the library left, accelerate's hooks still in place and working."""
    plain, model = models
    accelerate_hooks = {name: module._hf_hook for name, module in model.named_modules() if hasattr(module, "_hf_hook")}
    assert accelerate_hooks
    ids = random_ids(1, 5)
    with rh.watch(model, keep=ALL) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 0.5, token=2)
        model(ids)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert accelerate_hooks == {
        name: module._hf_hook for name, module in model.named_modules() if hasattr(module, "_hf_hook")
    }
    _, offloaded = _offloaded_mixers(model)
    assert offloaded, "after the watch, the offloaded weights were left in memory"
    with torch.no_grad():
        assert_close("logits after the watch", plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
