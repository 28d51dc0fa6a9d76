"""The real-size tier: every family at a real checkpoint's layer dims and vocabulary (tests/helpers/_real_sizes.py),
through the public API, one capability a test.

    pytest tests/package/test_real_size.py            # one family per kind
    pytest tests/package/test_real_size.py --full     # every family

Every other test builds tiny models (vocabulary 128, hidden 32); what breaks only at a real size (a 248,320-token
vocabulary's ids in float32, a 128-wide state, a chunk of 256, a 6144-wide layer) breaks here. Each prompt holds the
vocabulary's last ordinary id, and the studies' metric reads it. A family's model is built once (`_real_sizes.build`
keeps the last one) and its shared runs (`_runs`) once: the plain forward, and a watch that keeps every memory and the
kernels' values with a recording hook on every token of every mixer; the tests read them and add the runs of their
own capability.
"""

from __future__ import annotations

import collections
import dataclasses

import _real_sizes
import pytest
import torch
from _compare import assert_close, assert_equal
from _contract import STACK, reading_of
from _real_sizes import build, vocab

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.memory_parts import map_parts, parts_of

# The families whose cases run only with --full (CI runs them after the default suite): the time of every case of
# the family, its build included, measured on a 2-core machine with one torch thread (tests/conftest.py). The
# default suite keeps the kinds whose cases take a few seconds: its budget is 5 minutes in all.
HEAVY = {
    "minimax": "33 s: 2.9 G parameters (6144 wide, an untied 200064-token head), a 20 s build",
    "kimi_linear": "19 s: transformers' chunk_kimi_delta_attention at 32 heads of 128 takes 0.5 s a call",
    "zamba": "11 s: a 3712-wide hybrid whose mamba kernel runs once per head",
    "recurrent_gemma": "9 s: a 256000-token tied vocabulary at 2560 wide",
    "inkling2_loop": "9 s: a 201024-token vocabulary and four convolution windows a layer",
    "xlstm": "7 s: 4096 wide, the mLSTM's chunk-wise kernel and its step",
    "zaya": "6 s: a 262272-token tied vocabulary at 2048 wide",
}
FAMILIES = [pytest.param(name, marks=pytest.mark.full) if name in HEAVY else name for name in rh.FAMILIES]
T = 6  # prompt tokens
PAD = 0
SEVERAL_MIXERS_A_LAYER = ("inkling", "inkling2", "inkling2_loop")  # a sweep's cell is a layer's memory: refused


