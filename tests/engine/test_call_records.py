"""What a call's record says at its edges, one test (or a few) each.

- kept positions that lie outside every call the mixer saw give a `RecurrentHooksWarning` on exit (they kept
  nothing), as writes whose call never ran do; negative positions keep working;
- a float64 model keeps float64 states, and its watched logits are the unwatched ones to float64 precision;
- `repr(call)` shows the shapes and dtypes of kept tensors, not their values;
- `call.inputs` / `call.output` say where a call's kernel data is (`call.conv`, `call.kernel_calls[head]`);
- a state of several parts with a part that is not a tensor: the error names the part and what it should be;
- rwkv under transformers' batched decode bug: `call.tokens` is the number of positions the WKV kernel ran.
"""

import warnings

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import build, random_ids
from _runs import greedy, logits_of

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.memory_parts import parts_of

T = 12


@pytest.fixture(scope="module")
def qwen():
    return build("qwen3_5")


def _no_library_warning():
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("error", rh.RecurrentHooksWarning)
    return context


# -- keep at positions outside every call ---------------------------------------------------------------------


def test_keep_outside_every_call_warns(qwen):
    ids = random_ids(2, T)
    with pytest.warns(
        rh.RecurrentHooksWarning,
        match=r"keep=\{'states': \[100\]\} kept nothing at token 100 on "
        r"GatedDeltaNet\(qwen3_5, layer 0\).*call 0: 12 tokens",
    ):
        with rh.watch(qwen, keep={"states": [100]}):
            logits_of(qwen, ids)


def test_keep_partly_outside_names_only_the_missing_positions(qwen):
    ids = random_ids(2, T)
    with pytest.warns(rh.RecurrentHooksWarning) as record:
        with rh.watch(qwen, keep={"states": [3, 40, -13]}) as w:
            logits_of(qwen, ids)
    messages = [str(r.message) for r in record if issubclass(r.category, rh.RecurrentHooksWarning)]
    assert len(messages) == 1, messages
    assert "token 40" in messages[0] and "token -13" in messages[0] and "token 3," not in messages[0], messages[0]
    assert w.mixers[0].state_after(3).shape[0] == 2


def test_keep_negative_and_generate_positions_do_not_warn(qwen):
    ids = random_ids(2, T)
    context = _no_library_warning()
    try:
        with rh.watch(qwen, keep={"states": [-1]}) as w:
            logits_of(qwen, ids)
        assert_equal("state_after(-1) is state_after(11)", w.mixers[0].state_after(11), w.mixers[0].state_after(-1))
        # token 4 lies outside every one-token decode step, but the prompt kept it: nothing to report
        with rh.watch(qwen, keep={"states": [4, -1]}) as w:
            greedy(qwen, ids, 3)
        assert w.mixers[0].state_after(4, call=0).shape[0] == 2
    finally:
        context.__exit__(None, None, None)


# -- float64 models ---------------------------------------------------------------------------------------------

# Kinds whose transformers kernels compute in the model's dtype when it is float64 (Mamba-1 promotes its float32
# A with the model's Δ; RWKV-4 follows its inputs). The gated delta rules, Mamba-2's prompt kernel and xLSTM's
# compute in float32 whatever the model's dtype (explicit casts, `inference_state_dtype`): the library does too.
FLOAT64_FAMILIES = ["mamba", "zamba", "rwkv"]


def _last_hidden(model, ids):
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states[-1]


@pytest.mark.parametrize("family", FLOAT64_FAMILIES)
@pytest.mark.parametrize("keep", [("states",), {"states": [4, -1]}], ids=["every-token", "segments"])
def test_float64_model_keeps_float64(family, keep):
    model = build(family).double()
    ids = random_ids(1 if family == "rwkv" else 2, T)
    # the last hidden state: some families return float32 logits whatever the model's dtype
    expected = _last_hidden(model, ids)
    with rh.watch(model, keep=keep) as w:
        got = _last_hidden(model, ids)
    assert expected.dtype == torch.float64
    assert_close(f"{family}: watched float64 last hidden state", expected, got, rtol=1e-12, atol=1e-13)
    for mixer in w.mixers:
        for name, part in parts_of(mixer.state_after(-1)):
            assert part.dtype == torch.float64, f"{mixer}: kept state part {name!r} is {part.dtype}"


# -- repr of a call ----------------------------------------------------------------------------------------------


def test_call_repr_shows_shapes_not_values(qwen):
    with rh.watch(qwen, keep=("states", "inputs", "outputs")) as w:
        logits_of(qwen, random_ids(2, T))
    text = repr(w.mixers[0].calls[0])
    assert len(text) < 1500, f"repr of a call is {len(text)} characters: {text[:300]}..."
    assert "Tensor[2, 12," in text and "float32" in text, text
    assert "kernel='torch_chunk_gated_delta_rule'" in text, text


# -- where a call's kernel data is -------------------------------------------------------------------------------


def test_short_convolution_inputs_point_to_conv():
    model = build("lfm2")
    with rh.watch(model, keep=("inputs", "outputs")) as w:
        logits_of(model, random_ids(2, T))
    call = w.mixers[0].calls[0]
    for name in ("inputs", "output"):
        with pytest.raises(rh.Unavailable, match=rf"no recurrence kernel.*call\.conv\.{name}") as info:
            getattr(call, name)
        assert "per head" not in str(info.value), str(info.value)
    assert call.conv.inputs is not None and call.conv.output is not None


def test_per_head_inputs_point_to_parts():
    model = build("zamba")
    with rh.watch(model, keep=("inputs", "outputs")) as w:
        logits_of(model, random_ids(2, T))
    call = w.mixers[0].calls[0]
    with pytest.raises(
        rh.Unavailable, match=r"made \d+ recurrence kernel calls \(one per head\).*call\.kernel_calls\[head\]"
    ):
        call.inputs


# -- states of several parts with a part that is not a tensor ------------------------------------------------------


@pytest.mark.parametrize("family", ["rwkv", "xlstm"])
def test_part_given_as_list_is_named(family):
    model = build(family)
    ids = random_ids(1, T)
    with pytest.raises(rh.InvalidValue, match=r"part '\w+' is a list, expected a Tensor of shape \(1, "):
        with rh.watch(model) as w:
            w.mixers[0].register_state_hook(lambda m, c, t, s: type(s)(*(p.tolist() for p in s)), call=0, token=3)
            logits_of(model, ids)
    with rh.watch(model, keep=("states",)) as w:
        logits_of(model, ids)
    state = w.mixers[0].state_after(3)
    listed = type(state)(state[0].tolist(), *state[1:])
    with rh.watch(model) as w:
        name = type(state)._fields[0]
        with pytest.raises(
            rh.InvalidValue,
            match=rf"set_state_after\(3, call=0\): part '{name}' is a list,"
            rf" expected a Tensor \(axes: ",
        ):
            w.mixers[0].set_state_after(3, listed)


# -- rwkv under transformers' batched decode bug --------------------------------------------------------------------


def test_rwkv_batched_decode_record_is_what_ran():
    model = build("rwkv")
    with rh.watch(model, keep=("states", "windows")) as w:
        greedy(model, random_ids(2, 5), 3)
    mixer = w.mixers[0]
    for call in mixer.calls:
        assert call.tokens == call.states.num.shape[1], (call.index, call.tokens, tuple(call.states.num.shape))
        assert_equal(
            f"call {call.index}: state_after(-1) is the last kept state",
            call.states.num[:, -1],
            mixer.state_after(-1, call=call.index).num,
        )
    assert mixer.calls[1].tokens == 2  # the one-token step ran the WKV kernel over batch (2) positions
