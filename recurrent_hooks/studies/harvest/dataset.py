"""Read a harvest back: `rh.HarvestDataset`, one item per harvested token, mem-mapped from the shards.

    data = rh.HarvestDataset("harvest/", layer=0, what="states")
    len(data)                        # harvested (non-pad) tokens
    data[0]                          # {"doc": 0, "position": 0, "value": Tensor [*per-token shape]}
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

Module contents: `HarvestDataset`, `ShardShuffle` (the seeded sampler `HarvestDataset.sampler` returns).
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
from .shards import MappedShard, check_shards, read_manifest

__all__ = ["HarvestDataset", "ShardShuffle"]


class HarvestDataset(Dataset):
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

    def __repr__(self) -> str:
        return (
            f"HarvestDataset({str(self.out)!r}, layer={self.layer}, what={self.what!r}: {len(self)} tokens,"
            f" {len(self._files)} shards, {self.dtype} {list(self.shape)})"
        )

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None, "_index": None}  # (mappings are per process)

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
        """An item, `{"doc": int, "position": int, "value": Tensor}`; for a sequence of indices (a list, a 1-d
        tensor), those items collated: `{"doc": int64 [n], "position": int64 [n], "value": [n, ...]}`, read as `take`
        reads (a `DataLoader` with `batch_size=None` and a `BatchSampler` as its sampler asks for these)."""
        if isinstance(index, Sequence) and not isinstance(index, str) or getattr(index, "ndim", 0) == 1:
            gathered = self._gather(index, ["doc", "position", *self._names], "HarvestDataset")
            return {"doc": gathered["doc"], "position": gathered["position"], "value": self._value(gathered)}
        shard, row = self._locate(index)
        mapped = self.shards[shard]
        return {
            "doc": int(mapped["doc"][row]),
            "position": int(mapped["position"][row]),
            "value": self._value({name: mapped[name][row].clone() for name in self._names}),
        }

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The items of `indices` (a `DataLoader` asks for a batch at once), read as `take` reads them: each item's
        value is a row of the gathered values (the default collate stacks the rows again, at the cost of a copy)."""
        gathered = self._gather(indices, ["doc", "position", *self._names], "HarvestDataset")
        docs, positions = gathered.pop("doc").tolist(), gathered.pop("position").tolist()
        rows = self._value({name: tensor.unbind(0) for name, tensor in gathered.items()})
        if isinstance(rows, dict):  # a memory of several parts: each item's dict of its rows
            rows = [dict(zip(rows, parts)) for parts in zip(*rows.values())]
        return [
            {"doc": doc, "position": position, "value": value} for doc, position, value in zip(docs, positions, rows)
        ]

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


class ShardShuffle(Sampler[int]):
    """A seeded random order of a harvest's items that keeps reads local: the shards in a random order, taken
    `shards_at_once` at a time, the items of those shards shuffled together. Every item once per epoch; the same
    order for the same seed and epoch (`set_epoch(e)` before each epoch, as `DistributedSampler`)."""

    def __init__(self, starts: Sequence[int], seed: int = 0, shards_at_once: int = 4) -> None:
        self.starts, self.epoch = list(starts), 0
        self.seed, self.shards_at_once = _integer("seed", seed), _integer("shards_at_once", shards_at_once, least=1)

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


def _integer(name: str, value: Any, least: int | None = None) -> int:
    """`value` as an int (an int, a numpy integer; not a bool, not a float), at least `least`."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or least is not None and number < least:
        floor = "" if least is None else f" >= {least}"
        raise InvalidValue(f"HarvestDataset.sampler: expected {name}= an integer{floor}, got {value!r}")
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
