"""Writes at a different token in each batch row (a tensor of tokens or a mask), and writes on call sets."""

import pytest
import torch
from _compare import assert_close
from _contract import in_segments, one_family_per_kind
from _models import PAD, build, random_ids

import recurrent_hooks as rh

T = 13
ONE_PER_KIND = one_family_per_kind(in_segments)  # the kinds with chunk-wise maths


@pytest.fixture(params=ONE_PER_KIND)
def model(request):
    return build(request.param)


def zero_memory(model, ids, token=0):
    with rh.watch(model, keep=("states", "windows")) as w, torch.no_grad():
        model(ids)
    memory = w.mixers[0].memory_after(token)
    return rh.Memory(memory.state * 0 + 0.5, memory.window * 0)


# "fast paths": the fixed rule, the chunk-wise states (the cost model would take the token loop at these dims)
@pytest.mark.parametrize("fast", [False, True], ids=["token loop", "fast paths"])
def test_a_write_per_row_equals_each_row_written_alone(model, fast):
    paths = rh.Paths(rule="fixed") if fast else rh.Paths(rule="loop")
    ids = random_ids(3, T)
    value = zero_memory(model, ids)
    per_row = [2, 5, T - 1]
    mask = torch.zeros(3, T, dtype=torch.bool)
    mask[torch.arange(3), torch.tensor(per_row)] = True
    runs = {}
    for name, token in (("tokens", torch.tensor([2, 5, -1])), ("mask", mask)):
        with rh.watch(model, keep=("states",), paths=paths) as w, torch.no_grad():
            w.mixers[0].set_memory_after(token, value)
            runs[name] = (model(ids).logits, w.mixers[0].states)
    for row, token in enumerate(per_row):
        with rh.watch(model, keep=("states",), paths=paths) as alone, torch.no_grad():
            alone.mixers[0].set_memory_after(token, value)
            logits = model(ids).logits
        tolerance = dict(rtol=0, atol=0) if not fast else dict(rtol=1e-5, atol=1e-6)  # segments round differently
        for name, (got_logits, got_states) in runs.items():
            assert_close(f"{name}: row {row} logits", logits[row], got_logits[row], **tolerance)
            assert_close(f"{name}: row {row} states", alone.mixers[0].states[row], got_states[row], **tolerance)


def test_a_write_on_every_decode_step(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        model(ids)
    value = w.mixers[0].state_after(-1) * 0.25
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        w.mixers[0].set_state_after(-1, value, call=None)  # the prompt's last token, and every decode step
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=PAD)
    for call in range(4):
        assert_close(f"call {call}", value, w.mixers[0].state_after(-1, call=call), rtol=0, atol=0)


def test_per_row_writes_refuse_bad_tokens():
    model = build("qwen3_5")
    ids = random_ids(3, T)
    value = zero_memory(model, ids).state
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match=r"per-row tokens must be a 1-d integer tensor"):
            w.mixers[0].set_state_after(torch.tensor([1.0, 2.0, 3.0]), value)
        with pytest.raises(rh.InvalidValue, match=r"the mask of tokens selects no token"):
            w.mixers[0].set_state_after(torch.zeros(3, T, dtype=torch.bool), value)
    with pytest.raises(rh.InvalidValue, match=r"set_state_after: per-row tokens for 2 rows, but the call has batch 3"):
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].set_state_after(torch.tensor([1, 2]), value)
            model(ids)
    with pytest.raises(rh.InvalidValue, match=r"targets token 13, but call 0 \(torch_chunk_gated_delta_rule\) has 13"):
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].set_state_after(torch.tensor([1, 2, T]), value)
            model(ids)
