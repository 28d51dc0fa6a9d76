"""Reading a harvest back for training: `data.batches` items/s against `take`'s on the same harvest, in one run.

    python benchmarks/harvest_read.py                  # 16 shards of 4,096 tokens, 4 KiB a token (a minute)
    python benchmarks/harvest_read.py --quick          # 4 shards of 256 tokens (a smoke run)
    python benchmarks/harvest_read.py --batch-size 256 --repeats 5

The harvest: layer 0's states of a small gated DeltaNet (`benchmarks/run.py`'s `_gdn`: hidden 64, 4 value heads of
16 x 16, float32: 4 KiB a token), `--shards` batches of 8 rows of `--tokens` tokens, one shard each, written to a
temporary folder once (removed after), read once untimed (the page cache warm: the rows time the reader, not the
disk). Each row reads one epoch of `--batch-size` items; times are the median over interleaved rounds (one untimed
warm-up round first), as items/s, and "x take" is the median of each round's ratio of the row's items/s to "take,
batches' indices" in the same round. Rows:

- take, file order: `data.take(range(i, i + b))`, consecutive items (the reader's best case);
- take, batches' indices: `data.take(rows)` for the rows of each batch `batches` makes (its shuffled order, each
  batch's rows sorted), computed before the timing: the read alone, the reference;
- batches: `for batch in data.batches(b, seed=0, epoch=round)`, the order made and the items read, with their doc
  and position (what a training loop iterates);
- DataLoader, BatchSampler: `DataLoader(data, sampler=BatchSampler(data.sampler(), b, False), batch_size=None)`,
  `data[indices]` per batch, as docs/harvest.md's "Reading a harvest" gives it.
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch.utils.data import BatchSampler, DataLoader

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from run import VOCAB, _gdn  # noqa: E402  (benchmarks/run.py's model)

import recurrent_hooks as rh  # noqa: E402


def build_harvest(out: pathlib.Path, shards: int, tokens: int) -> rh.HarvestDataset:
    torch.manual_seed(0)
    model = _gdn(64, 2, 4, 16, 128, ["linear_attention"] * 2).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, VOCAB, (8, tokens), generator=generator) for _ in range(shards)]
    rh.harvest(model, batches, out, keep=("states",), layers=[0], progress=False)
    data = rh.HarvestDataset(out, layer=0)
    data.take(range(len(data)))  # (the page cache warm)
    return data


def rows(data: rh.HarvestDataset, size: int) -> dict[str, Callable[[int], int]]:
    """Each row: a function of the round that reads one epoch and returns the items read."""
    indices = [batch_rows(data, size, epoch) for epoch in range(2)]

    def take_file_order(_: int) -> int:
        return sum(len(data.take(range(i, min(i + size, len(data))))) for i in range(0, len(data), size))

    def take_batches(round_: int) -> int:
        return sum(len(data.take(batch)) for batch in indices[round_ % 2])

    def batches(round_: int) -> int:
        return sum(len(batch["doc"]) for batch in data.batches(size, seed=0, epoch=round_ % 2))

    def loader(round_: int) -> int:
        sampler = data.sampler(seed=0)
        sampler.set_epoch(round_ % 2)
        loaded = DataLoader(data, sampler=BatchSampler(sampler, size, drop_last=False), batch_size=None)
        return sum(len(batch["doc"]) for batch in loaded)

    return {
        "take, file order": take_file_order,
        "take, batches' indices": take_batches,
        "batches": batches,
        "DataLoader, BatchSampler": loader,
    }


def batch_rows(data: rh.HarvestDataset, size: int, epoch: int) -> list[torch.Tensor]:
    """The rows (item indices) of each batch of `data.batches(size, seed=0, epoch=epoch)`."""
    where = {key: i for i, key in enumerate(zip(data.docs.tolist(), data.positions.tolist()))}
    return [
        torch.tensor([where[key] for key in zip(batch["doc"].tolist(), batch["position"].tolist())])
        for batch in data.batches(size, seed=0, epoch=epoch)
    ]


def measure(data: rh.HarvestDataset, args: argparse.Namespace) -> dict[str, list[float]]:
    table = rows(data, args.batch_size)
    seconds: dict[str, list[float]] = {row: [] for row in table}
    for round_ in range(args.repeats + 1):
        for row, read in table.items():
            start = time.perf_counter()
            items = read(round_)
            elapsed = time.perf_counter() - start
            if items != len(data):
                raise AssertionError(f"{row} read {items} items of {len(data)}")
            if round_:
                seconds[row].append(elapsed)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 shards of 2 x 128 tokens: a smoke run")
    parser.add_argument("--shards", type=int, default=None, help="batches harvested, one shard each (default 16)")
    parser.add_argument("--tokens", type=int, default=None, help="T of the 8 rows of each batch (default 512)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the harvest is written (default: a temporary folder)")
    args = parser.parse_args(argv)
    shards, tokens = args.shards or (4 if args.quick else 16), args.tokens or (32 if args.quick else 512)
    if args.quick:
        args.batch_size = min(args.batch_size, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            data = build_harvest(pathlib.Path(folder) / "harvest", shards, tokens)
            seconds = measure(data, args)
            report(data, args, seconds)
    finally:
        torch.set_num_threads(threads)
    return 0


def report(data: rh.HarvestDataset, args: argparse.Namespace, seconds: dict[str, list[float]]) -> None:
    reference = seconds["take, batches' indices"]
    size = torch.Size(data.shape).numel() * torch.empty(0, dtype=getattr(torch, data.dtype)).element_size()
    print(
        f"\n{len(data)} tokens in {len(data.shards)} shards, {size / 1024:.0f} KiB a token; batches of"
        f" {args.batch_size}; {args.repeats} rounds, {torch.get_num_threads()} threads"
    )
    print(f"{'row':<28} {'items/s':>12} {'MB/s':>8} {'x take':>10}")
    for row, times in seconds.items():
        rate = len(data) / statistics.median(times)
        ratio = statistics.median(reference[i] / t for i, t in enumerate(times))
        print(f"{row:<28} {rate:>12,.0f} {rate * size / 1e6:>8.0f} {ratio:>9.2f}x")


if __name__ == "__main__":
    sys.exit(main())
