"""Benchmark: one gated DeltaNet prompt call through each path, in one run: the ground a cost model stands on.

    python benchmarks/kernel_paths.py

For each shape (batch, T, heads, head dim), the time of one call, best of 3, in ms, and each path's ratio to
transformers' chunked kernel (`torch_chunk_gated_delta_rule`, what an idle call runs):
- "loop": the library's token loop (`chunk_gated_delta_rule`);
- "loop + hook": the same with an identity `on_token`, as a hook on every token runs;
- "states": the library's chunk-wise kernel that returns every token's state (`chunk_gated_delta_rule_states`).
No gradients, 2 threads. A call run in segments costs about one chunked call per segment.
"""

import time

import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

from recurrent_hooks.kinds.gated_delta_net import chunk_gated_delta_rule, chunk_gated_delta_rule_states

SHAPES = [(1, 25, 4, 16), (64, 25, 4, 16), (1, 512, 4, 16), (1, 512, 16, 128), (8, 128, 16, 64), (1, 2048, 16, 128)]


def _inputs(batch: int, seq: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(3))
    return q, k, v, -torch.rand(batch, seq, heads, generator=gen), torch.rand(batch, seq, heads, generator=gen)


def _best(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(2)
    chunked = modeling.torch_chunk_gated_delta_rule
    kwargs = dict(initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    print("batch   T heads dim | chunked ms |  loop  loop+hook  states (x chunked)")
    with torch.no_grad():
        for shape in SHAPES:
            x = _inputs(*shape)
            base = _best(lambda: chunked(*x, **kwargs))
            paths = [
                _best(lambda: chunk_gated_delta_rule(*x, **kwargs)),
                _best(lambda: chunk_gated_delta_rule(*x, on_token=lambda t, s: s, **kwargs)),
                _best(lambda: chunk_gated_delta_rule_states(*x, **kwargs)),
            ]
            print(
                f"{shape[0]:5} {shape[1]:4} {shape[2]:5} {shape[3]:3} | {base * 1e3:10.1f} |"
                + "".join(f" {p / base:6.2f}" for p in paths)
            )


if __name__ == "__main__":
    main()
