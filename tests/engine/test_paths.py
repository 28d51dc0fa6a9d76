"""The cost model that chooses a busy call's path (`recurrent_hooks/engine/paths/choose.py`, `costs.py`), and the
token-loop tails of segments.

- `choose` on declared shapes: the token loop at tiny dims with a large batch and short prompts, segments at
  real dims with 8 stops, never the chunk-wise states with gradients on, never blocks without an all-states
  kernel, a token-loop tail for a Mamba-2 stop just past a chunk boundary, the fixed rule when told;
- the policy (`rh.Paths`, an argument of `watch` and `register_state_hook`): the path it asks for is the one each
  call records, with the token loop's results; a device without calibration takes the fixed rule; bad policies;
- segments with tails (`runners.run_in_segments`) equal the token loop: outputs, final state, what the
  stops are handed, at the kernel and through a watched model (outputs, kept states, hook inputs, writes,
  cache contents, decode steps);
- the cost model (the shipped default) end to end gives what the token loop gives;
- `torch.compile(model, fullgraph=True)` traces the cost model's choice (aot_eager for qwen3_5 and mamba2, one
  inductor case): a hook, a write, kept states, standalone hooks, the token loop and segments, as eagerly;
- `benchmarks/paths.py --quick` runs (no timing is asserted).
"""

import dataclasses
import importlib.util
import pathlib
from types import SimpleNamespace

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import PAD, build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.choose as rh_choose
import recurrent_hooks.engine.paths.costs as rh_costs
import recurrent_hooks.engine.paths.runners as rh_busy
import recurrent_hooks.engine.policy as rh_policy
import recurrent_hooks.engine.standalone as standalone_impl
from recurrent_hooks.engine.policy import Strategy
from recurrent_hooks.kinds.gated_delta_net import GatedDeltaNet
from recurrent_hooks.kinds.state_space import Mamba2StateSpace
from recurrent_hooks.registry import family_of

ROOT = pathlib.Path(__file__).resolve().parents[2]
GDN = GatedDeltaNet.kernel_for("prompt")
SSD = Mamba2StateSpace.kernel_for("prompt")


def _meta(*shape: int) -> torch.Tensor:
    """A float32 CPU tensor of `shape` that holds one element (the cost model reads shapes, device and dtype)."""
    return torch.zeros(()).expand(*shape)


def gdn_arguments(batch: int, tokens: int, key_heads: int, heads: int, dim: int) -> dict:
    return {
        "query": _meta(batch, tokens, key_heads, dim),
        "key": _meta(batch, tokens, key_heads, dim),
        "value": _meta(batch, tokens, heads, dim),
        "g": _meta(batch, tokens, heads),
        "beta": _meta(batch, tokens, heads),
    }


def ssd_arguments(batch: int, tokens: int, heads: int, head_dim: int, d_state: int, chunk: int) -> dict:
    return {
        "hidden_states": _meta(batch, tokens, heads, head_dim),
        "dt": _meta(batch, tokens, heads),
        "B": _meta(batch, tokens, 1, d_state),
        "C": _meta(batch, tokens, 1, d_state),
        "chunk_size": chunk,
    }


def keeping(*tokens: int, kind: type = GatedDeltaNet) -> SimpleNamespace:
    return SimpleNamespace(hooks=[], keep=frozenset(tokens), kind=kind)


def hooked(tokens: frozenset[int] | None, kind: type = GatedDeltaNet) -> SimpleNamespace:
    """A plan with one hook at `tokens` (None: every token), of a mixer of `kind` (only its type is read)."""
    return SimpleNamespace(hooks=[(None, tokens)], keep=None, kind=kind)


def spread(count: int, tokens: int) -> list[int]:
    return sorted({min(tokens - 1, int((i + 0.5) * tokens / count)) for i in range(count)})


def path_of(choice: rh_policy.Choice | None) -> Strategy:
    return Strategy.LOOP if choice is None else choice.path


# -- choose ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kept", [1, 12])
def test_tiny_heads_large_batch_short_prompt_take_the_token_loop(kept):
    """Tiny heads, a large batch, a short prompt (4 value heads of 16, batch 64, T = 25): transformers' chunked kernel
    costs far more than the token loop."""
    arguments = gdn_arguments(64, 25, 2, 4, 16)
    choice = rh_choose.choose(GDN, [keeping(*spread(kept, 25))], 25, arguments, grad=False)
    assert path_of(choice) is Strategy.LOOP


