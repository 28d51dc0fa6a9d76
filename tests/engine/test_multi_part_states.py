"""A state of several named parts (`STATE_TYPE`, a NamedTuple of tensors) goes through the engine part by part.

A test kind, `SplitDeltaNet`, is gated DeltaNet whose state is handed to hooks as two parts: the first
and the last key rows of S_t (`Halves(top, bottom)`, two tensors of their own). Its qwen3_5 model must
give, through the parts, exactly what the one-tensor kind gives: kept states, writes (whole batch and per
row), hook replacements, gradients through a kept state, the checks of a bad replacement, decode steps.
"""

import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import PAD, build, random_ids
from torch import Tensor

import recurrent_hooks as rh
import recurrent_hooks.registry as registry
from recurrent_hooks.extend import GatedDeltaNet, Role

T = 9


class Halves(NamedTuple):
    top: Tensor  # batch heads key_dim/2 value_dim: the first half of S_t's key rows
    bottom: Tensor  # batch heads key_dim/2 value_dim: the other half


def _split(loop):
    @functools.wraps(loop)  # the loop's signature: the engine binds a call's arguments by it
    def split_loop(*args, on_token=None, **kwargs):
        if on_token is None:
            return loop(*args, **kwargs)

        def as_halves(t, state):
            half = state.shape[-2] // 2
            parts = on_token(t, Halves(state[..., :half, :], state[..., half:, :]))
            return torch.cat([parts.top, parts.bottom], dim=-2)

        return loop(*args, on_token=as_halves, **kwargs)

    return split_loop


class SplitDeltaNet(GatedDeltaNet):
    STATE_TYPE = Halves
    STATE = {"top": "batch heads half value_dim", "bottom": "batch heads half value_dim"}
    KERNELS = tuple(
        dataclasses.replace(kernel, loop=_split(kernel.loop), segments=None) if kernel.memory == "state" else kernel
        for kernel in GatedDeltaNet.KERNELS
    )


def halves(state: Tensor) -> Halves:
    half = state.shape[-2] // 2
    return Halves(state[..., :half, :], state[..., half:, :])


@pytest.fixture
def kind_of_qwen3_5():
    """A function that makes qwen3_5's mixers `kind` for the next watches (the registry is restored after the test)."""
    row = rh.FAMILIES["qwen3_5"]

    def route(kind):
        registry.replace(dataclasses.replace(row, mixers={row.mixer_class: kind}))

    yield route
    registry.replace(row)


def test_kept_parts_are_the_halves_of_the_one_tensor_state(kind_of_qwen3_5, monkeypatch):
    model, ids = build("qwen3_5"), random_ids(2, T)
    loop = rh.Paths(rule="loop")  # both through the token loop: the same bits
    with rh.watch(model, keep=("states",), paths=loop) as whole, torch.no_grad():
        plain = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    kind_of_qwen3_5(SplitDeltaNet)
    with rh.watch(model, keep=("states",), paths=loop) as w, torch.no_grad():
        split = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    assert_equal("generated tokens", plain, split)
    mixer, reference = w.mixers[0], whole.mixers[0]
    assert isinstance(mixer, SplitDeltaNet) and isinstance(mixer.states, Halves)
    for call in range(3):
        for got, want in zip(mixer.calls[call].states, halves(reference.calls[call].states)):
            assert_close(f"call {call} kept part", want, got, rtol=0, atol=0)
    after = mixer.state_after(4, call=0)
    assert isinstance(after, Halves)
    assert_close("state_after's part", halves(reference.state_after(4, call=0)).bottom, after.bottom, rtol=0, atol=0)


def test_writes_and_replacing_hooks_take_parts(kind_of_qwen3_5):
    model, ids = build("qwen3_5"), random_ids(2, T)
    kind_of_qwen3_5(SplitDeltaNet)
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        plain = model(ids).logits
        kept = w.mixers[0].state_after(3)
    written = Halves(kept.top * 2, kept.bottom - 1)
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        w.mixers[0].set_state_after(3, written)
        w.mixers[-1].register_state_hook(lambda m, c, t, s: Halves(s.top * 0.5, s.bottom), token=5)
        steered = model(ids).logits
    assert_close("logits up to the written token", plain[:, :4], steered[:, :4], rtol=1e-5, atol=1e-6)
    assert (steered[:, 4:] - plain[:, 4:]).abs().max() > 1e-4
    for got, want in zip(w.mixers[0].state_after(3), written):
        assert_close("the written part", want, got, rtol=0, atol=0)
    # the same write as one tensor, on the one-tensor kind, gives the same logits
    kind_of_qwen3_5(GatedDeltaNet)
    with rh.watch(model) as one, torch.no_grad():
        one.mixers[0].set_state_after(3, torch.cat(list(written), dim=-2))
        one.mixers[-1].register_state_hook(
            lambda m, c, t, s: torch.cat([s[..., :4, :] * 0.5, s[..., 4:, :]], dim=-2), token=5
        )
        same = model(ids).logits
    assert_close("logits of the one-tensor write", same, steered, rtol=1e-6, atol=1e-6)


