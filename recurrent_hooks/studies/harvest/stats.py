"""Statistics of a harvest's values, formed as its shards are written: per value (each tensor a shard holds,
`<mixer>/<what>[.<part>]`), its token count, every feature's mean and variance (a token's value flattened: its
features), and the mean of its squared norm (over the flattened value), all in float64.

Each shard holds its own (`shard_stats`: `stats/<value>/count`, `mean`, `m2`, the sum of squared deviations from
the shard's mean, and `squared_norm`, their sum over tokens), computed from the values as stored (after `dtype=`),
so they are covered by the shard's SHA-256 and come back with a shard a resumed harvest keeps. The manifest's
`stats` (`write_stats`) merges the shards' in batch order (Chan, Golub and LeVeque's pairwise update), the same on
one rank or several and after a resume: `stats.safetensors` (`<value>/count`, `mean`, `var`, `mean_squared_norm`),
recorded in the manifest with its size and SHA-256. `var` is the population variance (divided by the count).

Module contents: `HarvestStats`, `shard_stats`, `write_stats`, `read_stats`, `STATS` (the shards' tensor prefix).
"""

import dataclasses
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .shards import MappedShard, write_shard

__all__ = ["HarvestStats", "shard_stats", "write_stats", "read_stats", "STATS"]

STATS = "stats/"
FILE = "stats.safetensors"
_ELEMENTS = 1 << 21  # values made float64 at a time (a shard's values are not copied whole)


@dataclasses.dataclass(frozen=True)
class HarvestStats:
    """One value's statistics over every harvested token, float64: `count` (0-d), `mean` and `var` (population)
    per feature `[features]` (the per-token value flattened), `mean_squared_norm` (0-d)."""

    count: Tensor
    mean: Tensor
    var: Tensor
    mean_squared_norm: Tensor


def shard_stats(tensors: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Tensor]:
    """The statistics of a shard's values `names` (each `[tokens, ...]`), as tensors to store in it: one pass over
    the values, a few rows made float64 at a time (at most `_ELEMENTS` values: a chunk's temporaries stay small at
    a full state's width), each chunk's moments merged into the shard's (`_merged`)."""
    out = {}
    for name in names:
        x = tensors[name].reshape(tensors[name].shape[0], -1)
        rows = max(1, _ELEMENTS // max(x.shape[1], 1))
        moments: list[Any] = [0, torch.zeros(x.shape[1], dtype=torch.float64), None, 0.0]
        moments[2] = torch.zeros_like(moments[1])
        for chunk in x.split(rows):
            wide = chunk.to(torch.float64)
            mean = wide.mean(0)
            m2 = (wide - mean).square_().sum(0)
            moments = _merged(moments, [len(wide), mean, m2, float(wide.square().sum())])
        out[f"{STATS}{name}/count"] = torch.tensor([moments[0]], dtype=torch.int64)
        out[f"{STATS}{name}/mean"] = moments[1]
        out[f"{STATS}{name}/m2"] = moments[2]
        out[f"{STATS}{name}/squared_norm"] = torch.tensor([moments[3]], dtype=torch.float64)
    return out


def _merged(total: list[Any], part: list[Any]) -> list[Any]:
    """Moments `[count, mean, m2, squared_norm]` of two sets of tokens merged (Chan, Golub and LeVeque)."""
    if total[0] == 0:
        return [part[0], part[1], part[2], total[3] + part[3]]
    if part[0] == 0:
        return total
    n = total[0] + part[0]
    delta = part[1] - total[1]
    return [
        n,
        total[1] + delta * (part[0] / n),
        total[2] + part[2] + delta.square() * (total[0] * part[0] / n),
        total[3] + part[3],
    ]


def _merge(total: list[Any], shard: MappedShard, name: str) -> list[Any]:
    """Moments `[count, mean, m2, squared_norm]` with a shard's merged in."""
    count = int(shard[f"{STATS}{name}/count"][0])
    mean, m2 = shard[f"{STATS}{name}/mean"].clone(), shard[f"{STATS}{name}/m2"].clone()
    return _merged(total, [count, mean, m2, float(shard[f"{STATS}{name}/squared_norm"][0])])


def write_stats(out: pathlib.Path, shards: list[pathlib.Path], rank: int = 0) -> dict[str, Any] | None:
    """Every shard's statistics merged in batch order, in `out/stats.safetensors`; returns its record for the
    manifest (None without shards)."""
    if not shards:
        return None
    first = MappedShard(shards[0])
    names = sorted({key.removeprefix(STATS).rsplit("/", 1)[0] for key in first.header if key.startswith(STATS)})
    totals: dict[str, list[Any]] = {name: [0, None, None, 0.0] for name in names}
    for path in shards:  # (in batch order: one shard mapped at a time)
        shard = MappedShard(path)
        for name in names:
            totals[name] = _merge(totals[name], shard, name)
    tensors = {}
    for name, total in totals.items():
        count = max(total[0], 1)
        tensors[f"{name}/count"] = torch.tensor(float(total[0]), dtype=torch.float64)
        tensors[f"{name}/mean"] = total[1]
        tensors[f"{name}/var"] = total[2] / count
        tensors[f"{name}/mean_squared_norm"] = torch.tensor(total[3] / count, dtype=torch.float64)
    size, sha256 = write_shard(out / FILE, tensors, {}, rank)
    return {"file": FILE, "bytes": size, "sha256": sha256}


def read_stats(out: pathlib.Path, names: Iterable[str]) -> dict[str, HarvestStats]:
    """The merged statistics of the values `names` (copies, not views of the mapping)."""
    mapped = MappedShard(out / FILE)
    return {
        name: HarvestStats(
            *(mapped[f"{name}/{field}"].clone() for field in ("count", "mean", "var", "mean_squared_norm"))
        )
        for name in names
    }