def test_real_dims_with_8_stops_take_segments():
    """Qwen3.5 dims (16 key / 32 value heads of 128), T = 2048, 8 kept positions: segments; Mamba-2 too."""
    choice = rh_choose.choose(GDN, [keeping(*spread(8, 2048))], 2048, gdn_arguments(1, 2048, 16, 32, 128), grad=False)
    assert path_of(choice) is Strategy.SEGMENTS
    assert choice.stops == spread(8, 2048) and not choice.every_state
    choice = rh_choose.choose(
        SSD, [keeping(*spread(8, 2048))], 2048, ssd_arguments(1, 2048, 24, 64, 128, 256), grad=False
    )
    assert path_of(choice) is Strategy.SEGMENTS


def test_chunkwise_states_with_gradients_where_the_kind_has_an_adjoint():
    """Every state kept with gradients: chunk-wise (`engine.adjoint`) where the kind declares an adjoint and no hook
    or write stops the call; the token loop otherwise (a kind without one; a hook between)."""
    paths = rh.Paths(force=Strategy.STATES)
    for batch, heads, dim in ((1, 32, 128), (64, 4, 16)):
        every = keeping(*range(64))
        choice = rh_choose.choose(GDN, [every], 64, gdn_arguments(batch, 64, heads, heads, dim), grad=True, paths=paths)
        assert path_of(choice) is Strategy.STATES and choice.every_state and choice.stops == []
        hooked_too = SimpleNamespace(hooks=[(None, [5])], keep=frozenset(range(64)), kind=every.kind)
        choice = rh_choose.choose(
            GDN, [hooked_too], 64, gdn_arguments(batch, 64, heads, heads, dim), grad=True, paths=paths
        )
        assert path_of(choice) is not Strategy.STATES and (choice is None or not choice.every_state)
    no_adjoint = dataclasses.replace(GDN, segments=dataclasses.replace(GDN.segments, adjoint=None))
    choice = rh_choose.choose(
        no_adjoint, [keeping(*range(64))], 64, gdn_arguments(1, 64, 4, 4, 16), grad=True, paths=paths
    )
    assert path_of(choice) is not Strategy.STATES and (choice is None or not choice.every_state)
    choice = rh_choose.choose(
        no_adjoint, [keeping(*range(64))], 64, gdn_arguments(1, 64, 4, 4, 16), grad=False, paths=paths
    )
    assert path_of(choice) is Strategy.STATES  # without gradients it can


@pytest.mark.parametrize("force", [None, Strategy.BLOCKS])
def test_never_blocks_without_all_states(force):
    paths = rh.Paths(force=force)
    every_token = hooked(None)
    without = dataclasses.replace(GDN, segments=dataclasses.replace(GDN.segments, all_states=None))
    arguments = gdn_arguments(1, 512, 16, 32, 128)
    assert path_of(rh_choose.choose(without, [every_token], 512, arguments, grad=False, paths=paths)) is Strategy.LOOP
    assert path_of(rh_choose.choose(GDN, [every_token], 512, arguments, grad=True, paths=paths)) is Strategy.LOOP
    # at real dims blocks were measured slower than the loop (`Segments.blocks_below`): not available, even forced
    assert path_of(rh_choose.choose(GDN, [every_token], 512, arguments, grad=False, paths=paths)) is Strategy.LOOP
    small = gdn_arguments(1, 512, 2, 4, 16)  # 4 heads of 16 x 16: under the delta rules' blocks_below
    blocks = rh_choose.choose(GDN, [every_token], 512, small, grad=False, paths=paths)
    assert path_of(blocks) in ((Strategy.BLOCKS,) if force else (Strategy.BLOCKS, Strategy.LOOP))


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_a_hooked_decode_step_runs_transformers_kernel_then_the_hooks(family, monkeypatch):
    """A decode step is one token: a hook on it (at every token, or at -1) or a write is a stop at token 0, so the
    bound kernel runs and the hooks see the state it returns; the same logits, hook inputs and cache as the loop."""
    decode = type_of(family).kernel_for("decode")
    assert rh_choose.choose(decode, [hooked(None)], 1, None, grad=False) == rh_policy.Choice(
        Strategy.SEGMENTS, [0], False
    )
    model, ids = build(family), random_ids(2, 7)
    runs = {}
    for fast in (True, False):
        segmented, real = [], rh_busy.run_in_segments
        monkeypatch.setattr(rh_busy, "run_in_segments", lambda *a: segmented.append(a[0].role) or real(*a))
        seen = []
        with rh.watch(model, paths=None if fast else LOOP) as w, torch.no_grad():
            first = w.mixers[0]
            first.register_state_hook(lambda m, c, t, s: seen.append((c, t, s.clone())))
            first.register_state_hook(lambda m, c, t, s: s * 0.5, call=2)
            out = model.generate(
                ids,
                max_new_tokens=4,
                min_new_tokens=4,
                do_sample=False,
                pad_token_id=PAD,
                output_logits=True,
                return_dict_in_generate=True,
            )
        monkeypatch.setattr(rh_busy, "run_in_segments", real)
        runs[fast] = (out, seen, segmented)
    (fast_out, fast_seen, segmented), (slow_out, slow_seen, _) = runs[True], runs[False]
    assert segmented.count("decode") == 3, segmented  # the hooked mixer's decode steps 1-3
    assert_equal("sequences", slow_out.sequences, fast_out.sequences)
    for step, (a, b) in enumerate(zip(slow_out.logits, fast_out.logits)):
        assert_close(f"logits of step {step}", a, b, rtol=1e-5, atol=1e-6)
    assert [h[:2] for h in fast_seen] == [h[:2] for h in slow_seen]
    for (c, t, a), (_, _, b) in zip(slow_seen, fast_seen):
        assert_close(f"hooked state, call {c} token {t}", a, b, rtol=1e-5, atol=1e-6)


