"""`rh.attribute(..., steps=k)`: integrated gradients on the line from the corrupt to the clean input embeddings.

Each term is (clean - corrupt memory) . the mean of the gradients of k runs of the embeddings
E(corrupt) + alpha (E(clean) - E(corrupt)), alpha = 0, 1/k, ..., (k-1)/k. The reference here makes those k runs
itself, each keeping every state and window differentiably, and takes the deltas from two runs kept without grad.
"""

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import build, random_ids
from torch import nn

import recurrent_hooks as rh

T = 13
KINDS = ["qwen3_5", "mamba2", "mamba"]  # gated DeltaNet, Mamba-2 (both with adjoints), Mamba-1 (the token loop)
ANSWERS = torch.tensor([3, 5])  # one answer per pair: each pair has its own metric


def metric(logits):
    return rh.metrics.logit_difference(ANSWERS, wrong=4)(logits)


def integrated_reference(model, clean, corrupt, metric, steps):
    """`[pairs, layers, seq]` state and window terms from `steps` explicit forwards of interpolated embeddings."""
    embedding = model.get_input_embeddings()
    with torch.no_grad():
        start, end = embedding(corrupt), embedding(clean)
    with rh.watch(model, keep=("states", "windows")) as c, torch.no_grad():
        model(clean)
    with rh.watch(model, keep=("states", "windows")) as r, torch.no_grad():
        model(corrupt)
    sums = None
    for step in range(steps):
        with rh.watch(model, keep=("states", "windows")) as w:
            value = metric(model(inputs_embeds=start + (step / steps) * (end - start)).logits).sum()
        leaves = [m.calls[0].differentiable(memory)[0] for m in w.mixers for memory in ("state", "window")]
        grads = torch.autograd.grad(value, leaves)
        sums = grads if sums is None else [total + grad for total, grad in zip(sums, grads)]
    state_rows, window_rows = [], []
    for i, (clean_mixer, corrupt_mixer) in enumerate(zip(c.mixers, r.mixers)):
        state_grad, window_grad = sums[2 * i] / steps, sums[2 * i + 1] / steps
        state_rows.append(((clean_mixer.states - corrupt_mixer.states) * state_grad).flatten(2).sum(-1))
        window_rows.append(((clean_mixer.windows - corrupt_mixer.windows) * window_grad).flatten(2).sum(-1))
    return torch.stack(state_rows, dim=1), torch.stack(window_rows, dim=1)


@pytest.fixture(scope="module", params=KINDS)
def frozen(request):
    return build(request.param).requires_grad_(False)


@pytest.mark.parametrize("method", ["pieces", "states"])
def test_steps_average_the_gradients_on_the_line_between_the_embeddings(frozen, method):
    clean, corrupt = random_ids(2, T, seed=1), random_ids(2, T, seed=2)
    result = rh.attribute(frozen, clean, corrupt, metric, method=method, piece=4, steps=3)
    state, window = integrated_reference(frozen, clean, corrupt, metric, 3)
    scale = (state + window).abs().max()
    for n in range(2):  # per pair
        assert_close(f"pair {n} state", state[n], result.state[n], rtol=1e-4, atol=1e-6 * scale)
        assert_close(f"pair {n} window", window[n], result.window[n], rtol=1e-4, atol=1e-6 * scale)
    with torch.no_grad():  # the baselines stay the clean and the corrupt runs'
        baselines = torch.stack([metric(frozen(clean).logits), metric(frozen(corrupt).logits)])
    assert_close("baselines", baselines, torch.stack([result.clean, result.corrupt]), rtol=1e-5, atol=1e-6)
    first = rh.attribute(frozen, clean, corrupt, metric, method=method, piece=4)
    assert (result.memory - first.memory).abs().max() > 1e-3 * scale  # the average is not the first-order term


@pytest.mark.parametrize("method", ["pieces", "states"])
def test_one_step_is_first_order_attribution_patching(frozen, method):
    clean, corrupt = random_ids(2, T, seed=3), random_ids(2, T, seed=4)
    default = rh.attribute(frozen, clean, corrupt, metric, method=method, piece=4)
    one = rh.attribute(frozen, clean, corrupt, metric, method=method, piece=4, steps=1)
    for name in ("state", "window", "clean", "corrupt"):
        assert_equal(name, getattr(default, name), getattr(one, name))
    state, window = integrated_reference(frozen, clean, corrupt, metric, 1)
    scale = one.memory.abs().max()
    assert_close("state", state, one.state, rtol=1e-4, atol=1e-6 * scale)
    assert_close("window", window, one.window, rtol=1e-4, atol=1e-6 * scale)


