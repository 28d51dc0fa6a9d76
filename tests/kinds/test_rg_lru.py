"""RecurrentGemma's RG-LRU (`RealGatedLinearRecurrence`): kernels, references and the family bar.

The kind's memory lives on module attributes (`block.rg_lru.recurrent_states`, `block.conv1d_state`), not in
the Cache, and its two kernels are class attributes (`RecurrentGemmaRglru._rnn_scan`, the block's `forward`),
so it has its own test file with the checks of tests/kinds/test_families.py, parametrized by family:
- the two loops against transformers' own methods, bit for bit, and the states and windows against float64
  references written from Griffin's equations (h_t = a_t h_{t-1} + sqrt(1 - a_t^2)(i_t * x_t));
- writes (prompt, decode, conv window), an in-place hook edit as a replacement, the whole-memory identity,
  gradients, support (parity, generate, the call counter, standalone hooks, the input gradient and bindings
  are tests/kinds/test_contract.py's);
- transformers' own quirks (a fresh conv window sized with hidden_size; the module-held memory surviving across
  calls; a multi-token forward with a state recomputing the conv from zeros) and its beam search, which leaves the
  module-held memory in place, reproduced watched and unwatched.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_close, assert_equal
from _contract import ContractReading, family_fixtures, perturbation
from _models import DEVICE, build, random_ids
from _runs import greedy, logits_of, watched_greedy

import recurrent_hooks as rh
from recurrent_hooks.engine.binding.rebinding import import_default
from recurrent_hooks.kinds.rg_lru import recurrent_block_forward, rnn_scan

RG_LRU_FAMILIES = [name for name, row in rh.FAMILIES.items() if row.kind is rh.RealGatedLinearRecurrence]
ALL = ("states", "windows", "inputs", "outputs")
T = 13
EXACT = dict(rtol=0, atol=0)

# -- how the contract reads this kind (tests/kinds/test_contract.py, tests/helpers/_contract.py's ContractReading) -----


def rg_lru_memory(out, mixer, memory):
    """RecurrentGemma keeps its memory on the block, not in the cache (`rg_lru.recurrent_states`, `conv1d_state`)."""
    module = mixer.module
    return {"the module": module.rg_lru.recurrent_states if memory == "state" else module.conv1d_state}


CONTRACT = {
    rh.RealGatedLinearRecurrence: ContractReading(
        carried=rg_lru_memory,
        window_in=None,
        window_reach="every",
        recomputes_once=True,
        finite_difference=("state", "window"),
        whole_memory_tol=dict(rtol=1e-5, atol=1e-6),
    )
}


def classes(family):
    module = rh.FAMILIES[family].module()
    return module.RecurrentGemmaRglru, module.RecurrentGemmaRecurrentBlock


def bindings(family):
    """What the kind's two class attributes hold now, read from the classes' own `__dict__`."""
    return {
        kernel.name: vars(rh.FAMILIES[family].classes[0].target(kernel)[0])[kernel.name]
        for kernel in rh.FAMILIES[family].kind.KERNELS
    }


family, model = family_fixtures(RG_LRU_FAMILIES)


# -- float64 references from the paper's equations ---------------------------------------------------------------


def rg_lru_reference(rg_lru, x, position_ids, initial_state=None):
    """Every h_t of one call in float64, from the RG-LRU's input x_t (the conv output) and the module's weights:
    r_t = sigma(W_a x_t + b_a), i_t = sigma(W_x x_t + b_x) per head block; log a_t = -8 r_t softplus(param);
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2)(i_t * x_t), with a_t = 0 and the factor 1 at position 0."""
    x = x.double()
    batch, seq, width = x.shape
    heads = rg_lru.num_attention_heads
    blocks = x.reshape(batch, seq, heads, width // heads)

    def gate(weight, bias):
        pre = torch.einsum("bthi,hij->bthj", blocks, weight.double()) + bias.double()
        return torch.sigmoid(pre).reshape(batch, seq, width)

    r = gate(rg_lru.recurrent_gate_weight, rg_lru.recurrent_gate_bias)
    i = gate(rg_lru.input_gate_weight, rg_lru.input_gate_bias)
    a = torch.exp(-8.0 * r * F.softplus(rg_lru.recurrent_param.double()))
    reset = (position_ids == 0)[:, :, None].expand(batch, seq, width)
    a = torch.where(reset, torch.zeros_like(a), a)
    norm = torch.where(reset, torch.ones_like(a), torch.sqrt(1 - a * a))
    h = x.new_zeros(batch, width) if initial_state is None else initial_state.double()
    states = []
    for t in range(seq):
        h = a[:, t] * h + norm[:, t] * (i[:, t] * x[:, t])
        states.append(h)
    return torch.stack(states, dim=1)


class Captured:
    """The blocks' inputs and their RG-LRUs' inputs (the conv outputs) of every forward, by module hooks."""

    def __init__(self, model):
        self.blocks, self.lrus, self.handles = {}, {}, []
        for path, module in model.named_modules():
            if type(module).__name__ == "RecurrentGemmaRecurrentBlock":
                self.handles.append(module.register_forward_pre_hook(self._block(module), with_kwargs=True))
                self.handles.append(module.rg_lru.register_forward_pre_hook(self._lru(module)))

    def _block(self, module):
        def hook(m, args, kwargs):
            self.blocks.setdefault(module, []).append((args[0].detach(), kwargs["position_ids"]))

        return hook

    def _lru(self, module):
        def hook(m, args):
            self.lrus.setdefault(module, []).append((args[0].detach(), args[1]))

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def window_reference(block, u, previous=None):
    """The window after every token in float64: the last K-1 inputs W_x u, oldest first (a prompt from zeros;
    a decode step shifts its input into the previous window)."""
    x = block.linear_x(u).double().transpose(1, 2)  # b D T
    size = block.conv1d_width - 1
    start = x.new_zeros(x.shape[0], x.shape[1], size) if previous is None else previous.double()
    run = torch.cat([start, x], dim=-1)
    return torch.stack([run[..., t + 1 : t + 1 + size] for t in range(x.shape[-1])], dim=1)


def conv_reference(block, windows_before, x):
    """The conv output of each position in float64: sum_k w_k (window, x_t)_k + b."""
    weight, bias = block.conv_1d.weight[:, 0].double(), block.conv_1d.bias.double()
    full = torch.cat([windows_before.double(), x.double()[..., None]], dim=-1)  # b t D K
    return (full * weight).sum(-1) + bias


# -- the kernels against transformers' own methods ---------------------------------------------------------------


def _scan_inputs(seq, dtype, state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, 16, generator=gen).to(dtype)
    a = torch.rand(2, seq, 16, generator=gen).to(dtype)
    position_ids = torch.arange(seq)[None].repeat(2, 1) + (0 if state is None else 5)
    if seq > 3:
        position_ids[1] -= 3  # row 1 starts a new sequence at token 3
    reset = (position_ids == 0)[:, :, None]
    h0 = None if state is None else torch.randn(2, 16, generator=gen).to(DEVICE)
    return x.to(DEVICE), a.to(DEVICE), reset.to(DEVICE), h0


@pytest.mark.parametrize("family_", RG_LRU_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seq", [1, 9])
@pytest.mark.parametrize("start", ["zeros", "state"])
def test_scan_loop_equals_transformers_bit_for_bit(family_, dtype, seq, start):
    rglru_cls, _ = classes(family_)
    original = import_default(rglru_cls, "_rnn_scan")
    module = build(family_).model.layers[0].temporal_block.rg_lru
    x, a, reset, h0 = _scan_inputs(seq, dtype, None if start == "zeros" else True)
    expected = original(module, x, a, reset, h0)
    seen = []
    for got in (
        rnn_scan(module, x, a, reset, h0),
        rnn_scan(module, x, a, reset, h0, on_token=lambda t, s: seen.append(t) or s),
    ):
        assert_equal("output", expected[0], got[0])
        assert_equal("last state", expected[1], got[1])
        assert got[0].dtype == expected[0].dtype and got[1].dtype == torch.float32
    assert seen == list(range(seq))


def test_scan_loop_continues_from_what_on_token_returns(family):
    rglru_cls, _ = classes(family)
    original = import_default(rglru_cls, "_rnn_scan")
    module = build(family).model.layers[0].temporal_block.rg_lru
    x, a, reset, h0 = _scan_inputs(9, torch.float32, True)
    value = torch.randn(2, 16).to(DEVICE)
    out, last = rnn_scan(module, x, a, reset, h0, on_token=lambda t, s: value if t == 4 else s)
    head, _ = original(module, x[:, :5], a[:, :5], reset[:, :5], h0)
    tail, tail_last = original(module, x[:, 5:], a[:, 5:], reset[:, 5:], value)
    assert_equal("tokens <= 4", head, out[:, :5])
    assert_equal("tokens > 4 continue from the write", tail, out[:, 5:])
    assert_equal("last state", tail_last, last)


def _run_block(forward, block, steps, on_token=None):
    """Run `forward` over (input, position_ids, use_cache) steps on `block`; outputs and the module's memory."""
    results = []
    for u, position_ids, use_cache in steps:
        extra = {} if on_token is None else {"on_token": on_token}
        out, none = forward(block, u, position_ids, None, use_cache, **extra)
        assert none is None
        state, window = block.rg_lru.recurrent_states, block.conv1d_state
        results.append((out, None if state is None else state.clone(), None if window is None else window.clone()))
    return results


