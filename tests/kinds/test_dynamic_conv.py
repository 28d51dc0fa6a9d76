"""The dynamic short-convolution kinds (`DynamicShortConvolution`, `LoopedDynamicShortConvolution`): the bar of
tests/kinds/test_families.py for inkling2's and inkling2_loop's dynamic k/v convolutions, whose forward the library
owns.

The float64 reference is the equation of transformers' inkling2 dynamic convolution, from the module's own inputs:
y_t = (x_t + sum_{j<K} (W_s[j] + (W_p u_t)_{head,j}) x_{t-j}) / sqrt(2K + 1); the window after token t is the last
K inputs x_{t-K+1..t}, oldest first.
"""

import copy
import dataclasses
import math

import pytest
import torch
from _compare import assert_close, assert_equal
from _contract import family_fixtures, reading_of
from _models import PAD, build, random_ids
from _runs import calls_of, greedy, greedy_under_replacing_hooks, logits_of, watched_greedy, watched_logits

import recurrent_hooks as rh
from recurrent_hooks.engine.binding.rebinding import import_default
from recurrent_hooks.kinds.dynamic_conv import dynamic_conv_forward

ROWS = {
    row.name: row
    for family in rh.FAMILIES.values()
    for row in family.classes  # the dynamic mixer classes
    if issubclass(row.kind, rh.DynamicShortConvolution)
}
FAMILIES = list(ROWS)
KEEP = ("windows", "inputs", "outputs")
T = 13

# -- how the contract reads this kind (tests/kinds/test_contract.py, tests/helpers/_contract.py's ContractReading) -----


# The dynamic convolutions of the keys and values feed full attention: a window write at a decode step moves the
# tiny random model's later logits (about 0.3) by about 1e-6 (inkling2_loop: 9.2e-7 and 1.0e-6 at calls 3 and 4,
# on transformers 5.24 and 5.25), while the calls before it stay equal bit for bit (decode_early); otherwise as the
# short convolution it extends.
CONTRACT = {rh.DynamicShortConvolution: dataclasses.replace(reading_of(rh.ShortConvolution), later=1e-7)}


def dynamic(w):
    """The watch's dynamic convolutions, in module order (inkling2_loop: a mixer per pass)."""
    return [mixer for mixer in w.mixers if isinstance(mixer, rh.DynamicShortConvolution)]


