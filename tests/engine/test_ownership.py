"""Which mixer a kernel call belongs to, decided without stack frames.

While a watch or a standalone hook is active, the `__call__` of each watched mixer class pushes a per-thread entry
for every instance, watched or not, and pops it in a `finally`: a kernel call belongs to the innermost entry. These
tests pin what a stack walk got wrong: a kernel that a submodule of an unwatched mixer calls (the walk found the
submodule, not a mixer, and gave the call to the watched forward around it), and an interrupt after the kernels
(the walk left a stale entry until the next forward). The rest (threads, models inside hooks, checkpointing,
accelerate, compile) is pinned in test_reentrancy.py, test_families.py, test_accelerate.py and test_compile.py.
"""

import pathlib
import re

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import build, random_ids
from _runs import halved, halved_around
from torch import nn

import recurrent_hooks as rh
import recurrent_hooks.engine.tracking.threads as rh_threads
import recurrent_hooks.registry as rh_registry

T = 11


def _plain_states(model, ids):
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        model(ids)
    return {m.layer: m.states for m in w.mixers}


# recurrent_gemma's scan `_rnn_scan` is a method of RecurrentGemmaRglru, a submodule of the mixer
# (RecurrentGemmaRecurrentBlock); the others call their kernels from the mixer's own methods.
@pytest.mark.parametrize("family", ["recurrent_gemma", "qwen3_5", "mamba2"])
def test_an_unwatched_model_inside_a_watched_forward_runs_its_own_kernels_whoever_calls_them(family):
    """Model B (same family, unwatched) run from a torch hook on a projection of A's mixer: none of B's kernel
    calls is A's, even those a submodule of B's mixer makes, and A's hook does not reach B."""
    a, b = build(family, seed=0), build(family, seed=1)
    ids = random_ids(2, T)
    with torch.no_grad():
        plain_b = b(ids).logits
    want_a = halved(a, ids)[1].mixers[0].states
    first = next(m for m in a.modules() if rh_registry.family_of(m) is not None)
    projection = next(m for m in first.modules() if isinstance(m, nn.Linear))  # runs inside the mixer's forward
    w, inner = halved_around(a, b, ids, projection)
    assert len(inner) == 1
    assert_equal(f"{family}: B's logits inside A's forward", plain_b, inner[0])
    assert [len(m.calls) for m in w.mixers] == [1] * len(w.mixers)
    assert_close(f"{family}: A's states with the hook", want_a, w.mixers[0].states, rtol=0, atol=0)


def test_a_watched_model_inside_an_unwatched_forward_of_its_family_is_watched():
    """The other way round: A is watched, and runs from a torch hook inside an unwatched model B's mixer."""
    a, b = build("recurrent_gemma", seed=0), build("recurrent_gemma", seed=1)
    ids = random_ids(2, T)
    want_a = halved(a, ids)[1].mixers[0].states
    with torch.no_grad():
        plain_b = b(ids).logits
    first = next(m for m in b.modules() if rh_registry.family_of(m) is not None)
    projection = next(m for m in first.modules() if isinstance(m, nn.Linear))
    with rh.watch(a, keep=("states",)) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 0.5)
        handle = projection.register_forward_hook(lambda mod, args, out: a(ids) and None)
        try:
            got_b = b(ids).logits
        finally:
            handle.remove()
    assert_equal("B's logits around A", plain_b, got_b)
    assert [len(m.calls) for m in w.mixers] == [1] * len(w.mixers)
    assert_close("A's states inside B", want_a, w.mixers[0].states, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["watch", "standalone hook"])
def test_an_interrupt_after_the_kernels_leaves_no_entry_behind(how):
    """A KeyboardInterrupt from a forward hook of the mixer (after its kernels) skips torch's post-forward hooks;
    the mixer's own call pops its entry on the way out, so nothing is left for a later forward to find."""
    model = build("qwen3_5")
    ids = random_ids(2, T)
    mixer_module = model.model.layers[0].linear_attn
    seen = []

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = (
        rh.register_state_hook(mixer_module, lambda m, c, t, s: seen.append(c), token=-1)
        if how == "standalone hook"
        else None
    )

    def run():
        """A forward with the hook: the standalone one, or one registered in a watch."""
        with torch.no_grad():
            if handle is None:
                with rh.watch(model) as w:
                    w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append(c), token=-1)
                    model(ids)
            else:
                model(ids)

    projection = mixer_module.register_forward_hook(interrupt, prepend=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            run()
        assert rh_threads.THREAD.running == []  # at once, not at the next forward
    finally:
        projection.remove()
    run()
    if handle is not None:
        handle.remove()
    assert rh_threads.THREAD.running == [] and seen == [0, 0]


def test_the_class_call_is_rebound_for_the_watch_only():
    """The mixer class's `__call__` is rebound while a watch or hook holds the family, and restored exactly."""
    model = build("qwen3_5")
    cls = type(model.model.layers[0].linear_attn)
    before = dict(vars(cls))
    with rh.watch(model):
        assert getattr(vars(cls).get("__call__"), "__recurrent_hooks__", False)
        with rh.watch(model):  # nested: one binding, counted
            assert getattr(vars(cls).get("__call__"), "__recurrent_hooks__", False)
        assert getattr(vars(cls).get("__call__"), "__recurrent_hooks__", False)
    assert dict(vars(cls)) == before
    handle = rh.register_state_hook(model.model.layers[0].linear_attn, lambda m, c, t, s: None)
    assert getattr(vars(cls).get("__call__"), "__recurrent_hooks__", False)
    handle.remove()
    assert dict(vars(cls)) == before
    with pytest.raises(RuntimeError), rh.watch(model):  # an exception in the block restores it too
        raise RuntimeError("out")
    assert dict(vars(cls)) == before


_FRAME_WORDS = re.compile(r"\b(_getframe|f_locals|f_back|inspect\.stack|currentframe)\b")


def test_no_module_of_the_package_reads_stack_frames():
    root = pathlib.Path(rh.__file__).parent
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _FRAME_WORDS.search(line)
    ]
    assert found == [], f"stack frames read in recurrent_hooks/: {found}"


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_forward_past_the_class_call_is_watched_and_an_interrupt_there_does_not_stick(interrupted):
    """`module._call_impl(...)` skips the class's `__call__`: the pre-forward hook pushes the entry and the
    post-forward hook pops it; an entry an interrupt left there is dropped when the module begins again."""
    model = build("qwen3_5")
    ids = random_ids(2, T)
    mixer_module = model.model.layers[0].linear_attn
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
    seen = []
    handle = rh.register_state_hook(mixer_module, lambda m, c, t, s: seen.append(c), token=-1)
    try:
        if interrupted:

            def interrupt(module, args, output):
                raise KeyboardInterrupt

            stop = mixer_module.register_forward_hook(interrupt, prepend=True)
            with pytest.raises(KeyboardInterrupt), torch.no_grad():
                mixer_module._call_impl(hidden)
            stop.remove()
        with torch.no_grad():
            out = mixer_module._call_impl(hidden)
            mixer_module._call_impl(hidden)
            through_call = mixer_module(hidden)
        assert rh_threads.THREAD.running == []
    finally:
        handle.remove()
    assert seen == [0] * (4 if interrupted else 3)
    assert rh_threads.THREAD.running == []
    assert_equal("the output past __call__ (the same path as through it)", through_call, out)
