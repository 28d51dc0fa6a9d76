"""zaya's CCA projection (`CompressedConvolutionalAttention`): the family bar for a forward the library owns that
updates two memories, the q/k conv window (`conv_state`) and the one-token value delay (`state`).

The float64 reference is the equation of transformers' zaya CCA, from the module's own inputs x:
c_t = [W_q x_t; W_k x_t]; ĉ = GroupConv_{t1}(DWConv_{t0}(c)) over the K window columns before each token and the
token's own; q = ĉ_q + (q~ + rep(k~)) / 2, k = ĉ_k + its group mean; v_t = [W_vc x_t ; delay_{t-1}], delay_t =
W_vd x_t (delay_{-1} = W_vd 0). The window after token t is c_{t-K+1..t}, oldest first.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_close, assert_equal
from _contract import ContractReading
from _models import PAD, build, random_ids
from _runs import calls_of, greedy, logits_of, watched_greedy, watched_logits

import recurrent_hooks as rh
from recurrent_hooks.engine.binding.rebinding import import_default
from recurrent_hooks.kinds.shared.recording import RECORDING
from recurrent_hooks.kinds.zaya import PAST_RECORDING_RUNS, CompressedConvolutionalAttention, cca_forward

KEEP = ("windows", "states", "inputs", "outputs")
T = 13

# -- how the contract reads this kind (tests/kinds/test_contract.py, tests/helpers/_contract.py's ContractReading) -----


# one forward updates both memories, the q/k window and the one-token value delay (the state): a call's state
# input is the delay the forward received; its forward, operation for operation (loop_atol); grad mode recomputes
CONTRACT = {
    rh.CompressedConvolutionalAttention: ContractReading(
        state_in=lambda mixer, call: mixer.calls[call].conv.inputs["delay"], loop_atol=0.0, grad_parity=(13,)
    )
}


@pytest.fixture(scope="module")
def model():
    return build("zaya")


def _modules(model):
    return [m for m in model.modules() if type(m).__name__ == "ZayaCCAProjection"]


def _owner(model):
    return type(_modules(model)[0])


def perturbation(value, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return value + torch.randn(value.shape, generator=gen) * (value.abs().max() + 1)


# -- the float64 reference ----------------------------------------------------------------------------------------


def _equation(module, x, window=None, delay=None, windows_written=None, delays_written=None):
    """Per token, in float64: the windows [b, t, c, K], the delays [b, t, d] and (q, k, v), over inputs x [b, t, h]
    from `window` / `delay` (the memories before token 0; zeros and W_vd 0 by default); `windows_written` /
    `delays_written` = {t: value} replace the memory after token t."""
    d = {name: p.double() for name, p in module.named_parameters()}
    x = x.double()
    batch, seq, _ = x.shape
    heads, kv_heads, dim, size = (
        module.num_attention_heads,
        module.num_key_value_heads,
        module.head_dim,
        module.conv_kernel_size,
    )
    groups = heads // kv_heads

    def linear(name, inputs):
        bias = d.get(f"{name}.bias")
        return inputs @ d[f"{name}.weight"].T + (0 if bias is None else bias)

    q_tilde = linear("q_proj", x)  # b t (H D)
    k_tilde = linear("k_proj", x)  # b t (Hkv D)
    c = torch.cat([q_tilde, k_tilde], dim=-1)  # b t C
    channels = c.shape[-1]
    current = x.new_zeros(batch, channels, size) if window is None else window.double()
    # delay_{-1}
    before = linear("v_proj_delayed", x.new_zeros(batch, x.shape[-1])) if delay is None else delay.double()
    windows, delays, conv, delayed = [], [], [], []
    for t in range(seq):
        context = torch.cat([current, c[:, t, :, None]], dim=-1)  # b C K+1
        hidden = F.conv1d(context, d["conv_qk_depthwise.weight"], d["conv_qk_depthwise.bias"], groups=channels)
        out = F.conv1d(hidden, d["conv_qk_grouped.weight"], d["conv_qk_grouped.bias"], groups=heads + kv_heads)
        conv.append(out[..., 0])  # b C   ĉ_t
        current = context[..., 1:]  # the window after t
        if windows_written is not None and t in windows_written:
            current = windows_written[t].double()
        windows.append(current)
        delayed.append(before)  # token t's delayed value half: the delay after t-1
        before = linear("v_proj_delayed", x[:, t])  # delay_t
        if delays_written is not None and t in delays_written:
            before = delays_written[t].double()
        delays.append(before)
    conv = torch.stack(conv, dim=1)  # b t C
    mixed = (
        q_tilde.view(batch, seq, heads, dim)
        + k_tilde.view(batch, seq, kv_heads, 1, dim).expand(-1, -1, -1, groups, -1).reshape(batch, seq, heads, dim)
    ) / 2
    q = conv[..., : heads * dim].view(batch, seq, heads, dim) + mixed
    k = conv[..., heads * dim :].view(batch, seq, kv_heads, dim) + mixed.view(batch, seq, kv_heads, groups, dim).mean(
        -2
    )
    current_v = linear("v_proj_current", x)
    v = torch.cat([current_v, torch.stack(delayed, dim=1)], dim=-1).view(batch, seq, kv_heads, dim)
    return torch.stack(windows, dim=1), torch.stack(delays, dim=1), (q, k, v)


def _check_outputs(name, expected, part, rtol=1e-5, atol=1e-6):
    for what, want in zip(("query", "key", "value"), expected):
        assert_close(f"{name}: {what}", want, part.output[what], rtol=rtol, atol=atol)


def test_windows_delays_and_outputs_equal_the_float64_equation_at_prompt_and_decode_steps(model):
    """Prompt and 3 decode steps of generate: every kept window is the last K conv inputs, every kept delay
    W_vd x_t, and q, k, v the equation's."""
    w = watched_greedy(model, KEEP, T, 4)
    assert len(w.mixers) == 2
    for mixer in w.mixers:
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        assert [c.conv.kernel for c in mixer.calls] == [c.kernel for c in mixer.calls] == ["forward"] * 4
        assert mixer.calls[0].conv.inputs["conv_state"] is None and mixer.calls[0].conv.inputs["delay"] is None
        x = torch.cat([c.conv.inputs["hidden_states"] for c in mixer.calls], dim=1)
        windows, delays, outputs = _equation(mixer.module, x)
        assert_close(
            f"{mixer} windows", windows, torch.cat([c.windows for c in mixer.calls], dim=1), rtol=1e-6, atol=1e-7
        )
        assert_close(f"{mixer} delays", delays, torch.cat([c.states for c in mixer.calls], dim=1), rtol=1e-6, atol=1e-7)
        for what, want in zip(("query", "key", "value"), outputs):
            got = torch.cat([c.conv.output[what] for c in mixer.calls], dim=1)
            assert_close(f"{mixer} {what}", want, got, rtol=1e-5, atol=1e-6)
        assert_equal(f"{mixer} values", mixer.calls[0].conv.output["value"], mixer.values(call=0)["value"])


