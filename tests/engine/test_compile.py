"""torch.compile(model, fullgraph=True) inside a watch: eager's outputs, hook calls and records, compiled once.

The engine's per-call bookkeeping runs when the graph runs, in custom ops (`recurrent_hooks.engine.tracking.compiled`),
so a compiled model is traced once and its later calls replay the graph: `error_on_recompile` holds from the second call
on. Families holding every kind between them (four kinds in the default suite, the rest with --full), compiled with the
"aot_eager" backend (dynamo and functionalization, what decides graphs and guards, without inductor's code generation,
which would take minutes per family); one test compiles Mamba-1 with inductor, whose buffer reuse is what the ops'
copies guard against.

What is checked against the same run made eagerly: the logits of every call, every hook call (call index,
token, the state's norm), the states kept, a write aimed at one call only, a replacing hook, the call
records. The two upstream tests of transformers that a watch used to break are mirrored on the families
whose generate compiles (`cache_implementation="static"` with a `CompileConfig`): the compiled generate
equals the eager one, and a second generate, of the same or a smaller length, does not recompile.
"""

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import PAD, build, random_ids
from transformers import CompileConfig

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.runners as rh_busy
from recurrent_hooks.engine.declare.memory_parts import map_parts, parts_of

# the default suite compiles four of the kinds (gated DeltaNet, both Mamba scans, RWKV); the others (about 50 s:
# the looped convolutions with transformers 5.25's full-graph limit alone 18 s; Kimi delta attention, gated
# DeltaNet's maths with a decay per key channel, 5 s) with --full, which .ci/run runs after the default suite, for
# the suite's time
DEFAULT_COMPILED = ("qwen3_5", "mamba", "mamba2", "rwkv")


def _covering_every_kind() -> list[str]:
    """Families that hold every mixer kind of the registry between them: DEFAULT_COMPILED, then, in the registry's
    order, each family that holds a kind not held yet (inkling2: a short and a dynamic convolution)."""
    chosen, held = [], set()
    for name in [*DEFAULT_COMPILED, *rh.FAMILIES]:
        kinds = {mixer.kind for mixer in rh.FAMILIES[name].classes}
        if name not in chosen and kinds - held:
            chosen.append(name)
            held |= kinds
    return chosen


EVERY_KIND = _covering_every_kind()
STACK = {"state": "states", "window": "windows"}  # memory -> its keep name
CALLS = 3
T = 5
KEPT, WRITTEN, REPLACED = 1, 2, 3  # tokens: kept, written at call 1, replaced by a hook at every call


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _first(state):
    return parts_of(state)[0][1]


def _norm(state) -> float:
    return float(_first(state).float().norm())


def _memory_of(model) -> str:
    with rh.watch(model) as w:
        return w.mixers[0].MEMORIES[0]


def _written(model, ids):
    """What the write puts in: zeros of the first mixer's memory after token KEPT of an eager run."""
    memory = _memory_of(model)
    with rh.watch(model, keep={STACK[memory]: [KEPT]}) as w, torch.no_grad():
        model(ids)
    first = w.mixers[0]
    state = first.state_after(KEPT) if memory == "state" else first.window_after(KEPT)
    return memory, map_parts(torch.zeros_like, state)


def _one_of_each_kind(w):
    """The first mixer of each kind in the watch, and the last mixer (what the hooks are registered on)."""
    first = {type(mixer): mixer for mixer in reversed(w.mixers)}
    return [mixer for mixer in w.mixers if mixer in first.values() or mixer is w.mixers[-1]]


def _watched_calls(model, forward, ids, memory, zero, hooked=None, paths=None):
    """CALLS forwards of `forward` in one watch (its policy `paths`), every one after the first with
    error_on_recompile; the read hooks at the tokens `hooked` (None: every token)."""
    seen = []
    with rh.watch(model, keep={STACK[memory]: [KEPT]}, paths=paths) as w, torch.no_grad():
        for mixer in _one_of_each_kind(w):
            mixer.register_state_hook(lambda m, c, t, s: seen.append((m.layer, c, t, _norm(s))), token=hooked)
        w.mixers[-1].register_state_hook(lambda m, c, t, s: map_parts(lambda p: p * 0.5, s), token=REPLACED)
        first = w.mixers[0]
        (first.set_state_after if memory == "state" else first.set_window_after)(WRITTEN, zero, call=1)
        logits = []
        for call in range(CALLS):
            with torch._dynamo.config.patch(error_on_recompile=call > 0 and forward is not model):
                logits.append(forward(ids).logits)
    return logits, seen, w


