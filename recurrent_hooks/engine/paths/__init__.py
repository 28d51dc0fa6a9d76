"""How a busy kernel call runs (one with hooks, writes or kept values): which path it takes (`choose`, by the cost
model of `costs` and its calibrations in costs.json, within the memory `budget`), one runner per path (`runners`:
segments of the bound kernel, the chunk-wise states, blocks, chunk-wise reductions, the token loop), the blocks
(`blocks`), every state with gradients through the kind's adjoint (`adjoint`, on `backward`'s one reverse sweep
over a call's pieces) and what the path hands each token's memory to (`visitor`: keeps, hooks, writes). The paths
themselves are listed once, in `policy.Strategy`."""
