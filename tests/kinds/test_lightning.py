"""MiniMax lightning attention (`LightningAttention`): the library's forward against transformers' and the
float64 recurrence, and the bar every family meets (tests/kinds/test_families.py), for a kind whose kernel is the
mixer's whole forward, bound as a class attribute, and whose memory is the state alone (the kind-agnostic part
of the bar: tests/kinds/test_contract.py).

The float64 reference is written from the MiniMax-01 equations:
    [q; k; v] = SiLU(W_qkv x),  S_t = λ_h S_{t-1} + k_t^T v_t,  o_t = q_t S_t,  out = W_o(σ(W_g x) ⊙ RMSNorm(o)),
    λ_h = exp(-s_h),  s_h = 2^(-8 (h+1) / H) (1 - l / (L - 1 + 1e-5) + 1e-5).
"""

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_close, assert_close_per_call, assert_equal
from _contract import ContractReading, family_fixtures
from _models import DEVICE, PAD, _minimax, build, random_ids
from _runs import greedy, logits_of, sparse_generate, watched_greedy

import recurrent_hooks as rh
import recurrent_hooks.kinds.lightning as rh_lightning
from recurrent_hooks.engine.binding.rebinding import import_default
from recurrent_hooks.kinds.lightning import lightning_attention_forward
from recurrent_hooks.registry import family_of

LIGHTNING = [name for name, row in rh.FAMILIES.items() if row.kind is rh.LightningAttention]
ALL = ("states", "inputs", "outputs")  # the kind has no conv window to keep
T = 13  # two chunks of 8 (block_size) in transformers' chunk loop, the second one partial

# -- how the contract reads this kind (tests/kinds/test_contract.py, tests/helpers/_contract.py's ContractReading) -----


def lightning_state(out, mixer, memory):
    """MiniMax's cache holds the linear state (`get_linear_cache`); the forward returns it too (`final_state`)."""
    cached = out.cache.get_linear_cache(mixer.layer)
    return {"the cache": cached, "the forward's final_state": mixer.calls[-1].output["final_state"]}


CONTRACT = {
    rh.LightningAttention: ContractReading(
        carried=lightning_state,
        window_in=None,
        recomputes_once=True,
        whole_memory_model=lambda: _minimax(linear_first=True),
        whole_memory_tol=dict(rtol=1e-4, atol=1e-6),
        whole_memory_early=dict(rtol=0, atol=0),
    )
}


FP32 = dict(rtol=1e-5, atol=1e-6)  # float32 against float32 (the chunk loop against the token loop)
F64 = dict(rtol=1e-4, atol=1e-6)  # float32 against the float64 reference


family, model = family_fixtures(LIGHTNING)


def mixer_class(family):
    return getattr(rh.FAMILIES[family].module(), rh.FAMILIES[family].mixer_class)


def mixers_of(model):
    return [m for m in model.modules() if family_of(m) is not None]


# -- the float64 reference -------------------------------------------------------------------------------------


def slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """s_h, float64: 2^(-8 (h+1) / H) (1 - l / (L - 1 + 1e-5) + 1e-5)."""
    h = torch.arange(heads, dtype=torch.float64)
    return 2.0 ** (-8.0 * (h + 1) / heads) * (1 - layer / (layers - 1 + 1e-5) + 1e-5)


def lightning_reference(module, hidden_states, attention_mask=None, initial_state=None):
    """The mixer's output and the state after every token, `[batch, seq, heads, d, d]`, in float64."""
    assert module.act_fn.__class__.__name__ == "SiLUActivation" or module.act_fn is F.silu
    f64 = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731  (the reference stays on the CPU)
    x = f64(hidden_states)
    batch, seq, _ = x.shape
    heads, d = module.num_attention_heads, module.head_dim
    qkv = F.silu(x @ f64(module.qkv_proj.weight).T)
    if attention_mask is not None:
        qkv = qkv * f64(attention_mask)[:, :, None]
    q, k, v = qkv.view(batch, seq, heads, 3 * d).split(d, dim=-1)  # b t h d
    decay = torch.exp(-slopes(heads, module.layer_idx, module.num_hidden_layers))[:, None, None]  # λ_h
    state = torch.zeros(batch, heads, d, d, dtype=torch.float64) if initial_state is None else f64(initial_state)
    states, outs = [], []
    for t in range(seq):
        state = decay * state + torch.einsum("bhi,bhj->bhij", k[:, t], v[:, t])  # S_t = λ S_{t-1} + k_t^T v_t
        outs.append(torch.einsum("bhi,bhij->bhj", q[:, t], state))  # o_t = q_t S_t
        states.append(state)
    o = torch.stack(outs, dim=1).reshape(batch, seq, heads * d)
    normed = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + module.norm.variance_epsilon) * f64(module.norm.weight)
    gate = torch.sigmoid(x @ f64(module.output_gate.weight).T)
    out = (gate * normed) @ f64(module.out_proj.weight).T
    return out, torch.stack(states, dim=1)


