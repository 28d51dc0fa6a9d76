"""`rh.Sweep` and `rh.Attribution` share one convention: 0-d tensor baselines, `normalized()`, and `to_dict()` /
`from_dict()` through `torch.save` and `torch.load(weights_only=True)`."""

import dataclasses

import torch
from _compare import assert_close, assert_equal
from _models import build, random_ids

import recurrent_hooks as rh


def _same(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert_equal(field.name, y, x)
        else:
            assert x == y, (field.name, x, y)


def test_results_save_and_load_with_weights_only(tmp_path):
    model = build("qwen3_5").requires_grad_(False)
    clean, corrupt = random_ids(1, 7, seed=1)[0], random_ids(1, 7, seed=2)[0]  # one pair: 0-d baselines
    metric = rh.metrics.log_prob(answer=5)
    sweep = rh.patching_sweep(model, clean, corrupt, metric, progress=False)
    result = rh.attribute(model, clean, corrupt, metric)
    for value, kind in ((sweep, rh.Sweep), (result, rh.Attribution)):
        assert value.clean.dim() == 0 and value.corrupt.dim() == 0
        path = tmp_path / f"{kind.__name__}.pt"
        torch.save(value.to_dict(), path)
        _same(value, kind.from_dict(torch.load(path, weights_only=True)))
    assert_close(
        "attribution normalized", result.normalized(), result.memory / (result.clean - result.corrupt), rtol=0, atol=0
    )
    assert_close(
        "sweep normalized",
        sweep.normalized(),
        (sweep.values - sweep.corrupt) / (sweep.clean - sweep.corrupt),
        rtol=0,
        atol=0,
    )