# -- the forward against transformers' ------------------------------------------------------------------------------


def test_the_forward_equals_transformers_bit_for_bit(model):
    """On the recorded calls of a prompt, a multi-token continuation, decode steps and a left-padded batch: the
    library's forward, with and without hooks on both memories, gives transformers' q, k, v and cache (window and
    delay) bit for bit (float32, no writes); the last window and delay handed over are the cached ones."""
    original = import_default(_owner(model), "forward")
    ids = random_ids(2, T)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0

    def run():
        with torch.no_grad():
            out = model(ids[:, :8], use_cache=True)
            model(ids[:, 8:], cache=out.past_key_values, use_cache=True)
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)

    calls = calls_of(_modules(model), run)
    assert {args[0].shape[1] for _, args, _ in calls} == {8, T - 8, T, 1}
    for module, args, kwargs in calls:
        cache_at = 1 if len(args) > 1 else None

        def with_cache(cache):
            a = list(args)
            if cache_at is not None:
                a[cache_at] = cache
                return a, kwargs
            return a, {**kwargs, "cache": cache}

        given = args[1] if cache_at is not None else kwargs.get("cache")
        caches = [copy.deepcopy(given) for _ in range(3)]
        seen = {"window": [], "delay": []}
        with torch.no_grad():
            theirs = original(module, *with_cache(caches[0])[0], **with_cache(caches[0])[1])
            ours = cca_forward(module, *with_cache(caches[1])[0], **with_cache(caches[1])[1])
            a, k = with_cache(caches[2])
            looped = cca_forward(
                module,
                *a,
                **k,
                on_token=lambda t, s: seen["window"].append(s) or s,
                on_also=lambda t, s: seen["delay"].append(s) or s,
            )
        for name, mine in (("", ours), (" with hooks", looped)):
            for what, a_, b_ in zip(("query", "key", "value"), theirs, mine):
                assert_equal(f"{what}{name}", a_, b_)
        if caches[0] is not None:
            layer = module.layer_idx
            for cache in caches[1:]:
                assert_equal("cached window", caches[0].get_conv_state(layer), cache.get_conv_state(layer))
                assert_equal("cached delay", caches[0].get_recurrent_state(layer), cache.get_recurrent_state(layer))
            assert_equal(
                "the last window handed over is the cached one", caches[0].get_conv_state(layer), seen["window"][-1]
            )
            assert_equal(
                "the last delay handed over is the cached one", caches[0].get_recurrent_state(layer), seen["delay"][-1]
            )