def _compare_runs(eager, compiled, memory, atol, hooked=T):
    (logits, seen, w), (compiled_logits, compiled_seen, cw) = eager, compiled
    for call, (a, b) in enumerate(zip(logits, compiled_logits)):
        assert_close(f"logits of call {call}", a, b, rtol=1e-5, atol=atol)
    assert (logits[1] - logits[0]).abs().max() > 0, "the write at call 1 changed nothing"
    assert_equal("call 2's logits (the write is call 1's only)", compiled_logits[0], compiled_logits[2])
    assert [hook[:3] for hook in compiled_seen] == [hook[:3] for hook in seen]
    assert {hook[1] for hook in seen} == set(range(CALLS)) and all(type(hook[1]) is int for hook in compiled_seen)
    assert_close(
        "hooked state norms",
        torch.tensor([h[3] for h in seen]),
        torch.tensor([h[3] for h in compiled_seen]),
        rtol=1e-5,
        atol=1e-6,
    )
    # a hook runs once per kernel call of a call (once per head where the kind runs its kernel per head)
    assert len(seen) == CALLS * hooked * sum(max(1, len(m.calls[0].kernel_calls)) for m in _one_of_each_kind(w))
    for mixer, compiled_mixer in zip(w.mixers, cw.mixers):
        assert [c.index for c in compiled_mixer.calls] == list(range(CALLS))
        assert [c.kernel for c in compiled_mixer.calls] == [c.kernel for c in mixer.calls]
        for call in range(CALLS):
            read = (
                (lambda m: m.state_after(KEPT, call=call))
                if memory == "state"
                else (lambda m: m.window_after(KEPT, call=call))
            )
            for (name, a), (_, b) in zip(parts_of(read(mixer)), parts_of(read(compiled_mixer))):
                assert_close(f"{mixer} call {call}: kept {memory} {name}", a, b, rtol=1e-5, atol=1e-6)


def _full_graph_refused_by_transformers(family, model, ids) -> bool:
    """Whether the family's registry row says its model cannot compile in a full graph (a transformers bug); if so,
    check that the plain model, with no watch, fails with dynamo's refusal."""
    if "torch.compile(fullgraph=True)" not in rh.FAMILIES[family].limits:
        return False
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.Unsupported, match="deepcopy"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(ids)
    torch._dynamo.reset()
    return True


@pytest.mark.parametrize(
    "family",
    [family if family in DEFAULT_COMPILED else pytest.param(family, marks=pytest.mark.full) for family in EVERY_KIND],
)
def test_a_compiled_forward_in_a_watch_is_eager_and_compiles_once(family):
    """In a full graph; where transformers' own forward cannot compile in one (the family's limits say so, and the
    plain model fails the same way), with graph breaks, still once."""
    model, ids = build(family), random_ids(1, T)
    memory, zero = _written(model, ids)
    fullgraph = not _full_graph_refused_by_transformers(family, model, ids)
    eager = _watched_calls(model, model, ids, memory, zero)
    compiled = _watched_calls(model, torch.compile(model, fullgraph=fullgraph, backend="aot_eager"), ids, memory, zero)
    _compare_runs(eager, compiled, memory, atol=1e-6)


# the bound kernel's pieces; the library's (Mamba-1), with --full for the suite's time
@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("mamba", marks=pytest.mark.full)])
def test_a_compiled_forward_with_a_few_hooked_tokens_runs_in_segments_as_eagerly(family, monkeypatch):
    """A few hooked, kept and written tokens: the bound kernel runs in segments between them, in the graph too
    (the path is chosen as eagerly; the spy is on the eager run: a list it appended to would be a guard)."""
    model, ids = build(family), random_ids(1, T)
    memory, zero = _written(model, ids)
    segmented, real = [], rh_busy.run_in_segments
    monkeypatch.setattr(rh_busy, "run_in_segments", lambda *a: segmented.append(1) or real(*a))
    fixed = rh.Paths(rule="fixed")  # segments: the cost model picks the token loop at these tiny dims
    eager = _watched_calls(model, model, ids, memory, zero, hooked=[0, -1], paths=fixed)
    assert segmented, "the eager run did not take segments"
    monkeypatch.setattr(rh_busy, "run_in_segments", real)
    compiled = _watched_calls(
        model, torch.compile(model, fullgraph=True, backend="aot_eager"), ids, memory, zero, hooked=[0, -1], paths=fixed
    )
    _compare_runs(eager, compiled, memory, atol=1e-6, hooked=2)


