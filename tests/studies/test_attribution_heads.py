"""`attribute(..., heads=True)`: `state` and `window` per (layer, head, token), summing over heads to the per-layer
result, each head's terms equal to (clean - corrupt) . gradient over that head's slice of the state and its share
of the window channels (tests/helpers/_heads.py: a channel's term split equally among the heads it feeds), per kind."""

import pytest
import torch
from _compare import assert_close
from _heads import shares
from _models import build, random_ids

import recurrent_hooks as rh

T = 9
CASES = [
    ("qwen3_5", "auto"),
    ("qwen3_5", "states"),
    ("kimi_linear", "auto"),
    ("mamba2", "auto"),
    ("mamba2", "states"),
    ("zamba", "auto"),
    ("minimax", "auto"),
    ("xlstm", "auto"),
]


def metric(logits):
    return logits[:, -1].logsumexp(-1)


def parts(value):
    return [value] if isinstance(value, torch.Tensor) else list(value)


def reference(model, family, clean, corrupt, layer, t):
    """The per-head state and window terms at token t of `layer`, `[pairs, heads]` each, from leaves written there."""
    with rh.watch(model, keep=("states", "windows")) as c, torch.no_grad():
        model(clean)
    with rh.watch(model, keep=("states", "windows")) as r, torch.no_grad():
        model(corrupt)
    has_window = "window" in r.mixer(layer).MEMORIES
    clean_state, corrupt_state = c.mixer(layer).state_after(t), r.mixer(layer).state_after(t)
    leaves = [p.clone().requires_grad_() for p in parts(corrupt_state)]
    state_leaf = leaves[0] if isinstance(corrupt_state, torch.Tensor) else type(corrupt_state)(*leaves)
    window_leaf = r.mixer(layer).window_after(t).clone().requires_grad_() if has_window else None
    # every layer kept: every call runs the library's loops (transformers' xlstm kernel cannot be differentiated)
    with rh.watch(model, keep=("states",)) as w:
        if has_window:
            w.mixer(layer).set_memory_after(t, rh.Memory(state_leaf, window_leaf))
        else:
            w.mixer(layer).set_state_after(t, state_leaf)
        metric(model(corrupt).logits).sum().backward()
    state = sum(
        ((cp - p.detach()) * p.grad).flatten(2).sum(-1) for cp, p in zip(parts(clean_state), leaves)
    )  # pairs heads
    if not has_window:
        return state, torch.zeros_like(state)
    clean_window = c.mixer(layer).window_after(t)
    per_channel = ((clean_window - window_leaf.detach()) * window_leaf.grad).sum(-1)  # pairs channels
    split = shares(family, model, tuple(parts(clean_state)[0].shape), clean_window.shape[1])
    return state, per_channel @ split


@pytest.mark.parametrize("family, method", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_per_head_terms_sum_to_the_layer_and_equal_the_heads_own_gradients(family, method):
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(2, T, seed=1), random_ids(2, T, seed=2)
    layers = rh.attribute(model, clean, corrupt, metric, method=method)
    heads = rh.attribute(model, clean, corrupt, metric, method=method, heads=True)
    assert heads.state.shape[:2] == (2, len(layers.layers)) and heads.state.shape[3] == T and heads.state.shape[2] >= 2
    assert heads.heads == heads.state.shape[2] and layers.heads is None
    scale = layers.memory.abs().max()
    for name in ("state", "window"):
        assert_close(
            f"{family} {method}: {name} summed over heads vs per layer",
            getattr(layers, name),
            getattr(heads, name).sum(2),
            rtol=1e-4,
            atol=1e-6 * scale,
        )
    for i, layer in enumerate(heads.layers):
        for t in (0, 4, T - 2):
            state, window = reference(model, family, clean, corrupt, layer, t)
            assert_close(
                f"{family} {method}: layer {layer} token {t} state per head",
                state,
                heads.state[:, i, :, t],
                rtol=1e-4,
                atol=1e-6 * scale,
            )
            assert_close(
                f"{family} {method}: layer {layer} token {t} window per head",
                window,
                heads.window[:, i, :, t],
                rtol=1e-4,
                atol=1e-6 * scale,
            )
    assert heads.state.abs().amax(dim=(0, 1, 3)).min() > 0, f"{family}: a head with no state term at all"


def test_one_pair_per_head_and_the_errors():
    model = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(1, T, seed=1), random_ids(1, T, seed=2)
    one = rh.attribute(model, clean[0], corrupt[0], metric, heads=True)
    assert one.state.shape == (2, 4, T) and one.heads == 4
    assert_close("normalized", one.memory / (one.clean - one.corrupt), one.normalized(), rtol=0, atol=0)
    saved = rh.Attribution.from_dict(one.to_dict())
    assert saved.heads == 4 and torch.equal(saved.state, one.state)
    with pytest.raises(
        rh.InvalidValue,
        match=r"attribute: heads=True needs a state with heads in every chosen"
        r" layer; SelectiveScan\(mamba, layer 0\) has a state of axes"
        r" 'batch d_inner d_state' without heads",
    ):
        rh.attribute(build("mamba"), clean[0], corrupt[0], metric, heads=True)
    with pytest.raises(rh.InvalidValue, match=r"attribute: expected heads=True or heads=False, got heads='yes'"):
        rh.attribute(model, clean[0], corrupt[0], metric, heads="yes")