@pytest.mark.parametrize("seq", [1, 3, T])
def test_watched_logits_equal_unwatched(model, seq):
    """An idle watch, one keeping both memories and one with no-op hooks on both give the plain logits bit for bit."""
    ids = random_ids(2, seq)
    expected, idle, kept, w = watched_logits(model, ids, KEEP)
    assert_equal("idle watch", expected, idle)
    assert_equal("keep both memories", expected, kept)
    assert w.mixers[0].windows.shape == (2, seq, 48, 2) and w.mixers[0].states.shape == (2, seq, 8)
    with rh.watch(model) as w:
        for mixer in w.mixers:
            mixer.register_state_hook(lambda m, c, t, s: None, memory="window")
            mixer.register_state_hook(lambda m, c, t, s: None, memory="state")
        assert_equal("no-op hooks on both memories", expected, logits_of(model, ids))


def test_greedy_generate_and_hooks_at_prompt_tokens_and_decode_steps(model):
    """Hooks on both memories see (call, token) of the prompt, then of each decode step, in order, with the memory
    the next token reads; generate's tokens are the unwatched ones."""
    ids = random_ids(2, T)
    expected = greedy(model, ids, 5)
    seen = {"window": [], "state": []}
    with rh.watch(model, keep=("windows", "states")) as w:
        mixer = w.mixers[1]
        for which in seen:
            mixer.register_state_hook(
                lambda m, c, t, s, which=which: seen[which].append((c, t, s.clone())), memory=which
            )
        assert_equal("generate", expected, greedy(model, ids, 5))
    order = [(0, t) for t in range(T)] + [(k, 0) for k in range(1, 5)]
    for which, getter in (("window", mixer.window_after), ("state", mixer.state_after)):
        assert [(c, t) for c, t, _ in seen[which]] == order, which
        for c, t, value in seen[which]:
            assert_equal(f"{which} hooked at call {c}, token {t}", getter(t, call=c), value)


# -- writes -----------------------------------------------------------------------------------------------------------


def _prompt_memories(model, ids):
    with rh.watch(model, keep=KEEP) as w:
        clean = logits_of(model, ids, use_cache=True)
    return clean, w.mixers[0]


