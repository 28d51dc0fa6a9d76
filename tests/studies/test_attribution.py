"""Gradients with respect to every kept state and window at once, and attribution patching (`rh.attribute`)."""

import pytest
import torch
from _compare import assert_close
from _contract import in_segments, one_family_per_kind
from _models import build, random_ids

import recurrent_hooks as rh

T = 13
ONE_PER_KIND = one_family_per_kind(in_segments)  # the kinds with chunk-wise maths


def metric(logits):
    return logits[:, -1].logsumexp(-1)


@pytest.fixture(params=ONE_PER_KIND)
def frozen(request):
    model = build(request.param)
    model.requires_grad_(False)  # the usual setup: no weight requires grad
    return model


def test_every_kept_state_and_window_is_differentiable_as_one_tensor_with_frozen_weights(frozen):
    """autograd.grad(metric, mix.states) in one backward, equal to the gradient through a leaf written at t."""
    ids = random_ids(2, T)
    with rh.watch(frozen, keep=("states", "windows")) as w:
        value = metric(frozen(ids).logits).sum()
    mixer = w.mixers[0]
    per_head = type(mixer).KERNEL_PER_HEAD
    states = mixer.calls[0].differentiable("state")
    windows = mixer.calls[0].differentiable("window")
    assert all(s.requires_grad for s in states + windows)
    grads = torch.autograd.grad(value, [*states, *windows], retain_graph=True)
    state_grad = torch.stack(grads[: len(states)], dim=2) if per_head else grads[0]
    window_grad = grads[-1]
    if not per_head:  # mix.states is the same tensor, and so is every token's state_after
        assert mixer.states is states[0]
        token_grads = torch.autograd.grad(value, [mixer.state_after(t) for t in (2, 7)], retain_graph=True)
        for t, grad in zip((2, 7), token_grads):
            assert_close(f"token {t}", grad, state_grad[:, t], rtol=1e-6, atol=0)
    for t in (2, 7):
        leaf_state = mixer.state_after(t).detach().clone().requires_grad_()
        leaf_window = mixer.window_after(t).detach().clone().requires_grad_()
        with rh.watch(frozen) as again:
            again.mixers[0].set_memory_after(t, rh.Memory(leaf_state, leaf_window))
            metric(frozen(ids).logits).sum().backward()
        assert leaf_state.grad.abs().max() > 0
        assert_close(f"state grad at {t}", leaf_state.grad, state_grad[:, t], rtol=1e-4, atol=1e-7)
        assert_close(f"window grad at {t}", leaf_window.grad, window_grad[:, t], rtol=1e-4, atol=1e-7)


def test_attribute_is_the_first_order_estimate_of_patching_each_memory(frozen):
    clean, corrupt = random_ids(2, T, seed=1), random_ids(2, T, seed=2)
    result = rh.attribute(frozen, clean, corrupt, metric)
    with rh.watch(frozen, keep=("states", "windows")) as c, torch.no_grad():
        frozen(clean)
    assert result.state.shape == result.window.shape == (2, len(c.mixers), T)  # pairs x layers x tokens
    assert result.layers == tuple(m.layer for m in c.mixers)
    assert_close("memory", result.state + result.window, result.memory, rtol=0, atol=0)
    for i, layer in enumerate(result.layers):
        for t in (0, 5, T - 2):
            clean_memory = c.mixer(layer).memory_after(t)
            with rh.watch(frozen, keep=("states", "windows")) as r, torch.no_grad():
                frozen(corrupt)
            corrupt_memory = r.mixer(layer).memory_after(t)
            leaf_state = corrupt_memory.state.clone().requires_grad_()
            leaf_window = corrupt_memory.window.clone().requires_grad_()
            with rh.watch(frozen) as w:
                w.mixer(layer).set_memory_after(t, rh.Memory(leaf_state, leaf_window))
                metric(frozen(corrupt).logits).mean().backward()
            state_term = ((clean_memory.state - corrupt_memory.state) * leaf_state.grad).sum()
            window_term = ((clean_memory.window - corrupt_memory.window) * leaf_window.grad).sum()
            scale = result.memory.abs().max()
            # (the mean metric of both rows: the mean of the pairs' own terms)
            assert_close(
                f"layer {layer} token {t} state",
                state_term,
                result.state[:, i, t].mean(0),
                rtol=1e-4,
                atol=1e-6 * scale,
            )
            assert_close(
                f"layer {layer} token {t} window",
                window_term,
                result.window[:, i, t].mean(0),
                rtol=1e-4,
                atol=1e-6 * scale,
            )
    assert result.memory.abs().max() > 0


def test_attribute_refuses_bad_arguments():
    model = build("qwen3_5")
    ids = random_ids(2, T)
    with pytest.raises(rh.InvalidValue, match=r"attribute: clean_ids \(2, 13\) and corrupt_ids \(2, 12\) must have"):
        rh.attribute(model, ids, ids[:, 1:], metric)
    with pytest.raises(
        rh.InvalidValue,
        match=r"attribute: expected metric\(logits\) to return one value per row, a"
        r" tensor of shape \(2,\) \(or a 0-d tensor, the value of one row\) for logits of shape"
        r" \(2, 13, 128\), got a tensor of shape \(2, 13, 128\)",
    ):
        rh.attribute(model, ids, ids, lambda logits: logits)
    with pytest.raises(rh.InvalidValue, match=r"attribute: no recurrent mixer at layers \[1\]"):
        rh.attribute(model, ids, ids, metric, layers=[1])


def test_a_layer_of_several_mixers_is_attributed_as_all_its_memories_at_once():
    """inkling2's full-attention layers hold several convolution windows (mixers): each layer's row is the first-
    order estimate of patching every memory of the layer together, each mixer paired with itself in the clean run
    (the layer's first mixer was paired with all of them: a size mismatch, or another mixer's values)."""
    model = build("inkling2").requires_grad_(False)
    clean, corrupt = random_ids(1, T, seed=1), random_ids(1, T, seed=2)
    result = rh.attribute(model, clean, corrupt, metric)
    with rh.watch(model, keep=("windows",)) as c, torch.no_grad():
        model(clean)
    with rh.watch(model, keep=("windows",)) as r, torch.no_grad():
        model(corrupt)
    several = [layer for layer in result.layers if sum(m.layer == layer for m in c.mixers) > 1]
    assert several and result.layers == tuple(dict.fromkeys(m.layer for m in c.mixers))
    t = 5
    for i, layer in enumerate(result.layers):
        places = [k for k, m in enumerate(c.mixers) if m.layer == layer]
        leaves = [r.mixers[k].memory_after(t).window.clone().requires_grad_() for k in places]
        with rh.watch(model) as w:
            for k, leaf in zip(places, leaves):
                w.mixers[k].set_memory_after(t, rh.Memory(None, leaf))
            metric(model(corrupt).logits).sum().backward()
        term = sum(
            ((c.mixers[k].memory_after(t).window - leaf.detach()) * leaf.grad).sum() for k, leaf in zip(places, leaves)
        )
        assert_close(
            f"layer {layer} ({len(places)} mixers) token {t}",
            term,
            result.memory[0, i, t],
            rtol=1e-4,
            atol=1e-6 * result.memory.abs().max(),
        )
