"""`rh.harvest` and `rh.HarvestDataset`: every non-pad token's kept values on disk equal the watch's, in (doc,
position) order; a harvest stopped mid-way (an exception between batches, a full disk inside a shard's write) and
called again gives the same files as one uninterrupted; another request's directory and changed batches are
refused; bad batches get errors naming what came."""

import errno
import pathlib
import pickle

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.memory_parts import map_parts
from recurrent_hooks.studies.harvest import shards


def _batches(pad_id=0, left=True):
    """Two batches: padded rows with a mask (on the left, or on the right), then ids without padding."""
    ids = random_ids(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    pads = slice(0, 3) if left else slice(6, 9)
    mask[1, pads] = 0
    ids[1, pads] = pad_id
    return [{"input_ids": ids, "attention_mask": mask, "labels": ids}, random_ids(3, 5, seed=1)]


def _watched(model, batch, keep, reduce=None):
    """Per mixer layer and name, the watch's values of one batch at its non-pad tokens, `[tokens, ...]`."""
    ids, mask = (batch["input_ids"], batch["attention_mask"]) if isinstance(batch, dict) else (batch, None)
    memories = tuple(name for name in keep if name in ("states", "windows"))
    io = ("inputs", "outputs") if set(keep) - set(memories) else ()
    with torch.no_grad(), rh.watch(model, keep=(*memories, *io), reduce=reduce) as w:
        model(ids, **({} if mask is None else {"attention_mask": mask}))
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    out = {}
    for mixer in w.mixers:
        for name in keep:
            value = getattr(mixer, name) if name in memories else mixer.values()[name]
            out[mixer.layer, name] = map_parts(lambda v: v[real], value)
    return out


def _files(out):
    return {
        path.relative_to(out).as_posix(): path.read_bytes()
        for path in sorted(pathlib.Path(out).rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize(
    "family, keep",
    [
        ("qwen3_5", ("states", "key", "beta")),
        ("mamba2", ("states", "windows")),
        ("mamba", ("states", "dt")),
        ("xlstm", ("states",)),
    ],
)
def test_the_harvested_values_are_the_watchs_at_every_non_pad_token(family, keep, tmp_path):
    model = build(family)
    masked = "left padding" not in rh.support(model)[0].unavailable
    batches = _batches(left=masked)  # xLSTM lets pads into its state: its batches are padded on the right
    if model.config.pad_token_id is None:  # (a config without a pad id: the batch without padding is not checked)
        batches[0]["input_ids"][batches[0]["attention_mask"] == 0] = 5
    harvested = rh.harvest(model, batches, tmp_path, keep=keep, progress=False)
    assert (harvested.tokens, harvested.docs, harvested.batches) == (9 + 6 + 15, 5, 2)
    expected = [_watched(model, batch, keep) for batch in batches]
    for layer, name in expected[0]:
        data = rh.HarvestDataset(tmp_path, layer=layer, what=name)
        assert len(data) == 30 and data.docs.tolist() == [0] * 9 + [1] * 6 + [2] * 5 + [3] * 5 + [4] * 5
        assert data.positions.tolist() == [*range(9), *range(6), *range(5), *range(5), *range(5)]
        got = data.take(range(len(data)))
        want = [batch[layer, name] for batch in expected]
        if isinstance(got, dict):  # a memory of several parts (the mLSTM's C, n, m)
            for part in got:
                assert_close(
                    f"{family} layer {layer} {name}.{part}",
                    torch.cat([getattr(w, part) for w in want]),
                    got[part],
                    rtol=0,
                    atol=0,
                )
            continue
        assert_close(f"{family} layer {layer} {name}", torch.cat(want), got, rtol=0, atol=0)
        item = data[11]
        assert (item["doc"], item["position"]) == (1, 2)
        assert torch.equal(item["value"], want[0][11])


def test_reductions_probes_layers_and_dtype(tmp_path):
    model, batches = build("qwen3_5"), _batches()
    norm = lambda s: s.flatten(2).norm(dim=-1)  # noqa: E731
    probe = rh.probe(torch.randn(4, 3, 8), torch.randn(4, 3, 8))
    harvested = rh.harvest(
        model,
        batches,
        tmp_path,
        keep=("states", "key"),
        reduce={"states": {0: norm, 2: probe}},
        layers=[2],
        dtype=torch.bfloat16,
        progress=False,
    )
    assert set(harvested.values) == {"2/states", "2/key"}
    assert harvested.values["2/states"] == ("bfloat16", (4, 3))
    expected = torch.cat([_watched(model, batch, ("states",), {"states": probe})[2, "states"] for batch in batches])
    data = harvested.dataset(2)
    assert_close(
        "the probe, stored as bfloat16",
        expected.to(torch.bfloat16).float(),
        data.take(range(30)).float(),
        rtol=0,
        atol=0,
    )
    with pytest.raises(rh.Unavailable, match=r"harvested no mixer at 0; its mixers \(name: layer\): \{'2': 2\}"):
        rh.HarvestDataset(tmp_path, layer=0)
    with pytest.raises(rh.Unavailable, match=r"kept no 'windows' of mixer '2'; it kept \['key', 'states'\]"):
        rh.HarvestDataset(tmp_path, layer=2, what="windows")


def test_a_second_call_skips_what_is_on_disk_and_a_stopped_harvest_finishes_with_the_same_files(tmp_path, monkeypatch):
    model, batches = build("qwen3_5"), _batches() + [random_ids(2, 4, seed=2), random_ids(1, 6, seed=3)]
    whole = tmp_path / "whole"
    first = rh.harvest(model, batches, whole, keep=("states",), progress=False)
    again = rh.harvest(model, batches, whole, keep=("states",), progress=False)
    assert (first.skipped, again.written, again.skipped) == (0, 0, 4) and first.written > 0
    files = _files(whole)

    stopped = tmp_path / "stopped"

    def stop_after_two():  # an exception between batches (a kill, a preempted job)
        yield from batches[:2]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rh.harvest(model, stop_after_two(), stopped, keep=("states",), progress=False)
    assert not (stopped / "manifest.json").exists()
    with pytest.raises(rh.Unavailable, match="no manifest.json, so no complete harvest \\(2 batches on disk\\)"):
        rh.HarvestDataset(stopped, layer=0)

    calls = []
    real_bytes = shards._bytes_of

    def full_disk(tensor):  # the third shard's write fails half-way: a full disk
        calls.append(tensor)
        if len(calls) == 3:  # (two batches are on disk: the third tensor of batch 2's shard)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_bytes(tensor)

    monkeypatch.setattr(shards, "_bytes_of", full_disk)
    with pytest.raises(OSError, match="No space left on device") as error:
        rh.harvest(model, batches, stopped, keep=("states",), progress=False)
    assert any("writing batch 2's shard" in note and "call rh.harvest again" in note for note in error.value.__notes__)
    assert sorted(p.name for p in (stopped / "shards").iterdir()) == [
        f"00000{i}.{ext}" for i in range(2) for ext in ("json", "safetensors")
    ]
    monkeypatch.setattr(shards, "_bytes_of", real_bytes)
    resumed = rh.harvest(model, batches, stopped, keep=("states",), progress=False)
    assert resumed.skipped == 2
    assert _files(stopped) == files


def test_a_shard_whose_record_a_kill_prevented_is_adopted_not_rewritten(tmp_path):
    model, batches = build("qwen3_5"), _batches()
    rh.harvest(model, batches, tmp_path, keep=("states",), progress=False)
    files = _files(tmp_path)
    (tmp_path / "shards" / "000001.json").unlink()
    (tmp_path / "manifest.json").unlink()
    again = rh.harvest(model, batches, tmp_path, keep=("states",), progress=False)
    assert (again.written, again.skipped) == (0, 2)
    assert _files(tmp_path) == files


def test_another_request_or_other_batches_are_refused(tmp_path):
    model, batches = build("qwen3_5"), _batches()
    rh.harvest(model, batches, tmp_path, keep=("states",), progress=False)
    with pytest.raises(
        rh.InvalidValue,
        match=r"holds another harvest, whose request differs from this call's in:"
        r" keep \(",
    ):
        rh.harvest(model, batches, tmp_path, keep=("states", "key"), progress=False)
    other = build("qwen3_5", seed=1)
    with pytest.raises(
        rh.InvalidValue,
        match=r"holds another harvest, whose request differs from this call's in:"
        r" model weights_sha256 \(",
    ):
        rh.harvest(other, batches, tmp_path, keep=("states",), progress=False)
    with pytest.raises(rh.InvalidValue, match=r"batch 1 is not the batch harvested into .*000001.json"):
        rh.harvest(model, [batches[0], random_ids(3, 5, seed=9)], tmp_path, keep=("states",), progress=False)


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    model = build("qwen3_5")
    padded = random_ids(2, 6)
    padded[0, 4] = 0
    with pytest.raises(
        rh.InvalidValue,
        match=r"batch 1 holds the pad token id 0 \(config.pad_token_id\) at row 0,"
        r" position 4, and no attention_mask",
    ):
        rh.harvest(model, [random_ids(1, 4), padded], tmp_path / "a", keep=("states",), progress=False)
    with pytest.raises(
        rh.InvalidValue,
        match=r"batch 0: expected attention_mask of the ids' shape \(2, 6\),"
        r" got shape \(2, 5\)",
    ):
        rh.harvest(
            model,
            [{"input_ids": padded, "attention_mask": torch.ones(2, 5)}],
            tmp_path / "b",
            keep=("states",),
            progress=False,
        )
    with pytest.raises(rh.InvalidValue, match=r"batch 0: expected a dict with 'input_ids'"):
        rh.harvest(model, [{"ids": padded}], tmp_path / "c", keep=("states",), progress=False)
    with pytest.raises(
        rh.InvalidValue,
        match=r"keep='dt', but GatedDeltaNet\(qwen3_5, layer 0\) has no such memory or"
        r" value: it keeps \('states', 'windows'\) and the values \('query', 'key'",
    ):
        rh.harvest(model, [], tmp_path / "d", keep=("dt",), progress=False)
    with pytest.raises(rh.InvalidValue, match=r"expected dtype= a floating torch.dtype"):
        rh.harvest(model, [], tmp_path / "e", keep=("states",), dtype=torch.int8, progress=False)
    wrong = rh.probe(torch.ones(4, 2, 5), torch.ones(4, 2, 8))
    with pytest.raises(rh.InvalidValue, match=r"expected states \[batch, chunk, 4, 5, 8\]"):
        rh.harvest(model, [random_ids(1, 4)], tmp_path / "f", keep=("states",), reduce=wrong, progress=False)
    assert not list((tmp_path / "f" / "shards").iterdir())


def test_a_left_padded_row_is_refused_where_pads_enter_the_memory(tmp_path):
    """RWKV passes no mask to its mixers: a pad before a real token would be in the row's states, so harvest refuses
    the batch, naming the doc, the position and the mixer, and takes the same rows padded on the right."""
    model = build("rwkv")
    with pytest.raises(
        rh.Unavailable,
        match=r"harvest: doc 1 has a pad at position 0 before a real token, and"
        r" WeightedKeyValue\(rwkv, layer 0\) does not mask pads \(RwkvModel ignores attention_mask.*"
        r"pad its batches on the right",
    ):
        rh.harvest(model, _batches(), tmp_path / "left", keep=("states",), progress=False)
    harvested = rh.harvest(model, _batches(left=False), tmp_path / "right", keep=("states",), progress=False)
    assert (harvested.tokens, harvested.docs) == (9 + 6 + 15, 5)


def test_the_dataset_pickles_loads_in_batches_and_shuffles_by_seed(tmp_path):
    model = build("qwen3_5")
    batches = [random_ids(2, 5, seed=s) for s in range(5)]
    rh.harvest(
        model,
        batches,
        tmp_path,
        keep=("states",),
        reduce={"states": lambda s: s.flatten(2).norm(dim=-1)},
        progress=False,
    )
    data = rh.HarvestDataset(tmp_path, layer=2)
    copy = pickle.loads(pickle.dumps(data))
    assert torch.equal(copy.take([3, 40, 7]), torch.stack([data[3]["value"], data[-10]["value"], data[7]["value"]]))
    loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=data.sampler(seed=1, shards_at_once=2))
    seen = torch.cat([batch["doc"] * 100 + batch["position"] for batch in loader])
    assert sorted(seen.tolist()) == sorted((data.docs * 100 + data.positions).tolist())
    sampler = data.sampler(seed=1, shards_at_once=2)
    first = list(sampler)
    assert first == list(data.sampler(seed=1, shards_at_once=2)) and first != list(range(len(data)))
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == list(range(len(data)))
    shard_of = [i // 10 for i in first]  # (10 tokens a shard) two shards at a time: 20 items from two shards
    assert all(len(set(shard_of[i : i + 20])) == 2 for i in range(0, 40, 20))
    with pytest.raises(IndexError, match="index 50 is out of range for 50 tokens"):
        data[50]


def test_a_watch_of_some_layers_keeps_nothing_at_the_others():
    model, ids = build("qwen3_5"), random_ids(1, 6)
    with torch.no_grad(), rh.watch(model, keep=("states",), layers=[2]) as w:
        model(ids)
    assert w.mixer(2).states.shape[:2] == (1, 6)
    with pytest.raises(rh.Unavailable, match="kept no states"):
        w.mixer(0).states
    with pytest.raises(
        rh.Unavailable,
        match=r"layers=\[1\], but layers \[1\] have no recurrent mixer; recurrent"
        r" layers: \[0, 2\]",
    ):
        with rh.watch(model, keep=("states",), layers=[1]):
            pass
    with pytest.raises(rh.InvalidValue, match=r"expected layers= decoder layer indices"):
        rh.watch(model, layers="0")
