"""Reductions formed where the states are formed (`policy.Strategy.CHUNKS`, `runners.reduce_in_chunks`).

A watch whose busy plans only reduce every state (`reduce=`), without gradients, runs the kind's all-states kernel
once over the call, which hands each of its chunks' states, a view of one reused buffer, to the reductions
(`Segments.on_chunk`). Checked per kind (gated DeltaNet, Kimi delta attention, Mamba-2, Mamba-1 chunk-wise and by
its token loop), at T = 37 (chunks of 16: [0, 16) [16, 32) [32, 37)) and batch 2:
- the path taken, and the reduction kept equal to fn of the token loop's states (a norm, a tensor with extra
  axes, `rh.probe`), with the model's logits unchanged;
- a result in the kernel's buffer (the chunk itself, a view of it) is copied: every token keeps its own values; a
  change of the chunk in place changes nothing the model computes;
- a wrong result is refused with the message of the other paths, an error inside fn says where;
- with a hook on every token, with states kept as they are by another watch, or with gradients, the other paths
  run, with the same results;
- the kernels: `all_states(on_chunk=...)` hands over consecutive chunks in one buffer of one chunk, returns no
  states, and the same output and last state as without it;
- `choose.choose` offers the path only where it applies, and `Paths(force="chunks")` names it.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.choose as rh_choose
import recurrent_hooks.engine.policy as rh_policy
import recurrent_hooks.kinds.selective_scan as selective_scan
import recurrent_hooks.kinds.shared.delta_rule as delta_rule
import recurrent_hooks.kinds.state_space as state_space
from recurrent_hooks.engine.declare.kernels import Pieces
from recurrent_hooks.engine.policy import Strategy
from recurrent_hooks.kinds.gated_delta_net import GatedDeltaNet

T, BATCH = 37, 2
CHUNKS = Strategy.CHUNKS.label  # "chunk-wise reductions"
# case -> (module, constant, value) set for it (None: as shipped). The test models' states are small: the delta rules
# and Mamba-2 form a chunk's states by one product; "row-steps" forms them token by token, as at real dims
# (`ROW_STEPS_FROM`). Mamba-1's `CHUNKWISE_UP_TO` at 0 makes its all-states kernel run its token loop, which gathers
# the states into a chunk buffer (`loops.chunked`)
CASES = {
    "qwen3_5": None,
    "qwen3_5-row-steps": (delta_rule, "ROW_STEPS_FROM", 0),
    "kimi_linear": None,
    "kimi_linear-row-steps": (delta_rule, "ROW_STEPS_FROM", 0),
    "mamba2": None,
    "mamba2-row-steps": (state_space, "ROW_STEPS_FROM", 0),
    "mamba": None,
    "mamba-token-loop": (selective_scan, "CHUNKWISE_UP_TO", 0),
}
TOLERANCE = dict(rtol=1e-4, atol=1e-6)

_MODELS: dict = {}
_LOOP_STATES: dict = {}


@pytest.fixture(params=sorted(CASES))
def case(request, monkeypatch):
    """(family, model, ids, the token loop's states by layer) for a case of `CASES`."""
    name = request.param
    if CASES[name] is not None:
        monkeypatch.setattr(*CASES[name])
    family = name.split("-")[0]
    if family not in _MODELS:
        _MODELS[family] = build(family)
    model, ids = _MODELS[family], random_ids(BATCH, T, seed=11)
    if family not in _LOOP_STATES:
        with torch.no_grad(), rh.watch(model, keep=("states",), paths=rh.Paths(rule="loop")) as w:
            model(ids)
        _LOOP_STATES[family] = {m.layer: m.states for m in w.mixers}
    return family, model, ids, _LOOP_STATES[family]


def paths_of(mixer) -> set[str]:
    return {part.path for call in mixer.calls for part in call.kernel_calls}


def norm(states):
    return states.flatten(2).norm(dim=-1)  # b c


def extra_axes(states):
    return torch.stack([states.sum(-1), states.amax(-1)], dim=-1)  # b c *state[:-1] 2


def probe_for(state: torch.Tensor, seed: int):
    """A rank-3 probe for a layer whose states are `[batch, seq, (heads,) rows, cols]` (no heads: one head)."""
    heads, rows, cols = (1, *state.shape[2:]) if state.dim() == 4 else tuple(state.shape[2:])
    gen = torch.Generator().manual_seed(seed)
    return rh.probe(torch.randn(heads, 3, rows, generator=gen), torch.randn(heads, 3, cols, generator=gen))


def reduced(model, ids, fn, **watch):
    with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": fn}, **watch) as w:
        logits = model(ids).logits
    return w, logits


@pytest.mark.parametrize("what", ["norm", "extra axes", "probe"])
def test_the_reduction_on_the_chunks_path_is_fn_of_the_token_loops_states(case, what):
    family, model, ids, loop = case
    fns = {
        layer: {"norm": norm, "extra axes": extra_axes}.get(what) or probe_for(state, layer)
        for layer, state in loop.items()
    }
    w, logits = reduced(model, ids, fns)
    with torch.no_grad():
        assert_close(f"{family}: logits", model(ids).logits, logits, rtol=1e-4, atol=1e-5)
    for mixer in w.mixers:
        assert paths_of(mixer) == {CHUNKS}, (family, paths_of(mixer))
        expected = fns[mixer.layer](loop[mixer.layer])
        assert mixer.states.shape == expected.shape
        assert_close(f"{family} {mixer} {what}", expected, mixer.states, **TOLERANCE)
        assert_close(f"{family} {mixer} {what} after 20", expected[:, 20], mixer.state_after(20), **TOLERANCE)


@pytest.mark.parametrize("returned", ["its input", "a view of it"])
def test_a_result_in_the_kernels_buffer_is_copied(case, returned):
    """fn gets a view of the kernel's chunk buffer, which the next chunk overwrites: a result that is the chunk
    itself, or a view of it, is copied, so that every token keeps its own state's values."""
    family, model, ids, loop = case
    fn = (lambda states: states) if returned == "its input" else (lambda states: states[..., 0])
    w, _ = reduced(model, ids, fn)
    for mixer in w.mixers:
        assert paths_of(mixer) == {CHUNKS}
        assert_close(f"{family} {mixer} returning {returned}", fn(loop[mixer.layer]), mixer.states, **TOLERANCE)


def test_a_change_in_place_changes_nothing_the_model_computes(case):
    """The kernel takes what it needs of a chunk (the outputs, the state the next chunk starts from) before it hands
    the chunk over: a reduction that scales its chunk in place sees the scaled states, and the model is unchanged."""
    family, model, ids, loop = case
    w, logits = reduced(model, ids, lambda states: norm(states.mul_(2)))
    with torch.no_grad():
        assert_close(f"{family}: logits", model(ids).logits, logits, rtol=1e-4, atol=1e-5)
    for mixer in w.mixers:
        assert paths_of(mixer) == {CHUNKS}
        assert_close(f"{family} {mixer} scaled in place", 2 * norm(loop[mixer.layer]), mixer.states, **TOLERANCE)


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_a_wrong_result_is_refused_as_on_the_other_paths(family):
    model, ids = build(family), random_ids(BATCH, T)
    wrong = lambda states: states.flatten(1).norm(dim=1)  # noqa: E731   [batch]: no token axis
    for paths, tokens, chunk in (
        (None, "0..15", 16),
        (rh.Paths(force="blocks"), "0..36", 37),
        (rh.Paths(rule="loop"), "0..36", 37),
    ):
        with pytest.raises(
            rh.InvalidValue,
            match=rf", layer \d+\), call 0, tokens {tokens}: the reduction .*"
            rf" returned a tensor of shape \(2,\); expected a tensor \[batch,"
            rf" chunk, \.\.\.\] with chunk = {chunk} \(a result per token",
        ):
            reduced(model, ids, wrong, paths=paths)

    def failing(states):
        raise RuntimeError("my reduction")

    with pytest.raises(RuntimeError, match="my reduction") as error:
        reduced(model, ids, failing)
    notes = getattr(error.value, "__notes__", [])
    assert any(", call 0, tokens 0..15: the reduction" in note for note in notes), notes


@pytest.mark.parametrize("other", ["a hook on every token", "states kept by another watch", "gradients"])
def test_with_a_hook_kept_states_or_gradients_the_other_paths_run(case, other):
    family, model, ids, loop = case
    seen = []
    with (
        torch.set_grad_enabled(other == "gradients"),
        rh.watch(model, keep=("states",), reduce={"states": norm}) as w,
        rh.watch(model, keep=("states",) if other.startswith("states") else ()) as plain,
    ):
        if other.startswith("a hook"):
            for mixer in plain.mixers:
                mixer.register_state_hook(lambda m, call, token, state: seen.append(token))
        model(ids)
    assert not other.startswith("a hook") or len(seen) == T * len(w.mixers)
    for mixer, kept in zip(w.mixers, plain.mixers):
        assert CHUNKS not in paths_of(mixer) and paths_of(mixer) <= {"blocks", "token loop"}, paths_of(mixer)
        assert mixer.states.requires_grad == (other == "gradients")
        assert_close(f"{family} {mixer} with {other}", norm(loop[mixer.layer]), mixer.states.detach(), **TOLERANCE)
        if other.startswith("states"):
            assert_close(f"{family} {kept}: the other watch's states", loop[kept.layer], kept.states, **TOLERANCE)


def test_inference_mode_runs_the_chunks_path():
    model, ids = build("qwen3_5"), random_ids(BATCH, T)
    with torch.no_grad():
        expected = reduced(model, ids, norm)[0]
    with torch.inference_mode(), rh.watch(model, keep=("states",), reduce={"states": norm}) as w:
        model(ids)
    for mixer, reference in zip(w.mixers, expected.mixers):
        assert paths_of(mixer) == {CHUNKS}
        assert_close(f"inference mode {mixer}", reference.states, mixer.states, rtol=0, atol=0)


def test_all_states_hands_over_its_chunks_in_one_buffer(case):
    """At the kernel: `on_chunk(start, states)` gets consecutive chunks covering the call, all views of one buffer
    of one chunk (the kernel holds no `[seq, ...]` states), each equal to those tokens' states; the output and last
    state are those of `all_states` without it, and no states are returned."""
    family, model, ids, _ = case
    with torch.no_grad(), rh.watch(model, keep=("inputs",)) as w:
        model(ids)
    kind = type(w.mixers[0])
    kernel = kind.kernel_for("prompt")
    assert kernel.segments.on_chunk
    inputs = w.mixers[0].calls[0].kernel_calls[0].inputs
    pieces = Pieces(kernel, (), inputs)
    leading, named = pieces.call(0, T, pieces.state)
    with torch.no_grad():
        (out, last), every = kernel.segments.all_states(*leading, **named)
        handed = []

        def on_chunk(start, states):
            handed.append(
                (
                    start,
                    states.shape[0],
                    states.untyped_storage().data_ptr(),
                    states.untyped_storage().nbytes(),
                    states.clone(),
                )
            )

        (chunked_out, chunked_last), none = kernel.segments.all_states(*leading, **named, on_chunk=on_chunk)
    assert none is None
    assert_close(f"{family}: output", out, chunked_out, **TOLERANCE)
    assert_close(f"{family}: last state", last, chunked_last, **TOLERANCE)
    starts = [start for start, *_ in handed]
    sizes = [size for _, size, *_ in handed]
    assert starts == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == T, (starts, sizes)
    assert len({pointer for _, _, pointer, _, _ in handed}) == 1, "the chunks are not in one buffer"
    assert handed[0][3] == max(sizes) * every[0].nbytes, "the buffer holds more than one chunk of states"
    for start, size, _, _, states in handed:
        assert_close(f"{family}: tokens {start}..{start + size - 1}", every[start : start + size], states, **TOLERANCE)


def _plan(tokens, reduce=norm, hooks=()):
    return SimpleNamespace(hooks=list(hooks), keep=frozenset(range(tokens)), reduce=reduce, kind=GatedDeltaNet)


def test_choose_offers_the_chunks_path_only_where_it_applies():
    kernel = GatedDeltaNet.kernel_for("prompt")
    arguments = {
        "query": torch.zeros(()).expand(1, 64, 16, 128),
        "key": torch.zeros(()).expand(1, 64, 16, 128),
        "value": torch.zeros(()).expand(1, 64, 32, 128),
        "g": torch.zeros(()).expand(1, 64, 32),
        "beta": torch.zeros(()).expand(1, 64, 32),
    }

    def path(busy, tokens=64, grad=False, paths=rh_policy.DEFAULT, of=kernel):
        choice = rh_choose.choose(of, busy, tokens, arguments, grad=grad, paths=paths)
        return Strategy.LOOP if choice is None else choice.path

    assert path([_plan(64)]) is Strategy.CHUNKS
    assert path([_plan(64), _plan(64)]) is Strategy.CHUNKS  # two reducing handles
    assert path([_plan(64)], grad=True) is Strategy.LOOP
    assert path([_plan(64, hooks=[(None, None)])]) is not Strategy.CHUNKS
    assert path([_plan(64, hooks=[(None, frozenset({3}))])]) is not Strategy.CHUNKS  # a write at token 3
    assert path([_plan(64), _plan(64, reduce=None)]) is not Strategy.CHUNKS  # states kept as they are too
    assert path([_plan(64)], paths=rh.Paths(force="blocks")) is Strategy.BLOCKS
    assert path([_plan(64)], paths=rh.Paths(rule="loop")) is Strategy.LOOP
    without = dataclasses.replace(kernel, segments=dataclasses.replace(kernel.segments, on_chunk=False))
    assert path([_plan(64)], of=without) is Strategy.BLOCKS
    assert path([_plan(1)], tokens=1) is not Strategy.CHUNKS  # a decode step
    assert rh.Paths(force="chunks").force is Strategy.CHUNKS


def test_forced_chunks_name_the_path_and_give_the_same_results():
    model, ids = build("mamba2"), random_ids(BATCH, T)
    default, _ = reduced(model, ids, norm)
    forced, _ = reduced(model, ids, norm, paths=rh.Paths(force="chunks"))
    for a, b in zip(default.mixers, forced.mixers):
        assert paths_of(b) == {CHUNKS} and b.calls[0].kernel_calls[0].path == "chunk-wise reductions"
        assert_close(f"forced {b}", a.states, b.states, rtol=0, atol=0)
