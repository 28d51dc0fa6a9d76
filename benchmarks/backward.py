"""Benchmark: the token loops under autograd, forward + backward, at growing T: is the time linear in the tokens?

    python benchmarks/backward.py                    # T = 256, 1,024, 4,096 (about a minute on 2 cores)
    python benchmarks/backward.py --tokens 256,1024  # fewer lengths
    python benchmarks/backward.py --width 256        # narrower channels

Per kind, the library's token loop is run on random inputs that require grad, with a hook on every token (the
identity: what a kept state with gradients or a reading hook costs), and one backward of the outputs' sum. A loop
whose per-token work reads or writes a slice of a whole-sequence tensor has a backward quadratic in T (each
slice's gradient is a whole-sequence tensor); one that unbinds its inputs once and stacks its outputs once is
linear. Printed: seconds per row and the ratio of each T's time to the previous T's (4x the tokens: 4 when
linear). Kinds: RG-LRU's scan (recurrent_gemma, width `--width`), RWKV-4's WKV (channels `--width`), the mLSTM
(xlstm, 4 heads of `--width` / 4), lightning attention's per-token branch (minimax, 4 heads of `--width` / 16),
the short convolution's window loop (`--width` channels, kernel 4; a window kept with gradients recomputes every
position from its window into a list stacked once). The dynamic convolution's and zaya's window loops unbind and
stack the same way.
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's package
import types  # noqa: E402

from recurrent_hooks.kinds import lightning, mlstm, rg_lru, wkv  # noqa: E402
from recurrent_hooks.kinds.shared import conv  # noqa: E402


def _identity(t, state):
    return state


def _rg_lru(tokens: int, width: int):
    x = torch.randn(1, tokens, width, requires_grad=True)
    gate = torch.rand(1, tokens, width, requires_grad=True)
    reset = torch.zeros(1, tokens, 1, dtype=torch.bool)
    return [x, gate], lambda: rg_lru.rnn_scan(None, x, gate, reset, None, on_token=_identity)[0]


def _wkv(tokens: int, width: int):
    decay, first = torch.randn(width, requires_grad=True), torch.randn(width, requires_grad=True)
    key, value = torch.randn(1, tokens, width, requires_grad=True), torch.randn(1, tokens, width, requires_grad=True)
    return [key, value], lambda: wkv.rwkv_linear_attention(decay, first, key, value, on_token=_identity)[0]


def _mlstm(tokens: int, width: int):
    heads, dim = 4, max(1, width // 4)
    q, k, v = (torch.randn(1, heads, tokens, dim, requires_grad=True) for _ in range(3))
    igate, fgate = torch.randn(1, heads, tokens, requires_grad=True), torch.randn(1, heads, tokens, requires_grad=True)
    state = mlstm.MLSTMState(torch.zeros(1, heads, dim, dim), torch.zeros(1, heads, dim), torch.zeros(1, heads, 1))
    return [q, k, v], lambda: mlstm._mlstm(q, k, v, igate, fgate, state, 1e-6, torch.float32, _identity)[0]


def _lightning(tokens: int, width: int):
    heads, dim = 4, max(1, width // 16)
    q, k, v = (torch.randn(1, heads, tokens, dim, requires_grad=True) for _ in range(3))
    module = types.SimpleNamespace(slope_rate=torch.rand(heads, 1, 1))
    state = torch.zeros(1, heads, dim, dim)
    return [q, k, v], lambda: torch.cat(lightning._per_token(module, q, k, v, state, 0, tokens, _identity)[0], dim=2)


def _conv(tokens: int, width: int):
    x = torch.randn(1, width, tokens, requires_grad=True)
    weight, bias = torch.randn(width, 4, requires_grad=True), torch.randn(width, requires_grad=True)
    return [x, weight], lambda: conv.causal_conv1d_fn(x, weight, bias, "silu", on_token=_identity)


KINDS = {
    "rg_lru (recurrent_gemma)": _rg_lru,
    "wkv (rwkv)": _wkv,
    "mlstm (xlstm)": _mlstm,
    "lightning (minimax, per token)": _lightning,
    "short conv window (causal_conv1d_fn, kernel 4)": _conv,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,1024,4096")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(t) for t in args.tokens.split(",")]
    print(
        f"forward + backward of each token loop with a hook on every token; width {args.width}, batch 1,"
        f" {args.threads} threads, median of {args.repeats} (+1 warm-up)"
    )
    for name, make in KINDS.items():
        times = []
        for tokens in lengths:
            torch.manual_seed(0)
            leaves, run = make(tokens, args.width)
            seconds = []
            for round_ in range(args.repeats + 1):
                start = time.perf_counter()
                torch.autograd.grad(run().float().sum(), leaves)
                if round_:
                    seconds.append(time.perf_counter() - start)
            times.append(statistics.median(seconds))
        cells = [
            f"T={t}: {s:.3f} s" + (f" ({s / times[i - 1]:.1f}x)" if i else "")
            for i, (t, s) in enumerate(zip(lengths, times))
        ]
        print(f"{name}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
