"""State hooks without a watch (`rh.register_state_hook` on a mixer module), on qwen3_5: such a hook counts calls from
each prompt, steers every generate it sees, and shares the kernels' binding with the other hooks on the module and
with a watch beside it until the last handle goes; like a torch module hook, a hook whose handle is dropped stays
until the module dies, and then the kernels go back."""

import gc
import importlib

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids
from _qwen3_5 import T, bindings, generate, run

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as rh_patching
import recurrent_hooks.engine.standalone as standalone_impl


@pytest.fixture
def model():
    return build("qwen3_5")


def test_register_state_hook_without_a_watch_counts_from_each_prompt(model):
    seen = []
    before = bindings()
    handle = rh.register_state_hook(model.model.layers[0].linear_attn, lambda m, c, t, s: seen.append((c, t)), token=-1)
    assert isinstance(handle, torch.utils.hooks.RemovableHandle)
    assert all(getattr(f, "__recurrent_hooks__", False) for f in bindings().values())
    run(model)
    generate(model, 3)
    generate(model, 2)
    handle.remove()
    assert seen == [(0, T - 1), (0, T - 1), (1, 0), (2, 0), (0, T - 1), (1, 0)]
    assert bindings() == before
    run(model)
    assert len(seen) == 6


def test_standalone_hooks_share_the_binding_until_the_last_handle(model):
    before = bindings()
    mixer_module = model.model.layers[2].linear_attn
    first = rh.register_state_hook(mixer_module, lambda *a: None)
    second = rh.register_state_hook(mixer_module, lambda *a: None)
    first.remove()
    assert bindings() != before
    with rh.watch(model) as w:  # a watch beside a standalone hook
        run(model)
    second.remove()
    assert bindings() == before and len(w.mixers[1].calls) == 1
    with pytest.raises(rh.InvalidValue, match="expected a recurrent mixer module .* got Qwen3_5DecoderLayer"):
        rh.register_state_hook(model.model.layers[0], lambda *a: None)


def test_a_standalone_write_steers_generation(model):
    """The forward-hook workflow: a hook that returns a state steers every prompt it sees."""
    ids = random_ids(2, T)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    handle = rh.register_state_hook(model.model.layers[0].linear_attn, lambda m, c, t, s: s * 10, call=0, token=-1)
    with torch.no_grad():
        steered = model.generate(
            ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    handle.remove()
    assert_close("prompt logits unchanged", plain.logits[0], steered.logits[0], rtol=1e-5, atol=1e-5)
    assert (plain.logits[1] - steered.logits[1]).abs().max() > 1e-6


def test_a_dropped_standalone_handle_keeps_its_hook_until_the_module_dies():
    """Like a torch module hook: dropping the handle leaves the hook; the kernels go back when the module dies."""
    model = build("qwen3_5")
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    seen = []
    rh.register_state_hook(model.model.layers[0].linear_attn, lambda m, c, t, s: seen.append(c), token=-1)
    gc.collect()
    with torch.no_grad():
        model(random_ids(1, 5))
    assert (
        seen == [0]
        and ("transformers.models.qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule") in rh_patching._BINDINGS
    )
    del model
    gc.collect()
    assert not rh_patching._BINDINGS and not standalone_impl._STANDALONE
    assert not getattr(module.torch_chunk_gated_delta_rule, "__recurrent_hooks__", False)