LOOP = rh.Paths(rule="loop")  # the token loop for every busy call: what the fast paths are checked against


def type_of(family: str):
    return rh.FAMILIES[family].kind


def test_a_stop_just_past_a_chunk_boundary_ends_with_a_token_loop():
    """Mamba-2 at mamba2-130m dims, chunk 256, tails on: a stop at token 300 runs the kernel on [0, 256) and the
    token loop on [256, 301), rather than the kernel on a piece padded to 512 tokens. Off (the default), not."""
    arguments = ssd_arguments(1, 1024, 24, 64, 128, 256)
    assert rh_choose.choose(SSD, [keeping(300)], 1024, arguments, grad=False) == rh_policy.Choice(
        Strategy.SEGMENTS, [300], False, ()
    )
    choice = rh_choose.choose(SSD, [keeping(300)], 1024, arguments, grad=False, paths=rh.Paths(tails=True))
    assert path_of(choice) is Strategy.SEGMENTS
    assert (256, 301) in choice.tails
    assert all(start % 256 == 0 or start in (0, 301) for start, _ in choice.tails)


def _cpu(key: str) -> rh_policy.Constants:
    return rh_costs.costs_for("cpu", torch.float32)[key]


def test_tails_are_only_taken_when_cheaper():
    shape, constants = rh_costs.Shape("ssd", 1, 24, 64, 128, 256), _cpu("ssd")
    for start, end in rh_costs.pieces([300, 700], 1024):
        cost, tail = rh_costs._piece(constants, shape, start, end, True)
        assert cost <= rh_costs.kernel_cost(constants, shape, end - start)
        assert tail is None or cost < rh_costs.kernel_cost(constants, shape, end - start)
    assert rh_costs.segments_cost(constants, shape, 1024, [300], tails=False)[1] == ()


def test_the_fixed_rule_when_told():
    arguments, fixed = gdn_arguments(64, 25, 2, 4, 16), rh.Paths(rule="fixed")
    choice = rh_choose.choose(GDN, [keeping(3)], 25, arguments, grad=False, paths=fixed)
    assert choice == rh_policy.Choice(Strategy.SEGMENTS, [3], False)
    assert rh_choose.choose(GDN, [keeping(*range(0, 25, 2))], 25, arguments, grad=False, paths=fixed) is None  # > 8
    assert rh_choose.choose(GDN, [keeping(*range(25))], 25, arguments, grad=False, paths=fixed).path is Strategy.STATES


def test_estimates_grow_with_what_they_count():
    small, large = rh_costs.Shape("delta rule", 1, 4, 16, 16, 64), rh_costs.Shape("delta rule", 64, 4, 16, 16, 64)
    constants = _cpu("delta rule")
    for cost in (rh_costs.kernel_cost, rh_costs.loop_cost, rh_costs.states_cost):
        assert 0 < cost(constants, small, 25) <= cost(constants, small, 200)
        assert cost(constants, small, 25) <= cost(constants, large, 25)
    assert rh_costs.kernel_cost(constants, small, 1) == rh_costs.kernel_cost(constants, small, 64)  # one chunk


# -- segments with token-loop tails equal the token loop -----------------------------------------------------------


def _ssd_inputs(batch: int, tokens: int, heads: int, head_dim: int, d_state: int, chunk: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, tokens, heads, head_dim, generator=gen)
    dt = torch.randn(batch, tokens, heads, generator=gen) - 2
    B, C = (torch.randn(batch, tokens, 2, d_state, generator=gen) for _ in range(2))
    A = -torch.rand(heads, generator=gen)
    kwargs = dict(
        D=torch.rand(heads, generator=gen),
        dt_bias=torch.zeros(heads),
        initial_states=torch.randn(batch, heads, head_dim, d_state, generator=gen),
        dt_softplus=True,
        return_final_states=True,
    )
    return (x, dt, A, B, C, chunk), kwargs


