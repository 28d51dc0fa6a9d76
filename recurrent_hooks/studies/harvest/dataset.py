"""Read a harvest back: `rh.HarvestDataset`, one item per harvested token, mem-mapped from the shards.

    data = rh.HarvestDataset("harvest/", layer=0, what="states")
    len(data)                        # harvested (non-pad) tokens
    data[0]                          # {"doc": 0, "position": 0, "token": 17, "value": Tensor [*per-token shape]}
    data.tokens, data.documents, data.stats   # every token's id, the documents' columns, the value's statistics
    loader = torch.utils.data.DataLoader(data, batch_size=256, sampler=data.sampler(seed=0))
    x = data.take(torch.nonzero(data.positions == 7).flatten())   # [n, ...]: every doc's token 7, stacked

Items are in (doc, position) order: the shards in batch order, each shard's tokens row by row. The shards are mapped
into memory (read from the disk when touched, shared by processes through the page cache) and every read copies
its rows out of the mapping: a value, a `take`, a batch of items is a tensor of its own, which a user may change in
place and a `DataLoader`'s worker may send through its queue (a view of the mapping can be neither). A memory of
several parts is a dict of them. A `DataLoader` asks for a batch of items at once (`__getitems__`): it is read as
`take` reads, one gather per shard, and its items are rows of the gathered tensor, which the default collate stacks
(a second copy) and any other `collate_fn` gets as items. `data[indices]` reads a batch of items collated, in one
read (what a `DataLoader` with a `BatchSampler` as its sampler and `batch_size=None` asks for: the fastest loader).
The mappings are opened in each process on first use (a `DataLoader`'s workers open their own; the dataset pickles
without them).

Module contents: `HarvestDataset`, `HarvestSubset` (a view over some documents, `HarvestDataset.split`),
`HarvestBatches` (an epoch in batches, `HarvestDataset.batches`), `ShardShuffle` (the seeded sampler
`HarvestDataset.sampler` returns).
"""

import bisect
import operator
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from ...engine.errors import InvalidValue, Unavailable
from .documents import Documents, read_documents
from .shards import MappedShard, check_shards, read_manifest
from .stats import HarvestStats, read_stats

__all__ = ["HarvestDataset", "HarvestSubset", "HarvestBatches", "ShardShuffle"]


