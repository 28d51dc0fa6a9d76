"""RWKV-4 time mixing (`WeightedKeyValue`): the kernels against transformers and the paper, and the family bar.

Kernels:
- the WKV loop against transformers' `rwkv_linear_attention_cpu` (outputs and new state, from no state and
  from a state), and the state it hands `on_token` after every token against a float64 recurrence written
  from the paper's equations (a_t, b_t; the library's (num, den, max) read as a = num e^max, b = den e^max);
- the token-shift method against transformers' `RwkvSelfAttention.extract_key_value` (prompt, prompt over a
  state, one-token step; batch 2 reproduces transformers' broadcast, bug 1);
- `on_token` replacements change only later tokens.

Family (parametrized by every family of the kind): the bar of tests/kinds/test_families.py, adapted to a model
without a Cache (the memory is the `state=` list) and to transformers' bugs: decoding with a state is
right for batch 1 only (bug 1), so every generate runs batch 1 and prompts run batch 2; attention_mask is
ignored (bug 2): the kind declares that pads enter its state (`LEFT_PADDING`, checked by the contract). All comparisons
are eval against eval (eval mode rescales weights in place; a no-op for the tiny 2-layer model, whose rescale factor is
2^0). The kind-agnostic part of the bar (parity, generate, the call counter, standalone hooks, the input gradient,
bindings) is tests/kinds/test_contract.py's.
"""

import inspect
import math

import pytest
import torch
from _compare import assert_close, assert_equal
from _contract import ContractReading, family_fixtures, perturbation
from _models import FAMILIES as BUILDERS
from _models import build, random_ids
from _runs import greedy, logits_of

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as patching
from recurrent_hooks.engine.declare.memory_parts import map_parts, stack_parts
from recurrent_hooks.extend import WkvState
from recurrent_hooks.kinds.wkv import extract_key_value, rwkv_linear_attention

FAMILIES = [name for name, row in rh.FAMILIES.items() if row.kind is rh.WeightedKeyValue]
ALL = ("states", "windows", "inputs", "outputs")
T = 13

# -- how the contract reads this kind (tests/kinds/test_contract.py, tests/helpers/_contract.py's ContractReading) -----


def perturbed_wkv(state, seed=1):
    """A different valid WKV state: num and den scaled per channel (den stays positive), max shifted (the token
    shift, a tensor: `perturbation`)."""
    if not isinstance(state, WkvState):
        return perturbation(state, seed)
    gen = torch.Generator().manual_seed(seed)
    scale = (torch.rand(state.num.shape, generator=gen) * 3 + 0.2).to(state.num.device)
    shift = torch.randn(state.max.shape, generator=gen).to(state.max.device)
    return WkvState(state.num * scale, state.den * scale, state.max + shift)


def wkv_memory(out, mixer, memory):
    """RWKV has no Cache: the model's `state` list ([1] the shifts, [2:5] num, den, max), layers on axis 2."""
    if memory == "state":
        return {"the model's state": WkvState(*(s[:, :, mixer.layer] for s in out.state[2:5]))}
    return {"the model's state": out.state[1][:, :, mixer.layer]}


def wkv_shift_in(mixer, call):
    """The token shift a call started from: the `state=` list's [1] it received."""
    return mixer.calls[call].conv.inputs["state"][1][:, :, mixer.layer]


CONTRACT = {
    rh.WeightedKeyValue: ContractReading(
        perturb=perturbed_wkv,
        carried=wkv_memory,
        window_in=wkv_shift_in,
        batch=1,
        grad_use_cache=False,
        loop_atol=0.0,
        window_tokens=(5, T - 1),
        split_tol=dict(rtol=1e-5, atol=1e-6),
        recomputes_once=True,
        finite_difference=("state", "window"),
        whole_memory_tol=dict(rtol=1e-5, atol=1e-6),
    )
}


BATCH, CHANNELS = 2, 16


def test_every_family_of_the_kind_has_a_tiny_model():
    assert FAMILIES and all(name in BUILDERS for name in FAMILIES)