def test_tails_at_the_kernel_equal_the_token_loop():
    """A piece ending in a token loop from its last chunk boundary: the outputs, the last state and the state
    each stop is handed (and the replacement it returns) are the token loop's."""
    import transformers.models.mamba2.modeling_mamba2 as modeling

    args, kwargs = _ssd_inputs(2, 40, 4, 8, 8, 8)
    stops, tails = [12, 30], ((8, 13), (24, 31), (32, 40))

    def run(fast: bool):
        seen = {}

        def on_token(t, state):
            if t in stops:
                seen[t] = state.clone()
                return state * 0.5
            return state

        if fast:
            out = rh_busy.run_in_segments(SSD, modeling.mamba2_chunk_scan, args, kwargs, stops, tails, on_token, [])
        else:
            out = SSD.loop(*args, on_token=on_token, **kwargs)
        return out, seen

    (fast_y, fast_state), fast_seen = run(True)
    (slow_y, slow_state), slow_seen = run(False)
    assert_close("outputs", slow_y, fast_y, rtol=1e-4, atol=1e-5)
    assert_close("last state", slow_state, fast_state, rtol=1e-4, atol=1e-5)
    assert sorted(slow_seen) == sorted(fast_seen) == stops
    for t in stops:
        assert_close(f"state at stop {t}", slow_seen[t], fast_seen[t], rtol=1e-4, atol=1e-5)


# Constants that make every tail cheaper than a chunk: segments end in token loops wherever they can.
CHEAP_TAILS = rh_policy.Constants(
    kernel=(0.0, 1.0, 0.0, 0.0, 0.0), loop=(0.0, 1e-3, 0.0, 0.0), states=(0.0, 1.0, 0.0, 0.0, 0.0)
)
TAILS_EVERYWHERE = rh.Paths(force="segments", tails=True, costs={"ssd": CHEAP_TAILS, "delta rule": CHEAP_TAILS})


@pytest.mark.parametrize("family", ["mamba2", "qwen3_5"])
def test_tails_through_a_watch_equal_the_token_loop(family, monkeypatch):
    """Kept states, a write and a hook at tokens past chunk boundaries, a generate with decode steps: same logits,
    kept states, hook inputs and cache contents with tails as through the token loop."""
    model = build(family)
    ids = random_ids(2, 150)
    with rh.watch(model, keep={"states": [10]}) as w, torch.no_grad():
        model(ids, use_cache=False)
    value = w.mixers[0].state_after(10) * 0.5
    taken = []
    real = rh_busy.run_in_segments
    monkeypatch.setattr(rh_busy, "run_in_segments", lambda *a: taken.append(a[5]) or real(*a))
    runs = {}
    for fast in (True, False):
        seen = []
        with (
            rh.watch(model, keep={"states": [2, 10, 80, -1]}, paths=TAILS_EVERYWHERE if fast else LOOP) as w,
            torch.no_grad(),
        ):
            w.mixers[0].set_state_after(10, value)
            w.mixers[-1].register_state_hook(lambda m, c, t, s: seen.append(s.clone()) or s * 0.9, token=[12, 140])
            w.mixers[0].register_state_hook(lambda m, c, t, s: s * 1.1, token=[19])
            out = model.generate(
                ids,
                max_new_tokens=3,
                do_sample=False,
                pad_token_id=PAD,
                output_logits=True,
                return_dict_in_generate=True,
            )
        runs[fast] = (w, out, seen)
    (fast, fast_out, fast_seen), (slow, slow_out, slow_seen) = runs[True], runs[False]
    assert any(taken), "no segment ended in a token loop"
    assert_equal("tokens", slow_out.sequences, fast_out.sequences)
    for step, (a, b) in enumerate(zip(slow_out.logits, fast_out.logits, strict=True)):
        assert_close(f"logits of call {step}", a, b, rtol=1e-4, atol=1e-5)
    assert_close("hook inputs", torch.stack(slow_seen), torch.stack(fast_seen), rtol=1e-4, atol=1e-6)
    for a, b in zip(slow.mixers, fast.mixers, strict=True):
        for token in (2, 10, 80, -1):
            assert_close(
                f"{a} state after {token}", a.state_after(token, 0), b.state_after(token, 0), rtol=1e-4, atol=1e-6
            )
        assert_close(
            f"{a} cached state",
            slow_out.past_key_values.get_recurrent_state(a.layer),
            fast_out.past_key_values.get_recurrent_state(b.layer),
            rtol=1e-4,
            atol=1e-6,
        )


