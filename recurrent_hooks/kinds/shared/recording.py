"""A forward over a cache that records its past (assisted and prompt-lookup decoding), said once for the kinds whose
transformers modeling code splits it: the limit `support` lists, under one name.

- `RECORDING`: the limit's name, the key in a kind's `LIMITS` (zaya's, under transformers 5.24, has the same name);
- `SPLIT_RECORDING`: `{RECORDING: limit}` for the kinds that declare it (gated DeltaNet, Kimi delta attention,
  Mamba-1 but zamba's per-head scan, Mamba-2), `{}` where nothing is limited.

The library serves such a forward as one call (`engine.tracking.tracker`: a split forward's tokens count across its
kernel calls), so the entry is a `Caveat`: what differs is said once here, and docs/concepts.md ("Known limits")
says the same in words.
"""

from ...engine.binding.upstream import is_at_least
from ...engine.declare.limits import Caveat

RECORDING = "assisted decoding / prompt-lookup decoding (a recording cache)"

# transformers 5.25's modeling code of these kinds' families reads `cache.get_recurrent_states_to_keep()` (5.24's
# `activate_past_recording` takes no such count, and such a forward is one prompt-kernel call like any continuation)
SPLIT_RECORDING = (
    {
        RECORDING: Caveat(
            "transformers 5.25 runs a forward of several tokens over a cache that records its past with"
            " recurrent_states_to_keep=k as a prompt-kernel call followed by k one-token decode-kernel calls; the watch"
            " records it as one call (its tokens count across them, call.kernels lists them, call.split is True) and a"
            " rollback of the cache as the next call's continues_from. Effective attention and call.differentiable"
            " refuse"
            " such a call (each kernel call's inputs and outputs are in call.kernel_calls)",
        )
    }
    if is_at_least(5, 25)
    else {}
)