def test_a_per_row_write_of_parts(kind_of_qwen3_5):
    kind_of_qwen3_5(SplitDeltaNet)
    model, ids = build("qwen3_5"), random_ids(2, T)
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        model(ids)
        kept = w.mixers[0].state_after(2)
    zero = Halves(torch.zeros_like(kept.top), torch.zeros_like(kept.bottom))
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        w.mixers[0].set_state_after(torch.tensor([2, 6]), zero)  # row 0 at token 2, row 1 at token 6
        model(ids)
    mixer = w.mixers[0]
    assert_equal("row 0 zeroed at token 2", torch.zeros_like(kept.top[0]), mixer.state_after(2).top[0])
    assert_close("row 1 untouched at token 2", kept.top[1], mixer.state_after(2).top[1], rtol=0, atol=0)
    assert_equal("row 1 zeroed at token 6", torch.zeros_like(kept.bottom[1]), mixer.state_after(6).bottom[1])


def test_gradients_reach_each_kept_part(kind_of_qwen3_5):
    kind_of_qwen3_5(SplitDeltaNet)
    model, ids = build("qwen3_5"), random_ids(1, T)
    with rh.watch(model, keep={"states": [4]}) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    kept = w.mixers[0].state_after(4)
    grads = torch.autograd.grad(metric, list(kept))
    leaf = Halves(*(part.detach().clone().requires_grad_() for part in kept))
    with rh.watch(model) as w:
        w.mixers[0].set_state_after(4, leaf)
        model(ids).logits[0, -1].logsumexp(-1).backward()
    for name, grad, part in zip(Halves._fields, grads, leaf):
        assert part.grad.abs().max() > 0
        assert_close(f"grad of part {name}", part.grad, grad, rtol=1e-5, atol=1e-8)
    with rh.watch(model, keep=("states",)) as w:
        metric = model(ids).logits[0, -1].logsumexp(-1)
    every = w.mixers[0].calls[0].differentiable("state")[0]
    assert isinstance(every, Halves) and every.top.shape[1] == T
    by_token = torch.autograd.grad(metric, list(every))
    assert_close("the stack's gradient at token 4", grads[0][0], by_token[0][0, 4], rtol=1e-5, atol=1e-8)


def test_a_bad_replacement_names_the_part(kind_of_qwen3_5):
    kind_of_qwen3_5(SplitDeltaNet)
    model, ids = build("qwen3_5"), random_ids(1, T)
    with pytest.raises(rh.InvalidValue, match=r"returned Tensor; expected None or a Halves"):
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].register_state_hook(lambda m, c, t, s: s.top, token=1)
            model(ids)
    with pytest.raises(
        rh.InvalidValue,
        match=r"state part 'bottom' with shape \(1, 4, 3, 8\), expected \(1, 4, 4, 8\)"
        r" \(axes: batch heads half value_dim\)",
    ):
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].register_state_hook(lambda m, c, t, s: Halves(s.top, s.bottom[..., :3, :]), token=1)
            model(ids)
    with pytest.raises(
        rh.InvalidValue,
        match=r"expected a Halves with axes \(top: batch heads half value_dim;"
        r" bottom: batch heads half value_dim\), got Tensor",
    ):
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(1, torch.zeros(1, 4, 8, 8))
    assert SplitDeltaNet.kernel_for(Role.PROMPT).segments is None


def test_attribution_and_a_sweep_sum_over_the_parts(kind_of_qwen3_5, monkeypatch):
    """A state of parts is attributed and patched part by part: the same numbers as the one-tensor state."""
    model, loop = build("qwen3_5"), rh.Paths(rule="loop")
    clean, corrupt = random_ids(2, T, seed=1), random_ids(2, T, seed=2)
    metric = lambda logits: logits[:, -1, 5] - logits[:, -1, 7]  # noqa: E731
    runs = {}
    for kind in (GatedDeltaNet, SplitDeltaNet):
        kind_of_qwen3_5(kind)
        # method="states" for both: a state of parts takes it (the chunked method, whose window term runs through
        # another graph, serves one-tensor states; tests/studies/test_attribution_at_scale.py checks it against
        # "states")
        runs[kind] = (
            rh.attribute(model, clean, corrupt, metric, paths=loop, method="states"),
            rh.patching_sweep(model, clean[0], corrupt[0], metric, positions=[2, 5], progress=False, paths=loop),
        )
    (one, one_sweep), (split, split_sweep) = runs[GatedDeltaNet], runs[SplitDeltaNet]
    assert one.state.abs().max() > 0
    assert_close("attributed state", one.state, split.state, rtol=1e-5, atol=1e-7)
    assert_close("attributed window", one.window, split.window, rtol=0, atol=0)
    assert_close("swept effects", one_sweep.values, split_sweep.values, rtol=1e-5, atol=1e-6)