def assert_state_close(name, expected, got, *, rtol, atol):
    """Two WKV states (`WkvState`s of tensors of any shape), part by part."""
    for value in (expected, got):
        assert isinstance(value, WkvState), f"{name}: expected WkvStates, got {type(value).__name__}"
    for field, a, b in zip(WkvState._fields, expected, got):
        assert_close(f"{name}, {field}", a, b, rtol=rtol, atol=atol)


def cat_states(states, dim):
    """WKV states concatenated part by part (the per-token stacks of consecutive calls)."""
    return map_parts(lambda *parts: torch.cat(parts, dim=dim), *states)


# -- references ---------------------------------------------------------------------------------------------------


def wkv_reference(time_decay, time_first, key, value, state=None):
    """wkv_t, a_t and b_t of every token in float64, from the paper's recurrent form of WKV (Peng et al. 2023):
        wkv_t = (a_{t-1} + e^{u+k_t} v_t) / (b_{t-1} + e^{u+k_t}),  a_t = e^{-w} a_{t-1} + e^{k_t} v_t,
        b_t = e^{-w} b_{t-1} + e^{k_t},  w = exp(time_decay), u = time_first;
    a_{-1} = num e^max, b_{-1} = den e^max from transformers' scaled state (zero without one)."""
    w, u = time_decay.double().exp(), time_first.double()
    k, v = key.double(), value.double()
    if state is None:
        a = b = torch.zeros_like(k[:, 0])
    else:
        num, den, p = (s.double() for s in state)
        a, b = num * p.exp(), den * p.exp()
    wkvs, As, Bs = [], [], []
    for t in range(k.shape[1]):
        bonus = torch.exp(u + k[:, t])
        wkvs.append((a + bonus * v[:, t]) / (b + bonus))
        a = torch.exp(-w) * a + torch.exp(k[:, t]) * v[:, t]
        b = torch.exp(-w) * b + torch.exp(k[:, t])
        As.append(a)
        Bs.append(b)
    return torch.stack(wkvs, 1), torch.stack(As, 1), torch.stack(Bs, 1)


def paper_form(states):
    """(a, b) from the library's WkvState (parts of any shape): a = num e^max, b = den e^max (float64)."""
    assert isinstance(states, WkvState), type(states).__name__
    num, den, p = (part.double() for part in states)
    return num * p.exp(), den * p.exp()


def transformers_wkv():
    """transformers' CPU WKV loop (what `rwkv_linear_attention` runs on CPU), as bound at import."""
    module = rh.FAMILIES[FAMILIES[0]].module()
    fn = patching.import_default(module, "rwkv_linear_attention_cpu")
    assert not getattr(fn, "__recurrent_hooks__", False)
    return fn


