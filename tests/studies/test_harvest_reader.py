"""`rh.HarvestDataset` read through torch's `DataLoader`: every configuration (batched or not, the default collate
or one that keeps the items, in the process or in fork and spawn workers, persistent or not) yields exactly the
dataset's items, and never hangs; what a read hands out is the reader's own (changed in place, it changes no later
read); a batch read (`__getitems__`, `data[indices]`) is the items read one by one; statistics from a seeded sample."""

import pickle

import pytest
import torch
from _models import build, random_ids
from torch.utils.data import BatchSampler, DataLoader

import recurrent_hooks as rh

# A worker that drops a batch (one it cannot send) leaves the loader waiting for it forever: the loader's `timeout`
# (seconds for each batch) turns that into an error. Spawn workers import torch and the library before their first.
TIMEOUT = {"fork": 15, "spawn": 60}


@pytest.fixture(scope="module")
def harvest(tmp_path_factory):
    """A harvest of the qwen3_5 test model's states and keys: 3 batches (shards) of 2 rows, 28 tokens."""
    out = tmp_path_factory.mktemp("harvest")
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0  # (a row padded on the right: its pads are not items)
    batches = [
        {"input_ids": random_ids(2, 5), "attention_mask": mask},
        random_ids(2, 4, seed=1),
        random_ids(2, 6, seed=2),
    ]
    rh.harvest(build("qwen3_5"), batches, out, keep=("states", "key"), progress=False)
    return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A harvest of a memory of several parts (the mLSTM's C, n, m): 2 shards."""
    out = tmp_path_factory.mktemp("parts")
    rh.harvest(build("xlstm"), [random_ids(2, 4), random_ids(1, 5, seed=1)], out, keep=("states",), progress=False)
    return out


def _rows(batch):
    """A loader's batch, whatever its collate made of it, as a list of items `(doc, position, value)`."""
    if isinstance(batch, dict) and isinstance(batch["doc"], int):  # one item (batch_size=None)
        return [(batch["doc"], batch["position"], batch["value"])]
    if isinstance(batch, dict):  # collated: tensors [n], [n, ...]
        return list(zip(batch["doc"].tolist(), batch["position"].tolist(), batch["value"].unbind(0)))
    return [row for item in batch for row in _rows(item)]  # the items as a list


def _expected(data, order):
    docs, positions, values = data.docs[order].tolist(), data.positions[order].tolist(), data.take(order)
    return list(zip(docs, positions, values.unbind(0)))


def _assert_same(got, want, case):
    assert [row[:2] for row in got] == [row[:2] for row in want], f"{case}: not the items, in the sampler's order"
    for (doc, position, value), (_, _, expected) in zip(got, want):
        assert torch.equal(value, expected), f"{case}: doc {doc} position {position} has another value"


def _keep(items):  # a collate_fn that keeps the items (module level: spawn workers unpickle it)
    return items


COLLATES = {"default": None, "keep": _keep}


def _matrix():
    cases = []
    for workers, context, persistent in [(0, None, False), (2, "fork", False), (2, "spawn", False), (2, "fork", True)]:
        for batch_size in (None, 1, 7):
            for collate in COLLATES:
                # spawn: one case by default (each worker imports torch), the others with --full
                default = context != "spawn" or (batch_size, collate) == (None, "keep")
                if persistent and (batch_size, collate) != (7, "keep"):
                    continue
                case = pytest.param(
                    batch_size,
                    collate,
                    workers,
                    context,
                    persistent,
                    id=f"batch={batch_size}-collate={collate}-workers={workers}"
                    + (f"-{context}" if context else "")
                    + ("-persistent" if persistent else ""),
                    marks=() if default else pytest.mark.full,
                )
                cases.append(case)
    return cases


@pytest.mark.parametrize("batch_size, collate, workers, context, persistent", _matrix())
def test_a_dataloader_yields_exactly_the_items(harvest, batch_size, collate, workers, context, persistent):
    data = rh.HarvestDataset(harvest, layer=0)
    sampler = data.sampler(seed=3, shards_at_once=2)
    loader = DataLoader(
        data,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=COLLATES[collate],
        num_workers=workers,
        multiprocessing_context=context,
        persistent_workers=persistent,
        timeout=TIMEOUT[context] if workers else 0,
    )
    for epoch in range(2 if persistent else 1):
        sampler.set_epoch(epoch)
        want = _expected(data, torch.tensor(list(sampler)))
        _assert_same([row for batch in loader for row in _rows(batch)], want, f"epoch {epoch}")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_of_batches_of_indices_reads_whole_batches(harvest, workers):
    """`sampler=BatchSampler(...)`, `batch_size=None`: each batch is `data[indices]`, one read of whole batches."""
    data = rh.HarvestDataset(harvest, layer=2, what="key")
    batches = BatchSampler(data.sampler(seed=1), batch_size=8, drop_last=False)
    loader = DataLoader(
        data,
        sampler=batches,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        timeout=TIMEOUT["fork"] if workers else 0,
    )
    got = list(loader)
    assert [len(batch["doc"]) for batch in got] == [8, 8, 8, 4]
    _assert_same(
        [row for batch in got for row in _rows(batch)],
        _expected(data, torch.tensor([i for batch in batches for i in batch])),
        "BatchSampler",
    )


def test_a_read_is_the_readers_own(harvest):
    """What a read hands out (an item, a batch of items, take's values, docs and positions), changed in place,
    changes no later read."""
    data = rh.HarvestDataset(harvest, layer=0)
    first, docs, positions = data.take(range(len(data))), data.docs, data.positions
    reads = {
        "an item's value": lambda: data[3]["value"],
        "take": lambda: data.take([3, 20, 3]),
        "__getitems__": lambda: data.__getitems__([3, 20])[0]["value"],
        "data[indices]": lambda: data[[3, 20]]["value"],
        "data[indices] doc": lambda: data[[3, 20]]["doc"],
        "docs": lambda: data.docs,
        "positions": lambda: data.positions,
    }
    for name, read in reads.items():
        read().fill_(-7)
        assert torch.equal(data.take(range(len(data))), first), f"{name}, changed in place, changed the values"
        assert torch.equal(data.docs, docs) and torch.equal(data.positions, positions), (
            f"{name}, changed in place, changed the docs or positions"
        )
    assert torch.equal(data[3]["value"], first[3]) and (data[20]["doc"], data[20]["position"]) == (
        int(docs[20]),
        int(positions[20]),
    )
    items = data.__getitems__([5, 6])
    items[0]["value"].mul_(0)
    assert torch.equal(items[1]["value"], first[6]), "an item's change reached its neighbour in the batch"


def test_a_batch_read_is_the_items_read_one_by_one(harvest, parts):
    for out, layer in [(harvest, 0), (harvest, 2), (parts, 0)]:
        data = rh.HarvestDataset(out, layer=layer)
        indices = [0, len(data) - 1, -1, 9, 9, 5, 3]  # every shard, a repeat, a negative index
        one_by_one = [data[i] for i in indices]
        items = data.__getitems__(indices)
        batch, values = data[indices], data.take(indices)
        assert [(item["doc"], item["position"]) for item in items] == [
            (item["doc"], item["position"]) for item in one_by_one
        ]
        assert batch["doc"].tolist() == [item["doc"] for item in items]
        assert batch["position"].tolist() == [item["position"] for item in items]
        if isinstance(values, dict):  # the mLSTM's parts
            assert set(values) == {"C", "n", "m"} == set(batch["value"]) == set(items[0]["value"])
            stacked = {part: torch.stack([item["value"][part] for item in one_by_one]) for part in values}
            for part in values:
                assert torch.equal(values[part], stacked[part]) and torch.equal(batch["value"][part], stacked[part])
                assert all(torch.equal(item["value"][part], stacked[part][i]) for i, item in enumerate(items))
            continue
        stacked = torch.stack([item["value"] for item in one_by_one])
        assert torch.equal(values, stacked) and torch.equal(batch["value"], stacked)
        assert all(torch.equal(item["value"], stacked[i]) for i, item in enumerate(items))
        assert torch.equal(data[torch.tensor(indices)]["value"], stacked)  # a 1-d tensor of indices: a batch
        assert torch.equal(data[torch.tensor(9)]["value"], stacked[3])  # a 0-d one: an item
    data = rh.HarvestDataset(harvest, layer=0)
    assert data.take([]).shape == (0, *data.shape) and data.__getitems__([]) == []
    assert data[[]]["doc"].shape == (0,)
    with pytest.raises(IndexError, match=r"HarvestDataset: indices from -29 to 3 are out of range for 28 tokens"):
        data.__getitems__([3, -29])
    with pytest.raises(IndexError, match=r"HarvestDataset.take: indices from 0 to 28 are out of range for 28"):
        data.take([0, 28])
    with pytest.raises(
        rh.InvalidValue,
        match=r"HarvestDataset.take: expected integer indices, got a tensor of"
        r" torch.float32",
    ):
        data.take([1.0, 2.0])


def test_normalisation_statistics_from_a_seeded_sample(harvest):
    """The statistics recipe of docs/harvest.md, section "Reading": a seeded sample of items, read with `take`."""
    data = rh.HarvestDataset(harvest, layer=0)

    def scale(n, seed):
        sample = torch.randint(len(data), (n,), generator=torch.Generator().manual_seed(seed))
        return data.take(sample).flatten(1).norm(dim=1).mean()

    full = data.take(range(len(data))).flatten(1).norm(dim=1).mean()
    assert torch.equal(scale(64, seed=0), scale(64, seed=0)) and not torch.equal(scale(64, seed=0), scale(64, seed=1))
    assert abs(scale(4096, seed=0) / full - 1) < 0.05


def test_the_dataset_pickles_without_its_mappings(harvest):
    """What a spawn worker gets: the dataset without its mappings, which it opens itself on first use."""
    data = rh.HarvestDataset(harvest, layer=0)
    data[0], data.docs
    copy = pickle.loads(pickle.dumps(data))
    assert copy._maps is None and copy._index is None
    assert torch.equal(copy.take([4, 1]), data.take([4, 1]))


def test_the_sampler_takes_integers_and_any_seed_torch_takes(harvest):
    data = rh.HarvestDataset(harvest, layer=0)
    for bad, name in (
        (True, "shards_at_once= an integer >= 1, got True"),
        (0, "shards_at_once= an integer >= 1"),
        (2.0, "shards_at_once= an integer >= 1, got 2.0"),
    ):
        with pytest.raises(rh.InvalidValue, match=rf"HarvestDataset.sampler: expected {name}"):
            data.sampler(seed=0, shards_at_once=bad)
    with pytest.raises(rh.InvalidValue, match=r"expected seed= an integer, got 1.5"):
        data.sampler(seed=1.5)
    for seed in (2**63, -(2**62), 2**70):  # (a random 64-bit seed: torch's range, its product past it wraps)
        assert sorted(data.sampler(seed=seed)) == list(range(len(data)))