def _block_steps(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def u(n):
        return torch.randn(2, n, 32, generator=gen).to(DEVICE)

    def pos(a, b):
        return torch.arange(a, b, device=DEVICE)[None]

    return [
        (u(9), pos(0, 9), True),  # a prompt
        (u(1), pos(9, 10), True),
        (u(1), pos(10, 11), True),  # decode steps
        (u(4), pos(11, 15), True),  # a multi-token continuation (the conv restarts from zeros: bug 5)
        (u(1), pos(15, 16), True),
        (u(2), pos(0, 2), True),  # a prompt shorter than the window
        (u(1), pos(2, 3), True),
        (u(6), pos(0, 6), False),  # no cache: both memories dropped
    ]


@pytest.mark.parametrize("on_token", ["none", "identity", "view"])
def test_block_forward_loop_equals_transformers_bit_for_bit(family, on_token):
    """The library's block forward: same outputs and module memory as transformers' forward, at every step."""
    _, block_cls = classes(family)
    original = import_default(block_cls, "forward")
    block = build(family).model.layers[0].temporal_block
    hooks = {"none": None, "identity": lambda t, w: w, "view": lambda t, w: w.view_as(w)}
    expected = _run_block(original, copy.deepcopy(block), _block_steps())
    got = _run_block(recurrent_block_forward, copy.deepcopy(block), _block_steps(), hooks[on_token])
    for step, (e, g) in enumerate(zip(expected, got)):
        for what, a, b in zip(("output", "state", "window"), e, g):
            if a is None:
                assert b is None, f"step {step}: transformers dropped the {what}, the loop kept it"
            else:
                assert_equal(f"step {step} {what}", a, b)


def test_block_forward_recomputes_written_positions_as_transformers_computes_them(family):
    """A window handed back as a new tensor (a write of the same values) recomputes the positions that read
    it, one F.conv1d each: the same values as transformers' one conv call, to float32 precision."""
    _, block_cls = classes(family)
    original = import_default(block_cls, "forward")
    block = build(family).model.layers[0].temporal_block
    expected = _run_block(original, copy.deepcopy(block), _block_steps())
    got = _run_block(recurrent_block_forward, copy.deepcopy(block), _block_steps(), lambda t, w: w.clone())
    for step, (e, g) in enumerate(zip(expected, got)):
        for what, a, b in zip(("output", "state", "window"), e, g):
            if a is not None:
                assert_close(f"step {step} {what}", a, b, rtol=1e-6, atol=1e-7)


def test_block_forward_window_write_feeds_the_next_positions(family):
    """A window written after token t is what positions t+1..t+K-1 convolve over, and the next call too."""
    block = build(family).model.layers[0].temporal_block
    size = block.conv1d_width - 1
    u = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    pos = torch.arange(9, device=DEVICE)[None]
    written = torch.randn(2, 32, size, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    seen = []
    with torch.no_grad():
        capture = Captured(torch.nn.ModuleDict({"b": block}))
        recurrent_block_forward(
            block, u, pos, None, True, on_token=lambda t, w: (seen.append(w.clone()), written if t == 3 else w)[1]
        )
        capture.remove()
    x = block.linear_x(u).transpose(1, 2)
    # the window each position reads, before its own input
    before = [torch.zeros(2, 32, size, device=DEVICE), *seen[:-1]]
    before[4] = written
    for t in range(5, 9):
        before[t] = torch.cat([before[t - 1][..., 1:], x[..., t - 1, None]], dim=-1)
    reference = conv_reference(block, torch.stack(before, dim=1), x.transpose(1, 2))
    conv_out = capture.lrus[block][0][0]
    assert_close("conv outputs with the written window", reference, conv_out, rtol=1e-5, atol=1e-6)
    for t in range(5, 9):
        assert_close(
            f"window after {t}", torch.cat([before[t][..., 1:], x[..., t, None]], dim=-1), seen[t], rtol=0, atol=0
        )
    assert_close("the module keeps the last window", seen[-1], block.conv1d_state, **EXACT)


# -- the model: states and windows against the references ---------------------------------------------------------


def test_states_and_windows_equal_float64_references_at_prompt_and_decode_steps(model):
    """h_t from the paper's equations over the RG-LRU's own inputs; windows and conv outputs from the block's
    inputs; at the prompt and at every decode step."""
    capture = Captured(model)
    try:
        w = watched_greedy(model, ALL, T, 4)
    finally:
        capture.remove()
    for mixer in w.mixers:
        block = mixer.module
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        for call in range(4):
            x, position_ids = capture.lrus[block][call]
            h0 = None if call == 0 else mixer.state_after(-1, call=call - 1)
            assert_close(
                f"{mixer} call {call} states",
                rg_lru_reference(block.rg_lru, x, position_ids, h0),
                mixer.calls[call].states,
                rtol=1e-4,
                atol=1e-6,
            )
            assert_close(
                f"{mixer} call {call} state in",
                h0 if h0 is not None else torch.zeros(2, 32),
                mixer.calls[call].inputs["recurrent_states"],
                **EXACT,
            )
            u, _ = capture.blocks[block][call]
            previous = None if call == 0 else mixer.window_after(-1, call=call - 1)
            with torch.no_grad():
                windows = window_reference(block, u, previous)
                before = torch.cat(
                    [
                        windows.new_zeros(2, 1, 32, 3) if previous is None else previous.double()[:, None],
                        windows[:, :-1],
                    ],
                    dim=1,
                )
                x_in = block.linear_x(u).double()
                conv = conv_reference(block, before, x_in)
            assert_close(f"{mixer} call {call} windows", windows, mixer.calls[call].windows, rtol=1e-6, atol=1e-7)
            assert_close(f"{mixer} call {call} conv outputs", conv, x, rtol=1e-5, atol=1e-6)


# -- writes ------------------------------------------------------------------------------------------------------


def test_a_window_write_in_the_prompt_is_shifted_into_the_next_tokens_window(model):
    """A window written after prompt token t is what token t+1 shifts its input into: the window after t+1 is
    the written one shifted by one (the write contract checks the decode form only: tests/kinds/test_contract.py)."""
    ids, token = random_ids(2, T), 5
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, ids)
        value = perturbation(w.mixers[0].window_after(token))
    with rh.watch(model, keep=ALL) as w:
        mixer = w.mixers[0]
        mixer.set_window_after(token, value)
        logits_of(model, ids)
    assert_close("window after the write", value, mixer.window_after(token), **EXACT)
    assert_close("next window shifts the written one", value[..., 1:], mixer.window_after(token + 1)[..., :-1], **EXACT)


def _records_of(mixer):
    """Every tensor a watched call left: its states, windows, kernel inputs and outputs, by name."""
    records = {}
    for call in mixer.calls:
        records[f"call {call.index} states"] = call.states
        records[f"call {call.index} windows"] = call.windows
        for what, values in (("input", call.inputs), ("output", call.output)):
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    records[f"call {call.index} {what} {name}"] = value
    return records


@pytest.mark.parametrize("call, token", [(0, 4), (2, 0)], ids=["prompt", "decode"])
def test_an_in_place_edit_equals_the_returned_replacement(family, call, token):
    """The state handed to a hook is the live one: halving it in place (and returning None) is the replacement
    `s * 0.5`, as for every kind. RG-LRU's output is the state itself (y_t = h_t): token t's own output must
    not see the edit (a write after token t changes what tokens > t see), nor, through the attention layer,
    any later token's logits beyond what the continued state changes."""
    ids = random_ids(2, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)

    def run(hook):
        """Logits of every token (the prompt's forward, or each call of a generate) and the watch's mixers, on a
        fresh model (the memory survives on the modules: a generate's prompt would start from the last run's)."""
        model = build(family)
        with rh.watch(model, keep=ALL) as w:
            if hook is not None:
                w.mixers[0].register_state_hook(hook, call=call, token=token)
            if call == 0:
                logits = [logits_of(model, ids)]
            else:
                logits = [step[:, None] for step in greedy(model, ids, 4, **kwargs).logits]
        return torch.cat(logits, dim=1), w.mixers

    def halve_in_place(m, c, t, s):
        s.mul_(0.5)  # returns None: the change is in place only

    plain, _ = run(None)
    replaced, replaced_mixers = run(lambda m, c, t, s: s * 0.5)
    in_place, in_place_mixers = run(halve_in_place)
    position = token if call == 0 else call  # the logits of the token written after (the prompt's, or call k's)
    assert_close(
        "logits up to the written token, the replacement",
        plain[:, : position + 1],
        replaced[:, : position + 1],
        rtol=1e-5,
        atol=1e-5,
    )
    assert (plain[:, position + 1 :] - replaced[:, position + 1 :]).abs().max() > 1e-6, (
        "halving the state changed no later logit: the test cannot tell an in-place edit from none"
    )
    assert_close("logits of every token, in place vs replaced", replaced, in_place, **EXACT)
    for mixer, other in zip(replaced_mixers, in_place_mixers):
        expected, got = _records_of(mixer), _records_of(other)
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            assert_close(f"{mixer} {name}, in place vs replaced", value, got[name], **EXACT)


# -- the whole memory --------------------------------------------------------------------------------------------


def first_mixer_outputs(model, ids, memory=None, token=None, state_only=False):
    """The first recurrent block's output, optionally with a memory written after `token`."""
    outputs = []
    block = model.model.layers[0].temporal_block
    handle = block.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    try:
        with rh.watch(model, keep=ALL) as w, torch.no_grad():
            if state_only:
                w.mixers[0].set_state_after(token, memory.state)
            elif memory is not None:
                w.mixers[0].set_memory_after(token, memory)
            model(ids, use_cache=False)
    finally:
        handle.remove()
    assert w.mixers[0].layer == 0
    return outputs[0], w.mixers[0]


def test_the_state_alone_carries_over_when_the_window_tokens_are_shared(model):
    """Run A's h_t after token t, written into run C, which shares A's tokens from t-K+2 on (the K-1 tokens the
    window holds): the first block's outputs after t equal A's (the whole-memory identity, and that the state
    alone is not the whole memory otherwise: tests/kinds/test_contract.py)."""
    token = 6
    run_a = random_ids(2, T, seed=5)
    out_a, mixer_a = first_mixer_outputs(model, run_a)
    memory = mixer_a.memory_after(token)
    assert memory.state.shape == (2, 32) and memory.window.shape == (2, 32, 3)
    run_c = run_a.clone()
    run_c[:, : token - 2] = random_ids(2, token - 2, seed=7)
    state_only, _ = first_mixer_outputs(model, run_c, memory, token, state_only=True)
    assert_close(
        "block output after t, state written, window tokens shared",
        out_a[:, token + 1 :],
        state_only[:, token + 1 :],
        rtol=1e-5,
        atol=1e-6,
    )


# -- gradients ---------------------------------------------------------------------------------------------------


def test_every_kept_state_is_differentiable_with_frozen_weights(model):
    ids = random_ids(1, T)
    model.requires_grad_(False)
    with rh.watch(model, keep=ALL) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    states, windows = torch.autograd.grad(metric, [w.mixers[0].states, w.mixers[0].windows])
    assert states.shape == (1, T, 32) and windows.shape == (1, T, 32, 3)
    assert states[:, :-1].abs().amax(-1).min() > 0 and windows[:, :-1].abs().amax((-2, -1)).min() > 0
    model.requires_grad_(True)


# -- support, values ---------------------------------------------------------------------------------------------


def test_support_lists_the_values_and_limits(model):
    rows = rh.support(model)
    assert [(row.path, row.layer, row.kind) for row in rows] == [
        ("model.layers.0.temporal_block", 0, "RealGatedLinearRecurrence"),
        ("model.layers.1.temporal_block", 1, "RealGatedLinearRecurrence"),
    ]
    row = rows[0]
    assert {"states", "windows", "values", "writes", "hooks"} <= set(row.available)
    assert set(row.unavailable) == set(rh.RealGatedLinearRecurrence.LIMITS)
    assert "multi-token continuation" in row.unavailable and "_rnn_scan" in row.notes["idle calls run"]
    with rh.watch(model) as w:
        assert [m.layer for m in w.mixers] == [0, 1]


def test_values_are_the_recurrence_inputs(model):
    w = watched_greedy(model, ALL, T, 2)
    mixer = w.mixers[0]
    for call in range(2):
        values = mixer.values(call=call)
        assert set(values) == set(rh.RealGatedLinearRecurrence.VALUES)
        assert values["reset"].shape == (2, T if call == 0 else 1)
        assert bool(values["reset"][:, 0].all()) == (call == 0)
        h = mixer.calls[call].inputs["recurrent_states"]
        for t in range(values["a"].shape[1]):  # h_t = a_t h_{t-1} + x_t, the kernel's own terms
            h = values["a"][:, t] * h + values["x"][:, t]
            assert_close(f"call {call} state after {t}", mixer.calls[call].states[:, t], h, **EXACT)
        assert_close("output", mixer.calls[call].states, values["output"], **EXACT)


# -- transformers' own quirks (window sized with hidden_size, memory kept across calls, conv from zeros) -----------


def test_multi_token_continuation_restarts_the_window_and_continues_the_state(model):
    """Bug 5: a forward of several tokens over the module's memory convolves from a zero window, while h_t
    continues. Watched with hooks, the logits are the unwatched model's, the call starts from the module's
    state, and its first window holds only its own first input."""
    from transformers import DynamicCache

    ids = random_ids(2, 12)
    position_ids = torch.arange(8, 12, device=DEVICE)[None]

    def run(watched):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], cache=cache)
            if watched is None:
                return model(ids[:, 8:], cache=cache, position_ids=position_ids).logits
            watched.mixers[0].register_state_hook(lambda m, c, t, s: None)
            return model(ids[:, 8:], cache=cache, position_ids=position_ids).logits

    plain = run(None)
    with rh.watch(model, keep=ALL) as w:
        watched = run(w)
    assert_close("continuation logits", plain, watched, rtol=1e-5, atol=1e-5)
    mixer = w.mixers[0]
    assert [c.tokens for c in mixer.calls] == [8, 4]
    assert_close(
        "the state continues", mixer.state_after(-1, call=0), mixer.calls[1].inputs["recurrent_states"], **EXACT
    )
    first_window = mixer.window_after(0, call=1)
    assert first_window[..., :-1].abs().max() == 0, "the window did not restart from zeros (bug 5 fixed?)"
    assert (logits_of(model, ids, use_cache=False)[:, 8:] - plain).abs().max() > 1e-3, (
        "the continuation equals one forward: transformers' bug 5 is gone, update the docs"
    )


