"""What is particular to the Mamba kinds at model level: the continuation limit, fused kernels, training
mode, per-head kernel calls (zamba) and the per-token values."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh

MAMBA1 = [name for name, row in rh.FAMILIES.items() if issubclass(row.kind, rh.SelectiveScan)]
MAMBA2 = [name for name, row in rh.FAMILIES.items() if issubclass(row.kind, rh.Mamba2StateSpace)]
T = 11


@pytest.mark.parametrize("family", MAMBA1)
def test_mamba1_multi_token_continuation_runs_watched_and_warns(family):
    """transformers' scan restarts from zero over a cache: the library runs it so and says so (the states of
    such a call are checked in tests/engine/test_cache_restart.py)."""
    model, ids = build(family), random_ids(2, T)
    with torch.no_grad():
        plain = model(ids[:, 6:], cache=model(ids[:, :6], use_cache=True).cache).logits
        with rh.watch(model) as w:  # idle: the model's own behaviour
            watched = model(ids[:, 6:], cache=model(ids[:, :6], use_cache=True).cache).logits
        assert_close("idle continuation", plain, watched, rtol=0, atol=0)
        assert (
            w.mixers[0].calls[1].kernel == rh.SelectiveScan.kernel_for("prompt").name
            and w.mixers[0].calls[1].tokens == T - 6
        )
        cache = model(ids[:, :6], use_cache=True).cache
        with pytest.warns(
            rh.RecurrentHooksWarning,
            match=r"call 0 \(mamba_selective_scan\): multi-token continuation:"
            r" the model restarted its SSM state from zero",
        ):
            with rh.watch(model, keep=("states", "inputs", "outputs")) as w:
                kept = model(ids[:, 6:], cache=cache).logits
        assert_close("kept continuation", plain, kept, rtol=1e-6, atol=1e-6)
    assert "multi-token continuation" in rh.support(model)[0].unavailable


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_fused_training_kernels_are_skipped_only_when_a_call_is_watched(family, monkeypatch):
    """With mamba_ssm the fused kernel would return the output and skip the hookable path: not inside a watch."""
    model, ids = build(family), random_ids(2, T)
    row = rh.FAMILIES[family]
    (fused_name,) = row.kind.FUSED
    module = row.module()
    sentinel = []

    def fused(*args, **kwargs):
        sentinel.append(1)
        return torch.zeros(2, T, model.config.hidden_size)

    monkeypatch.setattr(module, fused_name, fused)
    model.train()
    with rh.watch(model) as w:
        model(ids, use_cache=False)
    assert len(sentinel) == len(w.mixers) and all(c.kernel is None for m in w.mixers for c in m.calls)
    with rh.watch(model, keep=("states", "inputs", "outputs")) as w:
        model(ids, use_cache=False)
    assert len(sentinel) == len(w.mixers), "the fused kernel ran although states were kept"
    assert w.mixers[0].states.shape[:2] == (2, T)


@pytest.mark.parametrize("family", ["mamba", "zamba", "mamba2"])
def test_training_mode_keeps_hooks_and_gradients(family):
    model, ids = build(family), random_ids(1, T)
    model.train()
    hits = []
    with rh.watch(model, keep=("states", "inputs", "outputs")) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: hits.append(t) if m.head in (None, 0) else None)
        loss = model(ids, use_cache=False).logits[0, -1].logsumexp(-1)
    loss.backward()
    assert hits == list(range(T))
    assert all(p.grad is not None for p in w.mixers[0].module.parameters() if p.requires_grad)


def test_zamba_runs_one_kernel_call_per_head():
    model, ids = build("zamba"), random_ids(2, T)
    heads = model.config.n_mamba_heads
    seen = []
    with rh.watch(model, keep=("states", "inputs", "outputs")) as w:
        mixer = w.mixers[0]
        mixer.register_state_hook(lambda m, c, t, s: seen.append((c, t, m.head, tuple(s.shape))), token=[0, -1])
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    head_dim, d_state = mixer.calls[0].kernel_calls[0].inputs["A"].shape
    assert seen[: 2 * heads] == [(0, t, h, (2, head_dim, d_state)) for h in range(heads) for t in (0, T - 1)]
    assert [len(c.kernel_calls) for c in mixer.calls] == [heads] * 3
    assert mixer.calls[0].states.shape == (2, T, heads, head_dim, d_state)
    with pytest.raises(rh.Unavailable, match="made 2 recurrence kernel calls .* read call.kernel_calls"):
        mixer.calls[0].inputs
    values = mixer.values(0)
    assert values["x"].shape == (2, T, heads, head_dim) and values["B"].shape == (2, T, heads, d_state)


@pytest.mark.parametrize("family", MAMBA1 + MAMBA2)
def test_values_rebuild_the_states(family):
    """values() are the per-token discretized quantities: the recurrence rebuilt from them gives the states."""
    model, ids = build(family), random_ids(2, T)
    with rh.watch(model, keep=("states", "inputs", "outputs")) as w, torch.no_grad():
        model(ids)
    mixer = w.mixers[0]
    values, states = mixer.values(), mixer.states
    parts = mixer.calls[0].kernel_calls
    previous = torch.zeros_like(states[:, 0])
    for t in range(T):
        if isinstance(mixer, rh.Mamba2StateSpace):
            heads = values["x"].shape[2]
            B = values["B"].float().repeat_interleave(heads // values["B"].shape[2], dim=2)[:, t]  # b h n
            drive = values["dt"][:, t, :, None, None] * values["x"][:, t, :, :, None].float() * B[:, :, None, :]
            expected = values["decay"][:, t, :, None, None] * previous + drive
        else:
            A = torch.stack([p.inputs["A"] for p in parts]) if len(parts) > 1 else parts[0].inputs["A"]
            dt, x, B = values["dt"][:, t], values["x"][:, t].float(), values["B"][:, t].float()
            expected = torch.exp(dt[..., None] * A) * previous + (dt * x)[..., None] * B[..., None, :]
        assert_close(f"{mixer} state {t} from values()", expected, states[:, t], rtol=1e-4, atol=1e-6)
        previous = states[:, t]
