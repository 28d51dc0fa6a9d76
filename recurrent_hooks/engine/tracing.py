"""Whether torch.compile is tracing the running code: the package's one place that asks (tests/package/test_layout.py
pins it).

What differs while tracing, each where it happens: the per-call tracker hands out its traced implementation
(`tracker.CallTracker.now`), kept states are copied (no storage queries), a hook's result is a new tensor (no
version counters), the token loop keeps torch's threads, and the adjoint, blocks and chunk-wise reductions are not
taken (their Python-side bookkeeping does not trace).
"""

import torch

# True while torch.compile (dynamo) traces the caller; a constant in the traced graph. torch's own function, not a
# wrapper: the token loops ask it per token, and a wrapper would add a Python call there.
compiling = torch.compiler.is_compiling