def reference_states(mixer, call):
    """Per-token states of `call`, recomputed in float64 from the call's recorded inputs."""
    x = mixer.calls[call].inputs
    return lightning_reference(mixer.module, x["hidden_states"], x["attention_mask"], x["initial_state"])[1]


def test_the_slopes_are_the_equations(model):
    with rh.watch(model) as w:
        assert [m.layer for m in w.mixers] == [m.layer_idx for m in mixers_of(model)]
    for module in mixers_of(model):
        assert_close(
            f"slope_rate of layer {module.layer_idx}",
            slopes(module.num_attention_heads, module.layer_idx, module.num_hidden_layers)[:, None, None],
            module.slope_rate,
            rtol=1e-6,
            atol=0,
        )
    decays = [torch.exp(-m.slope_rate).min().item() for m in mixers_of(model)]
    assert decays[0] < 0.97, f"the first lightning layer barely decays ({decays}): its λ would go untested"


# -- the library's forward against transformers' ----------------------------------------------------------------


def _cache_with(layer, state):
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    cache = MiniMaxCache()
    if state is not None:
        cache.set_linear_cache(layer, state)
    return cache


def _hidden(seq, seed=0):
    return torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _state(seed, scale=1.0):
    """A [2, 2, 16, 16] state of N(0, scale^2) entries, on the model's device."""
    return (torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


@pytest.mark.parametrize("cached", [False, True], ids=["prompt", "cached"])
@pytest.mark.parametrize("seq", [1, T, 70], ids=lambda s: f"T{s}")
def test_forward_matches_transformers(family, seq, cached):
    """Against the class's own forward (its chunk loop for a prompt, its per-token loop over a cached state):
    output, returned state and cached state; bit for bit over a cached state, where both run the same ops."""
    model = build(family)
    original = import_default(mixer_class(family), "forward")
    assert not getattr(original, "__recurrent_hooks__", False)
    for module in mixers_of(model):
        start = _state(9, 0.3) if cached else None
        x, mask = _hidden(seq, seed=module.layer_idx), None
        caches = [_cache_with(module.layer_idx, start), _cache_with(module.layer_idx, start)]
        with torch.no_grad():
            want_out, want_state = original(module, x, None, mask, cache=caches[0])
            out, state = lightning_attention_forward(module, x, None, mask, cache=caches[1])
        tol = dict(rtol=0, atol=0) if cached else FP32
        where = f"layer {module.layer_idx}, T={seq}"
        assert_close(f"{where} output", want_out, out, **tol)
        assert_close(f"{where} returned state", want_state, state, **tol)
        assert caches[1].get_linear_cache(module.layer_idx) is state
        assert_close(f"{where} cached state", caches[0].get_linear_cache(module.layer_idx), state, **tol)


def test_forward_without_a_cache_and_with_padding(family):
    model = build(family)
    original = import_default(mixer_class(family), "forward")
    module = mixers_of(model)[0]
    x = _hidden(T, seed=3)
    mask = torch.ones(2, T, dtype=torch.long, device=DEVICE)
    mask[0, :4] = 0
    with torch.no_grad():
        want_out, want_state = original(module, x, None, mask)
        out, state = lightning_attention_forward(module, x, None, mask)
    assert_close("padded output", want_out, out, **FP32)
    assert_close("padded state", want_state, state, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_prompt_is_transformers_per_token_branch_from_a_zero_state(family, dtype):
    """The token loop over a prompt is the branch transformers runs over a cached state, started from zeros:
    bit for bit, in half precision too (the state stays in the model dtype, as transformers caches it)."""
    model = build(family).to(dtype)
    original = import_default(mixer_class(family), "forward")
    for module in mixers_of(model):
        x = _hidden(T, seed=8).to(dtype)
        zero = torch.zeros(2, module.num_attention_heads, module.head_dim, module.head_dim, dtype=dtype, device=DEVICE)
        with torch.no_grad():
            want_out, want_state = original(module, x, None, None, cache=_cache_with(module.layer_idx, zero))
            out, state = lightning_attention_forward(module, x, None, None)
        assert state.dtype == dtype
        assert_equal(f"layer {module.layer_idx} output", want_out, out)
        assert_equal(f"layer {module.layer_idx} state", want_state, state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_logits_stay_within_transformers_own_prompt_versus_decode_difference(family, dtype):
    """In half precision the chunk loop and the per-token loop round differently: a watched prompt is
    within transformers' own difference between its prompt path and its per-token path (the yardstick)."""
    model = build(family).to(dtype)
    ids = random_ids(2, 70)
    with torch.no_grad():
        plain = model(ids).logits.float()
        with rh.watch(model, keep=ALL):
            watched = model(ids).logits.float()
        first = model(ids[:, :1], use_cache=True)
        stepwise = torch.cat([first.logits, model(ids[:, 1:], cache=first.cache).logits], dim=1).float()
    yardstick = (stepwise - plain).abs().max()
    assert yardstick > 0
    assert (watched - plain).abs().max() <= 2 * yardstick, (float((watched - plain).abs().max()), float(yardstick))


@pytest.mark.parametrize("cached", [False, True], ids=["prompt", "cached"])
def test_per_token_states_match_the_float64_reference(family, cached):
    model = build(family)
    for module in mixers_of(model):
        start = _state(4, 0.3) if cached else None
        x = _hidden(37, seed=5)
        states = []

        def record(t, state):
            states.append(state.clone())
            return state

        with torch.no_grad():
            out, final = lightning_attention_forward(
                module, x, None, None, cache=_cache_with(module.layer_idx, start), on_token=record
            )
        want_out, want_states = lightning_reference(module, x, initial_state=start)
        assert len(states) == 37
        assert_close(f"layer {module.layer_idx} states", want_states, torch.stack(states, dim=1), **F64)
        assert_close(f"layer {module.layer_idx} output", want_out, out, **F64)
        assert_close("final state is the last state", states[-1], final, rtol=0, atol=0)


@pytest.mark.parametrize("token", [0, 10, 36], ids=lambda t: f"at{t}")
def test_on_token_replacement_changes_only_later_tokens_and_the_cache(family, token):
    model = build(family)
    module = mixers_of(model)[0]
    x = _hidden(37, seed=6)
    replacement = _state(7)
    cache = _cache_with(module.layer_idx, None)
    with torch.no_grad():
        plain, _ = lightning_attention_forward(module, x, None, None)
        out, final = lightning_attention_forward(
            module, x, None, None, cache=cache, on_token=lambda t, s: replacement if t == token else s
        )
    assert_close(f"outputs up to token {token}", plain[:, : token + 1], out[:, : token + 1], rtol=0, atol=0)
    if token < 36:
        want_out, want_states = lightning_reference(module, x[:, token + 1 :], initial_state=replacement)
        assert_close(f"outputs after token {token}", want_out, out[:, token + 1 :], **F64)
        assert_close("final state", want_states[:, -1], final, **F64)
    else:
        assert final is replacement
    assert cache.get_linear_cache(module.layer_idx) is final


@pytest.mark.parametrize("stops", [[36], [3, 20], [0, 7, 8, 35]], ids=lambda s: "-".join(map(str, s)))
def test_stops_run_blocks_between_them(family, stops):
    """With `stops`, a prompt calls on_token only there and runs the block computation in between: outputs
    and states equal the float64 reference, a replacement at a stop changes only later tokens, and with the
    last token as the only stop the prompt is transformers' chunk loop bit for bit."""
    model = build(family)
    original = import_default(mixer_class(family), "forward")
    for module in mixers_of(model):
        x = _hidden(37, seed=10)
        seen = {}

        def record(t, state):
            seen[t] = state.clone()
            return state

        with torch.no_grad():
            out, final = lightning_attention_forward(module, x, None, None, on_token=record, stops=stops)
        want_out, want_states = lightning_reference(module, x)
        assert sorted(seen) == stops
        for t in stops:
            assert_close(f"layer {module.layer_idx} state at stop {t}", want_states[:, t], seen[t], **F64)
        assert_close(f"layer {module.layer_idx} output", want_out, out, **F64)
        assert_close("final state", want_states[:, -1], final, **F64)
        if stops == [36]:
            with torch.no_grad():
                want_out, want_state = original(module, x, None, None)
            assert_equal("one stop at the end: transformers' chunk loop", want_out, out)
            assert_equal("one stop at the end: its state", want_state, final)
        replacement = torch.randn(final.shape, generator=torch.Generator().manual_seed(11)).to(final.device)
        at = stops[0]
        with torch.no_grad():
            replaced, _ = lightning_attention_forward(
                module, x, None, None, stops=stops, on_token=lambda t, s: replacement if t == at else s
            )
        assert_close("outputs up to the stop", out[:, : at + 1], replaced[:, : at + 1], rtol=0, atol=0)
        if at < 36:
            want_out, _ = lightning_reference(module, x[:, at + 1 :], initial_state=replacement)
            assert_close("outputs after the replaced stop", want_out, replaced[:, at + 1 :], **F64)


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_stops_against_the_token_loop_and_the_reference(family, seed):
    """Random lengths, left padding, stops and replacements: the block computation between stops, the token
    loop and the float64 reference agree on outputs, the states at the stops and the final state."""
    gen = torch.Generator().manual_seed(seed)
    model = build(family)
    module = mixers_of(model)[seed % len(mixers_of(model))]
    seq = int(torch.randint(1, 45, (), generator=gen))
    x = torch.randn(2, seq, 32, generator=gen).to(DEVICE)
    mask = torch.ones(2, seq, dtype=torch.long, device=DEVICE)
    mask[1, : int(torch.randint(0, seq, (), generator=gen))] = 0
    stops = sorted(
        {int(t) for t in torch.randint(0, seq, (int(torch.randint(1, 5, (), generator=gen)),), generator=gen)}
    )
    replaced = {
        t: (torch.randn(2, 2, 16, 16, generator=gen) * 0.3).to(DEVICE)
        for t in stops
        if torch.rand((), generator=gen) < 0.5
    }
    runs = {}
    for name, arguments in (("blocks", dict(stops=stops)), ("token loop", {})):
        seen = {}

        def hook(t, state):
            if t in stops:
                seen[t] = state.clone()
            return replaced.get(t, state)

        with torch.no_grad():
            runs[name] = (*lightning_attention_forward(module, x, None, mask, on_token=hook, **arguments), seen)
    # the reference, piece by piece: from each replacement on, the float64 recurrence starts again
    pieces, start, state = [], 0, None
    for end in [*(t + 1 for t in sorted(replaced)), seq]:
        if end > start:
            out, states = lightning_reference(module, x[:, start:end], mask[:, start:end], initial_state=state)
            pieces.append((start, out, states))
            state = replaced.get(end - 1, states[:, -1])
            start = end
    want_out = torch.cat([out for _, out, _ in pieces], dim=1)
    want_at = {s + i: states[:, i] for s, _, states in pieces for i in range(states.shape[1])}
    for name, (out, final, seen) in runs.items():
        assert sorted(seen) == stops
        assert_close(f"seed {seed} {name} output (T={seq}, stops {stops})", want_out, out, **F64)
        for t in stops:
            assert_close(f"seed {seed} {name} state at {t}", want_at[t], seen[t], **F64)
        assert_close(f"seed {seed} {name} final state", replaced.get(seq - 1, want_at[seq - 1]), final, **F64)


def test_stops_over_a_cached_state_run_token_by_token(family):
    """Over a cached state transformers runs its per-token branch; so does the library's forward, stops or not."""
    model = build(family)
    original = import_default(mixer_class(family), "forward")
    module = mixers_of(model)[0]
    start = _state(12, 0.3)
    x = _hidden(9, seed=13)
    with torch.no_grad():
        want_out, want_state = original(module, x, None, None, cache=_cache_with(module.layer_idx, start))
        out, state = lightning_attention_forward(
            module, x, None, None, cache=_cache_with(module.layer_idx, start), on_token=lambda t, s: s, stops=[4]
        )
    assert_equal("output", want_out, out)
    assert_equal("state", want_state, state)


# -- the bar: states, writes, padding (parity, generate and the call counter: tests/kinds/test_contract.py) -------


def test_states_equal_float64_reference_at_prompt_and_decode_steps(model):
    w = watched_greedy(model, ALL, T, 4)
    for mixer in w.mixers:
        assert [c.tokens for c in mixer.calls] == [T, 1, 1, 1]
        assert mixer.calls[0].inputs["initial_state"] is None
        for call in range(4):
            assert_close(f"{mixer} call {call}", reference_states(mixer, call), mixer.calls[call].states, **F64)
            assert_close(
                f"{mixer} call {call} final state",
                mixer.calls[call].states[:, -1],
                mixer.calls[call].output["final_state"],
                rtol=0,
                atol=0,
            )
            if call:
                assert_close(
                    f"{mixer} call {call} starts where call {call - 1} ended",
                    mixer.calls[call - 1].output["final_state"],
                    mixer.calls[call].inputs["initial_state"],
                    rtol=0,
                    atol=0,
                )


def test_multi_token_continuation_runs_the_per_token_branch(model):
    """Several tokens over a cached state: transformers' per-token branch, which the library's loop equals bit
    for bit; its states continue the prompt's."""
    ids = random_ids(2, T)
    with torch.no_grad():
        plain = model(ids[:, 8:], cache=model(ids[:, :8], use_cache=True).cache).logits
        cache = model(ids[:, :8], use_cache=True).cache
        with rh.watch(model, keep=ALL) as w:
            watched = model(ids[:, 8:], cache=cache).logits
    assert_close("continuation logits", plain, watched, rtol=0, atol=0)
    for mixer in w.mixers:
        assert [c.tokens for c in mixer.calls] == [T - 8] and mixer.calls[0].inputs["initial_state"] is not None
        assert_close(f"{mixer} continuation states", reference_states(mixer, 0), mixer.calls[0].states, **F64)


def test_replacing_hooks_on_the_first_and_last_mixer_equal_writes_in_a_generate(model):
    """A hook that returns a state is a write: s * 0.5 on the first mixer at token 4 of the prompt and on the LAST
    mixer at decode call 2, in one generate (the contract hooks the first mixer's prompt only:
    tests/kinds/test_contract.py): the kept states are the halved ones, and writing them gives every call's logits bit
    for bit."""
    ids = random_ids(2, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    with rh.watch(model, keep=ALL) as w:
        halve = lambda m, c, t, s: s * 0.5  # noqa: E731
        w.mixers[0].register_state_hook(halve, call=0, token=4)
        w.mixers[-1].register_state_hook(halve, call=2)
        hooked = greedy(model, ids, 4, **kwargs)
    assert w.mixers[-1] is not w.mixers[0] and w.mixers[-1].calls[2].tokens == 1, "not a decode step of another mixer"
    first, last = w.mixers[0].state_after(4, call=0), w.mixers[-1].state_after(0, call=2)
    with rh.watch(model, keep=ALL) as plain:
        greedy(model, ids, 4, **kwargs)
    assert_close(
        "the hook halved the prompt state", plain.mixers[0].state_after(4, call=0) * 0.5, first, rtol=0, atol=0
    )
    with rh.watch(model, keep=ALL) as prompt_hooked:  # the same run up to the last mixer's hook at call 2
        prompt_hooked.mixers[0].register_state_hook(halve, call=0, token=4)
        greedy(model, ids, 4, **kwargs)
    assert_close(
        "the hook halved the decode state", prompt_hooked.mixers[-1].state_after(0, call=2) * 0.5, last, rtol=0, atol=0
    )
    with rh.watch(model, keep=ALL) as v:
        v.mixers[0].set_state_after(4, first, call=0)
        v.mixers[-1].set_state_after(0, last, call=2)
        written = greedy(model, ids, 4, **kwargs)
    assert len(hooked.logits) == len(written.logits) == 4
    assert_close_per_call("logits", hooked.logits, written.logits, rtol=0, atol=0)
    assert_close(
        "call 3 of the last mixer started from the hooked state",
        last,
        v.mixers[-1].calls[3].inputs["initial_state"],
        rtol=0,
        atol=0,
    )


def _sparse_run(model, ids, fast, monkeypatch):
    """Writes, hooks and kept states at a few tokens of the prompt and at a decode step, through one path."""
    paths = None if fast else rh.Paths(rule="loop")
    blocks = []
    real = rh_lightning._chunks
    monkeypatch.setattr(rh_lightning, "_chunks", lambda *a: blocks.append(a[-2:]) or real(*a))
    keep = {"states": [2, 7, -1], "inputs": None}
    with rh.watch(model, keep=keep, paths=paths) as w, torch.no_grad():
        model(ids)
        value = w.mixers[0].state_after(7) * 0.5
    blocks.clear()
    return (*sparse_generate(model, ids, keep, paths, value), blocks)


def test_sparse_fast_path_equals_the_token_loop(model, monkeypatch):
    """Same outputs, kept states, hook inputs and cached states whether a prompt's few stops run the block
    computation between them or the token loop."""
    ids = random_ids(2, T)
    fast, fast_out, fast_seen, blocks = _sparse_run(model, ids, True, monkeypatch)
    slow, slow_out, slow_seen, no_blocks = _sparse_run(model, ids, False, monkeypatch)
    assert not no_blocks
    # prompt spans: the first mixer stops at 2, 7, 12; the last at 2, 3, 7, 11, 12 (kept states and its hook)
    assert blocks[:3] == [(0, 3), (3, 8), (8, 13)] and blocks[3:] == [(0, 3), (3, 4), (4, 8), (8, 12), (12, 13)]
    assert_close_per_call("logits", slow_out.logits, fast_out.logits, rtol=1e-5, atol=1e-5)
    assert_close("hook inputs", torch.tensor(slow_seen), torch.tensor(fast_seen), rtol=1e-5, atol=1e-7)
    for a, b in zip(slow.mixers, fast.mixers):
        for call in range(4):
            for token in (2, 7, -1) if call == 0 else (0,):
                assert_close(
                    f"{a} call {call} state after {token}",
                    a.state_after(token, call),
                    b.state_after(token, call),
                    **F64,
                )
            if call:
                assert_close(
                    f"{a} call {call} state in",
                    a.calls[call].inputs["initial_state"],
                    b.calls[call].inputs["initial_state"],
                    **F64,
                )


def test_a_state_kept_at_the_last_token_leaves_the_prompt_bit_identical(model):
    """One stop at the end: the prompt runs transformers' own block computation, so the logits are the
    unwatched model's bit for bit, and the kept state is what transformers cached."""
    ids = random_ids(2, 70)
    with torch.no_grad():
        plain = model(ids, use_cache=True)
        with rh.watch(model, keep={"states": [-1]}) as w:
            watched = model(ids, use_cache=True)
    assert_close("logits", plain.logits, watched.logits, rtol=0, atol=0)
    for mixer in w.mixers:
        assert_close(
            f"{mixer} last state", plain.cache.get_linear_cache(mixer.layer), mixer.state_after(-1), rtol=0, atol=0
        )
    row = rh.support(model)[0]
    assert "forward" in row.notes["a few tokens of a prompt"]


def test_beam_search_runs_as_unwatched_and_the_state_rows_stay_in_place(model):
    """transformers' MiniMaxCache leaves its linear states in place when beam search reorders the cache (a
    transformers bug, in LIMITS): the watch reproduces it, and call.reorder says the rows did not move."""
    ids = random_ids(1, 9)
    kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        plain = model.generate(ids, **kwargs)
        with rh.watch(model, keep=ALL) as w:
            watched = model.generate(ids, **kwargs)
        with rh.watch(model) as v:
            for mixer in v.mixers:
                mixer.register_state_hook(lambda m, c, t, s: None)
            hooked = model.generate(ids, **kwargs)
    assert_equal("beams, keep states", plain, watched)
    assert_equal("beams, hooks", plain, hooked)
    for mixer in w.mixers:
        for k in range(1, 5):
            assert mixer.calls[k].reorder is None
            assert_close(
                f"{mixer} call {k} starts from the same rows",
                mixer.calls[k - 1].output["final_state"],
                mixer.calls[k].inputs["initial_state"],
                rtol=0,
                atol=0,
            )
    assert "beam search" in rh.support(model)[0].unavailable


# -- gradients -----------------------------------------------------------------------------------------------------


def test_gradient_with_respect_to_a_state_kept_at_one_token(model):
    """d metric / d state after token t, one state kept: the block computation between stops keeps the tensor the
    recurrence used (every state kept, the token loop: tests/kinds/test_contract.py)."""
    ids = random_ids(1, T)
    token = 5
    with rh.watch(model, keep={"states": [token]}) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    state = w.mixers[0].state_after(token)
    leaf = state.detach().clone().requires_grad_()
    with rh.watch(model) as w:
        w.mixers[0].set_state_after(token, leaf)
        model(ids).logits[0, -1].logsumexp(-1).backward()
    grad = leaf.grad
    assert grad.abs().max() > 0
    assert_close("grad of the kept state", grad, torch.autograd.grad(metric, state)[0], rtol=1e-4, atol=1e-7)
    eps = 1e-2 * state.norm() / grad.norm()
    values = []
    for sign in (1, -1):
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].set_state_after(token, state.detach() + sign * eps * grad)
            values.append(model(ids).logits[0, -1].logsumexp(-1))
    slope = (values[0] - values[1]) / (2 * eps)
    assert_close("directional derivative", (grad * grad).sum(), slope, rtol=2e-2, atol=1e-6)


def test_every_kept_state_is_differentiable_with_frozen_weights(model):
    """One backward through `mix.states` gives the gradient at every token, with no weight requiring grad."""
    ids, token = random_ids(1, T), 5
    model.requires_grad_(False)
    with rh.watch(model, keep=ALL) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    (grads,) = torch.autograd.grad(metric, [w.mixers[0].states])
    leaf = w.mixers[0].state_after(token).detach().clone().requires_grad_()
    with rh.watch(model) as v:
        v.mixers[0].set_state_after(token, leaf)
        (one,) = torch.autograd.grad(model(ids).logits[0, -1].logsumexp(-1), [leaf])
    assert one.abs().max() > 0
    assert_close(
        f"the gradient at token {token}: from the stack and through a written leaf",
        one,
        grads[:, token],
        rtol=1e-4,
        atol=1e-7,
    )


# -- the whole memory ----------------------------------------------------------------------------------------------


def test_linear_attention_at_layer_0_breaks_cached_continuations_in_transformers():
    """Bug 8, documented in LIMITS: the model's own behaviour, which the watch reproduces exactly."""
    torch.manual_seed(0)
    model = _minimax(linear_first=True).eval()
    ids = random_ids(2, 12)
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits[:, 8:]
        continued = model(ids[:, 8:], cache=model(ids[:, :8], use_cache=True).cache).logits
        with rh.watch(model):
            watched = model(ids[:, 8:], cache=model(ids[:, :8], use_cache=True).cache).logits
    assert (whole - continued).abs().max() > 1e-4, "transformers fixed bug 8: update LightningAttention.LIMITS"
    assert_close("the watch runs what transformers runs", continued, watched, rtol=0, atol=0)
    assert "linear attention at layer 0" in rh.support(model)[0].unavailable


def test_the_memory_is_the_state_alone(model):
    with rh.watch(model, keep=ALL) as w:
        logits_of(model, random_ids(1, 5))
        mixer = w.mixers[0]
        for attempt in (
            lambda: mixer.window_after(0),
            lambda: mixer.windows,
            lambda: mixer.set_window_after(0, torch.zeros(1)),
            lambda: mixer.register_state_hook(lambda *a: None, memory="window"),
        ):
            with pytest.raises(
                rh.Unavailable,
                match=r"LightningAttention mixer has no window; it carries only state"
                r" \(state_after, set_state_after\)",
            ):
                attempt()
    row = rh.support(model)[0]
    assert row.kind == "LightningAttention" and "windows" not in row.available and "states" in row.available
    assert set(row.unavailable) == set(rh.LightningAttention.LIMITS)


def test_values(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=ALL) as w:
        greedy(model, ids, 2)
    mixer = w.mixers[0]
    for call in (0, 1):
        values = mixer.values(call)
        assert sorted(values) == sorted(rh.LightningAttention.VALUES)
        x = mixer.calls[call].inputs["hidden_states"]
        qkv = F.silu(mixer.module.qkv_proj(x)).view(*x.shape[:2], 2, 48)
        for i, name in enumerate(("query", "key", "value")):
            assert_close(f"call {call} {name}", qkv[..., 16 * i : 16 * (i + 1)], values[name], rtol=0, atol=0)
        assert values["output"] is mixer.calls[call].output["output"]
        assert values["gate"].shape == (2, mixer.calls[call].tokens, 2, 16)


def test_a_sweep_of_the_whole_memory_is_a_sweep_of_the_state(model):
    """The memory is the state alone: the whole memory's sweep (memory=None) is the state's."""
    clean, corrupt = random_ids(1, 9, seed=1), random_ids(1, 9, seed=2)
    metric = lambda logits: logits[:, -1, 5] - logits[:, -1, 6]  # noqa: E731
    memory = rh.patching_sweep(model, clean[0], corrupt[0], metric, progress=False)
    state = rh.patching_sweep(model, clean[0], corrupt[0], metric, memory="state", progress=False)
    assert_close("the whole memory vs the state", state.values, memory.values, rtol=0, atol=0)
    with pytest.raises(rh.Unavailable, match="no window"):
        rh.patching_sweep(model, clean[0], corrupt[0], metric, memory="window", progress=False)
    with rh.watch(model, keep={"states": [4]}) as w, torch.no_grad():
        model(clean, use_cache=False)
    with rh.watch(model) as v, torch.no_grad():
        v.mixer(w.mixers[0].layer).set_state_after(4, w.mixers[0].state_after(4))
        one = metric(model(corrupt, use_cache=False).logits)[0]
    assert_close(
        "the cell (first layer, token 4) against its own forward", one, memory.values[0, 4], rtol=1e-5, atol=1e-6
    )


def test_attribution_is_the_first_order_effect_of_patching_the_state(model):
    clean, corrupt = random_ids(1, 9, seed=1), random_ids(1, 9, seed=2)
    metric = lambda logits: logits[:, -1, 5] - logits[:, -1, 6]  # noqa: E731
    result = rh.attribute(model, clean[0], corrupt[0], metric)  # one pair, [seq]: [layers, seq]
    assert_close("no window", torch.zeros_like(result.window), result.window, rtol=0, atol=0)
    assert_close("the memory is the state", result.state, result.memory, rtol=0, atol=0)
    token, eps = 4, 1e-3
    states = {}
    for name, ids in (("clean", clean), ("corrupt", corrupt)):
        with rh.watch(model, keep={"states": [token]}) as w, torch.no_grad():
            model(ids)
        states[name] = w.mixers[0].state_after(token)
    with rh.watch(model) as w, torch.no_grad():
        w.mixers[0].set_state_after(token, states["corrupt"] + eps * (states["clean"] - states["corrupt"]))
        nudged = metric(model(corrupt).logits)[0]
    assert_close(
        "attribution vs the finite difference",
        (nudged - result.corrupt) / eps,
        result.state[0, token],
        rtol=2e-2,
        atol=1e-4,
    )


def test_effective_attention_is_refused_with_the_reason(model):
    with rh.watch(model, keep=("inputs", "outputs")) as w:
        logits_of(model, random_ids(1, 5))
    with pytest.raises(rh.Unavailable, match="no effective attention for the kind LightningAttention"):
        rh.effective_attention(w.mixers[0])
    assert "effective attention" in rh.support(model)[0].unavailable


# -- threads, routing and the frame check (bindings: tests/kinds/test_contract.py) ---------------------------------


def test_two_threads_watch_their_own_models(family):
    """The class attribute is shared; each thread's watch sees its own model's forwards only."""
    import threading

    models = [build(family, seed=s) for s in (0, 1)]
    ids = [random_ids(2, T, seed=s) for s in (0, 1)]

    def states_of(model, x):
        with rh.watch(model, keep=ALL) as w, torch.no_grad():
            for _ in range(3):
                model(x)
        return [torch.stack([c.states for c in m.calls]) for m in w.mixers]

    expected = [states_of(m, x) for m, x in zip(models, ids)]
    results, errors = [None, None], []

    def work(i):
        try:
            results[i] = states_of(models[i], ids[i])
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i in (0, 1):
        for want, got in zip(expected[i], results[i]):
            assert_close(f"model {i} states", want, got, rtol=0, atol=0)
    assert mixer_class(family).__dict__["forward"] is import_default(mixer_class(family), "forward")


def test_route_kernels_binds_the_library_forward_process_wide(model, family):
    cls = mixer_class(family)
    ids = random_ids(2, T)
    plain = logits_of(model, ids)
    rh.route_kernels(family, "torch")
    try:
        assert cls.__dict__["forward"] is lightning_attention_forward
        assert_close("the library's forward, unwatched", plain, logits_of(model, ids), rtol=1e-5, atol=1e-5)
    finally:
        rh.route_kernels(family, "default")
    assert cls.__dict__["forward"] is import_default(cls, "forward")


def test_an_unwatched_model_run_inside_a_watched_forward_is_untouched(model, family):
    """The dispatcher bound on the class serves every instance: a forward of another model's mixer, run from
    a torch hook inside a watched mixer's forward, runs transformers' forward and is not counted."""
    other = build(family, seed=1)
    ids = random_ids(1, 7)
    inner = []
    alone = logits_of(other, ids)
    module = mixers_of(model)[0]
    handle = module.qkv_proj.register_forward_hook(lambda m, a, out: inner.append(logits_of(other, ids)))
    try:
        with rh.watch(model, keep=ALL) as w:
            logits_of(model, ids)
    finally:
        handle.remove()
    assert_close("the other model's logits", alone, inner[0], rtol=0, atol=0)
    assert [c.tokens for c in w.mixers[0].calls] == [7]
    assert_close("the watched mixer's states", reference_states(w.mixers[0], 0), w.mixers[0].states, **F64)


# -- accelerate's offloading hooks keep the original forward on the instance -----------------------------------


@pytest.fixture(params=["cpu_offload", "disk"])
def offloaded(request, family, tmp_path):
    """(plain, offloaded): the same weights, the second run by accelerate with its weights off the CPU."""
    import accelerate

    plain = build(family)
    plain.save_pretrained(tmp_path / "saved")
    cls = type(plain)
    if request.param == "disk":
        model = cls.from_pretrained(
            tmp_path / "saved",
            device_map="auto",
            offload_folder=tmp_path / "offload",
            max_memory={"cpu": "150KB", "disk": "1GB"},
        )
    else:
        model = accelerate.cpu_offload(cls.from_pretrained(tmp_path / "saved"), execution_device="cpu")
    model.eval()
    for module in mixers_of(model):
        assert "forward" in vars(module) and "_old_forward" in vars(module)  # accelerate's wrapper
        assert all(p.device.type == "meta" for p in module.parameters())
    return plain, model


@pytest.mark.cpu_only(
    reason="the execution device here is the CPU (accelerate offloads to the CPU and the disk): on a"
    " GPU the execution device would be the GPU, which these tests do not build"
)
def test_offloaded_models_are_watched_through_the_bound_forward_accelerate_keeps(offloaded):
    """accelerate replaces each offloaded module's `forward` by a wrapper that calls the original method it
    stored on the instance (`_old_forward`): the watch rebinds that too, and only for the block."""
    plain, model = offloaded
    kept = {id(m): vars(m)["_old_forward"] for m in mixers_of(model)}
    ids = random_ids(2, T)
    runs = []
    for m in (plain, model):
        with rh.watch(m, keep=ALL) as w, torch.no_grad():
            w.mixers[0].set_state_after(4, w.mixers[0].module.slope_rate.new_ones(2, 2, 16, 16) * 0.1)
            w.mixers[-1].register_state_hook(lambda m, c, t, s: s * 0.8)
            out = m.generate(
                ids,
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=PAD,
                output_logits=True,
                return_dict_in_generate=True,
            )
        runs.append((w, out))
    (w0, out0), (w1, out1) = runs
    assert_equal("greedy generate", out0.sequences, out1.sequences)
    assert_close_per_call("logits", out0.logits, out1.logits, rtol=1e-5, atol=1e-6)
    for a, b in zip(w0.mixers, w1.mixers):
        assert len(b.calls) == 4
        for call in range(4):
            assert_close(f"{b} call {call} states", a.calls[call].states, b.calls[call].states, rtol=1e-5, atol=1e-6)
    assert all(vars(m)["_old_forward"] is kept[id(m)] for m in mixers_of(model)), "_old_forward was not restored"
    with pytest.raises(rh.Unavailable, match="offloaded"):
        w1.mixers[0].values()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    # a standalone hook that outlives the watch it was registered in keeps the binding alive
    seen = []
    with rh.watch(model):
        handle = rh.register_state_hook(mixers_of(model)[0], lambda m, c, t, s: seen.append(t), token=-1)
    with torch.no_grad():
        model(ids)
    handle.remove()
    assert seen == [T - 1]
    assert all(vars(m)["_old_forward"] is kept[id(m)] for m in mixers_of(model))
    with torch.no_grad():
        assert_close("logits after the watches", plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
