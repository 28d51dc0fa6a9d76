"""`watch(reduce=...)` on a kind that runs its kernel once per head (`KERNEL_PER_HEAD`: zamba): the reduction sees
every head's states, `[batch, chunk, heads, head_dim, d_state]`, the layout of the kept states, as on every other
kind; `rh.probe` with one factor pair per head keeps `[batch, seq, heads, r]`. Without gradients and hooks the last
head's kernel call forms every head's states a chunk at a time (`runners.reduce_heads_in_chunks`); otherwise the
earlier heads' states wait for it (`visitor.HeldHeads`)."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.engine.paths import visitor

TOKENS = 150  # more than two chunks of a reduction (visitor.Reduction.CHUNK = 64)
_MODEL = {}


def _model():
    if not _MODEL:
        _MODEL["zamba"] = build("zamba")
    return _MODEL["zamba"]


def _kept(model, ids):
    """Every mixer's kept states `[batch, seq, heads, head_dim, d_state]`, without gradients."""
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        model(ids, use_cache=False)
    return [mixer.states for mixer in w.mixers]


def _factors(states, rank=3, seed=0):
    """One factor pair per head: a `[heads, rank, head_dim]`, b `[heads, rank, d_state]`."""
    heads, rows, cols = states.shape[2:]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, rank, rows, generator=gen), torch.randn(heads, rank, cols, generator=gen)


def _probed(states, a, b):
    return torch.einsum("bthij,hki,hkj->bthk", states.double(), a.double(), b.double())


def _per_head_norm(states):
    return states.flatten(3).norm(dim=-1)  # batch chunk heads


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_probe_with_factors_per_head_equals_the_einsum_over_the_kept_states(grad):
    model, ids = _model(), random_ids(2, TOKENS, seed=3)
    kept = _kept(model, ids)
    a, b = _factors(kept[0])
    with torch.set_grad_enabled(grad), rh.watch(model, keep=("states",), reduce={"states": rh.probe(a, b)}) as w:
        model(ids, use_cache=False)
    for states, mixer in zip(kept, w.mixers, strict=True):
        expected = _probed(states, a, b)
        assert mixer.states.shape == (2, TOKENS, states.shape[2], 3)
        assert_close(
            f"{mixer}: probe per head ({'grad' if grad else 'no_grad'})",
            expected,
            mixer.states.double(),
            rtol=1e-5,
            atol=1e-6 * expected.abs().max(),
        )
        assert_close(
            f"{mixer}: state_after(-1)",
            expected[:, -1],
            mixer.state_after(-1).double(),
            rtol=1e-5,
            atol=1e-6 * expected.abs().max(),
        )


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_norm_per_head_sees_every_head_a_chunk_at_a_time_and_equals_the_kept_states_norm(grad):
    model, ids = _model(), random_ids(2, TOKENS, seed=3)
    kept = _kept(model, ids)
    seen = []

    def norm(states):
        seen.append(tuple(states.shape))
        return _per_head_norm(states)

    with torch.set_grad_enabled(grad), rh.watch(model, keep=("states",), reduce={"states": norm}) as w:
        model(ids, use_cache=False)
    heads, head_state = kept[0].shape[2], tuple(kept[0].shape[3:])
    assert seen and all(shape[0] == 2 and shape[2:] == (heads, *head_state) for shape in seen), seen
    assert max(shape[1] for shape in seen) <= visitor.Reduction.CHUNK, seen
    for states, mixer in zip(kept, w.mixers, strict=True):
        assert_close(f"{mixer}: norm per head", _per_head_norm(states), mixer.states, rtol=1e-5, atol=1e-6)