class _ForTraining:
    """`split` and `batches`, for a harvest (`HarvestDataset`) and a view of one (`HarvestSubset`); `_items()` says
    which harvest and which of its items (None: every one)."""

    def _items(self) -> "tuple[HarvestDataset, Tensor | None]":
        raise NotImplementedError

    def split(self, test: float | int = 0.2, seed: int = 0) -> tuple["HarvestSubset", "HarvestSubset"]:
        """`(train, test)`: views of these items over disjoint sets of documents (every token of a document on one
        side), the test side `round(test * docs)` documents drawn by a seeded shuffle of the doc ids (`0 < test < 1`),
        or `test` documents (an int). The same split for the same seed (`HarvestSubset`)."""
        return _split(*self._items(), test, seed)

    def batches(
        self,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        *,
        shards_at_once: int = 4,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> "HarvestBatches":
        """One epoch of these items in batches, `{"value": [b, ...], "doc": [b], "position": [b]}` (and `"token":
        [b]` where the harvest kept tokens), read as `take` reads (`HarvestBatches`)."""
        data, indices = self._items()
        return HarvestBatches(
            data, indices, batch_size, shuffle, seed, epoch, drop_last, shards_at_once, rank, world_size
        )


class HarvestDataset(Dataset, _ForTraining):
    """One item per harvested token of one mixer and value (the module docstring).

        data = rh.HarvestDataset(out, layer=2, what="states")     # what: as harvest's keep named it ("key", ...)
        data.docs, data.positions                                  # int64 [len(data)]: every item's doc and position
    `layer` is a decoder layer, or a mixer's name in the manifest (its module path where a layer has several).
    `verify=True` first reads every shard of the harvest and checks it against the manifest (`Harvest.verify`);
    without it, a shard whose header or size is wrong is refused, naming it, when first read.
    """

    def __init__(self, out: str | os.PathLike, layer: int | str, what: str = "states", *, verify: bool = False) -> None:
        self.out = pathlib.Path(out)
        if verify:
            check_shards(self.out)
        manifest = read_manifest(self.out)
        self.mixer = _mixer_name(manifest, layer, self.out)
        names = sorted(name for name in manifest["values"] if name.split("/")[0] == self.mixer)
        whats = sorted({name.split("/", 1)[1].split(".")[0] for name in names})
        if what not in whats:
            raise Unavailable(f"HarvestDataset: {self.out} kept no {what!r} of mixer {self.mixer!r}; it kept {whats}")
        self.layer, self.what = manifest["mixers"][self.mixer]["layer"], what
        # the tensors of this value in each shard: one, or one per part ("states.C", "states.n", ...)
        self._names = [name for name in names if name.split("/", 1)[1].split(".")[0] == what]
        self._parts = [name.split("/", 1)[1].partition(".")[2] for name in self._names]
        # each tensor's dtype and per-token shape (an empty read is made from these, without a shard)
        self._specs = {"doc": (torch.int64, ()), "position": (torch.int64, ())}
        if "token" in manifest.get("columns", ()):  # (a harvest before token ids were stored has none)
            self._specs["token"] = (torch.int64, ())
        self._columns = list(self._specs)  # the per-token columns an item carries besides its value
        self._stats = manifest.get("stats")
        for name in self._names:
            self._specs[name] = (
                getattr(torch, manifest["values"][name]["dtype"]),
                tuple(manifest["values"][name]["shape"]),
            )
        self._files = [self.out / shard["file"] for shard in manifest["shards"]]
        counts = [shard["tokens"] for shard in manifest["shards"]]
        self._starts = [0]
        for count in counts:
            self._starts.append(self._starts[-1] + count)
        self._ends = torch.tensor(self._starts[1:], dtype=torch.long)
        self.dtype = manifest["values"][self._names[0]]["dtype"]
        self.shape = tuple(manifest["values"][self._names[0]]["shape"])
        self._maps: list[MappedShard] | None = None
        self._index: tuple[Tensor, Tensor] | None = None
        self._tokens: Tensor | None = None
        self._documents: Documents | None = None

    def __repr__(self) -> str:
        return (
            f"HarvestDataset({str(self.out)!r}, layer={self.layer}, what={self.what!r}: {len(self)} tokens,"
            f" {len(self._files)} shards, {self.dtype} {list(self.shape)})"
        )

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None, "_index": None, "_tokens": None}  # (mappings are per process)

    @property
    def shards(self) -> list[MappedShard]:
        """The shards, mapped (their tensors are views of the mappings: the reads copy out of them)."""
        if self._maps is None:
            for file in self._files:
                if not file.is_file():
                    raise Unavailable(f"HarvestDataset: {file}, listed in {self.out / 'manifest.json'}, is missing")
            self._maps = [MappedShard(file) for file in self._files]
        return self._maps

    @property
    def docs(self) -> Tensor:
        """Every item's document id, int64 `[len(self)]` (a new tensor each time: keep it in a variable)."""
        return self._doc_positions()[0].clone()

    @property
    def positions(self) -> Tensor:
        """Every item's position in its document (among its non-pad tokens), int64 `[len(self)]` (a new tensor each
        time)."""
        return self._doc_positions()[1].clone()

    @property
    def tokens(self) -> Tensor:
        """Every item's token id, int64 `[len(self)]` (a new tensor each time); `Unavailable` for a harvest made
        before token ids were stored."""
        if "token" not in self._specs:
            raise Unavailable(
                f"HarvestDataset: {self.out} stores no token ids: the harvest predates them (harvest again to have"
                " data.tokens and items' 'token')"
            )
        if self._tokens is None:
            self._tokens = torch.cat([torch.zeros(0, dtype=torch.long), *(shard["token"] for shard in self.shards)])
        return self._tokens.clone()

    @property
    def documents(self) -> Documents:
        """The documents and their columns (a batch's other keys, a text dataset's other columns): `len`,
        `documents[doc]` a dict, `documents.columns`, `documents[name]` a column as a list (`documents` module);
        read from the shards' headers on first use."""
        if self._documents is None:
            self._documents = read_documents(self.out, read_manifest(self.out))
        return self._documents

    @property
    def stats(self) -> HarvestStats | dict[str, HarvestStats]:
        """This value's statistics over every token, formed as the harvest wrote it (`stats` module): `count`,
        `mean` and `var` per feature (the value flattened), `mean_squared_norm`, float64; a dict of parts for a
        memory of several."""
        if not self._stats:
            raise Unavailable(f"HarvestDataset: {self.out} has no statistics: the harvest predates them (or is empty)")
        stats = read_stats(self.out, self._names)
        return self._value(stats)

    def _doc_positions(self) -> tuple[Tensor, Tensor]:
        if self._index is None:
            empty = torch.zeros(0, dtype=torch.long)
            docs, positions = (
                torch.cat([empty, *(shard[name] for shard in self.shards)]) for name in ("doc", "position")
            )
            self._index = docs, positions
        return self._index

    def _locate(self, index: Any) -> tuple[int, int]:
        try:
            index = operator.index(index)  # (an int, a numpy integer, a 0-d integer tensor)
        except TypeError:
            raise InvalidValue(f"HarvestDataset: expected an integer index, got {type(index).__name__}") from None
        if not -len(self) <= index < len(self):
            raise IndexError(f"HarvestDataset: index {index} is out of range for {len(self)} tokens")
        index %= len(self)
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def _value(self, values: dict[str, Any]) -> Any:
        """The value of this dataset's tensors `values` (name -> tensor): a tensor, or a dict of parts."""
        if self._parts == [""]:
            return values[self._names[0]]
        return {part: values[name] for part, name in zip(self._parts, self._names)}

    def __getitem__(self, index: int | Sequence[int] | Tensor) -> dict[str, Any]:
        """An item, `{"doc": int, "position": int, "token": int, "value": Tensor}` (no "token" in a harvest that
        predates them); for a sequence of indices (a list, a 1-d tensor), those items collated: `{"doc": int64 [n],
        "position": int64 [n], "token": int64 [n], "value": [n, ...]}`, read as `take`
        reads (a `DataLoader` with `batch_size=None` and a `BatchSampler` as its sampler asks for these)."""
        if isinstance(index, Sequence) and not isinstance(index, str) or getattr(index, "ndim", 0) == 1:
            gathered = self._gather(index, [*self._columns, *self._names], "HarvestDataset")
            return {name: gathered[name] for name in self._columns} | {"value": self._value(gathered)}
        shard, row = self._locate(index)
        mapped = self.shards[shard]
        item: dict[str, Any] = {name: int(mapped[name][row]) for name in self._columns}
        return item | {"value": self._value({name: mapped[name][row].clone() for name in self._names})}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The items of `indices` (a `DataLoader` asks for a batch at once), read as `take` reads them: each item's
        value is a row of the gathered values (the default collate stacks the rows again, at the cost of a copy)."""
        gathered = self._gather(indices, [*self._columns, *self._names], "HarvestDataset")
        columns = {name: gathered.pop(name).tolist() for name in self._columns}
        rows = self._value({name: tensor.unbind(0) for name, tensor in gathered.items()})
        if isinstance(rows, dict):  # a memory of several parts: each item's dict of its rows
            rows = [dict(zip(rows, parts)) for parts in zip(*rows.values())]
        return [{name: columns[name][i] for name in columns} | {"value": value} for i, value in enumerate(rows)]

    def take(self, indices: Tensor | Sequence[int]) -> Any:
        """The values of `indices` stacked: `[len(indices), *shape]` (a dict of parts for a memory of several), read
        shard by shard (one gather per shard), in a new tensor."""
        return self._value(self._gather(indices, self._names, "HarvestDataset.take"))

    def _gather(self, indices: Tensor | Sequence[int], names: Sequence[str], caller: str) -> dict[str, Tensor]:
        """The rows of the items `indices` of each shard tensor `names`, `{name: [len(indices), ...]}`: new tensors,
        read shard by shard (one `index_select` per shard and name, into the rows of that shard's items in shard
        order; then one into the order of `indices`)."""
        indices = torch.as_tensor(indices)
        if indices.numel() and (indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool):
            raise InvalidValue(f"{caller}: expected integer indices, got a tensor of {indices.dtype}")
        indices = indices.to(torch.long).reshape(-1)
        out = {name: torch.empty(len(indices), *self._specs[name][1], dtype=self._specs[name][0]) for name in names}
        if not len(indices):
            return out
        low, high = (int(end) for end in torch.aminmax(indices))
        if not (-len(self) <= low and high < len(self)):
            raise IndexError(f"{caller}: indices from {low} to {high} are out of range for {len(self)} tokens")
        if low < 0:
            indices = indices % len(self)
        shard_of = torch.bucketize(indices, self._ends, right=True)
        first, last = (int(end) for end in torch.aminmax(shard_of))
        if first == last:  # all in one shard: read into the result directly
            rows = indices - self._starts[first]
            for name in names:
                torch.index_select(self.shards[first][name], 0, rows, out=out[name])
            return out
        shard_sorted, order = torch.sort(shard_of, stable=True)
        shards, counts = torch.unique_consecutive(shard_sorted, return_counts=True)
        rows, begin = indices[order], 0
        for shard, count in zip(shards.tolist(), counts.tolist()):
            for name in names:  # (rows begin:end of a contiguous tensor are contiguous: a valid out=)
                torch.index_select(
                    self.shards[shard][name],
                    0,
                    rows[begin : begin + count] - self._starts[shard],
                    out=out[name][begin : begin + count],
                )
            begin += count
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return {name: tensor.index_select(0, inverse) for name, tensor in out.items()}

    def sampler(self, seed: int = 0, shards_at_once: int = 4) -> "ShardShuffle":
        """A seeded shuffle of the items that reads few shards at a time (`ShardShuffle`)."""
        return ShardShuffle(self._starts, seed, shards_at_once)

    def _items(self) -> "tuple[HarvestDataset, Tensor | None]":
        return self, None


class ShardShuffle(Sampler[int]):
    """A seeded random order of a harvest's items that keeps reads local: the shards in a random order, taken
    `shards_at_once` at a time, the items of those shards shuffled together. Every item once per epoch; the same
    order for the same seed and epoch (`set_epoch(e)` before each epoch, as `DistributedSampler`)."""

    def __init__(self, starts: Sequence[int], seed: int = 0, shards_at_once: int = 4) -> None:
        self.starts, self.epoch = list(starts), 0
        self.seed, self.shards_at_once = (
            integer_argument("seed", seed),
            integer_argument("shards_at_once", shards_at_once, least=1),
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.starts[-1]

    def __iter__(self) -> Iterator[int]:
        # (modulo 2^64: torch takes seeds in [-2^63, 2^64) and wraps the negative ones the same way)
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)
        order = torch.randperm(len(self.starts) - 1, generator=generator).tolist()
        for group in range(0, len(order), self.shards_at_once):
            items = torch.cat(
                [torch.arange(self.starts[s], self.starts[s + 1]) for s in order[group : group + self.shards_at_once]]
            )
            yield from items[torch.randperm(len(items), generator=generator)].tolist()


def integer_argument(name: str, value: Any, least: int | None = None, where: str = "HarvestDataset.sampler") -> int:
    """`value` as an int (an int, a numpy integer; not a bool, not a float), at least `least`; else `InvalidValue`
    naming `name` and `where` (the function it was given to)."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or least is not None and number < least:
        floor = "" if least is None else f" >= {least}"
        raise InvalidValue(f"{where}: expected {name}= an integer{floor}, got {value!r}")
    return number


