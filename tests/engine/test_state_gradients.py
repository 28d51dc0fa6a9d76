"""Every state kept with gradients on, chunk-wise (`engine.adjoint`).

Where the kind declares an adjoint recurrence (gated DeltaNet, Kimi delta attention, Mamba-2), a call that keeps
every state with gradients on runs the all-states kernel forward and the adjoint backward, not the token loop.
Everything the token loop gives must come out the same: the gradients with respect to `.states` and
`state_after(t)`, the inputs' gradients, `loss.backward()` filling `.states.grad`, and a metric that uses a kept
state itself (whose limit on this path is a warning, never a silent number).
"""

import warnings

import pytest
import torch
from _compare import assert_close
from _models import FAMILIES as BUILDERS
from _models import build, random_ids

import recurrent_hooks as rh

# every family whose kind declares an adjoint recurrence (the chunk-wise path of every state kept with gradients)
ADJOINT_FAMILIES = [
    name
    for name, row in rh.FAMILIES.items()
    if name in BUILDERS
    and (segments := row.kind.kernel_for("prompt").segments) is not None
    and segments.adjoint is not None
]
PATHS = {"chunk-wise": rh.Paths(force="states"), "loop": rh.Paths(rule="loop")}
TOKENS = 70  # two backward pieces (engine.adjoint.PIECE = 64)


def _run(model, ids, paths, use_state=None):
    """(input embeddings leaf, watch, metric) with every state kept and gradients on."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    with rh.watch(model, keep=("states",), paths=paths) as w:
        metric = model(inputs_embeds=embeds).logits[:, -1].logsumexp(-1).sum()
        if use_state is not None:
            metric = metric + 0.1 * w.mixers[-1].state_after(use_state).pow(2).sum()
    return embeds, w, metric


def _through_each_path(model, ids):
    """`_run` through the chunk-wise path, then through the token loop: (path name, embeds, watch, metric), one run at
    a time."""
    for name, paths in PATHS.items():
        yield (name, *_run(model, ids, paths))


@pytest.fixture(scope="module", params=ADJOINT_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def frozen(family):
    return build(family).requires_grad_(False)


@pytest.mark.one_per_kind
def test_state_and_input_gradients_equal_the_token_loop(family, frozen):
    ids = random_ids(2, TOKENS, seed=1)
    got = {}
    for name, embeds, w, metric in _through_each_path(frozen, ids):
        mixers = w.mixers
        targets = [
            embeds,
            *(m.states for m in mixers),
            *(m.state_after(t) for m in mixers for t in (0, 40, TOKENS - 1)),
        ]
        got[name] = torch.autograd.grad(metric, targets, materialize_grads=True)  # (the loop: the last state unused)
        kernel = {call.path for m in mixers for call in m.calls[0].kernel_calls}
        assert ("chunk-wise states" in kernel) == (name == "chunk-wise"), kernel
        assert all(m.states.is_contiguous() for m in mixers), f"{name}: .states of 2 rows is not contiguous"
    for i, (chunk_wise, loop) in enumerate(zip(got["chunk-wise"], got["loop"])):
        assert_close(f"gradient {i}", chunk_wise, loop, rtol=1e-4, atol=1e-6 * loop.abs().max())


@pytest.mark.one_per_kind
def test_backward_fills_states_grad(family, frozen):
    ids = random_ids(1, TOKENS, seed=2)
    grads = {}
    for name, _, w, metric in _through_each_path(frozen, ids):
        metric.backward()
        grads[name] = w.mixers[0].states.grad
    assert grads["chunk-wise"] is not None
    assert_close(".states.grad", grads["chunk-wise"], grads["loop"], rtol=1e-4, atol=1e-6 * grads["loop"].abs().max())


@pytest.mark.one_per_kind
def test_a_metric_that_uses_a_kept_state_warns_and_keeps_the_inputs_gradients(family, frozen):
    ids = random_ids(2, TOKENS, seed=3)
    loop_embeds, loop_w, loop_metric = _run(frozen, ids, PATHS["loop"], use_state=30)
    loop_input, loop_states = torch.autograd.grad(loop_metric, [loop_embeds, loop_w.mixers[-1].states])
    embeds, w, metric = _run(frozen, ids, PATHS["chunk-wise"], use_state=30)
    with pytest.warns(rh.RecurrentHooksWarning, match="uses this call's kept states themselves"):
        (input_grad,) = torch.autograd.grad(metric, [embeds])
    assert_close("input gradient", input_grad, loop_input, rtol=1e-4, atol=1e-6 * loop_input.abs().max())
    embeds, w, metric = _run(frozen, ids, PATHS["chunk-wise"], use_state=30)
    with pytest.warns(rh.RecurrentHooksWarning):
        (states_grad,) = torch.autograd.grad(metric, [w.mixers[-1].states])  # asked alone: the use's effect is in
    assert_close(".states gradient", states_grad, loop_states, rtol=1e-4, atol=1e-6 * loop_states.abs().max())


def test_no_warning_without_a_use_and_default_rule_may_choose_it():
    model = build("qwen3_5").requires_grad_(False)
    ids = random_ids(1, TOKENS, seed=4)
    embeds, w, metric = _run(model, ids, rh.Paths(rule="fixed"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.autograd.grad(metric, [embeds, w.mixers[0].states])
    assert {call.path for call in w.mixers[0].calls[0].kernel_calls} == {"chunk-wise states"}