@pytest.mark.parametrize("which", ["window", "state", "both"])
@pytest.mark.parametrize("token", [0, 5, T - 2])
def test_a_write_at_a_prompt_token_changes_only_later_tokens_and_the_cache(model, which, token):
    """A write after token t (the window, the delay or both): the mixer's q, k, v up to t bit for bit, the logits up to
    t within the rounding of the attention kernel, later ones changed; the mixer's q, k, v are the equation's
    continued from the written memory, and the cache holds what it continued to.

    (torch's CPU SDPA with is_causal does not keep a row's rounding apart from later rows: changing only token 6's
    value in the plain model, with no library, moves the logits of tokens 0-5 by up to 7.5e-9.)"""
    ids = random_ids(2, T)
    clean, first = _prompt_memories(model, ids)
    window = perturbation(first.window_after(token)) if which in ("window", "both") else None
    delay = perturbation(first.state_after(token), seed=2) if which in ("state", "both") else None
    x = first.calls[0].conv.inputs["hidden_states"]
    with rh.watch(model, keep=KEEP) as w:
        if which == "both":
            w.mixers[0].set_memory_after(token, rh.Memory(delay, window))
        elif which == "window":
            w.mixers[0].set_window_after(token, window)
        else:
            w.mixers[0].set_state_after(token, delay)
        out = model(ids, use_cache=True)
    mixer = w.mixers[0]
    for name, value in first.calls[0].conv.output.items():
        assert_equal(
            f"{name} up to the written token", value[:, : token + 1], mixer.calls[0].conv.output[name][:, : token + 1]
        )
    assert_close(
        "logits up to the written token", clean[:, : token + 1], out.logits[:, : token + 1], rtol=1e-6, atol=1e-7
    )
    assert (clean[:, token + 1 :] - out.logits[:, token + 1 :]).abs().max() > 1e-6
    windows, delays, outputs = _equation(
        mixer.module,
        x,
        windows_written=None if window is None else {token: window},
        delays_written=None if delay is None else {token: delay},
    )
    _check_outputs("the mixer continues from the write", outputs, mixer.calls[0].conv)
    cache, layer = out.past_key_values, mixer.module.layer_idx
    assert_close("the cached window", windows[:, -1], cache.get_conv_state(layer), rtol=1e-6, atol=1e-7)
    assert_close("the cached delay", delays[:, -1], cache.get_recurrent_state(layer), rtol=1e-6, atol=1e-7)


