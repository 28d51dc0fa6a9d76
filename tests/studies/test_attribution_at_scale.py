"""`rh.attribute(method="pieces")`: attribution without keeping every state.

The pieces path must give today's values (method="states", the reference: every state kept) for every kind
it serves, with pieces and backward steps of several sizes, and the first-order estimate that finite
differences of a write measure.
"""

import pytest
import torch
from _compare import assert_close
from _contract import in_segments, one_family_per_kind
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.studies.attribution import pieces as attribution_pieces

CHUNKED = one_family_per_kind(in_segments)  # gated DeltaNet, KDA, Mamba-1 (2 ways), Mamba-2


def metric(logits):
    return logits[:, -1].logsumexp(-1)


@pytest.fixture(scope="module", params=CHUNKED)
def frozen(request):
    return build(request.param).requires_grad_(False)


@pytest.mark.parametrize("tokens, piece, steps_of", [(13, 64, None), (13, 4, None), (37, 20, 7)])
def test_pieces_equal_kept_states(frozen, tokens, piece, steps_of, monkeypatch):
    """One piece; many; pieces of several backward steps (`steps_of` tokens of states at once)."""
    if steps_of is not None:
        with rh.watch(frozen, keep=("states",)) as w, torch.no_grad():
            frozen(random_ids(2, 2))
        state = w.mixers[0].state_after(0)
        monkeypatch.setattr(attribution_pieces, "STEP_BYTES", steps_of * state.numel() * state.element_size())
    clean, corrupt = random_ids(2, tokens, seed=1), random_ids(2, tokens, seed=2)
    reference = rh.attribute(frozen, clean, corrupt, metric, method="states")
    result = rh.attribute(frozen, clean, corrupt, metric, method="pieces", piece=piece)
    assert result.layers == reference.layers
    scale = reference.memory.abs().max()
    assert scale > 0
    assert_close("state", result.state, reference.state, rtol=1e-4, atol=1e-5 * scale)
    assert_close("window", result.window, reference.window, rtol=1e-4, atol=1e-5 * scale)
    assert_close("clean", result.clean, reference.clean, rtol=1e-6, atol=0)
    assert_close("corrupt", result.corrupt, reference.corrupt, rtol=1e-6, atol=0)


def test_auto_is_pieces_where_the_kind_has_them(frozen):
    clean, corrupt = random_ids(1, 9, seed=3), random_ids(1, 9, seed=4)
    auto = rh.attribute(frozen, clean, corrupt, metric, layers=[frozen_layer(frozen)])
    pieces = rh.attribute(frozen, clean, corrupt, metric, layers=[frozen_layer(frozen)], method="pieces")
    assert_close("auto", auto.state, pieces.state, rtol=0, atol=0)


def frozen_layer(model):
    with rh.watch(model) as w:
        return w.mixers[-1].layer


def test_the_pieces_state_term_is_the_derivative_of_a_partial_write():
    """d metric / d h of the corrupt run with the state after t set to S'_t + h (S_t - S'_t), by central
    differences (the rest of the model in float64; gated DeltaNet's state is float32 by design, so h is not
    tiny: the error of central differences is O(h^2)): the state term at (layer, t)."""
    model = build("qwen3_5").double().requires_grad_(False)
    tokens = 11
    clean, corrupt = random_ids(2, tokens, seed=5), random_ids(2, tokens, seed=6)
    result = rh.attribute(model, clean, corrupt, metric, method="pieces", piece=4)
    with torch.no_grad(), rh.watch(model, keep=("states",)) as c:
        model(clean)
    with torch.no_grad(), rh.watch(model, keep=("states",)) as r:
        model(corrupt)
    h = 0.1
    for i, layer in enumerate(result.layers):
        for t in (0, 4, tokens - 2):
            delta = c.mixer(layer).state_after(t) - r.mixer(layer).state_after(t)
            values = []
            for sign in (1, -1):
                with torch.no_grad(), rh.watch(model) as w:
                    w.mixer(layer).set_state_after(t, r.mixer(layer).state_after(t) + sign * h * delta)
                    values.append(metric(model(corrupt).logits).mean())
            estimate = (values[0] - values[1]) / (2 * h)
            # (both rows patched, their mean metric: the mean of the pairs' own terms)
            assert_close(
                f"layer {layer} token {t}",
                result.state[:, i, t].mean(0).double(),
                estimate,
                rtol=2e-3,
                atol=1e-3 * result.state.abs().max().double(),
            )
    assert result.state.abs().max() > 0


def test_pieces_refuses_kinds_without_pieces_and_auto_falls_back():
    model = build("recurrent_gemma").requires_grad_(False)  # RG-LRU: no prompt kernel in pieces
    ids, other = random_ids(1, 7, seed=1), random_ids(1, 7, seed=2)
    with pytest.raises(
        rh.InvalidValue,
        match=r"attribute: method='pieces' needs one mixer a layer and a prompt"
        r" kernel .* RealGatedLinearRecurrence has none: use method='states'",
    ):
        rh.attribute(model, ids, other, metric, method="pieces")
    auto = rh.attribute(model, ids, other, metric)
    states = rh.attribute(model, ids, other, metric, method="states")
    assert_close("auto", auto.memory, states.memory, rtol=0, atol=0)


def test_pieces_refuses_bad_arguments_and_a_second_handle():
    model = build("qwen3_5").requires_grad_(False)
    ids, other = random_ids(1, 7, seed=1), random_ids(1, 7, seed=2)
    with pytest.raises(rh.InvalidValue, match=r"attribute: expected method in \('auto', 'pieces', 'states'\), got 'x'"):
        rh.attribute(model, ids, other, metric, method="x")
    with pytest.raises(rh.InvalidValue, match=r"attribute: expected piece as a positive int .* got 0"):
        rh.attribute(model, ids, other, metric, piece=0)
    # an outer watch that keeps the states makes the calls busy: the pieces path cannot serve them
    with rh.watch(model, keep=("states",)):
        with pytest.raises(rh.InvalidValue, match=r"ran 0 time\(s\) through the pieces path .* use method='states'"):
            rh.attribute(model, ids, other, metric, method="pieces")
