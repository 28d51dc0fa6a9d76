"""The short-convolution kind (`ShortConvolution`): the bar of tests/kinds/test_families.py for mixers whose only memory
is the conv window (lfm2, lfm2_moe, lfm3, inkling, inkling2), on tiny random-weight models. The kind-agnostic
part of the bar (parity, generate, the call counter, standalone hooks, bindings) is tests/kinds/test_contract.py.

Each family's float64 reference is its mixer's equation (as transformers' modules compute it), from the mixer module's
own input: LFM2 y = W_out(C ⊙ DWConv_K(B ⊙ x̃)) with [B; C; x̃] = W_in h; inkling y = x + DWConv_K(x); inkling2
(static) y = (x + DWConv_K(x)) / sqrt(K + 1). The window after token t is the last K convolution inputs.
"""

import math

import pytest
import torch
from _compare import assert_close, assert_close_per_call, assert_equal
from _contract import ContractReading, family_fixtures
from _models import build, random_ids
from _runs import greedy, greedy_under_replacing_hooks, logits_of, watched_greedy
from _upstream import transformers_kernel

import recurrent_hooks as rh

FAMILIES = [name for name, row in rh.FAMILIES.items() if issubclass(row.kind, rh.ShortConvolution)]
KEEP = ("windows", "inputs", "outputs")
T = 13  # not a multiple of anything

# -- how the contract reads this kind (tests/kinds/test_contract.py, tests/helpers/_contract.py's ContractReading) -----


# a window is the whole memory: its writes and the whole-memory identity are exact; the loops make transformers'
# operations in its order, bit for bit; grad mode recomputes every position from its kept window (grad_parity)
CONTRACT = {
    rh.ShortConvolution: ContractReading(
        loop_atol=0.0,
        grad_parity=(1, 13, 70),
        early=dict(rtol=1e-6, atol=1e-7),
        decode_early=dict(rtol=0, atol=0),
        window_tokens=(0, 5, T - 1),
        grad_tol=dict(rtol=1e-5, atol=1e-8),
        finite_difference=(),
        whole_memory_tol=dict(rtol=0, atol=0),
    )
}