@pytest.mark.parametrize("family", ["mamba2", "qwen3_5"])
@pytest.mark.parametrize("keep", [[4], list(range(0, 25, 2)), None], ids=["1 position", "13 positions", "every"])
def test_the_chosen_path_equals_the_token_loop(family, keep):
    """With the cost model on (whatever it picks at these dims), a sparse or full keep and a write give the token
    loop's logits and states."""
    model = build(family)
    ids = random_ids(3, 25)
    with rh.watch(model, keep={"states": [6]}) as w, torch.no_grad():
        model(ids, use_cache=False)
    value = w.mixers[0].state_after(6) * 0.5
    runs = {}
    for fast in (True, False):
        with rh.watch(model, keep={"states": keep}, paths=None if fast else LOOP) as w, torch.no_grad():
            w.mixers[0].set_state_after(6, value)
            w.mixers[-1].register_state_hook(lambda m, c, t, s: s * 0.5, token=9)
            logits = model(ids, use_cache=False).logits
        runs[fast] = (w, logits)
    (fast, fast_logits), (slow, slow_logits) = runs[True], runs[False]
    assert_close("logits", slow_logits, fast_logits, rtol=1e-4, atol=1e-5)
    for a, b in zip(slow.mixers, fast.mixers, strict=True):
        for token in keep or range(25):
            assert_close(f"{a} state after {token}", a.state_after(token), b.state_after(token), rtol=1e-4, atol=1e-6)


# -- torch.compile on the cost model's choice -----------------------------------------------------------------------

COMPILED_T, KEPT, WRITTEN = 6, 2, 3


# Constants under which the cost model picks segments (or the chunk-wise states) over the token loop.
CHEAP = rh_policy.Constants(
    kernel=(1e-6, 0.0, 0.0, 0.0, 0.0), loop=(1.0, 1.0, 0.0, 0.0), states=(1e-6, 0.0, 0.0, 0.0, 0.0)
)
CHEAP_SEGMENTS = rh.Paths(costs={"ssd": CHEAP, "delta rule": CHEAP})


def _watched_calls(model, forward, ids, what, value, calls=2, paths=None):
    """`calls` forwards of `forward` in one watch with `what` ("hook", "write", "kept" or "all": the three and a
    replacing hook) on the first mixer, each after the first with error_on_recompile: logits, hook calls, watch."""
    seen = []
    with rh.watch(model, keep={"states": [KEPT]} if what in ("kept", "all") else (), paths=paths) as w, torch.no_grad():
        first = w.mixers[0]
        if what in ("hook", "all"):
            first.register_state_hook(lambda m, c, t, s: seen.append((c, t, float(s.norm()))), token=-1)
        if what in ("write", "all"):
            first.set_state_after(WRITTEN, value)
        if what == "all":
            w.mixers[-1].register_state_hook(lambda m, c, t, s: s * 0.5, token=1)
        logits = []
        for call in range(calls):
            with torch._dynamo.config.patch(error_on_recompile=call > 0 and forward is not model):
                logits.append(forward(ids).logits)
    return logits, seen, w


def _compare_watched(what, eager, compiled, atol=1e-6):
    (logits, seen, w), (compiled_logits, compiled_seen, cw) = eager, compiled
    for call, (a, b) in enumerate(zip(logits, compiled_logits, strict=True)):
        assert_close(f"{what}: logits of call {call}", a, b, rtol=1e-5, atol=atol)
    assert [h[:2] for h in compiled_seen] == [h[:2] for h in seen]
    if seen:
        assert_close(
            f"{what}: hooked state norms",
            torch.tensor([h[2] for h in seen]),
            torch.tensor([h[2] for h in compiled_seen]),
            rtol=1e-5,
            atol=1e-6,
        )
    if what in ("kept", "all"):
        for a, b in zip(w.mixers, cw.mixers, strict=True):
            for call in range(len(logits)):
                assert_close(
                    f"{a} call {call}: kept state",
                    a.state_after(KEPT, call=call),
                    b.state_after(KEPT, call=call),
                    rtol=1e-5,
                    atol=1e-6,
                )


def _value(model, ids):
    with rh.watch(model, keep={"states": [WRITTEN]}) as w, torch.no_grad():
        model(ids)
    return w.mixers[0].state_after(WRITTEN) * 0.5


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("mamba2", marks=pytest.mark.full)])
# a hook by default (the crash was the same for each); a write and a kept state, and Mamba-2, with --full, for the
# suite's time
@pytest.mark.parametrize(
    "what", ["hook", pytest.param("write", marks=pytest.mark.full), pytest.param("kept", marks=pytest.mark.full)]
)
def test_fullgraph_compile_traces_the_cost_models_choice(family, what):
    """torch.compile(fullgraph=True) with a hook, a write or a kept state on a prompt, on the shipped path choice
    (the cost model): the choice traces (it used `min(key=...)`, which dynamo refused as an "invalid call to
    builtin op handler"), and the compiled calls give eager's logits, hook calls and kept states, compiled once."""
    model, ids = build(family), random_ids(2, COMPILED_T)
    value = _value(model, ids)
    eager = _watched_calls(model, model, ids, what, value)
    compiled = _watched_calls(model, torch.compile(model, fullgraph=True, backend="aot_eager"), ids, what, value)
    _compare_watched(what, eager, compiled)