def test_writes_after_the_last_prompt_token_and_at_a_decode_step_reach_the_next_call(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=KEEP) as w:
        greedy(model, ids, 4)
    first = w.mixers[0]
    window, delay = perturbation(first.window_after(-1)), perturbation(first.state_after(0, call=2), seed=2)
    with rh.watch(model, keep=KEEP) as w:
        w.mixers[0].set_window_after(T - 1, window)
        w.mixers[0].set_state_after(0, delay, call=2)
        greedy(model, ids, 4)
    calls = w.mixers[0].calls
    assert_equal("decode step 1 read the window written after the prompt", window, calls[1].conv.inputs["conv_state"])
    assert_equal("decode step 3 read the delay written at step 2", delay, calls[3].conv.inputs["delay"])
    value = calls[3].conv.output["value"]  # b 1 Hkv D: the second half of each head is the delay read
    assert_equal("decode step 3's delayed value half", delay.view(2, 1, 1, -1), value[..., value.shape[-1] // 2 :])


def test_a_replacing_hook_is_a_write(model):
    ids = random_ids(1, T)
    with rh.watch(model, keep=("windows", "states")) as w:
        logits_of(model, ids)
    window, delay = perturbation(w.mixers[0].window_after(4)), perturbation(w.mixers[0].state_after(4))
    with rh.watch(model) as w:
        w.mixers[0].set_window_after(4, window)
        w.mixers[0].set_state_after(4, delay)
        written = logits_of(model, ids)
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: window, call=0, token=4, memory="window")
        w.mixers[0].register_state_hook(lambda m, c, t, s: delay, call=0, token=4, memory="state")
        hooked = logits_of(model, ids)
    assert_equal("a replacing hook is a write", written, hooked)


def test_a_write_of_the_wrong_shape_names_the_memory_mixer_call_and_token(model):
    with rh.watch(model) as w:
        w.mixers[1].set_state_after(3, torch.zeros(2, 5))
        with pytest.raises(
            rh.InvalidValue,
            match=r"CompressedConvolutionalAttention\(zaya, layer 1\), call 0, token 3:"
            r" set_state_after.* gave a state with shape \(2, 5\), expected \(2, 8\)"
            r" \(axes: batch delay_channels\)",
        ):
            logits_of(model, random_ids(2, T))


def test_the_whole_memory_identity(model):
    """set_memory_after(t, memory_after(t)) changes nothing; and runs A and B that share their inputs after t: B
    written with A's memory after t continues as A (the module called on its own, without a cache)."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=("windows", "states")) as w:
        clean = logits_of(model, ids)
    memory = w.memory_after(6)
    with rh.watch(model) as w:
        w.set_memory_after(6, memory)
        assert_close("the model's own memory written back", clean, logits_of(model, ids), rtol=1e-6, atol=1e-6)
    module = _modules(model)[0]
    gen = torch.Generator().manual_seed(5)
    xa = torch.randn(2, T, module.hidden_size, generator=gen)
    xb = xa.clone()
    t = 6
    xb[:, : t + 1] = torch.randn(2, t + 1, module.hidden_size, generator=gen)
    with torch.no_grad(), rh.watch(model, keep=("windows", "states")) as w:
        qa, ka, va = module(xa, None)
        mixer = next(m for m in w.mixers if m.module is module)
        memory = mixer.memory_after(t)
    with torch.no_grad(), rh.watch(model) as w:
        plain = module(xb, None)
        mixer = next(m for m in w.mixers if m.module is module)
        mixer.set_memory_after(t, memory, call=1)
        qb, kb, vb = module(xb, None)
    for what, a, b, p in zip("qkv", (qa, ka, va), (qb, kb, vb), plain):
        assert (p[:, t + 1] - a[:, t + 1]).abs().max() > 1e-4, what  # B differs from A there, unwritten
        assert_equal(f"B's {what} up to t is B's own", p[:, : t + 1], b[:, : t + 1])
        assert_close(f"B's {what} after t is A's", a[:, t + 1 :], b[:, t + 1 :], rtol=1e-6, atol=1e-6)


def test_gradient_with_respect_to_a_kept_delay_and_window(model):
    ids = random_ids(1, T)
    token = 5
    with rh.watch(model, keep=("windows", "states")) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    mixer = w.mixers[0]
    grads = torch.autograd.grad(metric, [mixer.state_after(token), mixer.window_after(token)])
    delay = mixer.state_after(token).detach().clone().requires_grad_()
    window = mixer.window_after(token).detach().clone().requires_grad_()
    with rh.watch(model) as w:
        w.mixers[0].set_memory_after(token, rh.Memory(delay, window))
        model(ids).logits[0, -1].logsumexp(-1).backward()
    for name, leaf, grad in (("delay", delay, grads[0]), ("window", window, grads[1])):
        assert leaf.grad.abs().max() > 0, name
        assert_close(f"grad through the kept {name} vs a written leaf", leaf.grad, grad, rtol=1e-5, atol=1e-9)


# -- bindings, registry, support and transformers' limit -----------------------------------------------------------


def test_bindings_restored_after_exit_after_a_raising_hook_and_when_nested(model):
    owner = _owner(model)
    before = owner.__dict__["forward"]
    ids = random_ids(1, 5)
    with rh.watch(model):
        assert getattr(owner.__dict__["forward"], "__recurrent_hooks__", False)
        with rh.watch(model) as inner:
            inner.mixers[0].register_state_hook(lambda m, c, t, s: None, memory="state")
            logits_of(model, ids)
        assert getattr(owner.__dict__["forward"], "__recurrent_hooks__", False)
    assert owner.__dict__["forward"] is before

    def boom(mixer, call, token, state):
        raise KeyError("boom")

    for which in ("window", "state"):
        with pytest.raises(KeyError, match="boom"):
            with rh.watch(model) as w:
                w.mixers[0].register_state_hook(boom, token=3, memory=which)
                logits_of(model, ids)
        assert owner.__dict__["forward"] is before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert_equal("model unchanged after the watches", logits_of(build("zaya"), ids), logits_of(model, ids))


def test_registry_and_support_rows(model):
    from recurrent_hooks.registry import UNSUPPORTED, family_of, resolve_family

    assert rh.FAMILIES["zaya"].kind is CompressedConvolutionalAttention
    assert all(u.mixer_class != "ZayaCCAProjection" for u in UNSUPPORTED)
    assert all(family_of(m) is rh.FAMILIES["zaya"] for m in _modules(model))
    assert resolve_family(model) is rh.FAMILIES["zaya"]
    rows = [r for r in rh.support(model) if r.mixer_class == "ZayaCCAProjection"]
    assert [r.layer for r in rows] == [0, 1]
    for r in rows:
        assert (r.family, r.kind) == ("zaya", "CompressedConvolutionalAttention")
        assert r.available == ("states", "windows", "inputs", "outputs", "values", "writes", "hooks")
        if not PAST_RECORDING_RUNS:
            assert "activate_past_recording" in r.refused[RECORDING]
        else:
            assert RECORDING not in r.unavailable


def _decode_twice_recording_the_past(model, ids):
    """A prompt, then two decode steps under `cache.activate_past_recording()` (assisted decoding's cache)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        cache.activate_past_recording()
        logits = [out.logits[:, -1]]
        for _ in range(2):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.skipif(PAST_RECORDING_RUNS, reason="transformers >= 5.25 runs a recording cache: the next test")
def test_past_recording_fails_in_transformers_and_is_refused_by_name_when_watched(model):
    """transformers before 5.25: under `cache.activate_past_recording()` the cache grows zaya's window by whole
    windows and transformers' own forward raises at the second decode step; a watched call with hooks refuses
    a recording cache with a message naming it (an idle watch runs transformers' forward, which raises as it does)."""
    ids = random_ids(1, 5)
    with pytest.raises(RuntimeError, match="view"):
        _decode_twice_recording_the_past(model, ids)
    with pytest.raises(
        rh.Unavailable,
        match=r"ZayaCCAProjection \(layer 0\): a cache recording its past \(assisted"
        r" decoding\): transformers 5\.24\.\d+'s own forward cannot run it",
    ):
        with rh.watch(model) as w:
            w.mixers[0].register_state_hook(lambda m, c, t, s: None, memory="state")
            _decode_twice_recording_the_past(model, ids)


@pytest.mark.skipif(not PAST_RECORDING_RUNS, reason="transformers < 5.25 cannot run a recording cache: the test above")
def test_past_recording_runs_in_transformers_and_when_watched(model):
    """transformers 5.25 on: a cache recording its past keeps every past column of the window, and the forward takes
    its context from the cache. A watched run with hooks on both memories gives transformers' logits, and its hooks
    see the window's last K columns (what the next token reads) at each decode step."""
    ids = random_ids(1, 5)
    expected = _decode_twice_recording_the_past(model, ids)
    seen = []
    with rh.watch(model, keep=("windows",)) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append((c, t, s.clone())), memory="window")
        w.mixers[0].register_state_hook(lambda m, c, t, s: None, memory="state")
        got = _decode_twice_recording_the_past(model, ids)
    assert_equal("logits with a recording cache", expected, got)
    assert [(c, t) for c, t, _ in seen] == [(0, t) for t in range(5)] + [(1, 0), (2, 0)]
    for c, t, window in seen:
        assert window.shape[-1] == w.mixers[0].module.conv_kernel_size
        assert_equal(f"window hooked at call {c}, token {t}", w.mixers[0].window_after(t, call=c), window)