@pytest.mark.full  # about 8 s: inductor's code generation (run by .ci/run's full matrices)
def test_inductor_compiles_a_watched_mamba_once_with_eager_results():
    """Inductor reuses a buffer once its last reader has run: what the ops hand Python and take back are copies."""
    model, ids = build("mamba"), random_ids(1, T)
    memory, zero = _written(model, ids)
    eager = _watched_calls(model, model, ids, memory, zero)
    compiled = _watched_calls(model, torch.compile(model, fullgraph=True), ids, memory, zero)
    _compare_runs(eager, compiled, memory, atol=1e-5)


# -- transformers' compiled generate: the two upstream tests, with hooks ---------------------------------------


def _compile_config():
    config = CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles generate on accelerators only, unless told
    return config


GENERATE = dict(do_sample=False, cache_implementation="static", pad_token_id=PAD)
NEW = 4


def _generate(model, ids, compiled, zero, memory, again=()):
    """Greedy generate in a watch with a per-token hook and a write at decode step 2; `again`: more generates in the
    same watch, (ids, new tokens), each with error_on_recompile."""
    seen = []
    settings = dict(GENERATE, compile_config=_compile_config()) if compiled else dict(GENERATE, disable_compile=True)
    with rh.watch(model) as w, torch.no_grad():
        for mixer in _one_of_each_kind(w):
            mixer.register_state_hook(lambda m, c, t, s: seen.append((m.layer, c, t, _norm(s))))
        first = w.mixers[0]
        (first.set_state_after if memory == "state" else first.set_window_after)(0, zero, call=2)
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **settings)
        calls = len(seen)
        for more, new in again:
            with torch._dynamo.config.patch(error_on_recompile=True):
                model.generate(more, max_new_tokens=new, min_new_tokens=new, **settings)
    return out, seen[:calls], seen[calls:]


# Families whose generate transformers compiles, one per kind of recurrence (rwkv, xlstm and minimax have no
# compileable cache: transformers runs their generate eagerly). recurrent_gemma: a shorter prompt recompiles
# without the library too (its conv window's strides depend on the prompt's length), so its second generate has
# the same length. The dynamic and looped convolutions (inkling2, inkling2_loop) pass this test too, in 12 and
# 31 s: left to their compiled forwards above, for the suite's time; lfm2 stands for the short convolutions.
COMPILED_GENERATE = {
    "qwen3_5": True,
    "kimi_linear": True,
    "mamba": True,
    "zamba": True,
    "mamba2": True,
    "recurrent_gemma": False,
    "lfm2": True,
}


# qwen3_5, mamba and mamba2 by default; the other kinds' compiled generate with --full (about 15 s)
@pytest.mark.parametrize(
    "family",
    [
        family if family in ("qwen3_5", "mamba", "mamba2") else pytest.param(family, marks=pytest.mark.full)
        for family in COMPILED_GENERATE
    ],
)
def test_compiled_generate_with_hooks_equals_eager_and_does_not_recompile(family):
    """test_generate_compile_model_forward_fullgraph and test_static_cache_no_recompile_with_smaller_length, with
    a per-token hook and a write at a decode step: the same sequences and hook calls, and further generates of
    the same or a smaller length replay the compiled graph."""
    model, ids = build(family), random_ids(1, T)
    memory, zero = _written(model, ids)
    sequences, seen, _ = _generate(model, ids, False, zero, memory)
    again = [(ids, NEW)] + ([(ids[:, :-1], NEW - 1)] if COMPILED_GENERATE[family] else [])
    compiled, compiled_seen, later = _generate(model, ids, True, zero, memory, again)
    assert getattr(model, "_compiled_call", None) is not None, "transformers did not compile the forward"
    assert_equal("sequences", sequences, compiled)
    assert [hook[:3] for hook in compiled_seen] == [hook[:3] for hook in seen]
    assert_close(
        "hooked state norms",
        torch.tensor([h[3] for h in seen]),
        torch.tensor([h[3] for h in compiled_seen]),
        rtol=1e-5,
        atol=1e-6,
    )
    assert {hook[1] for hook in later} == set(range(NEW, NEW + sum(new for _, new in again))), (
        "the calls of the later generates continue the watch's counter"
    )


# -- gradients, records, errors, standalone hooks ---------------------------------------------------------------