@pytest.mark.full  # 17 s; tests/engine/test_compile.py runs segments in a graph by default (a few hooked tokens)
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_fullgraph_compile_traces_the_cost_models_segments(family, monkeypatch):
    """The same where the cost model picks segments and the chunk-wise states (constants that make the token loop
    dear): hooks, a write and a kept state in the graph, as eagerly; the spy is on the eager run only."""
    model, ids = build(family), random_ids(2, COMPILED_T)
    value = _value(model, ids)
    taken, real = [], rh_busy.run_in_segments
    monkeypatch.setattr(rh_busy, "run_in_segments", lambda *a: taken.append(bool(a[-1])) or real(*a))
    eager = _watched_calls(model, model, ids, "all", value, paths=CHEAP_SEGMENTS)
    assert False in taken, "the cost model did not pick segments"
    monkeypatch.setattr(rh_busy, "run_in_segments", real)
    compiled = _watched_calls(
        model, torch.compile(model, fullgraph=True, backend="aot_eager"), ids, "all", value, paths=CHEAP_SEGMENTS
    )
    _compare_watched("all", eager, compiled)
    taken.clear()
    monkeypatch.setattr(rh_busy, "run_in_segments", lambda *a: taken.append(bool(a[-1])) or real(*a))
    with rh.watch(model, keep=("states",), paths=CHEAP_SEGMENTS) as w, torch.no_grad():  # every state: chunk-wise
        logits, eager_states = model(ids).logits, [m.states for m in w.mixers]
    assert taken and all(taken), "every state kept: the cost model did not pick the chunk-wise states"
    monkeypatch.setattr(rh_busy, "run_in_segments", real)
    with rh.watch(model, keep=("states",), paths=CHEAP_SEGMENTS) as w, torch.no_grad():
        compiled_logits = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
        compiled_states = [m.states for m in w.mixers]
    assert_close("every state kept: logits", logits, compiled_logits, rtol=1e-5, atol=1e-6)
    for layer, (a, b) in enumerate(zip(eager_states, compiled_states, strict=True)):
        assert_close(f"every state kept: mixer {layer}'s states", a, b, rtol=1e-5, atol=1e-6)