def perturbation(window, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return window + torch.randn(window.shape, generator=gen, dtype=torch.float32).to(window.device, window.dtype) * (
        window.abs().max() + 1
    )


def static(w):
    """The watch's static short convolutions (inkling2's dynamic ones are tests/kinds/test_dynamic_conv.py's)."""
    return [mixer for mixer in w.mixers if not isinstance(mixer, rh.DynamicShortConvolution)]


def cache_index(mixer):
    """(cache layer, state index) of a mixer's window: its layer (inkling2_loop: its pass's cache layer), and its
    state index where a layer has several windows (inkling)."""
    return mixer.cache_index or (mixer.layer, getattr(mixer.module, "conv_idx", 0))


def cached_window(cache, mixer):
    """The window the cache holds for this mixer."""
    layer, state = cache_index(mixer)
    return cache.get_conv_state(layer, state_idx=state)


family, model = family_fixtures(FAMILIES)


# -- the float64 reference: each family's mixer equation -----------------------------------------------------------


def _windows(x, size):
    """[batch, seq, channels, K]: the last K of x [batch, channels, seq] before each position (zeros before 0)."""
    padded = torch.nn.functional.pad(x, (size - 1, 0))
    return padded.unfold(-1, size, 1).transpose(1, 2)


def _dwconv(windows, conv):
    out = (windows * conv.weight.double()[:, 0]).sum(-1)  # b t c
    return out if conv.bias is None else out + conv.bias.double()


def _lfm(module, h):
    """LFM2: [B; C; x~] = W_in h; the window holds B ⊙ x~; y = W_out(C ⊙ DWConv_K(B ⊙ x~))."""
    linear = lambda layer, v: v @ layer.weight.double().T + (0 if layer.bias is None else layer.bias.double())  # noqa: E731
    B, C, x = linear(module.in_proj, h).chunk(3, dim=-1)  # b t c each
    windows = _windows((B * x).transpose(1, 2), module.conv_kernel_size)
    return windows, linear(module.out_proj, C * _dwconv(windows, module.conv))


def _inkling(module, x, scale=1.0):
    """inkling: the window holds x; y = (x + DWConv_K(x)) * scale (inkling2: scale 1/sqrt(K + 1))."""
    windows = _windows(x.transpose(1, 2), module.conv_kernel_size)
    return windows, (x + _dwconv(windows, module.conv1d)) * scale


EQUATIONS = {
    "lfm2": _lfm,
    "lfm2_moe": _lfm,
    "lfm3": _lfm,
    "inkling": _inkling,
    "inkling2": lambda module, x: _inkling(module, x, 1 / math.sqrt(module.conv_kernel_size + 1)),
}
EQUATIONS["inkling2_loop"] = EQUATIONS["inkling2"]


def _record_module(mixer):
    """Record the forwards of a mixer's module that are the mixer's (inkling2_loop: its pass's, by cache layer):
    their input (float64) and output."""
    seen = []

    def hook(m, args, kwargs, out):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if m.layer_idx + kwargs.get("cache_offset", 0) == cache_index(mixer)[0]:
            seen.append((hidden.double(), out))

    return seen, mixer.module.register_forward_hook(hook, with_kwargs=True)


def test_windows_and_outputs_equal_the_float64_equation_at_prompt_and_decode_steps(model, family):
    """Over a prompt and 3 decode steps: every kept window is the last K conv inputs of the family's equation
    (B ⊙ x~ for lfm, x for inkling), and every output is the equation's, from the module's own inputs."""
    with rh.watch(model) as w:
        records = [_record_module(mixer) for mixer in static(w)]
    try:
        w = watched_greedy(model, KEEP, T, 4)
    finally:
        for _, handle in records:
            handle.remove()
    for mixer, (seen, _) in zip(static(w), records):
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        assert [c.kernel for c in mixer.calls] == ["causal_conv1d_fn"] + ["causal_conv1d_update"] * 3
        inputs = torch.cat([hidden for hidden, _ in seen], dim=1)  # the whole sequence, prompt and decode steps
        windows, outputs = EQUATIONS[family](mixer.module, inputs)
        kept = torch.cat([call.windows for call in mixer.calls], dim=1)
        assert_close(f"{mixer} windows", windows, kept, rtol=1e-5, atol=1e-6)
        assert_close(f"{mixer} outputs", outputs, torch.cat([out for _, out in seen], dim=1), rtol=1e-4, atol=1e-5)


def test_windows_are_the_last_inputs_of_each_kernel_call(model):
    """The window after every token is the last K inputs the kernel received (decode: after the cached window)."""
    w = watched_greedy(model, KEEP, T, 3)
    for mixer in static(w):
        for record in mixer.calls:
            x = record.conv.inputs["hidden_states"]
            if "conv_state" in record.conv.inputs:
                x = torch.cat([record.conv.inputs["conv_state"], x], dim=-1)
            size = record.conv.inputs["weight"].shape[-1]
            expected = _windows(x, size)[:, -record.tokens :]
            assert_close(f"{mixer} call {record.index}", expected, record.windows, rtol=0, atol=0)


def test_the_loops_equal_transformers_kernels_on_the_recorded_calls(model, family):
    """transformers' own kernels (behind the module globals' hub wrappers), on each call's recorded inputs, give the
    outputs the library's loops gave, and the decode kernel writes the window the library kept."""
    prompt, decode = (
        transformers_kernel(family, "causal_conv1d_fn"),
        transformers_kernel(family, "causal_conv1d_update"),
    )
    w = watched_greedy(model, KEEP, T, 3)
    for mixer in static(w):
        for record in mixer.calls:
            x = dict(record.conv.inputs)
            if "conv_state" in x:
                window = x["conv_state"].clone()
                theirs = decode(x["hidden_states"], window, x["weight"], x["bias"])
                assert_close(f"{mixer} call {record.index} window", record.windows[:, -1], window, rtol=0, atol=0)
            else:
                theirs = prompt(x["hidden_states"], x["weight"], x["bias"])
            assert_close(f"{mixer} call {record.index} output", theirs, record.conv.output["output"], rtol=0, atol=0)


# -- writes (parity, generate, the call counter and bindings: tests/kinds/test_contract.py) ----------------------------


def _written_at_4(model, ids):
    """A perturbed window after token 4 of the first mixer, and the logits of writing it there."""
    with rh.watch(model, keep=KEEP) as w:
        logits_of(model, ids)
        value = perturbation(static(w)[0].window_after(4))
    with rh.watch(model) as w:
        static(w)[0].set_window_after(4, value)
        return value, logits_of(model, ids)


def test_an_in_place_change_under_inference_mode_is_a_write(model):
    """Inference tensors have no version counter: the loop compares the window's values to tell an in-place change."""
    ids = random_ids(2, T)
    value, written = _written_at_4(model, ids)
    with rh.watch(model) as w, torch.inference_mode():
        static(w)[0].register_state_hook(lambda m, c, t, s: (s.copy_(value), None)[1], call=0, token=4)
        changed = model(ids).logits
    assert_close("an in-place change under inference_mode vs a write", written, changed, rtol=0, atol=0)


# -- the whole memory ----------------------------------------------------------------------------------------------


def test_every_kept_window_is_differentiable_as_one_tensor_with_frozen_weights(model):
    """`windows` is differentiable as one tensor with frozen weights: its gradient at t is the kept window's
    after t (which is the gradient through a written leaf: tests/kinds/test_contract.py), and the last window, read by
    no later token of the call, gets none."""
    ids = random_ids(1, T)
    token = 5
    with rh.watch(model, keep=KEEP) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    (grad,) = torch.autograd.grad(metric, static(w)[0].window_after(token))
    assert grad.abs().max() > 0
    model.requires_grad_(False)
    try:
        with rh.watch(model, keep=("windows",)) as w:
            metric = model(ids).logits[0, -1].logsumexp(-1)
        (every,) = torch.autograd.grad(metric, static(w)[0].windows)
    finally:
        model.requires_grad_(True)
    assert_close("grad of windows at t", grad, every[:, token], rtol=1e-5, atol=1e-8)
    assert every[:, -1].abs().max() == 0, "the last window is read by no later token of the call"


# -- padding, errors and support -----------------------------------------------------------------------------------


def test_the_state_is_unavailable_with_a_clear_message(model):
    with rh.watch(model, keep=KEEP) as w:
        logits_of(model, random_ids(1, 5))
        mixer = static(w)[0]
        carries = r"has no state; it carries only window \(window_after, set_window_after\)"
        for read in (
            lambda: mixer.state_after(0),
            lambda: mixer.states,
            lambda: mixer.set_state_after(0, torch.zeros(1)),
            lambda: mixer.register_state_hook(lambda m, c, t, s: None, memory="state"),
        ):
            kind = type(mixer).__name__
            with pytest.raises(
                rh.Unavailable,
                match=rf"{kind}\({mixer.family}, layer 0\)\.\w+: a {kind} mixer"
                rf" {carries}",
            ):
                read()
        values = mixer.values()
        assert values["x"].shape == values["output"].shape == (1, 5, mixer.windows.shape[2])
        assert_close("values: x is the window's newest column", mixer.windows[..., -1], values["x"], rtol=0, atol=0)


def test_support_rows(model, family):
    rows = [row for row in rh.support(model) if row.family is not None and "Dynamic" not in row.kind]
    with rh.watch(model) as w:
        assert len(rows) == len({id(mixer.module) for mixer in static(w)})  # a row per module (not per pass)
    for row in rows:
        assert (row.family, row.kind) == (family, rh.FAMILIES[family].kind.__name__)
        assert row.available == ("windows", "inputs", "outputs", "values", "writes", "hooks")
        assert "state" in row.unavailable and "patching_sweep(memory=None | 'window')" in " ".join(
            row.unavailable.values()
        )


def test_a_memory_per_layer_is_refused_where_a_layer_has_several_mixers(model):
    with rh.watch(model, keep=KEEP) as w:
        logits_of(model, random_ids(1, 5))
    layers = [mixer.layer for mixer in static(w)]
    if len(set(layers)) == len(layers):
        assert set(w.memory_after(2)) == set(layers)
        return
    assert [mixer.module.conv_idx for mixer in static(w) if mixer.layer == 0] == [0, 1, 2, 3]
    with pytest.raises(rh.Unavailable, match=r"Watch.memory_after: layers \[0, 1(, 2)?\] have several mixers each"):
        w.memory_after(2)
    with rh.watch(model) as other:
        with pytest.raises(rh.Unavailable, match=r"Watch.set_memory_after: layers \[0, 1(, 2)?\] have several"):
            other.set_memory_after(2, {})


def test_a_window_sweep_equals_one_forward_per_cell(model):
    """patching_sweep(memory="window") patches the clean window (here the whole memory) into the corrupt run, one
    cell per layer x position, equal to a forward with set_window_after; "memory" and "state" ask for a
    recurrent state and raise. Where a layer has several mixers (inkling), a cell per layer is refused."""
    clean = random_ids(1, 8, seed=1)
    corrupt = clean.clone()
    corrupt[:, 2] = (clean[:, 2] + 1) % 125 + 3
    metric = lambda logits: logits[:, -1].logsumexp(-1)  # noqa: E731
    with rh.watch(model) as w:
        layers = [mixer.layer for mixer in static(w)]
    if len(set(layers)) < len(layers):
        with pytest.raises(rh.Unavailable, match=r"patching_sweep: layers \[0, 1(, 2)?\] have several mixers each"):
            rh.patching_sweep(model, clean[0], corrupt[0], metric, memory="window", progress=False)
        return
    sweep = rh.patching_sweep(model, clean[0], corrupt[0], metric, memory="window", progress=False)
    with rh.watch(model, keep=("windows",)) as w, torch.no_grad():
        model(clean, use_cache=False)
    first = static(w)[0]
    for position in (2, 3):
        with rh.watch(model) as patched, torch.no_grad():
            patched.mixer(first.layer).set_window_after(position, first.window_after(position))
            value = metric(model(corrupt, use_cache=False).logits)
        assert_close(
            f"cell (layer {first.layer}, position {position})",
            value[0],
            sweep.values[sweep.layers.index(first.layer), position],
            rtol=1e-5,
            atol=1e-6,
        )
    # "memory" patches every memory the kind carries: here the window alone
    whole = rh.patching_sweep(model, clean[0], corrupt[0], metric, progress=False)
    assert_close("the memory sweep is the window sweep", sweep.values, whole.values, rtol=0, atol=0)
    with pytest.raises(rh.Unavailable, match="has no state; it carries only window"):
        rh.patching_sweep(model, clean[0], corrupt[0], metric, memory="state", progress=False)
    # attribution patching estimates the same cells: no state rows, window rows that vary with the position
    estimate = rh.attribute(model, clean[:1], corrupt[:1], metric, forward_kwargs={"use_cache": False})
    assert_equal("no state to attribute", torch.zeros_like(estimate.state), estimate.state)
    assert estimate.window.abs().max() > 0 and estimate.window.isfinite().all()


def _passes(w):
    """inkling2_loop's looped mixers: (pass 0, pass 1) of the first looped module, by cache layer."""
    looped = [mixer for mixer in static(w) if mixer.cache_index is not None]
    first = [mixer for mixer in looped if mixer.module is looped[0].module]
    return sorted(first, key=lambda mixer: mixer.cache_index[0])


def test_a_looped_module_has_a_mixer_per_pass_each_with_its_own_calls_and_cache_layer():
    """inkling2_loop's layer 1 runs twice per forward: a mixer per pass. A write in pass 1 changes only later
    tokens and pass 1's cache layer; pass 0, which runs before it in every forward, keeps every window."""
    model = build("inkling2_loop")
    ids = random_ids(2, T)
    with rh.watch(model, keep=KEEP) as w:
        plain = greedy(model, ids, 4, output_logits=True, return_dict_in_generate=True)
    first, second = _passes(w)
    assert (first.layer, first.cache_index, second.layer, second.cache_index) == (1, (1, 2), 1, (3, 2))
    assert repr(second) == "LoopedShortConvolution(inkling2_loop, layer 1, cache layer 3)"
    assert [len(m.calls) for m in (first, second)] == [4, 4] and second.calls[0].tokens == T
    value = perturbation(second.window_after(5, call=0))
    with rh.watch(model, keep=KEEP) as w:
        _passes(w)[1].set_window_after(5, value, call=[0, 1])  # the forward, then generate's prompt
        with torch.no_grad():
            out = model(ids, use_cache=True)
        steered = greedy(model, ids, 4, output_logits=True, return_dict_in_generate=True)
    first_w, second_w = _passes(w)
    reference = logits_of(model, ids)
    # not bit for bit: the MoE groups tokens by expert (see the prompt-write test above)
    assert_close("logits at tokens <= 5", reference[:, :6], out.logits[:, :6], rtol=1e-6, atol=1e-7)
    assert (reference[:, 6:] - out.logits[:, 6:]).abs().max() > 1e-6, "a write in pass 1 changed no later logits"
    assert_close("the written window", value, second_w.window_after(5, call=0), rtol=0, atol=0)
    assert_close(
        "pass 1's cache layer holds its continued window",
        second_w.calls[0].windows[:, -1],
        cached_window(out.past_key_values, second_w),
        rtol=0,
        atol=0,
    )
    for call in range(4):  # calls 0-3 of the generate, after the plain forward (call 0 of this watch)
        assert_close(
            f"pass 0 unchanged, call {call}", first.calls[call].windows, first_w.calls[call + 1].windows, rtol=0, atol=0
        )
    change = max((a - b).abs().max() for a, b in zip(plain.logits, steered.logits))
    assert change > 1e-6, "a write in pass 1 changed nothing"


def test_a_hook_without_a_watch_serves_the_first_pass_of_a_looped_module_and_warns_once():
    """A no-op hook must not make a working forward fail: the later passes run unhooked, as transformers runs them,
    and one warning says so; the first pass counts its calls as every mixer does."""
    model = build("inkling2_loop")
    with rh.watch(model) as w:
        module = _passes(w)[0].module
    ids = random_ids(1, 5)
    plain = greedy(model, ids, 3)
    seen = []
    handle = rh.register_state_hook(module, lambda m, c, t, s: seen.append((c, t)), token=-1)
    try:
        with pytest.warns(rh.RecurrentHooksWarning, match=r"later pass of a looped layer \(cache layer 3\)") as caught:
            hooked = greedy(model, ids, 3)
    finally:
        handle.remove()
    assert_equal("sequences", plain, hooked)
    assert len([c for c in caught if issubclass(c.category, rh.RecurrentHooksWarning)]) == 1
    assert seen == [(0, 4), (1, 0), (2, 0)]  # pass 0: the prompt's last token and each decode step


def test_a_multi_token_continuation_over_the_cache(model):
    """8 prompt tokens, then 4 in one cached forward (the prompt kernel over the cached window): watched, the
    logits are the unwatched ones, the continuation's windows are those of one 12-token call, and a write at
    its token 1 changes only its later tokens."""
    ids = random_ids(2, 12)

    def run(watch_keep=None, write=None):
        with rh.watch(model, keep=watch_keep or ()) as w, torch.no_grad():
            if write is not None:
                static(w)[0].set_window_after(1, write, call=1)
            first = model(ids[:, :8], use_cache=True)
            second = model(ids[:, 8:], cache=first.past_key_values, use_cache=True)
        return second.logits, w

    plain, _ = run()
    watched, w = run(KEEP)
    assert_close("continuation logits, watched", plain, watched, rtol=0, atol=0)
    with rh.watch(model, keep=KEEP) as whole, torch.no_grad():
        model(ids, use_cache=False)
    for mixer, one in zip(static(w), static(whole)):
        assert [c.kernel for c in mixer.calls] == ["causal_conv1d_fn"] * 2 and mixer.calls[1].tokens == 4
        assert_close(f"{mixer} continuation windows", one.windows[:, 8:], mixer.calls[1].windows, rtol=1e-6, atol=1e-7)
    value = perturbation(static(w)[0].window_after(1, call=1))
    steered, _ = run(write=value)
    assert_close("continuation tokens <= 1", plain[:, :2], steered[:, :2], rtol=1e-6, atol=1e-7)
    assert (plain[:, 2:] - steered[:, 2:]).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["lfm2", "inkling"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_windows_leave_the_logits_bit_identical(name, dtype):
    """The conv loops round as transformers' kernels do: keeping or hooking every window leaves the logits of a
    half-precision model bit-identical. lfm2's windows are in the model dtype; inkling's stay float32."""
    model = build(name).to(dtype)
    for module in model.modules():
        if type(module).__name__ == "InklingShortConvolution":
            module.float()  # transformers builds these in float32 (`.to(dtype=torch.float32)`); .to(dtype) undid it
    ids = random_ids(2, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    plain, plain_gen = logits_of(model, ids), greedy(model, ids, 3, **kwargs)
    with rh.watch(model, keep=KEEP) as w:
        assert_close("keep windows", plain, logits_of(model, ids), rtol=0, atol=0)
    expected = torch.float32 if name == "inkling" else dtype
    assert all(mixer.windows.dtype == expected for mixer in static(w))
    again = greedy_under_replacing_hooks(model, ids, 3, static, **kwargs)
    assert_equal("greedy, a replacing hook on every token", plain_gen.sequences, again.sequences)
    assert_close_per_call("logits", plain_gen.logits, again.logits, rtol=0, atol=0)


def test_the_support_command_lists_what_the_kind_offers(capsys, family):
    from recurrent_hooks.__main__ import main

    assert main(["support", family]) == 0
    out = capsys.readouterr().out.split("\n", 1)[1]  # after the transformers version line
    assert out.startswith(f"{family}: {rh.FAMILIES[family].mixer_class} -> {rh.FAMILIES[family].kind.__name__}")
    assert "  works: windows, inputs, outputs, values, writes, hooks\n" in out
