"""`rh.metrics`: the metrics the studies take, one value per row, checked by hand-written formulas."""

import pytest
import torch
from _compare import assert_close

import recurrent_hooks as rh


def _logits(batch=3, seq=5, vocab=11, seed=0):
    return torch.randn(batch, seq, vocab, generator=torch.Generator().manual_seed(seed))


def test_logit_difference_every_row_and_per_row():
    logits = _logits()
    got = rh.metrics.logit_difference(answer=4, wrong=7)(logits)
    assert_close("logit difference", got, logits[:, -1, 4] - logits[:, -1, 7], rtol=0, atol=0)
    answer, wrong, position = torch.tensor([1, 2, 3]), [5, 6, 0], torch.tensor([0, 2, -1])
    got = rh.metrics.logit_difference(answer, wrong, position)(logits)
    expected = torch.stack(
        [logits[i, int(position[i]), int(answer[i])] - logits[i, int(position[i]), wrong[i]] for i in range(3)]
    )
    assert_close("per-row logit difference", got, expected, rtol=0, atol=0)


def test_log_prob_is_the_log_softmax_at_the_answer():
    logits = _logits(seed=1)
    got = rh.metrics.log_prob(answer=[2, 9, 4], position=1)(logits)
    expected = torch.stack([logits[i, 1].log_softmax(-1)[a] for i, a in enumerate([2, 9, 4])])
    assert_close("log prob", got, expected, rtol=1e-6, atol=1e-7)


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(rh.InvalidValue, match="answer as an int or a \\[batch\\] tensor of ints, got 0.5"):
        rh.metrics.log_prob(0.5)
    metric = rh.metrics.logit_difference(answer=[1, 2], wrong=3)
    with pytest.raises(rh.InvalidValue, match="answer has 2 entries .* the logits have 3 rows"):
        metric(_logits())
    with pytest.raises(rh.InvalidValue, match="answer outside the vocabulary of 11 tokens"):
        rh.metrics.log_prob(11)(_logits())
    with pytest.raises(rh.InvalidValue, match="a position outside the 5 positions"):
        rh.metrics.log_prob(1, position=5)(_logits())
    with pytest.raises(rh.InvalidValue, match=r"expected logits \[batch, seq, vocab\], got shape \(3, 11\)"):
        rh.metrics.log_prob(1)(_logits()[:, -1])
    assert repr(metric) == "rh.metrics.logit_difference(answer=[1, 2], wrong=3, position=-1)"


def test_a_metric_drives_the_studies():
    from _models import build, random_ids

    model = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(1, 6, seed=1), random_ids(1, 6, seed=2)
    metric = rh.metrics.logit_difference(answer=3, wrong=4)
    sweep = rh.patching_sweep(model, clean[0], corrupt[0], metric, progress=False)
    with torch.no_grad():
        logits = model(corrupt).logits
    assert_close("corrupt baseline", sweep.corrupt, logits[0, -1, 3] - logits[0, -1, 4], rtol=1e-6, atol=1e-6)
    result = rh.attribute(model, clean, corrupt, rh.metrics.log_prob(3))
    assert result.state.shape[-1] == 6