def test_without_gradients_the_last_head_forms_every_heads_states_and_the_outputs_stay(monkeypatch):
    """The chunk-wise reductions' path: no head's states wait (`HeldHeads.gather` never holds one), and the model's
    logits are the unwatched model's."""
    model, ids = _model(), random_ids(2, TOKENS, seed=3)
    held = []
    gather = visitor.HeldHeads.gather

    def spy(self, where, head, heads, tokens, chunk, buffer):
        held.append(head)
        return gather(self, where, head, heads, tokens, chunk, buffer)

    monkeypatch.setattr(visitor.HeldHeads, "gather", spy)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with rh.watch(model, keep=("states",), reduce={"states": _per_head_norm}) as w:
            watched = model(ids, use_cache=False).logits
    assert not held, held
    assert {call.path for mixer in w.mixers for call in mixer.calls[0].kernel_calls} == {"chunk-wise reductions"}
    assert_close("logits with a reduction per head", plain, watched, rtol=1e-4, atol=1e-5)


def test_decode_steps_kept_positions_and_hooks_reduce_every_head():
    """A generate's one-token steps, a few kept positions, and a hook on every token (the earlier heads' states wait
    for the last head then): each reduction equals the norm per head of the kept states."""
    model, ids = _model(), random_ids(2, 7, seed=4)
    with torch.no_grad(), rh.watch(model, keep=("states",)) as full:
        model.generate(ids, max_new_tokens=3, do_sample=False)
    with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": _per_head_norm}) as w:
        model.generate(ids, max_new_tokens=3, do_sample=False)
    for whole, mixer in zip(full.mixers, w.mixers, strict=True):
        for index in range(len(whole.calls)):
            assert_close(
                f"{mixer}: call {index}",
                _per_head_norm(whole.calls[index].states),
                mixer.calls[index].states,
                rtol=1e-5,
                atol=1e-6,
            )
    kept = _kept(model, ids)
    with torch.no_grad(), rh.watch(model, keep={"states": [2, -1]}, reduce={"states": _per_head_norm}) as w:
        model(ids, use_cache=False)
    for states, mixer in zip(kept, w.mixers, strict=True):
        for token in (2, -1):
            assert_close(
                f"{mixer}: token {token}",
                _per_head_norm(states)[:, token],
                mixer.state_after(token),
                rtol=1e-5,
                atol=1e-6,
            )
    heads = []

    def halve_at_3(mix, call, token, state):  # on every token: the token loop; the state replaced at token 3
        heads.append(mix.head)
        return state * 0.5 if token == 3 else None

    hooked = []
    for reduce in (None, {"states": _per_head_norm}):
        with torch.no_grad(), rh.watch(model, keep=("states",), reduce=reduce) as w:
            w.mixers[0].register_state_hook(halve_at_3)
            model(ids, use_cache=False)
        hooked.append(w.mixers[0].states)
    assert sorted(set(heads)) == list(range(kept[0].shape[2]))
    assert_close("with a hook on every token", _per_head_norm(hooked[0]), hooked[1], rtol=1e-5, atol=1e-6)


def test_a_probe_sized_to_one_head_is_refused_with_the_states_it_got():
    model, ids = _model(), random_ids(1, 5)
    states = _kept(model, ids)[0]
    a, b = _factors(states[:, :, :1])
    with pytest.raises(
        rh.InvalidValue,
        match=r"expected states \[batch, chunk, 1, 32, 8\] \(heads, rows, cols of the"
        r" factors\), got \(1, 5, 2, 32, 8\)",
    ):
        with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": rh.probe(a, b)}):
            model(ids)


def test_a_harvest_of_a_probe_per_head_keeps_its_readouts(tmp_path):
    model, ids = _model(), random_ids(1, 12, seed=5)
    kept = _kept(model, ids)
    a, b = _factors(kept[0])
    harvested = rh.harvest(model, [ids], tmp_path, keep=("states",), reduce={"states": rh.probe(a, b)}, progress=False)
    with rh.watch(model) as w:
        first = w.mixers[0]
    path = next(name for name, module in model.named_modules() if module is first.module)
    layer = next(name for name, info in harvested.mixers.items() if info["path"] == path)
    got = rh.HarvestDataset(tmp_path, layer=layer, what="states").take(range(12))
    expected = _probed(kept[0], a, b)[0]
    assert got.shape == expected.shape
    assert_close("harvested probe per head", expected, got.double(), rtol=1e-5, atol=1e-6 * expected.abs().max())
