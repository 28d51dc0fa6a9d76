"""What a watch keeps, on qwen3_5: nothing it was not asked for (a watch with hooks alone holds no tensor over 400
decode steps; kernel inputs and outputs only under `keep=`, each call's metadata always), its records and their reprs
say what they hold, and a call's memories are read (`kept`, `after`, `ran`, `replaced`) and written (`set_after`) by
the memory's name as by the named readers and writers."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids
from _qwen3_5 import T, run
from _reachable import tensor_bytes_reachable
from _runs import greedy_exactly as greedy

import recurrent_hooks as rh


@pytest.fixture
def model():
    return build("qwen3_5")


def test_a_hook_only_watch_over_a_long_generation_keeps_no_tensor():
    model = build("qwen3_5")
    norms = []  # what the hook keeps: Python floats
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: norms.append(float(s.norm())), token=-1)
        greedy(model, random_ids(1, T), 400)
    assert len(norms) == 400 and len(w.mixers[0].calls) == 400
    assert (w.mixers[0].calls[-1].kernel, w.mixers[0].calls[-1].tokens) == ("torch_recurrent_gated_delta_rule", 1)
    assert tensor_bytes_reachable(w) == 0
    with rh.watch(model, keep=("inputs",)) as kept:  # the yardstick: kept inputs are counted
        greedy(model, random_ids(1, T), 2)
    assert tensor_bytes_reachable(kept) > 0


def test_a_watch_keeps_kernel_inputs_and_outputs_only_when_asked(model):
    with rh.watch(model, keep=("states",)) as w:
        run(model)
    call = w.mixers[0].calls[0]
    assert (call.kernel, call.tokens, call.index) == ("torch_chunk_gated_delta_rule", T, 0)  # metadata is free
    with pytest.raises(
        rh.Unavailable,
        match=r"the kernel inputs of call 0 were not kept: pass keep=\('inputs',"
        r" 'outputs'\) to watch",
    ):
        call.inputs
    with pytest.raises(rh.Unavailable, match=r"the kernel inputs of call 0 were not kept"):
        w.mixers[0].values()
    assert call.kernel_calls[0].inputs is None and call.conv.inputs is None and w.mixers[0].states.shape[1] == T
    with rh.watch(model, keep=("inputs", "outputs")) as w:
        run(model)
    call = w.mixers[0].calls[0]
    assert set(call.output) == {"output", "final_state"} and call.inputs["value"].shape == (2, T, 4, 8)
    assert call.conv.inputs["hidden_states"].shape[1] == 64
    with rh.watch(model, keep=("outputs",)) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: None)
        run(model)
    call = w.mixers[0].calls[0]
    assert call.kernel_calls[0].inputs is None and call.output["output"].shape == (2, T, 4, 8) and call.tokens == T


def test_reprs_say_what_is_watched(model):
    with rh.watch(model, keep=("states",)) as w:
        run(model)
        assert repr(w) == (
            "Watch(Qwen3_5ForCausalLM, active, keep=('states',), mixers=[layer 0: 1 calls, layer 2: 1 calls])"
        )
    assert repr(w.mixers[0]) == "GatedDeltaNet(qwen3_5, layer 0)"
    assert w.mixers[0].calls[0].kernel == "torch_chunk_gated_delta_rule"


def test_a_call_reads_its_memories_by_name_and_says_where_they_were_replaced():
    """`Call.kept(memory)`, `after(memory, token)`, `ran(memory)` and `replaced(memory)`: the record's own readers,
    by the memory's name, as the mixer's `states`, `windows` and `state_after` read them."""
    model = build("qwen3_5")
    with rh.watch(model, keep=("states", "windows")) as w:
        mix = w.mixers[0]
        mix.register_state_hook(lambda mixer, call, token, state: state * 0.5 if token == 3 else None)
        model(random_ids(1, 8))
    call = mix.calls[0]
    assert call.kept("state") is call.states and call.kept("window") is call.windows
    assert_close("state after 2", mix.state_after(2), call.after("state", 2), rtol=0, atol=0)
    assert_close("window after -1", mix.window_after(-1), call.after("window", -1), rtol=0, atol=0)
    assert call.ran("state") == call.ran("window") == call.tokens == 8
    assert call.replaced() == frozenset({3}) and call.replaced("window") == frozenset()
    with pytest.raises(rh.InvalidValue, match="expected a memory, one of 'state', 'window', got 'states'"):
        call.kept("states")
    assert_close("mix.after", mix.state_after([1, 2]), mix.after("state", [1, 2]), rtol=0, atol=0)
    with pytest.raises(rh.InvalidValue, match="expected memory='state' or memory='window', got 'states'"):
        mix.after("states", 2)


def test_set_after_writes_the_memory_it_names():
    """`mix.set_after(memory, token, value)` is `set_state_after` / `set_window_after` by the memory's name."""
    model, ids = build("qwen3_5"), random_ids(1, 8)
    with rh.watch(model, keep=("states", "windows")) as w, torch.no_grad():
        model(ids)
    state, window = w.mixers[0].state_after(2) * 0.5, w.mixers[0].window_after(2) * 0.5
    runs = {}
    for name, write in {
        "generic": lambda mix: (mix.set_after("state", 2, state), mix.set_after("window", 2, window)),
        "named": lambda mix: (mix.set_state_after(2, state), mix.set_window_after(2, window)),
    }.items():
        with rh.watch(model) as v, torch.no_grad():
            write(v.mixers[0])
            runs[name] = model(ids).logits
    assert_close("set_after vs set_state_after and set_window_after", runs["named"], runs["generic"], rtol=0, atol=0)