def _mixer_name(manifest: dict[str, Any], layer: int | str, out: pathlib.Path) -> str:
    mixers = manifest["mixers"]
    if isinstance(layer, str):
        if layer in mixers:
            return layer
        named = [name for name, info in mixers.items() if info["path"] == layer]
    elif isinstance(layer, int) and not isinstance(layer, bool):
        named = [name for name, info in mixers.items() if info["layer"] == layer]
    else:
        raise InvalidValue(f"HarvestDataset: expected layer= a decoder layer (int) or a mixer name, got {layer!r}")
    if len(named) == 1:
        return named[0]
    available = {name: info["layer"] for name, info in mixers.items()}
    if not named:
        raise Unavailable(
            f"HarvestDataset: {out} harvested no mixer at {layer!r}; its mixers (name: layer): {available}"
        )
    raise Unavailable(f"HarvestDataset: layer {layer} has several mixers in {out} ({named}): pass one's name")


class HarvestSubset(_ForTraining):
    """Some items of a harvest, as `HarvestDataset.split` hands them out: a view over the same shards, read through
    the harvest's dataset (`data`), with its API (len, items, `take`, `docs`, `positions`, `tokens` where the harvest
    kept them, `sampler`, `batches`, `split` again). Its item i is the harvest's item `indices[i]`, in file order.

        train, test = data.split(test=0.2, seed=0)     # disjoint documents: every token of a doc on one side
        train.take([0, 1]), test.docs, train.batches(256, epoch=1)
    """

    def __init__(self, data: HarvestDataset, indices: Tensor) -> None:
        if not isinstance(indices, Tensor) or indices.dtype != torch.long or indices.ndim != 1:
            got = (
                f"a tensor of {indices.dtype}, shape {list(indices.shape)}" if isinstance(indices, Tensor) else indices
            )
            raise InvalidValue(f"HarvestSubset: expected indices= a 1-d int64 tensor of the harvest's items, got {got}")
        increasing = not bool((indices.diff() <= 0).any())
        if len(indices) and (not increasing or indices[0] < 0 or indices[-1] >= len(data)):
            low, high = (int(end) for end in torch.aminmax(indices))
            raise InvalidValue(
                f"HarvestSubset: expected indices= increasing item numbers of the harvest, from 0 to {len(data) - 1};"
                f" got {len(indices)} from {low} to {high}{'' if increasing else ', not increasing'}"
            )
        self.data, self.indices = data, indices  # (the harvest's items, increasing)
        self.out, self.mixer, self.layer, self.what = data.out, data.mixer, data.layer, data.what
        self.dtype, self.shape = data.dtype, data.shape
        # where each of the harvest's shards begins among this view's items (a shard's items are a range here too)
        self._starts = torch.searchsorted(indices, torch.tensor(data._starts)).tolist()

    def __repr__(self) -> str:
        return f"HarvestSubset({len(self)} of the {len(self.data)} tokens of {self.data!r})"

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def docs(self) -> Tensor:
        """Every item's document id, int64 `[len(self)]` (a new tensor each time)."""
        return self.data._doc_positions()[0][self.indices]

    @property
    def positions(self) -> Tensor:
        """Every item's position in its document, int64 `[len(self)]` (a new tensor each time)."""
        return self.data._doc_positions()[1][self.indices]

    @property
    def tokens(self) -> Tensor:
        """Every item's token id, as the harvest's `tokens` (where it kept them)."""
        return self.data.tokens[self.indices]

    def _rows(self, indices: Tensor | Sequence[int], caller: str) -> Tensor:
        """The harvest's items of this view's `indices` (checked against this view's length)."""
        indices = torch.as_tensor(indices)
        if indices.numel() and (indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool):
            raise InvalidValue(f"{caller}: expected integer indices, got a tensor of {indices.dtype}")
        indices = indices.to(torch.long).reshape(-1)
        if len(indices):
            low, high = (int(end) for end in torch.aminmax(indices))
            if not (-len(self) <= low and high < len(self)):
                raise IndexError(f"{caller}: indices from {low} to {high} are out of range for {len(self)} tokens")
        return self.indices[indices]

    def __getitem__(self, index: int | Sequence[int] | Tensor) -> dict[str, Any]:
        """An item, or the items of a sequence of indices collated, as `HarvestDataset[...]` reads them."""
        if isinstance(index, Sequence) and not isinstance(index, str) or getattr(index, "ndim", 0) == 1:
            return self.data[self._rows(index, "HarvestSubset")]
        try:
            index = operator.index(index)
        except TypeError:
            raise InvalidValue(f"HarvestSubset: expected an integer index, got {type(index).__name__}") from None
        if not -len(self) <= index < len(self):
            raise IndexError(f"HarvestSubset: index {index} is out of range for {len(self)} tokens")
        return self.data[int(self.indices[index])]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return self.data.__getitems__(self._rows(indices, "HarvestSubset"))

    def take(self, indices: Tensor | Sequence[int]) -> Any:
        """The values of this view's items `indices` stacked, as `HarvestDataset.take` reads them."""
        return self.data.take(self._rows(indices, "HarvestSubset.take"))

    def sampler(self, seed: int = 0, shards_at_once: int = 4) -> ShardShuffle:
        """A seeded shuffle of this view's items that reads few shards at a time (`ShardShuffle`)."""
        return ShardShuffle(self._starts, seed, shards_at_once)

    def _items(self) -> "tuple[HarvestDataset, Tensor | None]":
        return self.data, self.indices