def test_one_pair_with_steps_is_that_pair_of_a_batch():
    model = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(2, T, seed=5), random_ids(2, T, seed=6)
    many = rh.attribute(model, clean, corrupt, metric, steps=4)
    one = rh.attribute(model, clean[1], corrupt[1], rh.metrics.logit_difference(int(ANSWERS[1]), wrong=4), steps=4)
    assert one.state.dim() == 2 and one.clean.dim() == 0
    assert_close("pair 1", many.memory[1], one.memory, rtol=1e-4, atol=1e-6 * one.memory.abs().max())


def test_steps_on_a_trained_toy():
    """The shipped Mamba-2 toy on MQAR pairs: the study's terms are the reference's."""
    from recurrent_hooks.toys import MQAR, load_toy

    model = load_toy("mamba2").requires_grad_(False)
    clean, corrupt = MQAR().contrast(2, seed=0)
    ids, other = clean.ids[:, :-1], corrupt.ids[:, :-1]  # the prompts without their last answer: one token differs
    toy_metric = rh.metrics.logit_difference(clean.answers[:, -1], corrupt.answers[:, -1])
    result = rh.attribute(model, ids, other, toy_metric, steps=4)
    state, window = integrated_reference(model, ids, other, toy_metric, 4)
    scale = (state + window).abs().max()
    assert_close("state", state, result.state, rtol=1e-4, atol=1e-6 * scale)
    assert_close("window", window, result.window, rtol=1e-4, atol=1e-6 * scale)


class _IdsOnly(nn.Module):
    """A model whose forward takes ids only."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, **kwargs):
        return self.inner(input_ids, **kwargs)

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()


class _ScaledEmbeddings(_IdsOnly):
    """A model whose forward of embeddings is not its forward of ids."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is not None:
            return self.inner(inputs_embeds=2 * inputs_embeds, **kwargs)
        return self.inner(input_ids, **kwargs)


def test_bad_steps_and_models_without_embeddings_are_refused():
    model = build("qwen3_5").requires_grad_(False)
    ids, other = random_ids(2, T, seed=1), random_ids(2, T, seed=2)
    for steps in (0, -2, 1.5, True, "4", None):
        with pytest.raises(
            rh.InvalidValue,
            match=r"attribute: expected steps as a positive int .*, got " + repr(steps).replace(".", r"\."),
        ):
            rh.attribute(model, ids, other, metric, steps=steps)
    with pytest.raises(
        rh.InvalidValue,
        match=r"attribute: steps=2 runs the model on input embeddings .* _IdsOnly"
        r" has a forward without an inputs_embeds argument: use steps=1",
    ):
        rh.attribute(_IdsOnly(model), ids, other, metric, steps=2)
    rh.attribute(_IdsOnly(model), ids, other, metric)  # steps=1 passes the ids, as before
    with pytest.raises(rh.InvalidValue, match=r"attribute: expected no inputs_embeds in forward_kwargs"):
        rh.attribute(model, ids, other, metric, steps=2, forward_kwargs={"inputs_embeds": None})
    with pytest.raises(
        rh.InvalidValue,
        match=r"attribute: steps=2: expected model\(inputs_embeds=E\(corrupt_ids\)\)"
        r" to be the forward of corrupt_ids",
    ):
        rh.attribute(_ScaledEmbeddings(model), ids, other, metric, steps=2)


def test_the_gradient_runs_free_their_calls():
    """Nothing of a gradient run outlives it: no `_InPieces` call's spec (its inputs, its boundary states)."""
    import gc

    from recurrent_hooks.studies.attribution import pieces as attribution_pieces

    model = build("mamba2").requires_grad_(False)
    rh.attribute(model, random_ids(2, T, seed=1), random_ids(2, T, seed=2), metric, method="pieces", piece=4, steps=3)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is attribution_pieces.Spec]