def top_id(model) -> int:
    """The vocabulary's last id that is not the pad, bos or eos token."""
    config = model.config.get_text_config()
    special = {getattr(config, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    return next(i for i in range(vocab(model) - 1, 0, -1) if i not in special)


def prompt(model, seed=0) -> torch.Tensor:
    """[1, T] ids in [3, vocabulary), never a special token, the vocabulary's last ordinary id at token 1."""
    config = model.config.get_text_config()
    special = torch.tensor(
        [
            i
            for i in (getattr(config, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id"))
            if i is not None
        ],
        dtype=torch.long,
    )
    ids = torch.randint(3, vocab(model), (1, T), generator=torch.Generator().manual_seed(seed))
    ids[torch.isin(ids, special)] = 3
    ids[0, 1] = top_id(model)
    return ids


def memories(family) -> tuple[str, ...]:
    """The memories of the family's (first) kind: "state", "window" or both."""
    return rh.FAMILIES[family].kind.MEMORIES


def metric(model):
    """log p(the vocabulary's last ordinary id) at the last token, per row."""
    return rh.metrics.log_prob(answer=top_id(model))


def tolerance(value) -> dict:
    """Float32 rounding of two kernel paths (and of a real width's sums after them), relative to the value's scale
    (its largest entry, over every part of a state of several)."""
    scale = max(float(part.abs().max()) for _, part in parts_of(value))
    return dict(rtol=1e-4, atol=1e-5 * max(scale, 1.0))


def assert_memory_close(name, expected, got, **tol):
    for (part, e), (_, g) in zip(parts_of(expected), parts_of(got)):
        assert_close(f"{name}{'.' + part if part else ''}", e, g, **(tol or tolerance(expected)))


@dataclasses.dataclass
class Runs:
    """A family's shared runs over `ids`: the plain forward (`plain`, its logits) and `watched`: a watch keeping every
    memory of every token and the kernels' inputs and outputs, with a hook on every token of every mixer that records
    (call, token, a copy of the memory it saw) per mixer (`seen`; a per-head kind's hooks, head 0 only)."""

    ids: torch.Tensor
    plain: torch.Tensor
    watched: rh.Watch
    out: object  # the watched forward's output (its cache)
    logits: torch.Tensor
    seen: dict


def _runs(model, family: str) -> Runs:
    ids = prompt(model)
    with torch.no_grad():
        plain = model(ids).logits
    seen = collections.defaultdict(list)
    keep = (*(STACK[m] for m in memories(family)), "inputs", "outputs")
    with torch.no_grad(), rh.watch(model, keep=keep) as w:
        for i, mixer in enumerate(w.mixers):
            mixer.register_state_hook(
                lambda m, c, t, s, i=i: (
                    seen[i].append((c, t, map_parts(torch.clone, s))) if m.head in (None, 0) else None
                )
            )
        out = model(ids, use_cache=True)
    return Runs(ids, plain, w, out, out.logits, dict(seen))


@pytest.fixture(scope="module", autouse=True)
def _free_the_models():
    """After this file: the last model and the memory pool go (the rest of the suite runs in this process)."""
    yield
    _real_sizes.release()


# Module-scoped and parametrized: pytest runs every test of one family before the next family's model is built.
@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return build(family)


@pytest.fixture(scope="module")
def runs(family, model):
    return _runs(model, family)


# -- kept memories ------------------------------------------------------------------------------------------------


@pytest.mark.one_per_kind
def test_the_model_runs_and_its_memories_are_finite_and_not_zero(family, model, runs):
    """The forward's logits are finite and a watch changes them by float rounding at most; every kept memory of every
    mixer is finite and not all zeros."""
    assert torch.isfinite(runs.plain).all(), f"{family}: the plain logits are not finite"
    assert_close(f"{family}: logits keeping every memory", runs.plain, runs.logits, **tolerance(runs.plain))
    for mixer in runs.watched.mixers:
        for memory in memories(family):
            for part, value in parts_of(getattr(mixer, STACK[memory])):
                assert value.shape[:2] == (1, T), f"{mixer} {memory}{part}: {tuple(value.shape)}"
                assert torch.isfinite(value).all(), f"{mixer} {memory}{part} is not finite"
                assert value.abs().max() > 0, f"{mixer} {memory}{part} is all zeros"


@pytest.mark.one_per_kind
def test_memories_kept_at_some_tokens_are_those_of_every_token_and_the_last_is_what_the_model_carries(
    family, model, runs
):
    """A watch keeping tokens 1, 3 and the last keeps the memories a watch of every token keeps there (within the
    two kernel paths' rounding), and the last is the memory the model carries on (its cache, module or state list)."""
    positions = [1, 3, T - 1]
    keep = {STACK[memory]: positions for memory in memories(family)}
    with torch.no_grad(), rh.watch(model, keep=keep) as w:
        model(runs.ids)
    carried = reading_of(rh.FAMILIES[family].kind).carried
    for some, every in zip(w.mixers, runs.watched.mixers):
        for memory in memories(family):
            expected = every.after(memory, positions)
            assert_memory_close(f"{some} {memory} at {positions}", expected, some.after(memory, positions))
            for where, value in carried(runs.out, every, memory).items():
                assert_memory_close(f"{every}: {where} holds the last {memory}", every.after(memory, -1), value)


# -- hooks and writes ---------------------------------------------------------------------------------------------


@pytest.mark.one_per_kind
def test_a_hook_runs_once_a_token_sees_the_kept_memory_and_an_identity_changes_nothing(family, model, runs):
    """The shared run's read-only hooks ran at every token of every mixer, in order, and saw the memory the watch kept
    there; a hook that returns a copy of what it sees leaves the logits as they were."""
    first = memories(family)[0]
    for i, mixer in enumerate(runs.watched.mixers):
        seen = runs.seen[i]
        assert [(c, t) for c, t, _ in seen] == [(0, t) for t in range(T)], f"{mixer}: the hook saw {seen}"
        for _, t, value in seen:
            kept = mixer.after(first, t)
            if type(mixer).KERNEL_PER_HEAD:  # the hook of head 0 saw head 0's slice
                kept = kept[:, 0]
            assert_memory_close(f"{mixer}: the hook's {first} at token {t}", kept, value, rtol=0, atol=0)
    with torch.no_grad(), rh.watch(model) as w:
        for mixer in w.mixers:
            mixer.register_state_hook(lambda m, c, t, s: map_parts(torch.clone, s))
        copied = model(runs.ids).logits
    assert_close(f"{family}: logits under hooks that return a copy", runs.plain, copied, **tolerance(runs.plain))


@pytest.mark.one_per_kind
def test_a_write_changes_the_logits_after_its_token_and_not_before(family, model, runs):
    """Every memory of the first mixer written after token 2 (the kept one, perturbed): the logits at tokens 0..2 are
    the plain ones, later ones move, and the watch keeps the written memory."""
    reading = reading_of(rh.FAMILIES[family].kind)
    mixer = runs.watched.mixers[0]
    token = 2
    values = {memory: reading.perturb(mixer.after(memory, token)) for memory in memories(family)}
    with torch.no_grad(), rh.watch(model, keep=tuple(STACK[m] for m in values)) as w:
        for memory, value in values.items():
            w.mixers[0].set_after(memory, token, value)
        written = model(runs.ids).logits
    early = {
        name: max(bound, tolerance(runs.plain)[name])  # wider rounds more
        for name, bound in reading.early.items()
    }
    assert_close(f"{family}: logits up to the write", runs.plain[:, : token + 1], written[:, : token + 1], **early)
    change = (written[:, token + 1 :] - runs.plain[:, token + 1 :]).abs().max()
    assert change > reading.later, f"{family}: a write after token {token} moved the later logits by {change}"
    for memory, value in values.items():
        assert_memory_close(
            f"{w.mixers[0]}: the kept {memory}", value, w.mixers[0].after(memory, token), rtol=0, atol=0
        )


@pytest.mark.one_per_kind
def test_generate_calls_a_hook_at_every_step_and_starts_from_the_plain_argmax(family, model, runs):
    """A 4-token greedy generate: a hook after the last token of every call of the first mixer sees calls 0..3 (the
    prompt, then one token a decode step), one on decode steps only (`call=slice(1, None)`) of the last mixer sees
    calls 1..3; the first token is the plain forward's argmax (the whole greedy generate against the unwatched one is
    tests/kinds/test_contract.py's, on the tiny models)."""
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=PAD)
    every, decode = [], []
    with torch.no_grad(), rh.watch(model) as w:
        w.mixers[0].register_state_hook(
            lambda m, c, t, s: every.append((c, t)) if m.head in (None, 0) else None, token=-1
        )
        w.mixers[-1].register_state_hook(
            lambda m, c, t, s: decode.append(c) if m.head in (None, 0) else None, call=slice(1, None)
        )
        hooked = model.generate(runs.ids, **kwargs)
    assert every == [(0, T - 1), (1, 0), (2, 0), (3, 0)], f"{family}: the hook saw {every}"
    assert decode == [1, 2, 3], f"{family}: the decode hook saw calls {decode}"
    assert [c.tokens for c in w.mixers[0].calls] == [T, 1, 1, 1]
    assert hooked.shape == (1, T + 4)
    assert_equal(f"{family}: the prompt", runs.ids, hooked[:, :T])
    assert int(hooked[0, T]) == int(runs.plain[0, -1].argmax()), f"{family}: the first token is not the argmax"


# -- studies ------------------------------------------------------------------------------------------------------


def _value_name(kind) -> str:
    """A kernel value to harvest: "key", else "dt", else the kind's first."""
    return next((name for name in ("key", "dt") if name in kind.VALUES), next(iter(kind.VALUES)))


def _probe_factors(state: torch.Tensor, rank: int = 3):
    """Probe factors `a` [heads, rank, rows], `b` [heads, rank, cols] for a state [batch, (heads,) rows, cols] (a
    per-head kind's too: its reductions see every head, as its kept states)."""
    heads, rows, cols = state.shape[1:] if state.dim() == 4 else (1, *state.shape[1:])
    gen = torch.Generator().manual_seed(2)
    return (
        torch.randn(heads, rank, rows, generator=gen) / rows**0.5,
        torch.randn(heads, rank, cols, generator=gen) / cols**0.5,
    )


def _probed(states: torch.Tensor, a, b) -> torch.Tensor:
    """The probe's readouts of kept states [batch, seq, (heads,) rows, cols], in float64: [batch, seq, heads, rank]."""
    s = states.double() if states.dim() == 5 else states.double().unsqueeze(2)
    return torch.einsum("hki,bthij,hkj->bthk", a.double(), s, b.double()).float()


def _harvest_names(harvested, model, mixers):
    """The manifest name of each watch mixer: by module path, the passes of a looped module in order."""
    paths = {id(module): name for name, module in model.named_modules()}
    names = collections.defaultdict(list)
    for name, info in harvested.mixers.items():
        names[info["path"]].append(name)
    taken = collections.Counter()
    out = []
    for mixer in mixers:
        path = paths[id(mixer.module)]
        out.append(sorted(names[path])[taken[path]])
        taken[path] += 1
    return out


@pytest.mark.one_per_kind
def test_a_harvest_of_a_probe_and_a_kernel_value_equals_the_watch(family, model, runs, tmp_path):
    """`rh.harvest` of one prompt, keeping the kind's first memory (a rank-3 probe of the state where the state is one
    tensor with rows and columns, else the memory itself) and a kernel value, read back with `rh.HarvestDataset`:
    the shared watch's values at every token (within float rounding: the harvest's kernels take other paths, which
    round the later layers' inputs otherwise)."""
    kind = rh.FAMILIES[family].kind
    stack, value = STACK[memories(family)[0]], _value_name(kind)
    sample = getattr(runs.watched.mixers[0], stack)
    probe = stack == "states" and isinstance(sample, torch.Tensor) and sample.dim() >= 4
    reduce = None
    if probe:
        factors = {mixer.layer: _probe_factors(getattr(mixer, stack)[:, 0]) for mixer in runs.watched.mixers}
        reduce = {stack: {layer: rh.probe(a, b) for layer, (a, b) in factors.items()}}
    harvested = rh.harvest(model, [runs.ids], tmp_path, keep=(stack, value), reduce=reduce, progress=False)
    assert (harvested.tokens, harvested.docs) == (T, 1)
    for name, mixer in zip(_harvest_names(harvested, model, runs.watched.mixers), runs.watched.mixers):
        kept = getattr(mixer, stack)
        expected = _probed(kept, *factors[mixer.layer]) if probe else kept
        data = rh.HarvestDataset(tmp_path, layer=name, what=stack)
        got = data.take(range(T))
        if isinstance(got, dict):  # a memory of several parts
            got = type(expected)(**{part: got[part].unsqueeze(0) for part in got})
        else:
            got = got.unsqueeze(0)
        assert_memory_close(f"{mixer}: harvested {stack}{' probe' if probe else ''}", expected, got)
        data = rh.HarvestDataset(tmp_path, layer=name, what=value)
        expected = mixer.values()[value]
        assert_memory_close(f"{mixer}: harvested {value}", expected[0], data.take(range(T)))


def _layers(runs) -> list[int]:
    """The first two decoder layers with a recurrent mixer."""
    return list(dict.fromkeys(mixer.layer for mixer in runs.watched.mixers))[:2]


def _pair(model, runs):
    """(clean, corrupt) prompts `[T]` (the shared run's and another), the first two recurrent layers, the metric."""
    return runs.ids[0], prompt(model, seed=1)[0], _layers(runs), metric(model)


@pytest.mark.one_per_kind
def test_a_patching_sweep_runs_and_its_cell_is_the_patched_forward(family, model, runs):
    """A sweep over 2 recurrent layers x 2 positions: finite values of shape [layers, positions]; its cell (first
    layer, token 3) is a forward of the corrupt prompt with the clean run's memory written there (`set_memory_after`).
    Models with several mixers a layer refuse it, as documented."""
    clean, corrupt, layers, score = _pair(model, runs)
    positions = [1, 3]
    if family in SEVERAL_MIXERS_A_LAYER:
        with pytest.raises(rh.Unavailable, match=r"patching_sweep: layers \[.*\] have several mixers each"):
            rh.patching_sweep(model, clean, corrupt, score, layers=layers, positions=positions, progress=False)
        return
    sweep = rh.patching_sweep(model, clean, corrupt, score, layers=layers, positions=positions, progress=False)
    assert sweep.values.shape == (len(layers), len(positions)) and torch.isfinite(sweep.values).all()
    mixer = next(m for m in runs.watched.mixers if m.layer == layers[0])
    with torch.no_grad(), rh.watch(model) as w:
        w.mixer(layers[0]).set_memory_after(3, mixer.memory_after(3))
        patched = score(model(corrupt[None]).logits)
    assert_close(
        f"{family}: the sweep's cell (layer {layers[0]}, token 3)", patched[0], sweep.values[0, 1], rtol=1e-4, atol=1e-4
    )


@pytest.mark.one_per_kind
def test_attribution_runs(family, model, runs):
    """`rh.attribute` over the first two recurrent layers: finite terms of shape [layers, tokens] and finite
    baselines. A kind whose transformers backward fails through a cached forward (`support` says so) attributes
    without a cache."""
    clean, corrupt, layers, score = _pair(model, runs)
    cached = not {"gradients with a state", "backward with a cache"} & set(rh.support(model)[0].unavailable)
    result = rh.attribute(
        model, clean, corrupt, score, layers=layers, forward_kwargs=None if cached else {"use_cache": False}
    )
    assert result.memory.shape == (len(layers), T), f"{family}: attribution of shape {tuple(result.memory.shape)}"
    assert torch.isfinite(result.memory).all() and torch.isfinite(result.clean) and torch.isfinite(result.corrupt)


@pytest.mark.one_per_kind
def test_support_has_a_row_for_every_mixer_module(family, model, runs):
    """`rh.support(model)`: one row per recurrent mixer module, in module order, with its path, layer and family, and
    something available."""
    rows = rh.support(model)
    paths = {id(module): name for name, module in model.named_modules()}
    modules = list(dict.fromkeys(paths[id(mixer.module)] for mixer in runs.watched.mixers))
    assert [row.path for row in rows] == modules
    assert {row.family for row in rows} == {family}
    assert all(row.available for row in rows), [row for row in rows if not row.available]