class HarvestBatches:
    """One epoch of a harvest's items (or a view's) in batches, an iterator of dicts of stacked tensors:

        for batch in data.batches(256, seed=0, epoch=e):    # {"value": [b, ...] (a dict of parts for a memory of
            batch["value"], batch["doc"], batch["position"]  #   several), "doc": [b], "position": [b], "token": [b]}

    The order: with `shuffle`, the shards in a seeded random order, taken `shards_at_once` at a time, the items of
    those shards shuffled together and cut into batches in that order (the order of `sampler(seed,
    shards_at_once)` at `set_epoch(epoch)`), so each batch reads from few shards; without it, file order. Within a
    batch the items are in file order. Every item once per epoch; the order a function of (seed, epoch) only. Each
    batch is one read, as `take` reads (one gather per shard and tensor), less `take`'s reordering (a batch's items
    are sorted): one copy of its values, new tensors of the caller's own. `"token"` is there where the harvest kept
    the tokens. The last batch holds the remainder (fewer than `batch_size` items) unless `drop_last`.

    Ranks (`rank=` and `world_size=`, or by default an initialized `torch.distributed` group's): the epoch's
    batches are dealt in turn, batch k to rank k % world_size, the same order on every rank, so the ranks' shares
    are disjoint and cover the epoch. Without `drop_last`, every item is read once across the ranks, and when the
    batches do not divide among the ranks the first ranks get one batch more (a loop that needs the same number of
    steps on every rank, as DDP's, passes `drop_last=True`). With `drop_last`, only whole rounds of full batches are
    dealt: every rank gets `len(...)` full batches and the items past them (fewer than `world_size` batches' worth,
    other items at each epoch when shuffled) are skipped this epoch. `len(batches)`: this rank's batches.
    """

    def __init__(
        self,
        data: HarvestDataset,
        indices: Tensor | None,
        batch_size: int,
        shuffle: bool,
        seed: int,
        epoch: int,
        drop_last: bool,
        shards_at_once: int,
        rank: int | None,
        world_size: int | None,
    ) -> None:
        where = "HarvestDataset.batches"
        self.batch_size = integer_argument("batch_size", batch_size, least=1, where=where)
        self.seed, self.epoch = (
            integer_argument("seed", seed, where=where),
            integer_argument("epoch", epoch, least=0, where=where),
        )
        self.shards_at_once = integer_argument("shards_at_once", shards_at_once, least=1, where=where)
        self.shuffle, self.drop_last = _flag(where, "shuffle", shuffle), _flag(where, "drop_last", drop_last)
        self.rank, self.world_size = _ranks(where, rank, world_size)
        self._data, self._indices = data, indices
        self._starts = (
            data._starts if indices is None else torch.searchsorted(indices, torch.tensor(data._starts)).tolist()
        )
        items = self._starts[-1]
        count = items // self.batch_size if self.drop_last else -(-items // self.batch_size)
        self._count = count - count % self.world_size if self.drop_last else count  # the batches dealt
        self._names = ["doc", "position", *(["token"] if "token" in data._specs else []), *data._names]
        self._mine = self._own()

    def __len__(self) -> int:
        return len(range(self.rank, self._count, self.world_size))

    def __iter__(self) -> "HarvestBatches":
        return self

    def __next__(self) -> dict[str, Any]:
        gathered = _read_sorted(self._data, next(self._mine), self._names)
        batch = {"value": self._data._value(gathered), "doc": gathered["doc"], "position": gathered["position"]}
        if "token" in gathered:
            batch["token"] = gathered["token"]
        return batch

    def _own(self) -> Iterator[Tensor]:
        """The harvest's items of this rank's batches, each batch's sorted."""
        for number, batch in enumerate(self._every()):
            if number >= self._count:
                return
            if number % self.world_size == self.rank:
                yield (batch if self._indices is None else self._indices[batch]).sort().values

    def _every(self) -> Iterator[Tensor]:
        """Every batch of the epoch (this view's items), in order: the same on every rank."""
        starts, size = self._starts, self.batch_size
        if not self.shuffle:
            for begin in range(0, starts[-1], size):
                yield torch.arange(begin, min(begin + size, starts[-1]))
            return
        # (ShardShuffle's draws, in its order: the batches are its order cut in pieces)
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)
        order = torch.randperm(len(starts) - 1, generator=generator).tolist()
        pending = torch.zeros(0, dtype=torch.long)
        for group in range(0, len(order), self.shards_at_once):
            items = torch.cat(
                [torch.arange(starts[s], starts[s + 1]) for s in order[group : group + self.shards_at_once]]
            )
            pending = torch.cat([pending, items[torch.randperm(len(items), generator=generator)]])
            while len(pending) >= size:
                yield pending[:size]
                pending = pending[size:]
        if len(pending):
            yield pending


