"""The statistics a harvest forms as it writes (`data.stats`: count, per-feature mean and variance, mean squared
norm, float64) equal a float64 pass over every harvested value, for memories, memories of several parts, values,
reductions and a stored dtype; a resumed harvest's equal an uninterrupted one's, byte for byte; a harvest that
predates them (or token ids) says so."""

import json

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import build, random_ids

import recurrent_hooks as rh


def _batches():
    ids = random_ids(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # (right padding: the pads are not harvested)
    return [{"input_ids": ids, "attention_mask": mask}, random_ids(3, 5, seed=1), random_ids(1, 7, seed=2)]


def _check(stats, values):
    """`stats` against a float64 pass over `values` `[tokens, ...]`."""
    x = values.reshape(len(values), -1).to(torch.float64)
    assert_equal("count", torch.tensor(float(len(x)), dtype=torch.float64), stats.count)
    assert_close("mean", x.mean(0), stats.mean, rtol=1e-12, atol=1e-15)
    assert_close("var", x.var(0, unbiased=False), stats.var, rtol=1e-12, atol=1e-15)
    assert_close("mean squared norm", x.square().sum(1).mean(), stats.mean_squared_norm, rtol=1e-12, atol=0)
    assert stats.mean.dtype == stats.var.dtype == torch.float64


@pytest.mark.parametrize(
    "family, keep, reduce, dtype",
    [
        ("mamba2", ("states", "windows"), None, None),
        ("qwen3_5", ("states", "key"), {"states": lambda s: s.flatten(2).norm(dim=-1)}, None),
        ("qwen3_5", ("states",), None, torch.bfloat16),
        ("xlstm", ("states",), None, None),  # the mLSTM's states: C, n, m
    ],
)
def test_the_stats_equal_a_float64_pass_over_every_value(family, keep, reduce, dtype, tmp_path):
    model = build(family)
    rh.harvest(model, _batches(), tmp_path, keep=keep, reduce=reduce, dtype=dtype, progress=False)
    for name in rh.Harvest.open(tmp_path).values:
        mixer, what = name.split("/")
        data = rh.HarvestDataset(tmp_path, layer=mixer, what=what.split(".")[0])
        values, stats = data.take(range(len(data))), data.stats
        if isinstance(values, dict):
            assert set(stats) == set(values)
            for part in values:
                _check(stats[part], values[part])
        else:
            _check(stats, values)


def test_a_resumed_harvests_stats_are_an_uninterrupted_ones(tmp_path):
    model = build("mamba2")
    rh.harvest(model, _batches(), tmp_path / "whole", progress=False)
    rh.harvest(model, _batches(), tmp_path / "resumed", progress=False)
    for name in ("manifest.json", "stats.safetensors", "shards/000001.json", "shards/000001.safetensors"):
        (tmp_path / "resumed" / name).unlink()
    resumed = rh.harvest(model, _batches(), tmp_path / "resumed", progress=False)
    assert resumed.skipped == 2
    for name in ("stats.safetensors", "manifest.json"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    data = rh.HarvestDataset(tmp_path / "resumed", layer=0)
    _check(data.stats, data.take(range(len(data))))
    rh.Harvest.open(tmp_path / "resumed").verify()
    (tmp_path / "resumed" / "stats.safetensors").write_bytes(b"0" * 16)
    with pytest.raises(rh.InvalidValue, match=r"the statistics .*stats.safetensors has 16 bytes"):
        rh.Harvest.open(tmp_path / "resumed").verify()


def test_a_harvest_before_stats_and_token_ids_says_so(tmp_path):
    rh.harvest(build("mamba2"), _batches(), tmp_path, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["stats"], manifest["columns"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    data = rh.HarvestDataset(tmp_path, layer=0)
    with pytest.raises(rh.Unavailable, match=r"no statistics: the harvest predates them"):
        data.stats
    with pytest.raises(rh.Unavailable, match=r"stores no token ids: the harvest predates them"):
        data.tokens
    assert set(data[0]) == {"doc", "position", "value"}
