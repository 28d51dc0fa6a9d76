"""What a harvest costs: `rh.harvest`'s tokens/s against the plain forward's, per what is kept, in one run.

    python benchmarks/harvest.py                       # Qwen3.5 and mamba2-130m layer dims, T = 2048 (minutes)
    python benchmarks/harvest.py --quick               # tiny dims, a few seconds (a smoke run)
    python benchmarks/harvest.py --models gdn --tokens 512 --states-tokens 256 --repeats 3

The models are `benchmarks/run.py`'s `gdn` (two gated DeltaNet layers at Qwen3.5 layer dims: 32 value heads of
128 x 128, a state of 2 MiB a token) and `mamba2` (two Mamba-2 layers at mamba2-130m dims: 24 heads of 64 x 128),
random weights, float32, batch 1, vocabulary 1,024. Each row harvests `--batches` batches of `[1, T]` ids into a
fresh directory (removed after); the reference is the plain forward of the same batches (`use_cache=False`, no
gradients). Times are the median over interleaved rounds (one untimed warm-up round first) of t(row) / t(forward)
in the same round, and tokens/s is the row's median. Rows:

- norm: `keep=("states",), reduce={"states": norm}`, a per-token norm of each state;
- norm, from text: the same, from texts through a tokenizer (`rh.harvest(model, texts, out, tokenizer=...,
  context=T)`: a word-level tokenizer of the vocabulary, one text of T - 1 words and its eos a batch), tokenization
  included;
- probe: `reduce={"states": rh.probe(a, b)}`, rank 8 on every head of every layer;
- writes: the kernel values the layer writes from (gated DeltaNet: key, value, beta; Mamba-2: x, dt, B);
- states: every state, at `--states-tokens` tokens (a full-dims state is 2 MiB a token and layer: T = 2048 would
  write 8 GiB a batch). Beside it, the disk's floor: its bytes over the write bandwidth measured here (a
  256 MiB file written and flushed to the disk), as seconds and as a ratio to that row's forward.
"""

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from run import VOCAB, _gdn, _mamba2  # noqa: E402  (benchmarks/run.py's models)

import recurrent_hooks as rh  # noqa: E402

WRITES = {"GatedDeltaNet": ("key", "value", "beta"), "Mamba2StateSpace": ("x", "dt", "B")}
RANK = 8


def _models(quick: bool) -> dict[str, Callable[[], Any]]:
    if quick:
        return {
            "gdn": lambda: _gdn(64, 2, 4, 16, 128, ["linear_attention"] * 2),
            "mamba2": lambda: _mamba2(64, 4, 32, 16, 16),
        }
    return {
        "gdn": lambda: _gdn(2048, 16, 32, 128, 6144, ["linear_attention"] * 2),
        "mamba2": lambda: _mamba2(768, 24, 64, 128, 256),
    }


def norm(states: torch.Tensor) -> torch.Tensor:
    return states.flatten(2).norm(dim=-1)


def _probe(model: Any) -> Any:
    """A rank-8 probe of the model's state shape (every layer has the same)."""
    with torch.no_grad(), rh.watch(model, keep={"states": [0]}) as w:
        model(torch.randint(3, VOCAB, (1, 2)), use_cache=False)
    state = w.mixers[0].state_after(0)  # [1, heads, rows, cols]
    heads, rows, cols = state.shape[1:]
    generator = torch.Generator().manual_seed(0)
    return rh.probe(
        torch.randn(heads, RANK, rows, generator=generator), torch.randn(heads, RANK, cols, generator=generator)
    )