def test_a_one_token_prompt_reads_the_previous_window(model, family):
    """Bug 4: the memory survives on the modules. A one-token prompt in a new generate convolves over the
    previous generate's window; watched, it does the same and is call 0."""
    first, single = random_ids(2, T), random_ids(2, 1, seed=9)
    fresh = build(family)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    greedy(model, first, 3)
    plain = greedy(model, single, 2, **kwargs).logits[0]
    clean = greedy(fresh, single, 2, **kwargs).logits[0]
    assert (plain - clean).abs().max() > 1e-4, "a one-token prompt no longer reads the previous window (bug 4 fixed?)"
    greedy(model, first, 3)
    with rh.watch(model, keep=ALL) as w:
        watched = greedy(model, single, 2, **kwargs).logits[0]
    assert_close("one-token prompt, watched", plain, watched, rtol=1e-5, atol=1e-5)
    assert [c.index for c in w.mixers[0].calls] == [0, 1]
    assert w.mixers[0].calls[0].inputs["reset"].all()


def test_a_window_sized_with_hidden_size_fails_in_both(family):
    """Bug 3: a fresh window has hidden_size channels. With lru_width != hidden_size, a first cached forward of
    one token fails in transformers; the library's loop fails the same way, watched or routed."""
    import transformers

    config = build(family).config
    config.lru_width = 48
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(config).eval()
    ids = random_ids(1, 1)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match") as plain:
        logits_of(model, ids)
    with rh.watch(model, keep=ALL), pytest.raises(RuntimeError, match="Sizes of tensors must match") as watched:
        logits_of(model, ids)
    assert str(plain.value) == str(watched.value)
    assert logits_of(model, random_ids(1, 5)).shape == (1, 5, 128)  # a longer prompt replaces the window