def _standalone_calls(model, forward, ids, calls=2):
    """A standalone hook on every mixer module (a reading one at the last token, a replacing one at token 1)."""
    seen = []
    modules = [m for m in model.modules() if family_of(m) is not None]
    handles = [
        rh.register_state_hook(m, lambda mx, c, t, s: seen.append((mx.layer, c, t, float(s.norm()))), token=-1)
        for m in modules
    ]
    handles.append(rh.register_state_hook(modules[-1], lambda mx, c, t, s: s * 0.5, token=1))
    try:
        with torch.no_grad():
            logits = []
            for call in range(calls):
                with torch._dynamo.config.patch(error_on_recompile=call > 0 and forward is not model):
                    logits.append(forward(ids).logits)
    finally:
        for handle in handles:
            handle.remove()
    return logits, seen


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("mamba2", marks=pytest.mark.full)])
def test_fullgraph_compile_with_standalone_hooks_on_the_cost_models_choice(family):
    model, ids = build(family), random_ids(2, COMPILED_T)
    logits, seen = _standalone_calls(model, model, ids)
    compiled_logits, compiled_seen = _standalone_calls(
        model, torch.compile(model, fullgraph=True, backend="aot_eager"), ids
    )
    for call, (a, b) in enumerate(zip(logits, compiled_logits, strict=True)):
        assert_close(f"logits of call {call}", a, b, rtol=1e-5, atol=1e-6)
    assert [h[:3] for h in compiled_seen] == [h[:3] for h in seen] and seen
    assert_close(
        "hooked state norms",
        torch.tensor([h[3] for h in seen]),
        torch.tensor([h[3] for h in compiled_seen]),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.full  # 10 s; tests/engine/test_compile.py compiles a watched model with inductor by default
def test_inductor_traces_the_cost_models_choice():
    """Inductor (the default backend) on the cost model's choice, with a hook, a write and a kept state."""
    model, ids = build("mamba2"), random_ids(2, COMPILED_T)
    value = _value(model, ids)
    eager = _watched_calls(model, model, ids, "all", value)
    compiled = _watched_calls(model, torch.compile(model, fullgraph=True), ids, "all", value)
    _compare_watched("all", eager, compiled, atol=1e-5)


# -- the benchmark ------------------------------------------------------------------------------------------------


def test_quick_paths_benchmark_runs(capsys):
    spec = importlib.util.spec_from_file_location("benchmark_paths", ROOT / "benchmarks" / "paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    assert module.main(["--quick"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for word in ("segments", "token loop", "chosen", "gdn_tiny", "mamba2_tiny"):
        assert word in out, f"the benchmark printed no {word!r}:\n{out}"
    assert "Traceback" not in out


# -- the policy: an argument of watch and register_state_hook ---------------------------------------------------------


def _kept_and_written(model, ids, paths, value=None):
    """A watch with `paths`: states kept at a few tokens, a write at token 6 (if `value`), a hook at token 9."""
    with rh.watch(model, keep={"states": [2, 6, -1]}, paths=paths) as w, torch.no_grad():
        if value is not None:
            w.mixers[0].set_state_after(6, value)
        w.mixers[-1].register_state_hook(lambda m, c, t, s: s * 0.5, token=9)
        logits = model(ids, use_cache=False).logits
    return w, logits


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_watch_paths_choose_the_path_and_each_call_records_it(family):
    """`watch(model, paths=rh.Paths(rule="loop"))` runs every busy call through the token loop, `rule="fixed"` in
    segments (at these tiny dims the cost model would take the loop), `force="states"` every state chunk-wise; the
    calls say which path they took, and every path gives the token loop's logits and states."""
    model, ids = build(family), random_ids(2, 25)
    value = _kept_and_written(model, ids, None)[0].mixers[0].state_after(6) * 0.5
    slow, slow_logits = _kept_and_written(model, ids, rh.Paths(rule="loop"), value)
    assert {part.path for m in slow.mixers for part in m.calls[0].kernel_calls} == {"token loop"}
    fixed, fixed_logits = _kept_and_written(model, ids, rh.Paths(rule="fixed"), value)
    assert {part.path for m in fixed.mixers for part in m.calls[0].kernel_calls} == {"segments"}
    assert_close("logits, fixed rule vs token loop", slow_logits, fixed_logits, rtol=1e-4, atol=1e-5)
    for a, b in zip(slow.mixers, fixed.mixers, strict=True):
        for token in (2, 6, -1):
            assert_close(f"{a} state after {token}", a.state_after(token), b.state_after(token), rtol=1e-4, atol=1e-6)
    with rh.watch(model, keep=("states",), paths=rh.Paths(force="states")) as w, torch.no_grad():
        model(ids, use_cache=False)
    assert {part.path for m in w.mixers for part in m.calls[0].kernel_calls} == {"chunk-wise states"}
    with rh.watch(model, keep=("states",)) as idle, torch.no_grad():  # nothing asked of the decode-free call
        model(ids, use_cache=False)
    with rh.watch(model) as nothing, torch.no_grad():
        model(ids, use_cache=False)
    assert {part.path for m in nothing.mixers for part in m.calls[0].kernel_calls} == {"bound kernel"}
    assert_close(
        "every state, forced chunk-wise vs the default", idle.mixers[0].states, w.mixers[0].states, rtol=1e-4, atol=1e-6
    )


def test_standalone_hooks_take_their_paths_and_disagreeing_handles_the_token_loop():
    """`register_state_hook(..., paths=...)` sets the standalone hooks' policy; a second, different one while
    they are live is refused; a watch and a standalone hook whose policies differ share a call through the
    token loop (the rule when handles disagree)."""
    model, ids = build("qwen3_5"), random_ids(2, 25)
    module = next(m for m in model.modules() if family_of(m) is not None)
    handle = rh.register_state_hook(module, lambda m, c, t, s: None, token=[3], paths=rh.Paths(rule="fixed"))
    try:
        with pytest.raises(rh.InvalidValue, match=r"run with Paths\(rule='fixed'.*got paths=Paths\(rule='loop'"):
            rh.register_state_hook(module, lambda m, c, t, s: None, paths=rh.Paths(rule="loop"))
        with rh.watch(model, keep={"states": [5]}, paths=rh.Paths(rule="fixed")) as w, torch.no_grad():
            model(ids, use_cache=False)
        assert w.mixers[0].calls[0].kernel_calls[0].path == "segments"  # the same policy: segments
        with rh.watch(model, keep={"states": [5]}) as w, torch.no_grad():
            model(ids, use_cache=False)
        assert w.mixers[0].calls[0].kernel_calls[0].path == "token loop"  # fixed and the default: the loop
    finally:
        handle.remove()


@pytest.mark.cpu_only(
    reason="costs.json ships cpu/float32 only: a model on another device takes the fixed rule, and"
    " support() says so in other words"
)
def test_a_device_without_calibration_takes_the_fixed_rule_and_support_says_so():
    """The constants are data keyed by device type and dtype (`costs.json`, "cpu/float32" shipped); a call on a
    device or dtype without calibration takes the fixed rule, and `support()` names the rule a model gets."""
    assert rh_costs.costs_for("cpu", torch.float32) is not None
    assert rh_costs.costs_for("cuda", torch.bfloat16) is None and rh_costs.costs_for("cpu", torch.bfloat16) is None
    tiny = gdn_arguments(64, 25, 2, 4, 16)  # the cost model's token loop on cpu/float32
    assert rh_choose.choose(GDN, [keeping(3)], 25, tiny, grad=False) is None
    uncalibrated = {name: value.to(torch.bfloat16) for name, value in tiny.items()}
    assert rh_choose.choose(GDN, [keeping(3)], 25, uncalibrated, grad=False) == rh_policy.Choice(
        Strategy.SEGMENTS, [3], False
    )
    model = build("qwen3_5")
    (row,) = [r for r in rh.support(model) if r.family][:1]
    assert row.notes["path choice"] == "the cost model, calibrated for cpu/float32"
    (row,) = [r for r in rh.support(model.to(torch.bfloat16)) if r.family][:1]
    assert row.notes["path choice"].startswith("the fixed rule") and "cpu/bfloat16" in row.notes["path choice"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "fast"}, r"expected rule= one of 'cost', 'fixed', 'loop', got rule='fast'"),
        (
            {"force": "loop"},
            r"expected force= None or one of 'segments', 'states', 'blocks', 'chunks' \(the token loop is"
            r" rule='loop'\), got force='loop'",
        ),
        ({"rule": "loop", "force": "segments"}, r"forces no other path"),
        ({"tails": 1}, r"expected tails=True or tails=False, got tails=1"),
        ({"blocks_below": -1}, r"blocks_below= None or a number of state elements >= 0, got blocks_below=-1"),
        ({"costs": {"ssd": (1, 2)}}, r"costs\['ssd'\]: expected Constants"),
        ({"loop_threads": 0}, r"expected loop_threads= None or a number of threads >= 1, got loop_threads=0"),
        ({"loop_threads": "one"}, r"got loop_threads='one'"),
    ],
)
def test_bad_paths_are_refused_with_what_was_expected(kwargs, message):
    with pytest.raises(rh.InvalidValue, match=message):
        rh.Paths(**kwargs)