def _read_sorted(data: HarvestDataset, rows: Tensor, names: Sequence[str]) -> dict[str, Tensor]:
    """The rows `rows` (sorted, in range) of the shard tensors `names`, `{name: [len(rows), ...]}`: `_gather`'s read
    less its reordering, one `index_select` per shard and name straight into the result (one copy of the values)."""
    out = {name: torch.empty(len(rows), *data._specs[name][1], dtype=data._specs[name][0]) for name in names}
    shards, counts = torch.unique_consecutive(torch.bucketize(rows, data._ends, right=True), return_counts=True)
    begin = 0
    for shard, count in zip(shards.tolist(), counts.tolist()):
        local = rows[begin : begin + count] - data._starts[shard]
        for name in names:
            torch.index_select(data.shards[shard][name], 0, local, out=out[name][begin : begin + count])
        begin += count
    return out


def _split(
    data: HarvestDataset, indices: Tensor | None, test: float | int, seed: int
) -> tuple[HarvestSubset, HarvestSubset]:
    """`(train, test)` views of the items `indices` of `data` (None: all), split by document."""
    where = "HarvestDataset.split"
    seed = integer_argument("seed", seed, where=where)
    docs = data._doc_positions()[0] if indices is None else data._doc_positions()[0][indices]
    ids = torch.unique(docs)  # (sorted)
    count = _test_documents(where, test, len(ids))
    generator = torch.Generator().manual_seed(seed % 2**64)
    held = torch.isin(docs, ids[torch.randperm(len(ids), generator=generator)[:count]])
    items = torch.arange(len(docs)) if indices is None else indices
    return HarvestSubset(data, items[~held]), HarvestSubset(data, items[held])