def test_beam_search_leaves_the_module_memory_in_place_and_call_reorder_says_so(model, monkeypatch):
    """transformers 5.24's beam search reorders the Cache (the attention layer) only: the module-held memory
    (`rg_lru.recurrent_states`, `conv1d_state`) stays where it is, so each row continues its own row, not its
    parent beam's. `call.reorder` tells what ran: the docs' identity, state_after(-1, call=k-1)[reorder] is
    what call k starts from, holds with reorder None meaning every row continues itself."""
    import transformers

    moves = []
    reorder_cache = transformers.DynamicCache.reorder_cache

    def spy(cache, beam_idx, *args, **kwargs):
        moves.append(beam_idx.clone())
        return reorder_cache(cache, beam_idx, *args, **kwargs)

    monkeypatch.setattr(transformers.DynamicCache, "reorder_cache", spy)
    ids = random_ids(2, 9)
    plain = greedy(model, ids, 5, num_beams=3)
    with rh.watch(model, keep=("states", "windows", "inputs")) as w:
        watched = greedy(model, ids, 5, num_beams=3)
    assert_equal("beam search, watched", plain, watched)
    assert any(not torch.equal(move, torch.arange(6)) for move in moves), "no beam was ever reordered"
    for mixer in w.mixers:
        calls = mixer.calls
        assert len(calls) == 5 and [c.tokens for c in calls[1:]] == [1] * 4
        for k in range(1, len(calls)):
            rows = torch.arange(6) if calls[k].reorder is None else calls[k].reorder
            before = mixer.state_after(-1, call=k - 1)[rows]
            assert_close(f"{mixer} call {k}: state in", before, calls[k].inputs["recurrent_states"], **EXACT)
            window = mixer.window_after(-1, call=k - 1)[rows]
            assert_close(
                f"{mixer} call {k}: window in", window[..., 1:], mixer.window_after(0, call=k)[..., :-1], **EXACT
            )
    row = rh.support(model)[0]
    assert "beam search" in row.unavailable and "reorder" in row.unavailable["beam search"]


