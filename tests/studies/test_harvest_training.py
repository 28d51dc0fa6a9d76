"""Reading a harvest for training: `split` puts every document on one side, the same for a seed; `batches` reads
every item once per epoch, in an order of (seed, epoch) only, each batch the values `take` reads for its items,
from few shards at a time; ranks get disjoint shares that cover the epoch; bad arguments are refused."""

import pytest
import torch
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.studies.harvest.dataset import HarvestSubset


@pytest.fixture(scope="module")
def harvest(tmp_path_factory):
    """A harvest of the qwen3_5 test model's states: 6 batches (shards) of 2 or 3 rows, 17 docs, 117 tokens."""
    out = tmp_path_factory.mktemp("harvest")
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0  # (a row padded on the right: its pads are not items)
    batches = [
        {"input_ids": random_ids(3, 8), "attention_mask": mask},
        random_ids(3, 7, seed=1),
        random_ids(2, 9, seed=2),
        random_ids(3, 6, seed=3),
        random_ids(3, 8, seed=4),
        random_ids(3, 5, seed=5),
    ]
    rh.harvest(build("qwen3_5"), batches, out, keep=("states",), progress=False)
    return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A harvest of a memory of several parts (the mLSTM's C, n, m): 2 shards, 5 docs."""
    out = tmp_path_factory.mktemp("parts")
    rh.harvest(build("xlstm"), [random_ids(2, 4), random_ids(3, 5, seed=1)], out, keep=("states",), progress=False)
    return out


def _keys(view):
    return list(zip(view.docs.tolist(), view.positions.tolist()))


def _local(view, batch):
    """The view's indices of a batch's items, found by (doc, position)."""
    where = {key: i for i, key in enumerate(_keys(view))}
    return [where[key] for key in zip(batch["doc"].tolist(), batch["position"].tolist())]


def _assert_equal(got, want, what):
    if isinstance(want, dict):
        assert set(got) == set(want), f"{what}: parts {set(got)}, expected {set(want)}"
        for part in want:
            assert torch.equal(got[part], want[part]), f"{what}: part {part} is not take's"
    else:
        assert torch.equal(got, want), f"{what}: not take's values"


def test_split_puts_each_document_on_one_side_and_covers_everything(harvest):
    data = rh.HarvestDataset(harvest, layer=0)
    docs = data.docs
    documents = len(torch.unique(docs))
    assert documents == 17 and len(data) == 117
    train, test = data.split(test=0.25, seed=0)
    assert len(train) + len(test) == len(data)
    assert sorted([*train.indices.tolist(), *test.indices.tolist()]) == list(range(len(data)))
    train_docs, test_docs = set(train.docs.tolist()), set(test.docs.tolist())
    assert not train_docs & test_docs and len(test_docs) == round(0.25 * documents) == 4
    for view in (train, test):  # every token of a document on its side
        assert (torch.isin(docs, view.docs) == torch.isin(torch.arange(len(data)), view.indices)).all()
        assert torch.equal(view.docs, docs[view.indices]) and torch.equal(view.positions, data.positions[view.indices])
        assert torch.equal(view.take(range(len(view))), data.take(view.indices))
        assert torch.equal(view.take([-1]), data.take(view.indices[-1:]))
        item = view[3]
        assert (item["doc"], item["position"]) == _keys(view)[3]
        assert torch.equal(item["value"], data[int(view.indices[3])]["value"])
        assert torch.equal(view[[3, 0]]["value"], data[view.indices[[3, 0]]]["value"])
        assert [i["doc"] for i in view.__getitems__([1, 2])] == view.docs[1:3].tolist()
        assert sorted(view.sampler(seed=1)) == list(range(len(view)))
    again = data.split(test=0.25, seed=0)
    assert all(torch.equal(a.indices, b.indices) for a, b in zip(again, (train, test))), "not deterministic"
    others = [set(data.split(test=0.25, seed=seed)[1].docs.tolist()) for seed in range(1, 6)]
    assert any(other != test_docs for other in others), "the seed does not change the split"
    _, four = data.split(test=4, seed=3)  # a count of documents
    assert len(set(four.docs.tolist())) == 4
    inner_train, inner_test = train.split(test=0.5, seed=0)  # a view splits again, within its own items
    assert sorted([*inner_train.indices.tolist(), *inner_test.indices.tolist()]) == train.indices.tolist()
    assert not set(inner_train.docs.tolist()) & set(inner_test.docs.tolist())
    assert len(set(inner_test.docs.tolist())) == round(0.5 * len(train_docs))


@pytest.mark.parametrize("view", ["whole", "train"])
def test_batches_read_every_item_once_per_epoch_as_take_reads(harvest, view):
    data = rh.HarvestDataset(harvest, layer=0)
    view = data if view == "whole" else data.split(test=0.3, seed=2)[0]
    orders = []
    for epoch in (0, 1):
        batches = view.batches(10, seed=4, epoch=epoch)
        got = list(batches)
        assert len(got) == len(batches) == -(-len(view) // 10)
        assert [len(b["doc"]) for b in got] == [10] * (len(view) // 10) + ([len(view) % 10] if len(view) % 10 else [])
        order = []
        for batch in got:
            local = _local(view, batch)
            assert set(batch) == {"value", "doc", "position", "token"}
            assert batch["token"].tolist() == view.tokens[local].tolist()
            _assert_equal(batch["value"], view.take(local), f"epoch {epoch}")
            order += local
        assert sorted(order) == list(range(len(view))), f"epoch {epoch}: not every item once"
        orders.append(order)
        again = [i for batch in view.batches(10, seed=4, epoch=epoch) for i in _local(view, batch)]
        assert again == order, "the order is not a function of (seed, epoch)"
        # the batches are the sampler's order at that epoch, cut in pieces (each piece in file order)
        sampler = view.sampler(seed=4)
        sampler.set_epoch(epoch)
        pieces = torch.tensor(list(sampler)).split(10)
        assert order == [i for piece in pieces for i in piece.sort().values.tolist()]
    assert orders[0] != orders[1], "two epochs gave the same order"
    assert [i for b in view.batches(7, shuffle=False) for i in _local(view, b)] == list(range(len(view)))
    assert [len(b["doc"]) for b in view.batches(7, shuffle=False, drop_last=True)] == [7] * (len(view) // 7)


def test_batches_of_a_memory_of_several_parts(parts):
    data = rh.HarvestDataset(parts, layer=0)
    train, _ = data.split(test=2, seed=0)
    for view in (data, train):
        seen = []
        for batch in view.batches(4, seed=1):
            assert set(batch["value"]) == {"C", "n", "m"}
            _assert_equal(batch["value"], view.take(_local(view, batch)), "parts")
            seen += _local(view, batch)
        assert sorted(seen) == list(range(len(view)))


def test_batches_read_from_few_shards(harvest):
    """Shuffled, a batch holds the items of the shards of one window of `shards_at_once` shards, or of two
    consecutive windows (where one ends within it): with batches no larger than a shard, 2 windows' shards at most."""
    data = rh.HarvestDataset(harvest, layer=0)
    ends = torch.tensor(data._starts[1:])
    assert len(ends) == 6 and min(ends.diff()) >= 10
    for shards_at_once in (1, 2):
        for epoch in range(3):
            for batch in data.batches(10, seed=0, epoch=epoch, shards_at_once=shards_at_once):
                shards = torch.bucketize(torch.tensor(_local(data, batch)), ends, right=True).unique()
                assert len(shards) <= 2 * shards_at_once, (
                    f"a batch read {len(shards)} shards ({shards_at_once} at once)"
                )
    # (a uniform shuffle of 117 items over 6 shards puts 4 or more shards in nearly every batch of 10)
    uniform = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).split(10)
    assert max(len(torch.bucketize(b, ends, right=True).unique()) for b in uniform) > 2


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_disjoint_shares_that_cover_the_epoch(harvest, world):
    data = rh.HarvestDataset(harvest, layer=0)
    train, _ = data.split(test=0.2, seed=0)
    for view in (data, train):
        one = [_local(view, b) for b in view.batches(8, seed=5, epoch=1)]
        shares = [view.batches(8, seed=5, epoch=1, rank=r, world_size=world) for r in range(world)]
        got = [[_local(view, b) for b in share] for share in shares]
        assert [len(share) for share in shares] == [len(g) for g in got]
        assert [len(g) for g in got] == [len(range(r, len(one), world)) for r in range(world)]
        for r in range(world):  # batch k is rank k % world's
            assert got[r] == one[r::world]
        items = [i for g in got for batch in g for i in batch]
        assert sorted(items) == list(range(len(view))), "the ranks' shares do not cover the items once"
        # drop_last: the same number of full batches on every rank, whole rounds only
        full = [
            [_local(view, b) for b in view.batches(8, seed=5, epoch=1, drop_last=True, rank=r, world_size=world)]
            for r in range(world)
        ]
        rounds = len(view) // 8 // world
        assert all(len(g) == rounds and all(len(b) == 8 for b in g) for g in full)
        assert len({i for g in full for b in g for i in b}) == rounds * world * 8


def test_the_ranks_of_an_initialized_group_are_the_default(harvest, monkeypatch):
    """Under torchrun (simulated: an initialized group's rank 1 of 2), `batches()` deals as rank=1, world_size=2."""
    data = rh.HarvestDataset(harvest, layer=0)
    explicit = [b["doc"].tolist() for b in data.batches(16, seed=0, rank=1, world_size=2)]
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    batches = data.batches(16, seed=0)
    assert (batches.rank, batches.world_size) == (1, 2)
    assert [b["doc"].tolist() for b in batches] == explicit
    assert data.batches(16, rank=0, world_size=1).world_size == 1  # explicit arguments win


def test_a_real_gloo_group_of_one_is_read(harvest, tmp_path):
    """An initialized group (gloo, one process: the real torch.distributed calls) deals to its only rank."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed is unavailable, or a group is already initialized in this process")
    data = rh.HarvestDataset(harvest, layer=0)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        batches = data.batches(16, seed=0)
        assert (batches.rank, batches.world_size) == (0, 1)
        assert sorted(i for b in batches for i in _local(data, b)) == list(range(len(data)))
    finally:
        dist.destroy_process_group()


def test_bad_arguments_are_refused(harvest):
    data = rh.HarvestDataset(harvest, layer=0)
    train, _ = data.split(test=0.5, seed=0)
    split = {
        "test=0.0": (dict(test=0.0), r"expected test= a share strictly between 0 and 1 \(or a count\), got 0.0"),
        "test=1.0": (dict(test=1.0), r"expected test= a share strictly between 0 and 1 \(or a count\), got 1.0"),
        "test=True": (dict(test=True), r"expected test= a share of the documents .* got True"),
        "test='a'": (
            dict(test="a"),
            r"expected test= a share of the documents \(0 < test < 1\) or a count of them, got 'a'",
        ),
        "test=0": (dict(test=0), r"expected test= a count of documents from 1 to 16 \(of 17\), got 0"),
        "test=17": (dict(test=17), r"expected test= a count of documents from 1 to 16 \(of 17\), got 17"),
        "test=0.01": (dict(test=0.01), r"test=0.01 of 17 documents rounds to 0 test documents"),
        "seed=1.5": (dict(seed=1.5), r"expected seed= an integer, got 1.5"),
    }
    for case, (kwargs, message) in split.items():
        with pytest.raises(rh.InvalidValue, match=rf"HarvestDataset.split: {message}"):
            data.split(**kwargs)
    batches = {
        "batch_size=0": (dict(batch_size=0), r"expected batch_size= an integer >= 1, got 0"),
        "batch_size=2.0": (dict(batch_size=2.0), r"expected batch_size= an integer >= 1, got 2.0"),
        "shuffle=1": (dict(shuffle=1), r"expected shuffle= True or False, got 1"),
        "drop_last=None": (dict(drop_last=None), r"expected drop_last= True or False, got None"),
        "epoch=-1": (dict(epoch=-1), r"expected epoch= an integer >= 0, got -1"),
        "seed=True": (dict(seed=True), r"expected seed= an integer, got True"),
        "shards_at_once=0": (dict(shards_at_once=0), r"expected shards_at_once= an integer >= 1, got 0"),
        "rank alone": (dict(rank=0), r"expected rank= and world_size= together .* got rank=0, world_size=None"),
        "rank=2 of 2": (dict(rank=2, world_size=2), r"expected rank= below world_size=2, got rank=2"),
        "world_size=0": (dict(rank=0, world_size=0), r"expected world_size= an integer >= 1, got 0"),
    }
    for view in (data, train):
        for case, (kwargs, message) in batches.items():
            with pytest.raises(rh.InvalidValue, match=rf"HarvestDataset.batches: {message}"):
                view.batches(**{"batch_size": 4, **kwargs})
    with pytest.raises(IndexError, match=rf"HarvestSubset.take: indices from 0 to {len(train)} are out of range"):
        train.take([0, len(train)])
    with pytest.raises(IndexError, match=rf"HarvestSubset: index {len(train)} is out of range for {len(train)}"):
        train[len(train)]
    with pytest.raises(rh.InvalidValue, match=r"HarvestSubset.take: expected integer indices, got a tensor of"):
        train.take([1.0])
    for bad, message in [
        ([0, 1], r"expected indices= a 1-d int64 tensor of the harvest's items, got \[0, 1\]"),
        (
            torch.tensor([0.0]),
            r"expected indices= a 1-d int64 tensor of the harvest's items, got a tensor of torch.float32, shape \[1\]",
        ),
        (
            torch.tensor([2, 1]),
            r"expected indices= increasing item numbers .* from 0 to 116; got 2 from 1 to 2, not increasing",
        ),
        (torch.tensor([0, len(data)]), r"expected indices= increasing .* from 0 to 116; got 2 from 0 to 117$"),
    ]:
        with pytest.raises(rh.InvalidValue, match=rf"HarvestSubset: {message}"):
            HarvestSubset(data, bad)
    one, _ = data.split(test=16, seed=0)  # one document left: it cannot be split again
    with pytest.raises(rh.InvalidValue, match=r"HarvestDataset.split: a split needs 2 documents at least"):
        one.split()