@pytest.mark.parametrize(
    ("setting", "inside"),
    [({}, 1), ({"loop_threads": None}, 2), ({"loop_threads": 2}, 2)],
    ids=["default", "torch", "two"],
)
def test_the_token_loop_runs_at_its_threads_and_restores_them(setting, inside):
    """`Paths(loop_threads=...)`: a token loop runs its ops, hooks included, on one intra-op thread by default; the
    caller's setting comes back after the call, and after a hook that raised."""
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.fail("this torch has no OpenMP threads: the test needs the per-thread setting the library changes")
    model, ids, seen = build("qwen3_5"), random_ids(1, 6), []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with rh.watch(model, paths=rh.Paths(rule="loop", **setting)) as w, torch.no_grad():
            w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append(torch.get_num_threads()))
            model(ids)
            assert torch.get_num_threads() == 2
            w.mixers[0].register_state_hook(lambda m, c, t, s: 1 / 0, token=3)
            with pytest.raises(ZeroDivisionError):
                model(ids)
            assert torch.get_num_threads() == 2, "a hook that raised left the loop's threads set"
    finally:
        torch.set_num_threads(before)
    assert set(seen) == {inside}


def test_watch_refuses_paths_that_are_not_a_policy():
    with pytest.raises(rh.InvalidValue, match=r"watch: expected paths= a recurrent_hooks.Paths .* got str 'loop'"):
        rh.watch(build("qwen3_5"), paths="loop")


def test_the_suite_runs_the_shipped_path_choice():
    """No fixture or switch changes the path policy for the whole suite: a watch and a standalone hook
    get the default `rh.Paths()`, the cost model, unless a test passes its own."""
    model = build("qwen3_5")
    assert rh.Paths() == rh.Paths(rule="cost", force=None, tails=False)
    with rh.watch(model) as w:
        assert {m.paths for m in w.mixers} == {rh.Paths()}
    module = w.mixers[0].module
    handle = rh.register_state_hook(module, lambda m, c, t, s: None)
    try:
        assert standalone_impl._STANDALONE[module].paths == rh.Paths()
    finally:
        handle.remove()