def test_support_reads_beam_search_from_the_kinds_reordered_by_cache(model, monkeypatch):
    """`support` lists beam search as unavailable for a kind whose memory the Cache reorder leaves in place
    (REORDERED_BY_CACHE = False), in the kind's own words if its LIMITS say why, else in general ones."""
    kind = rh.RealGatedLinearRecurrence
    monkeypatch.setattr(kind, "LIMITS", {k: v for k, v in kind.LIMITS.items() if k != "beam search"})
    assert "call.reorder stays None" in rh.support(model)[0].unavailable["beam search"]
    monkeypatch.setattr(kind, "REORDERED_BY_CACHE", True)
    assert "beam search" not in rh.support(model)[0].unavailable


# -- padding, checkpointing, routing -----------------------------------------------------------------------------


def test_route_kernels_binds_the_loops_and_back(model, family):
    ids = random_ids(2, T)
    plain = greedy(model, ids, 4)
    plain_logits = logits_of(model, ids)
    before = bindings(family)
    rh.route_kernels(family, "torch")
    try:
        assert bindings(family) == {k.name: k.loop for k in rh.RealGatedLinearRecurrence.KERNELS}
        assert_close("routed logits", plain_logits, logits_of(model, ids), **EXACT)
        assert_equal("routed generate", plain, greedy(model, ids, 4))
    finally:
        rh.route_kernels(family, "default")
    assert all(bindings(family)[name] is fn for name, fn in before.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_keeps_the_logits_bit_identical(family, dtype):
    """Both loops make transformers' operations in its dtypes: keeping every state and window of a bf16 or fp16
    model changes no logit and no generated token."""
    model = build(family).to(dtype)
    ids = random_ids(2, T)
    plain, tokens = logits_of(model, ids), greedy(model, ids, 5)
    with rh.watch(model, keep=ALL) as w:
        assert_equal("logits, every state kept", plain, logits_of(model, ids))
        assert_equal("generate, every state kept", tokens, greedy(model, ids, 5))
    assert w.mixers[0].states.dtype == torch.float32 and w.mixers[0].windows.dtype == dtype
