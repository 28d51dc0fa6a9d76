"""Many prompt pairs at once (issue 20): `attribute` over `[N, seq]` equals N single-pair calls stacked, per kind."""

import pytest
import torch

import recurrent_hooks as rh
from _compare import assert_close
from _models import build, random_ids

FAMILIES = ["qwen3_5", "kimi_linear", "mamba", "zamba", "mamba2", "recurrent_gemma"]  # chunks x 5 kinds, "states"
PAIRS, TOKENS = 3, 11


@pytest.mark.parametrize("family", FAMILIES)
def test_attribute_over_pairs_equals_one_call_per_pair(family):
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(PAIRS, TOKENS, seed=1), random_ids(PAIRS, TOKENS, seed=2)
    answers = torch.tensor([3, 5, 7])
    many = rh.attribute(model, clean, corrupt, rh.metrics.logit_difference(answers, wrong=4))
    assert many.state.shape[0] == many.window.shape[0] == many.clean.shape[0] == PAIRS
    for n in range(PAIRS):
        one = rh.attribute(model, clean[n], corrupt[n], rh.metrics.logit_difference(int(answers[n]), wrong=4))
        assert one.state.dim() == 2 and one.clean.dim() == 0  # one pair as [seq]: no pairs axis
        scale = one.memory.abs().max()
        for name in ("state", "window"):
            assert_close(f"pair {n} {name}", getattr(many, name)[n], getattr(one, name), rtol=1e-4,
                         atol=1e-6 * scale)
        assert_close(f"pair {n} baselines", torch.stack([many.clean[n], many.corrupt[n]]),
                     torch.stack([one.clean, one.corrupt]), rtol=1e-6, atol=1e-7)
    assert_close("normalized", many.normalized()[1], many.memory[1] / (many.clean[1] - many.corrupt[1]), rtol=0, atol=0)


def test_one_pair_as_a_batch_keeps_the_pairs_axis():
    model = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(1, TOKENS, seed=1), random_ids(1, TOKENS, seed=2)
    metric = rh.metrics.log_prob(3)
    batch, single = rh.attribute(model, clean, corrupt, metric), rh.attribute(model, clean[0], corrupt[0], metric)
    assert batch.state.shape == (1, *single.state.shape) and batch.clean.shape == (1,)
    assert_close("the same numbers", batch.memory[0], single.memory, rtol=0, atol=0)
    # a metric of one value for all rows is a metric of one row, called once per pair
    clean, corrupt = random_ids(3, TOKENS, seed=3), random_ids(3, TOKENS, seed=4)
    summed = rh.attribute(model, clean, corrupt, lambda logits: logits[:, -1, 3].sum())
    rows = rh.attribute(model, clean, corrupt, lambda logits: logits[:, -1, 3])
    assert_close("a 0-d metric, per pair", rows.memory, summed.memory, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_5", "mamba", "mamba2"])
def test_patching_sweep_over_pairs_equals_one_sweep_per_pair(family):
    model = build(family).requires_grad_(False)
    clean, corrupt = random_ids(2, 8, seed=3), random_ids(2, 8, seed=4)
    answers = torch.tensor([3, 6])
    many = rh.patching_sweep(model, clean, corrupt, rh.metrics.logit_difference(answers, wrong=4), positions=[1, 5],
                             progress=False)
    assert many.values.shape[0] == many.clean.shape[0] == 2
    for n in range(2):
        one = rh.patching_sweep(model, clean[n], corrupt[n], rh.metrics.logit_difference(int(answers[n]), wrong=4),
                                positions=[1, 5], progress=False)
        assert one.values.dim() == 2 and one.clean.dim() == 0
        # the pairs share batches (rows of both pairs, both clean prompts in one forward): CPU products round by
        # batch size, so within float32 rounding
        assert_close(f"pair {n}", many.values[n], one.values, rtol=1e-5, atol=1e-6)
        assert_close(f"pair {n} baselines", torch.stack([many.clean[n], many.corrupt[n]]),
                     torch.stack([one.clean, one.corrupt]), rtol=1e-5, atol=1e-6)
    assert_close("normalized per pair", many.normalized()[1],
                 (many.values[1] - many.corrupt[1]) / (many.clean[1] - many.corrupt[1]), rtol=0, atol=0)