def kernel_inputs(seq, seed=0, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(
        time_decay=torch.randn(CHANNELS, generator=gen) * 2,
        time_first=torch.randn(CHANNELS, generator=gen),
        key=torch.randn(BATCH, seq, CHANNELS, generator=gen) * 2,
        value=torch.randn(BATCH, seq, CHANNELS, generator=gen),
    )
    if with_state:
        state = (
            torch.randn(BATCH, CHANNELS, generator=gen),
            torch.rand(BATCH, CHANNELS, generator=gen) + 0.5,
            torch.randn(BATCH, CHANNELS, generator=gen),
        )
        inputs["state"] = state
    return inputs


# -- kernels ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [1, 37])
@pytest.mark.parametrize("with_state", [True, False], ids=["from a state", "no state"])
@pytest.mark.parametrize("return_state", [True, False])
def test_wkv_loop_equals_transformers(seq, with_state, return_state):
    inputs = kernel_inputs(seq, with_state=with_state)
    expected_out, expected_state = transformers_wkv()(**inputs, return_state=return_state)
    out, state = rwkv_linear_attention(**inputs, return_state=return_state)
    assert_close("wkv", expected_out, out, rtol=0, atol=0)
    assert (state is None) == (expected_state is None)
    if state is not None:
        for name, a, b in zip(WkvState._fields, expected_state, state):
            assert_close(f"final {name}", a, b, rtol=0, atol=0)
    # with an identity on_token too: the WkvState goes in and out unchanged
    seen = []
    out, state = rwkv_linear_attention(**inputs, return_state=True, on_token=lambda t, s: seen.append(s) or s)
    assert_close("wkv, on_token", expected_out, out, rtol=0, atol=0)
    assert len(seen) == seq and isinstance(seen[0], WkvState)
    assert all(part.shape == (BATCH, CHANNELS) and part.dtype == torch.float32 for part in seen[0])


@pytest.mark.parametrize("with_state", [True, False], ids=["from a state", "no state"])
def test_states_handed_to_on_token_equal_the_paper_recurrence(with_state):
    inputs = kernel_inputs(37, seed=1, with_state=with_state)
    seen = []
    out, _ = rwkv_linear_attention(**inputs, on_token=lambda t, s: seen.append(map_parts(torch.clone, s)) or s)
    wkv, a, b = wkv_reference(**inputs)
    got_a, got_b = paper_form(stack_parts(seen, 1))
    # float32 against float64: a_t is a signed sum, so its error is relative to its scale, not to each entry
    assert_close("a_t", a, got_a, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
    assert_close("b_t", b, got_b, rtol=1e-5, atol=1e-9)
    assert_close("wkv_t", wkv, out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("token", [0, 5, 36])
def test_a_replaced_wkv_state_changes_only_later_tokens(token):
    inputs = kernel_inputs(37, seed=2)
    plain, _ = rwkv_linear_attention(**inputs)
    gen = torch.Generator().manual_seed(3)
    replacement = WkvState(
        torch.randn(BATCH, CHANNELS, generator=gen),
        torch.rand(BATCH, CHANNELS, generator=gen),
        torch.randn(BATCH, CHANNELS, generator=gen),
    )
    out, final = rwkv_linear_attention(**inputs, on_token=lambda t, s: replacement if t == token else s)
    assert_close("tokens <= t", plain[:, : token + 1], out[:, : token + 1], rtol=0, atol=0)
    rest = {
        **inputs,
        "key": inputs["key"][:, token + 1 :],
        "value": inputs["value"][:, token + 1 :],
        "state": tuple(replacement),
    }
    expected, expected_final = transformers_wkv()(**rest)
    assert_close("tokens > t continue from the replacement", expected, out[:, token + 1 :], rtol=0, atol=0)
    assert_state_close(
        "final state", WkvState(*(expected_final if token < 36 else replacement)), WkvState(*final), rtol=0, atol=0
    )


def _shift_inputs(model, seq, batch, with_state):
    module = model.rwkv.blocks[1].attention
    gen = torch.Generator().manual_seed(seq + batch)
    device = module.key.weight.device  # the model's (pytest --device)
    hidden = torch.randn(batch, seq, module.config.hidden_size, generator=gen).to(device)
    state = None
    if with_state:
        shape = (batch, module.config.hidden_size, module.config.num_hidden_layers)
        state = [torch.randn(shape, generator=gen).to(device) for _ in range(5)]
    return module, hidden, state


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "seq, batch, with_state", [(7, 2, False), (7, 2, True), (1, 1, True), (1, 2, True), (1, 2, False)]
)
def test_token_shift_equals_transformers_method(family, seq, batch, with_state):
    """The library's extract_key_value and transformers' give the same receptance, key, value and stored shift
    (batch 2 at a one-token step: transformers' [batch, batch, hidden] broadcast, reproduced)."""
    module, hidden, state = _shift_inputs(build(family), seq, batch, with_state)
    original = inspect.getattr_static(type(module), "extract_key_value")
    assert not getattr(original, "__recurrent_hooks__", False)
    copies = [None if state is None else [s.clone() for s in state] for _ in range(3)]
    with torch.no_grad():
        expected = original(module, hidden, state=copies[0])
        got = extract_key_value(module, hidden, state=copies[1])
        shifts = []
        hooked = extract_key_value(module, hidden, state=copies[2], on_token=lambda t, s: shifts.append(s) or s)
    for name, a, b, c in zip(("receptance", "key", "value"), expected, got, hooked):
        assert_close(name, a, b, rtol=0, atol=0)
        assert_close(f"{name}, on_token", a, c, rtol=0, atol=0)
    if state is not None:
        for i in range(5):
            assert_close(f"state[{i}]", copies[0][i], copies[1][i], rtol=0, atol=0)
            assert_close(f"state[{i}], on_token", copies[0][i], copies[2][i], rtol=0, atol=0)
    assert_close("the shift after token t is token t's input", hidden, torch.stack(shifts, 1), rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_replaced_shift_changes_only_the_next_token(family):
    module, hidden, state = _shift_inputs(build(family), 9, 2, True)
    token, replacement = 4, torch.randn(2, hidden.shape[-1]).to(hidden.device)
    with torch.no_grad():
        _, plain, _, _ = extract_key_value(module, hidden, [s.clone() for s in state])
        _, key, _, _ = extract_key_value(
            module, hidden, [s.clone() for s in state], on_token=lambda t, s: replacement if t == token else s
        )
    changed = (key - plain).abs().amax(dim=(0, 2))
    assert changed[token + 1] > 1e-3 and changed[: token + 1].max() == 0 and changed[token + 2 :].max() == 0, changed


# -- the family bar -----------------------------------------------------------------------------------------------


family, model = family_fixtures(FAMILIES)


@pytest.mark.parametrize("seq, batch", [(1, 1), (T, 2), (70, 2)], ids=lambda v: str(v))
def test_a_forward_without_a_state_equals_one_with_it(model, seq, batch):
    """use_cache=False (no model state, `state=None` to every block), watched: the logits of the forward that
    builds and carries a state. (Parity of the watch itself: tests/kinds/test_contract.py.)"""
    ids = random_ids(batch, seq)
    plain = logits_of(model, ids)
    with rh.watch(model, keep=ALL):
        assert_close("no cache (state=None)", logits_of(model, ids, use_cache=False), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_is_bit_identical(family, dtype):
    """The loops round as transformers does: a bf16 / fp16 model's logits are the same bits watched (every state
    and shift kept, or hooked) as unwatched, in a batch-2 prompt and a batch-1 generate."""
    config = build(family).config
    torch.manual_seed(0)
    model = type(build(family))._from_config(config, dtype=dtype).eval()
    ids = random_ids(2, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    plain, generated = logits_of(model, ids), greedy(model, ids[:1], 5, **kwargs)
    with rh.watch(model, keep=("states", "windows")) as w:
        assert_equal("prompt logits, kept", plain, logits_of(model, ids))
        watched = greedy(model, ids[:1], 5, **kwargs)
    assert all(part.dtype == torch.float32 for part in w.mixers[0].states) and w.mixers[0].windows.dtype == dtype
    assert_equal("generated tokens, kept", generated.sequences, watched.sequences)
    for step, (a, b) in enumerate(zip(generated.logits, watched.logits)):
        assert_equal(f"logits of call {step}, kept", a, b)
    with rh.watch(model) as w:
        for mixer in w.mixers:
            mixer.register_state_hook(lambda m, c, t, s: None)
            mixer.register_state_hook(lambda m, c, t, s: None, memory="window")
        assert_equal("prompt logits, hooked", plain, logits_of(model, ids))


def test_route_kernels_to_the_token_loops(model, family):
    ids = random_ids(2, T)
    plain = logits_of(model, ids)
    rh.route_kernels(family, "torch")
    try:
        assert_close("routed to the library's loops", plain, logits_of(model, ids), rtol=0, atol=0)
    finally:
        rh.route_kernels(family, "default")
    assert kernel_bindings(family) == default_bindings(family)


def test_states_equal_float64_reference_at_prompt_and_decode_steps(model):
    """Batch 2 prompt, then a batch 1 generate (prompt and 3 decode steps): the kept states, read in the
    paper's form, and the kernel outputs equal the float64 recurrence over the call's own kernel inputs."""
    runs = []
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, random_ids(2, T))
    runs.append((w, [T]))
    with rh.watch(model, keep=ALL) as w:
        greedy(model, random_ids(1, T), 4)
    runs.append((w, [T, 1, 1, 1]))
    for w, tokens in runs:
        for mixer in w.mixers:
            assert [c.tokens for c in mixer.calls] == tokens
            for call, record in enumerate(mixer.calls):
                x = record.inputs
                wkv, a, b = wkv_reference(x["time_decay"], x["time_first"], x["key"], x["value"], x["state"])
                got_a, got_b = paper_form(record.states)
                assert_close(f"{mixer} call {call} a_t", a, got_a, rtol=1e-4, atol=1e-7)
                assert_close(f"{mixer} call {call} b_t", b, got_b, rtol=1e-4, atol=1e-7)
                assert_close(f"{mixer} call {call} wkv_t", wkv, record.output["output"], rtol=1e-4, atol=1e-6)
                assert_state_close(
                    f"{mixer} call {call} final state",
                    map_parts(lambda s: s[:, -1], record.states),
                    WkvState(*record.output["final_state"]),
                    rtol=0,
                    atol=0,
                )


def test_a_memory_write_per_row_equals_each_row_written_alone(model):
    ids = random_ids(3, T)
    with rh.watch(model, keep=("states", "windows")) as w, torch.no_grad():
        model(random_ids(3, T, seed=9))
    value = w.mixers[0].memory_after(3)
    per_row = [2, 5, T - 1]
    with rh.watch(model, keep=("states", "windows")) as w, torch.no_grad():
        w.mixers[0].set_memory_after(torch.tensor([2, 5, -1]), value)
        logits = model(ids).logits
    for row, token in enumerate(per_row):
        with rh.watch(model, keep=("states", "windows")) as alone, torch.no_grad():
            alone.mixers[0].set_memory_after(token, value)
            expected = model(ids).logits
        assert_close(f"row {row} logits", expected[row], logits[row], rtol=0, atol=0)
        assert_state_close(
            f"row {row} states",
            WkvState(*[s[row] for s in alone.mixers[0].states]),
            WkvState(*[s[row] for s in w.mixers[0].states]),
            rtol=0,
            atol=0,
        )
        assert_close(f"row {row} shifts", alone.mixers[0].windows[row], w.mixers[0].windows[row], rtol=0, atol=0)


def test_decode_memories_continue_the_prompt_memories_with_the_cache_on(model):
    """Split invariance as RWKV runs it by default: the long prompt with the cache on (its kernels start from the
    zero `state=` list the model builds; the contract's form, without a state: tests/kinds/test_contract.py). Every
    generate runs batch 1 (bug 1); the states and shifts of prompt + decode steps are those of one long prompt."""
    with rh.watch(model, keep=ALL) as w:
        sequence = greedy(model, random_ids(1, T), 5)
    with rh.watch(model, keep=ALL) as whole, torch.no_grad():
        out = model(sequence[:, :-1], use_cache=True)
    assert out.state is not None
    for mixer, long in zip(w.mixers, whole.mixers):
        assert long.calls[0].inputs["state"] is not None, f"{long}: the long prompt ran without a state"
        decoded = cat_states([c.states for c in mixer.calls], dim=1)
        assert_state_close(f"{mixer} prompt + decode vs one prompt", long.states, decoded, rtol=1e-5, atol=1e-6)
        shifts = torch.cat([c.windows for c in mixer.calls], dim=1)
        assert_close(f"{mixer} shifts", long.windows, shifts, rtol=1e-5, atol=1e-6)


def test_a_multi_token_continuation_continues_the_state(model):
    """Several tokens over a carried state (transformers' kernel takes the state for any length): one call
    that is not a prompt, whose states and shifts continue the prompt's as in one long prompt."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=ALL) as w, torch.no_grad():
        out = model(ids[:, :8], use_cache=True)
        model(ids[:, 8:], state=out.state, use_cache=True)
    with rh.watch(model, keep=ALL) as whole, torch.no_grad():
        model(ids)
    for mixer, long in zip(w.mixers, whole.mixers):
        assert [c.tokens for c in mixer.calls] == [8, T - 8]
        assert_state_close(
            f"{mixer} states", long.states, cat_states([c.states for c in mixer.calls], 1), rtol=1e-6, atol=1e-7
        )
        assert_close(f"{mixer} shifts", long.windows, torch.cat([c.windows for c in mixer.calls], 1), rtol=0, atol=0)
    seen = []
    handle = rh.register_state_hook(model.rwkv.blocks[0].attention, lambda m, c, t, s: seen.append((c, t)), token=0)
    try:
        with torch.no_grad():
            out = model(ids[:, :8], use_cache=True)
            model(ids[:, 8:], state=out.state, use_cache=True)
    finally:
        handle.remove()
    assert seen == [(0, 0), (1, 0)], "the continuation counted as a prompt"


def test_replacing_hooks_scale_the_paper_state(model):
    """A hook that adds log 2 to the max exponent doubles a_t and b_t (wkv unchanged at the next token:
    it is a ratio of the two, plus the current token's bonus, so it changes after)."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, ids)
    with rh.watch(model, keep=ALL) as doubled:
        doubled.mixers[0].register_state_hook(lambda m, c, t, s: WkvState(s.num, s.den, s.max + math.log(2)), token=4)
        logits_of(model, ids)
    a, b = paper_form(w.mixers[0].state_after(4))
    got_a, got_b = paper_form(doubled.mixers[0].state_after(4))
    assert_close("a doubled", 2 * a, got_a, rtol=1e-5, atol=0)
    assert_close("b doubled", 2 * b, got_b, rtol=1e-5, atol=0)
    before, after = w.mixers[0].calls[0].output["output"], doubled.mixers[0].calls[0].output["output"]
    assert_close("wkv up to token 4", before[:, :5], after[:, :5], rtol=0, atol=0)
    assert (before[:, 5:] - after[:, 5:]).abs().max() > 1e-4


def test_values(model):
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, random_ids(2, T))
    values = w.mixers[0].values()
    assert sorted(values) == sorted(rh.WeightedKeyValue.VALUES)
    assert all(v.shape == (2, T, model.config.hidden_size) for v in values.values())
    assert values["wkv"] is w.mixers[0].calls[0].output["output"]


# -- the token shift and the whole memory --------------------------------------------------------------------------


def test_shifts_are_the_ln1_outputs_at_prompt_and_decode_steps(model):
    with rh.watch(model, keep=ALL) as w:
        greedy(model, random_ids(1, T), 3)
    for mixer in w.mixers:
        for call, record in enumerate(mixer.calls):
            assert_close(f"{mixer} call {call} shifts", record.conv.inputs["hidden"], record.windows, rtol=0, atol=0)
            if call:  # what the model's state carried into the step: the previous call's last shift
                carried = record.conv.inputs["state"][1][:, :, mixer.layer]
                assert_close(
                    f"{mixer} call {call} shift in", mixer.calls[call - 1].windows[:, -1], carried, rtol=0, atol=0
                )


def test_a_shift_write_changes_the_next_tokens_key_only(model):
    """The shift after token t is token t+1's mixing input: a write there changes token t+1's key, value and
    receptance only, so the logits at t+1 already move, and the WKV state carries it on (the write contract:
    tests/kinds/test_contract.py)."""
    ids, token = random_ids(2, T), 5
    with rh.watch(model, keep=ALL) as w:
        plain = logits_of(model, ids)
        value = perturbation(w.mixers[0].window_after(token))
    unwritten = w.mixers[0].calls[0].inputs["key"]
    with rh.watch(model, keep=ALL) as w:
        w.mixers[0].set_window_after(token, value)
        written = logits_of(model, ids)
    change = (w.mixers[0].calls[0].inputs["key"] - unwritten).abs().amax(dim=(0, 2))
    assert change[token + 1] > 1e-6 and change[: token + 1].max() == 0 and change[token + 2 :].max() == 0, change
    assert (written[:, token + 1] - plain[:, token + 1]).abs().max() > 1e-6, "the logits at t+1 did not move"


def _first_mixer_outputs(model, ids, memory=None, token=None):
    """Layer 0's time-mixing output over `ids`, the cache on (the model's default), optionally with a whole
    memory written after `token`."""
    outputs = []
    handle = model.rwkv.blocks[0].attention.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    try:
        with rh.watch(model, keep=ALL) as w, torch.no_grad():
            if memory is not None:
                w.mixers[0].set_memory_after(token, memory)
            model(ids, use_cache=True)
    finally:
        handle.remove()
    assert w.mixers[0].layer == 0 and w.mixers[0].calls[0].inputs["state"] is not None
    return outputs[0], w.mixers[0]


def test_the_whole_memory_identity_holds_with_the_cache_on(model):
    """Memory(state, window) from run A after token t, written into run B (which shares A's tokens after t),
    with the cache on, as RWKV runs by default (the contract's form runs without a state: tests/kinds/test_contract.py):
    layer 0's outputs after t are A's, the WKV state alone is not enough."""
    token = 6
    run_a = random_ids(2, T, seed=5)
    run_b = run_a.clone()
    run_b[:, : token + 1] = random_ids(2, token + 1, seed=6)
    out_a, mixer_a = _first_mixer_outputs(model, run_a)
    out_b, mixer_b = _first_mixer_outputs(model, run_b)
    patched, _ = _first_mixer_outputs(model, run_b, mixer_a.memory_after(token), token)
    assert (out_b[:, token + 1 :] - out_a[:, token + 1 :]).abs().max() > 1e-6, "the two runs did not differ"
    assert_close(
        "layer output after t, memory written", out_a[:, token + 1 :], patched[:, token + 1 :], rtol=1e-5, atol=1e-6
    )
    state_only, _ = _first_mixer_outputs(
        model, run_b, rh.Memory(mixer_a.state_after(token), mixer_b.window_after(token)), token
    )
    assert (state_only[:, token + 1] - out_a[:, token + 1]).abs().max() > 1e-6, "the state alone made B continue as A"


# -- gradients ---------------------------------------------------------------------------------------------------


def test_backward_with_a_state_fails_in_transformers_watched_or_not(model):
    """The documented limit: the forward overwrites the state list in place after saving views of it."""
    ids = random_ids(1, T)
    for watched in (False, True):
        with rh.watch(model, keep=ALL) if watched else torch.enable_grad():
            metric = model(ids, use_cache=True).logits[0, -1].logsumexp(-1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            metric.backward()


def test_every_kept_state_is_differentiable_with_frozen_weights(model):
    model.requires_grad_(False)
    try:
        with rh.watch(model, keep=("states", "windows")) as w:
            metric = model(random_ids(1, T), use_cache=False).logits[0, -1].logsumexp(-1)
        *states, shifts = torch.autograd.grad(metric, [*w.mixers[0].states, w.mixers[0].windows])
    finally:
        model.requires_grad_(True)
    for name, grad, part in zip(WkvState._fields, states, w.mixers[0].states):
        assert grad.shape == part.shape and grad[:, :-1].abs().amax(dim=(0, 2)).min() > 0, name
    assert shifts[:, :-1].abs().amax(dim=(0, 2)).min() > 0


# -- support (bindings: tests/kinds/test_contract.py) ---------------------------------------------------------------


def kernel_bindings(family):
    row = rh.FAMILIES[family].classes[0]
    return {kernel.name: inspect.getattr_static(*row.target(kernel)) for kernel in row.kind.KERNELS}


def default_bindings(family):
    row = rh.FAMILIES[family].classes[0]
    return {kernel.name: patching.import_default(*row.target(kernel)) for kernel in row.kind.KERNELS}


def test_support_lists_the_kinds_values_and_limits(model, family):
    rows = rh.support(model)
    assert [(r.layer, r.family, r.kind) for r in rows] == [
        (0, family, "WeightedKeyValue"),
        (1, family, "WeightedKeyValue"),
    ]
    for limit in ("batched decode", "left padding", "eval rescaling", "gradients with a state", "feed-forward shift"):
        assert limit in rows[0].unavailable
    assert "states" in rows[0].available and "windows" in rows[0].available
    with rh.watch(model) as w:
        assert w.mixer(1) is w.mixers[1] and repr(w.mixers[0]) == f"WeightedKeyValue({family}, layer 0)"


def test_a_write_of_the_wrong_shape_names_the_parts(model):
    with rh.watch(model) as w:
        with pytest.raises(
            rh.InvalidValue,
            match=r"expected a WkvState with axes \(num: batch channels;"
            r" den: batch channels; max: batch channels\), got Tensor",
        ):
            w.mixers[0].set_state_after(2, torch.zeros(2, 3, model.config.hidden_size))
        zeros = torch.zeros(2, model.config.hidden_size)
        w.mixers[0].set_state_after(2, WkvState(zeros, zeros[:, :-1], zeros))
        with pytest.raises(
            rh.InvalidValue,
            match=r"state part 'den' with shape \(2, 31\), expected \(2, 32\)"
            r" \(axes: batch channels\)",
        ):
            logits_of(model, random_ids(2, T))
    with rh.watch(model) as w:
        w.mixers[0].set_window_after(2, torch.zeros(2, 3, model.config.hidden_size))
        with pytest.raises(rh.InvalidValue, match=r"expected \(2, 32\) \(axes: batch hidden\)"):
            logits_of(model, random_ids(2, T))


# -- the research tools -------------------------------------------------------------------------------------------


def test_a_patching_sweep_cell_is_one_write(model):
    clean, corrupt = random_ids(1, 10, seed=1), random_ids(1, 10, seed=2)

    def metric(logits):
        return logits[:, -1, 5] - logits[:, -1, 7]

    sweep = rh.patching_sweep(model, clean[0], corrupt[0], metric, batch_size=4)
    with rh.watch(model, keep=("states", "windows")) as a, torch.no_grad():
        model(clean, use_cache=False)
    for layer, token in ((0, 3), (1, 8)):
        with rh.watch(model) as b, torch.no_grad():
            b.mixers[layer].set_memory_after(token, a.mixers[layer].memory_after(token))
            expected = metric(model(corrupt, use_cache=False).logits)[0]
        assert_close(f"cell ({layer}, {token})", expected, sweep.values[layer, token], rtol=1e-5, atol=1e-6)


def test_attribution_runs_without_a_state(model):
    """rh.attribute differentiates the corrupt run: with use_cache=False (transformers' backward fails with a
    state, see LIMITS), every layer x token gets an attribution."""
    clean, corrupt = random_ids(1, 10, seed=1)[0], random_ids(1, 10, seed=2)[0]  # one pair: [layers, seq]

    def metric(logits):
        return logits[:, -1, 5] - logits[:, -1, 7]

    result = rh.attribute(model, clean, corrupt, metric, forward_kwargs={"use_cache": False})
    assert result.memory.shape == (2, 10) and bool(torch.isfinite(result.memory).all())
    assert result.memory[:, :-1].abs().min() > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        rh.attribute(model, clean, corrupt, metric)


def test_state_norms_plot_measures_every_part(model):
    """plots.state_norms on a WkvState: per token, the norm of num, den and max together (prompt, then decode)."""
    pytest.importorskip("matplotlib")
    from recurrent_hooks import plots

    with rh.watch(model, keep=("states",)) as w:
        greedy(model, random_ids(1, T), 3)
    lines = plots.state_norms(w).axes[0].get_lines()
    for mixer, line in zip(w.mixers, lines):
        whole = cat_states([c.states for c in mixer.calls], dim=1)  # batch seq channels, each part
        expected = torch.cat(list(whole), dim=-1)[0].double().norm(dim=-1)
        assert_close(f"{mixer} plotted norms", expected, torch.as_tensor(line.get_ydata()), rtol=1e-12, atol=0)