@pytest.mark.full  # (11 s: .ci/run runs it after the default suite)
def test_with_gradients_on_writes_are_traced_and_hooks_read():
    """A write's value gets its gradient through the compiled graph as eagerly; a hook reads a detached copy; a
    hook that replaces the state raises, naming itself."""
    model, ids = build("mamba"), random_ids(1, T)
    memory, zero = _written(model, ids)
    grads, norms = [], []
    for forward in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        value = (zero + 0.1).requires_grad_()
        seen = []
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(WRITTEN, value, call=1)
            w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append((c, t, _norm(s))), token=-1)
            losses = [forward(ids).logits.square().sum() for _ in range(2)]
        (gradient,) = torch.autograd.grad(losses[1], value)
        (unwritten,) = torch.autograd.grad(losses[0], value, allow_unused=True)
        assert unwritten is None or not unwritten.any(), "call 0 has a gradient with respect to call 1's write"
        grads.append(gradient)
        norms.append(seen)
    assert gradient.abs().max() > 0
    assert_close("gradient of the written value", grads[0], grads[1], rtol=1e-5, atol=1e-5)  # float32, reordered
    assert [h[:2] for h in norms[0]] == [h[:2] for h in norms[1]] == [(0, T - 1), (1, T - 1)]
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 2, token=1)
        with pytest.raises(
            rh.RecurrentHooksError, match=r"state hook .*returned a replacement inside a compiled graph"
        ):
            torch.compile(model, fullgraph=True, backend="aot_eager")(ids)


def test_kernel_records_of_a_compiled_call_equal_eager_ones():
    model, ids = build("qwen3_5"), random_ids(1, T)
    records = []
    for forward in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        with rh.watch(model, keep=("inputs", "outputs", "states")) as w, torch.no_grad():
            forward(ids)
        records.append(w.mixers[0].calls[0])
    eager, compiled = records
    assert eager.inputs.keys() == compiled.inputs.keys() and eager.output.keys() == compiled.output.keys()
    for name, value in eager.inputs.items():
        if isinstance(value, torch.Tensor):
            assert_close(f"input {name}", value, compiled.inputs[name], rtol=1e-6, atol=1e-7)
        else:
            assert value == compiled.inputs[name], name
    for name, value in eager.output.items():
        if isinstance(value, torch.Tensor):
            assert_close(f"output {name}", value, compiled.output[name], rtol=1e-5, atol=1e-6)
    assert_close("every state", eager.states, compiled.states, rtol=1e-5, atol=1e-6)


def test_a_hook_token_outside_a_call_it_names_raises_when_the_graph_runs():
    model = build("mamba")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with rh.watch(model) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: None, token=T + 2, call=1)
        compiled(random_ids(1, T))  # call 0: not targeted
        with pytest.raises(rh.InvalidValue, match=rf"targets token {T + 2}, but call 1 .* has {T} tokens"):
            compiled(random_ids(1, T))


def test_a_standalone_hook_counts_calls_from_each_prompt_under_compile():
    model = build("mamba")
    seen = []
    handle = rh.register_state_hook(model.backbone.layers[0].mixer, lambda m, c, t, s: seen.append((c, t)), token=-1)
    try:
        with torch.no_grad():
            model.generate(
                random_ids(1, T), max_new_tokens=3, min_new_tokens=3, **GENERATE, compile_config=_compile_config()
            )
            with torch._dynamo.config.patch(error_on_recompile=True):
                model.generate(
                    random_ids(1, T), max_new_tokens=3, min_new_tokens=3, **GENERATE, compile_config=_compile_config()
                )
    finally:
        handle.remove()
    assert seen == [(0, T - 1), (1, 0), (2, 0)] * 2


def test_a_collected_mixers_clock_leaves_the_table_between_traces_not_during_one():
    """The garbage collector may run while dynamo iterates the clocks' dict (`_CLOCKS[key]` in traced code): a
    collected tracker's clock is only retired then, and removed by the next registration, which is eager."""
    import gc

    import recurrent_hooks.engine.tracking.compiled as compiled

    class Tracker:  # any object the table can hold weakly, as it holds a CallTracker
        pass

    tracker = Tracker()
    key = compiled.register_tracker(tracker)
    del tracker
    gc.collect()
    assert key in compiled._CLOCKS, "a clock left the table from a finalizer"
    other = Tracker()
    compiled.register_tracker(other)
    assert key not in compiled._CLOCKS, "a collected tracker's clock outlived the next registration"