def perturbation(window, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return window + torch.randn(window.shape, generator=gen).to(window.device) * (window.abs().max() + 1)


def _build(family):
    """The tiny model, with random static taps (transformers initialises them to zeros)."""
    model = build(family)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == ROWS[family].mixer_class:
                module.static_weight.copy_(torch.randn(module.static_weight.shape, generator=gen) * 0.5)
    return model


family, model = family_fixtures(FAMILIES, _build)


def _modules(model, family):
    return [m for m in model.modules() if type(m).__name__ == ROWS[family].mixer_class]


# -- the float64 reference ----------------------------------------------------------------------------------------


def _equation(module, x, u, window=None, written=None):
    """Windows [b, t, c, K] and outputs [b, t, c] of the equation, in float64, over inputs x [b, t, c] and u, from
    `window` (the window before token 0, zeros by default); `written` = {t: window} replaces the window after t."""
    x, u = x.double(), u.double()
    batch, seq, channels = x.shape
    size, heads = module.conv_kernel_size, module.num_heads
    taps = module.static_weight.double().T.reshape(heads, channels // heads, size)  # H c/H K
    dyn = (u @ module.weight_proj.weight.double().T).reshape(batch, seq, heads, 1, size)  # b t H 1 K
    current = x.new_zeros(batch, channels, size) if window is None else window.double()
    windows, outputs = [], []
    for t in range(seq):
        current = torch.cat([current[..., 1:], x[:, t, :, None]], dim=-1)  # b c K
        lags = current.flip(-1).reshape(batch, heads, channels // heads, size)  # x_{t-j}
        y = (x[:, t] + ((taps + dyn[:, t]) * lags).sum(-1).reshape(batch, channels)) / math.sqrt(2 * size + 1)
        outputs.append(y)
        if written is not None and t in written:
            current = written[t].double()
        windows.append(current)
    return torch.stack(windows, dim=1), torch.stack(outputs, dim=1)


def test_windows_and_outputs_equal_the_float64_equation_at_prompt_and_decode_steps(model):
    """Prompt and 3 decode steps of generate: every kept window is the last K inputs, every output the equation's."""
    w = watched_greedy(model, KEEP, T, 4)
    mixers = dynamic(w)
    assert mixers
    for mixer in mixers:
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        assert [c.index for c in mixer.calls] == [0, 1, 2, 3]
        assert [c.conv.kernel for c in mixer.calls] == ["forward"] * 4
        assert mixer.calls[0].conv.inputs["conv_state"] is None
        x = torch.cat([c.conv.inputs["hidden_states"] for c in mixer.calls], dim=1)
        u = torch.cat([c.conv.inputs["dynamic_input"] for c in mixer.calls], dim=1)
        windows, outputs = _equation(mixer.module, x, u)
        kept = torch.cat([c.windows for c in mixer.calls], dim=1)
        assert_close(f"{mixer} windows", windows, kept, rtol=1e-6, atol=1e-7)
        got = torch.cat([c.conv.output["output"] for c in mixer.calls], dim=1)
        assert_close(f"{mixer} outputs", outputs, got, rtol=1e-5, atol=1e-6)
        values = mixer.values(call=0)
        assert_equal(f"{mixer} values x", mixer.calls[0].conv.inputs["hidden_states"], values["x"])


# -- the forward against transformers' ------------------------------------------------------------------------------


def test_the_forward_equals_transformers_bit_for_bit(model, family):
    """On the recorded calls of a prompt, decode steps and a multi-token continuation: the library's forward, with
    and without `on_token`, gives transformers' output and cache window bit for bit (float32, no writes)."""
    original = import_default(getattr(ROWS[family].module(), ROWS[family].mixer_class), "forward")
    ids = random_ids(2, T)

    def run():
        with torch.no_grad():
            out = model(ids[:, :8], use_cache=True)
            model(ids[:, 8:], cache=out.past_key_values, use_cache=True)
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)

    calls = calls_of(_modules(model, family), run)
    assert {args[0].shape[1] for _, args, _ in calls} == {8, T - 8, T, 1}
    windows = []
    for module, args, kwargs in calls:
        caches = [copy.deepcopy(kwargs.get("cache")) for _ in range(3)]
        where = (module.layer_idx + kwargs.get("cache_offset", 0), module.conv_idx)
        with torch.no_grad():
            theirs = original(module, *args, **{**kwargs, "cache": caches[0]})
            ours = dynamic_conv_forward(module, *args, **{**kwargs, "cache": caches[1]})
            looped = dynamic_conv_forward(
                module,
                *args,
                **{**kwargs, "cache": caches[2]},
                on_token=lambda t, window: windows.append(window) or window,
            )
        assert_equal(f"{module.__class__.__name__} output", theirs, ours)
        assert_equal(f"{module.__class__.__name__} output with on_token", theirs, looped)
        if caches[0] is not None:
            for cache in caches[1:]:
                assert_equal("cached window", caches[0].get_conv_state(*where), cache.get_conv_state(*where))
            assert_equal("the last window handed over is the cached one", caches[0].get_conv_state(*where), windows[-1])


@pytest.mark.parametrize("seq", [1, 3, T])
def test_watched_logits_equal_unwatched(model, seq):
    """An idle watch, and one keeping the windows (the token loop), give the plain logits bit for bit."""
    ids = random_ids(2, seq)
    expected, idle, kept, w = watched_logits(model, ids, ("windows",))
    assert_equal("idle watch", expected, idle)
    assert_equal("token loop", expected, kept)
    assert dynamic(w)[0].windows.shape[:2] == (2, seq)


def test_greedy_generate_is_identical_under_hooks_and_the_call_counter(model):
    ids = random_ids(2, T)
    expected = greedy(model, ids, 5)
    seen = []
    with rh.watch(model) as w:
        for mixer in dynamic(w):
            mixer.register_state_hook(lambda m, c, t, s: seen.append((c, t)))
        assert_equal("generate", expected, greedy(model, ids, 5))
    per_mixer = [(0, t) for t in range(T)] + [(k, 0) for k in range(1, 5)]
    assert sorted(seen) == sorted(per_mixer * len(dynamic(w)))  # every mixer: the prompt's tokens, then steps 1..4


# -- writes -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [0, 5, T - 2])
def test_a_window_write_at_a_prompt_token_changes_only_later_tokens_and_the_cache(model, token):
    ids = random_ids(2, T)
    with rh.watch(model, keep=KEEP) as w:
        clean = logits_of(model, ids, use_cache=True)
    first = dynamic(w)[0]
    value = perturbation(first.window_after(token))
    x, u = first.calls[0].conv.inputs["hidden_states"], first.calls[0].conv.inputs["dynamic_input"]
    with rh.watch(model, keep=KEEP) as w:
        dynamic(w)[0].set_window_after(token, value)
        out = model(ids, use_cache=True)
    mixer = dynamic(w)[0]
    assert_equal("logits up to the written token", clean[:, : token + 1], out.logits[:, : token + 1])
    assert (clean[:, token + 1 :] - out.logits[:, token + 1 :]).abs().max() > 1e-6
    _, expected = _equation(mixer.module, x, u, written={token: value})
    assert_close(
        "the mixer's outputs continue from the written window",
        expected,
        mixer.calls[0].conv.output["output"],
        rtol=1e-5,
        atol=1e-6,
    )
    layer, state = mixer.module.layer_idx, mixer.module.conv_idx
    windows, _ = _equation(mixer.module, x, u, written={token: value})
    assert_close(
        "the cache holds the window continued from the write",
        windows[:, -1],
        out.past_key_values.get_conv_state(layer, state_idx=state),
        rtol=1e-6,
        atol=1e-7,
    )


def test_writes_after_the_last_prompt_token_and_at_a_decode_step_reach_the_cache(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=KEEP) as w:
        clean = greedy(model, ids, 4)
    last, step = perturbation(dynamic(w)[0].window_after(-1)), perturbation(dynamic(w)[0].window_after(0, call=2))
    with rh.watch(model, keep=KEEP) as w:
        dynamic(w)[0].set_window_after(T - 1, last)
        dynamic(w)[0].set_window_after(0, step, call=2)
        greedy(model, ids, 4)
    calls = dynamic(w)[0].calls
    assert_equal("decode step 1 read the window written after the prompt", last, calls[1].conv.inputs["conv_state"])
    assert_equal("decode step 3 read the window written at step 2", step, calls[3].conv.inputs["conv_state"])
    assert_equal("the prompt is unchanged", clean[:, :T], greedy(model, ids, 4)[:, :T])


def test_a_replacing_hook_is_a_write(model):
    ids = random_ids(1, T)
    with rh.watch(model, keep=("windows",)) as w:
        logits_of(model, ids)
    value = perturbation(dynamic(w)[0].window_after(4))
    with rh.watch(model) as w:
        dynamic(w)[0].set_window_after(4, value)
        written = logits_of(model, ids)
    with rh.watch(model) as w:
        dynamic(w)[0].register_state_hook(lambda m, c, t, s: value, call=0, token=4)
        hooked = logits_of(model, ids)
    assert_equal("a replacing hook is a write", written, hooked)


def test_writing_the_window_makes_the_mixer_continue_as_in_the_other_run(model, family):
    """Whole-memory identity: runs A and B share their inputs after token t; writing A's window after t into B
    makes B's outputs after t equal A's (the module called on its own, without a cache)."""
    module = _modules(model, family)[0]
    gen = torch.Generator().manual_seed(5)
    channels, size = module.static_weight.shape[1], module.weight_proj.in_features
    xa, ua = torch.randn(2, T, channels, generator=gen), torch.randn(2, T, size, generator=gen)
    xb, ub = xa.clone(), ua.clone()
    t = 6
    xb[:, : t + 1], ub[:, : t + 1] = (
        torch.randn(2, t + 1, channels, generator=gen),
        torch.randn(2, t + 1, size, generator=gen),
    )
    xa, ua, xb, ub = (x.to(module.static_weight.device) for x in (xa, ua, xb, ub))  # the model's (pytest --device)
    with torch.no_grad(), rh.watch(model, keep=("windows",)) as w:
        ya = module(xa, ua)
        mixer = next(m for m in dynamic(w) if m.module is module)
        window = mixer.window_after(t)
    with torch.no_grad(), rh.watch(model) as w:
        plain = module(xb, ub)
        mixer = next(m for m in dynamic(w) if m.module is module)
        mixer.set_window_after(t, window, call=1)
        yb = module(xb, ub)
    assert (plain[:, t + 1 :] - ya[:, t + 1 :]).abs().max() > 1e-3
    assert_equal("B up to t is B's own", plain[:, : t + 1], yb[:, : t + 1])
    assert_close("B after t is A's", ya[:, t + 1 :], yb[:, t + 1 :], rtol=1e-6, atol=1e-6)


def test_gradient_with_respect_to_a_kept_window(model):
    ids = random_ids(1, T)
    token = 5
    with rh.watch(model, keep=KEEP) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    (grad,) = torch.autograd.grad(metric, dynamic(w)[0].window_after(token))
    leaf = dynamic(w)[0].window_after(token).detach().clone().requires_grad_()
    with rh.watch(model) as w:
        dynamic(w)[0].set_window_after(token, leaf)
        model(ids).logits[0, -1].logsumexp(-1).backward()
    assert leaf.grad.abs().max() > 0
    assert_close("grad through the kept window vs a written leaf", leaf.grad, grad, rtol=1e-5, atol=1e-8)
    assert grad[..., 0].abs().max() == 0, "the oldest column reaches no later output"


# -- bindings, registry and support -----------------------------------------------------------------------------------


def test_bindings_restored_after_exit_after_a_raising_hook_and_when_nested(model, family):
    owner = getattr(ROWS[family].module(), ROWS[family].mixer_class)
    before = owner.__dict__["forward"]
    ids = random_ids(1, 5)
    with rh.watch(model) as outer:
        assert getattr(owner.__dict__["forward"], "__recurrent_hooks__", False)
        with rh.watch(model) as inner:
            dynamic(inner)[0].register_state_hook(lambda m, c, t, s: None)
            logits_of(model, ids)
        assert getattr(owner.__dict__["forward"], "__recurrent_hooks__", False)
        assert dynamic(outer)
    assert owner.__dict__["forward"] is before

    def boom(mixer, call, token, state):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        with rh.watch(model) as w:
            dynamic(w)[0].register_state_hook(boom, token=3)
            logits_of(model, ids)
    assert owner.__dict__["forward"] is before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert_equal("model unchanged after the watches", logits_of(_build(family), ids), logits_of(model, ids))


def test_registry_and_support_rows(model, family):
    row = ROWS[family]
    assert row.name in rh.FAMILIES and rh.FAMILIES[row.name].mixer_class != row.mixer_class
    from recurrent_hooks.registry import UNSUPPORTED, family_of, mixer_of, resolve_family

    assert all(u.mixer_class != row.mixer_class for u in UNSUPPORTED)
    assert all(mixer_of(m) is row and family_of(m) is rh.FAMILIES[family] for m in _modules(model, family))
    assert resolve_family(model) is rh.FAMILIES[family]
    rows = [r for r in rh.support(model) if r.kind == row.kind.__name__]
    assert len(rows) == len(_modules(model, family))
    for r in rows:
        assert r.family == family
        assert r.available == ("windows", "inputs", "outputs", "values", "writes", "hooks")
        assert "state" in r.unavailable and "effective attention" in r.unavailable


def test_the_state_is_unavailable(model):
    with rh.watch(model, keep=KEEP) as w:
        logits_of(model, random_ids(1, 5))
    with pytest.raises(rh.Unavailable, match="window"):
        dynamic(w)[0].state_after(2)


def test_a_multi_token_continuation_and_left_padding(model):
    """A prompt, then 4 tokens in one cached forward, then a left-padded batch: watched with kept windows, the
    logits are the unwatched ones bit for bit; the continuation starts from the prompt's last window, and a
    padded position shifts a zero into the window."""
    ids = random_ids(2, T)

    def run():
        with torch.no_grad():
            out = model(ids[:, :8], use_cache=True)
            more = model(ids[:, 8:12], cache=out.past_key_values, use_cache=True)
        return out.logits, more.logits

    expected = run()
    with rh.watch(model, keep=KEEP) as w:
        got = run()
    for name, a, b in zip(("prompt", "continuation"), expected, got):
        assert_equal(name, a, b)
    for mixer in dynamic(w):
        prompt, continuation = mixer.calls
        assert continuation.tokens == 4 and continuation.index == 1
        assert_equal(
            f"{mixer} continues from the prompt's last window",
            prompt.windows[:, -1],
            continuation.conv.inputs["conv_state"],
        )
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0
    padded = ids.clone()
    padded[1, :4] = PAD
    expected = logits_of(model, padded, attention_mask=mask)
    with rh.watch(model, keep=KEEP) as w:
        assert_equal("left-padded batch", expected, logits_of(model, padded, attention_mask=mask))
    for mixer in dynamic(w):
        windows = mixer.calls[0].windows
        assert windows[1, :4].abs().max() == 0, f"{mixer}: the pads enter the window as zeros"
        assert windows[0, :4].abs().max() > 0


def test_standalone_hooks_count_from_each_prompt(model, family):
    """rh.register_state_hook on a dynamic module: its prompt is call 0 in every generate (a looped module, whose
    passes a hook without a watch cannot tell apart, serves its first pass), and the binding is restored."""
    module = _modules(model, family)[0]
    owner = getattr(ROWS[family].module(), ROWS[family].mixer_class)
    seen = []
    looped = issubclass(ROWS[family].kind, rh.LoopedShortConvolution) and module.layer_idx >= 1
    handle = rh.register_state_hook(module, lambda m, c, t, s: seen.append((c, t)), call=None if looped else 1)
    try:
        if looped:  # the first pass is hooked, the later ones run unhooked (one warning)
            with pytest.warns(rh.RecurrentHooksWarning, match="later pass of a looped layer"):
                greedy(model, random_ids(1, 5), 3)
            assert [c for c, _ in seen] == [0] * 5 + [1, 2]  # the first pass: a 5-token prompt, 2 decode steps
        else:
            greedy(model, random_ids(1, 5), 3)
            greedy(model, random_ids(1, 6), 2)
            assert seen == [(1, 0), (1, 0)]
    finally:
        handle.remove()
    assert owner.__dict__["forward"] is import_default(owner, "forward")


def test_bf16_windows_stay_float32_and_the_logits_bit_identical(family):
    """A bf16 model (built with `_from_config(dtype=...)`: `.to(bf16)` breaks inkling2's router, bug 11): keeping or
    replacing every window leaves the logits and greedy generate bit-identical; the windows are float32."""
    fp32 = _build(family)
    torch.manual_seed(0)
    model = type(fp32)._from_config(fp32.config, dtype=torch.bfloat16).eval()
    model.load_state_dict(fp32.state_dict())
    ids = random_ids(2, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    plain, plain_gen = logits_of(model, ids), greedy(model, ids, 3, **kwargs)
    with rh.watch(model, keep=KEEP) as w:
        assert_equal("keep windows", plain, logits_of(model, ids))
    assert all(mixer.windows.dtype == torch.float32 for mixer in dynamic(w))
    again = greedy_under_replacing_hooks(model, ids, 3, dynamic, **kwargs)
    assert_equal("greedy, a replacing hook on every token", plain_gen.sequences, again.sequences)
    for step, (a, b) in enumerate(zip(plain_gen.logits, again.logits)):
        assert_equal(f"logits of call {step}", a, b)