def _test_documents(where: str, test: Any, documents: int) -> int:
    """The number of test documents `test` asks for (a share in (0, 1) or a count), of `documents`."""
    if documents < 2:
        raise InvalidValue(f"{where}: a split needs 2 documents at least, and these items hold {documents}")
    if isinstance(test, bool) or not isinstance(test, (int, float)) and not hasattr(test, "__index__"):
        raise InvalidValue(
            f"{where}: expected test= a share of the documents (0 < test < 1) or a count of them, got {test!r}"
        )
    if isinstance(test, float):
        if not 0 < test < 1:
            raise InvalidValue(f"{where}: expected test= a share strictly between 0 and 1 (or a count), got {test}")
        count = round(test * documents)
        if not 0 < count < documents:
            raise InvalidValue(
                f"{where}: test={test} of {documents} documents rounds to {count} test documents; each side needs"
                " one at least: pass a count of documents"
            )
        return count
    count = operator.index(test)
    if not 0 < count < documents:
        raise InvalidValue(
            f"{where}: expected test= a count of documents from 1 to {documents - 1} (of {documents}), got {count}"
        )
    return count


def _ranks(where: str, rank: Any, world_size: Any) -> tuple[int, int]:
    """(rank, world size): the arguments', or an initialized torch.distributed group's, or (0, 1)."""
    if rank is None and world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise InvalidValue(
            f"{where}: expected rank= and world_size= together (or neither: an initialized torch.distributed"
            f" group's), got rank={rank!r}, world_size={world_size!r}"
        )
    world = integer_argument("world_size", world_size, least=1, where=where)
    rank = integer_argument("rank", rank, least=0, where=where)
    if rank >= world:
        raise InvalidValue(f"{where}: expected rank= below world_size={world}, got rank={rank}")
    return rank, world


def _flag(where: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidValue(f"{where}: expected {name}= True or False, got {value!r}")
    return value