def write_bandwidth(directory: pathlib.Path, size: int = 256 << 20) -> float:
    """Bytes per second of one file of `size` bytes written and flushed to the disk."""
    path = directory / "bandwidth.bin"
    block = bytes(size)
    start = time.perf_counter()
    with open(path, "wb") as file:
        file.write(block)
        file.flush()
        os.fsync(file.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return size / seconds


def _tokenizer() -> Any:
    """A word-level tokenizer of the benchmark's vocabulary: token i is the word `w{i}`, but for its specials `<pad>`
    (0), `<eos>` (2) and `<unk>` (3), whose strings no word contains (a special token's string is matched inside
    the text before the words are split)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"w{i}": i for i in range(VOCAB)} | {"<pad>": 0, "<eos>": 2, "<unk>": 3}
    for special in ("w0", "w2", "w3"):
        del vocabulary[special]
    words = Tokenizer(WordLevel(vocabulary, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def _rows(
    model: Any, kind: str, ids: list[torch.Tensor], states_ids: list[torch.Tensor], directory: pathlib.Path
) -> dict[str, tuple[Callable[[], Any], list[torch.Tensor]]]:
    probe = _probe(model)
    tokenizer, tokens = _tokenizer(), ids[0].shape[1]
    texts = [" ".join(f"w{i}" for i in batch[0, : tokens - 1].tolist()) for batch in ids]  # + eos: T tokens

    def harvest(batches: list[torch.Tensor], **keep: Any) -> Callable[[], Any]:
        def run() -> Any:
            out = directory / "harvest"
            shutil.rmtree(out, ignore_errors=True)
            result = rh.harvest(model, batches, out, progress=False, forward_kwargs={"use_cache": False}, **keep)
            shutil.rmtree(out)
            return result

        return run

    def forward(batches: list[torch.Tensor]) -> Callable[[], Any]:
        def run() -> None:
            with torch.no_grad():
                for batch in batches:
                    model(batch, use_cache=False)

        return run

    return {
        "forward": (forward(ids), ids),
        "norm": (harvest(ids, keep=("states",), reduce={"states": norm}), ids),
        "norm, from text": (
            harvest(
                texts, keep=("states",), reduce={"states": norm}, tokenizer=tokenizer, context=tokens, batch_size=1
            ),
            ids,
        ),
        f"probe (rank {RANK})": (harvest(ids, keep=("states",), reduce={"states": probe}), ids),
        f"writes ({', '.join(WRITES[kind])})": (harvest(ids, keep=WRITES[kind]), ids),
        "forward, states' tokens": (forward(states_ids), states_ids),
        "states": (harvest(states_ids, keep=("states",)), states_ids),
    }


def run_model(
    name: str, build: Callable[[], Any], args: argparse.Namespace, directory: pathlib.Path, bandwidth: float
) -> None:
    torch.manual_seed(0)
    model = build().eval()
    kind = rh.support(model)[0].kind
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, VOCAB, (1, args.tokens), generator=generator) for _ in range(args.batches)]
    states_ids = [batch[:, : args.states_tokens] for batch in ids]
    rows = _rows(model, kind, ids, states_ids, directory)
    times: dict[str, list[float]] = {row: [] for row in rows}
    written: dict[str, int] = {}
    for round_ in range(args.repeats + 1):
        for row, (fn, _) in rows.items():
            start = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - start
            if round_:
                times[row].append(seconds)
            if isinstance(result, rh.Harvest):
                written[row] = result.bytes
    print(
        f"\n{name}: {kind}, T = {args.tokens} ({args.states_tokens} for the states row), {args.batches} batches"
        f" of 1, {args.repeats} rounds; write bandwidth {bandwidth / 1e9:.2f} GB/s"
    )
    print(f"{'row':<34} {'time / forward':>15} {'tokens/s':>10} {'bytes':>10}  disk floor")
    for row, (_, batches) in rows.items():
        reference = "forward, states' tokens" if batches is states_ids else "forward"
        ratios = [t / r for t, r in zip(times[row], times[reference])]
        tokens = sum(batch.numel() for batch in batches)
        floor = ""
        if row == "states":
            seconds = written[row] / bandwidth
            floor = f"{seconds:.2f} s = {seconds / statistics.median(times[reference]):.2f} x the forward"
        print(
            f"{row:<34} {statistics.median(ratios):>14.2f}x {tokens / statistics.median(times[row]):>10.0f}"
            f" {_size(written.get(row, 0)):>10}  {floor}"
        )


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}"
        count /= 1000
    return f"{count:.0f} TB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny dims, T = 64: a smoke run")
    parser.add_argument("--models", default="gdn,mamba2", help="comma-separated: gdn, mamba2")
    parser.add_argument("--tokens", type=int, default=None, help="T per batch (default 2048; 64 with --quick)")
    parser.add_argument("--states-tokens", type=int, default=None, help="T of the states row (default 256; 64 quick)")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the harvests are written (default: a temporary folder)")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (64 if args.quick else 2048)
    args.states_tokens = min(args.tokens, args.states_tokens or (64 if args.quick else 256))
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    models = _models(args.quick)
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            directory = pathlib.Path(folder)
            bandwidth = write_bandwidth(directory, (16 if args.quick else 256) << 20)
            for name in args.models.split(","):
                run_model(name, models[name], args, directory, bandwidth)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
