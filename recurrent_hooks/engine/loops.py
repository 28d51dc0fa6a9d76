"""What the token loops of every kind share: the `on_token` contract, the starting state, refusals, the
chunk-wise decay mask.

Module contents:
- `OnToken`: `on_token(t, state) -> state`, the library's keyword-only argument of every token loop:
  called after token t's update with the state token t+1 would continue from; it returns the state
  token t+1 continues from (the same one, or a hook's or write's replacement).
- `at_least_float32(dtype)`: float32, or the model's dtype where it is wider (float64);
- `starting_state(initial, zeros)`: a float32 copy of the state a call starts from (the cache writes
  into its tensor in place later), or `zeros()` when the call starts from nothing.
- `refuse_packed(kwargs, names, needs)`: packed sequences are refused, naming the package that runs them.
- `causal_decay(cum)`: within a chunk, exp(c_i - c_j) for j <= i and 0 above the diagonal.
- `version_of(window)`, `handed_back_changed(window, version, written)`: whether `on_token` replaced a
  convolution window or changed it in place (then the next positions that read it are recomputed).
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .errors import RecurrentHooksError
from .parts import State

OnToken = Callable[[int, State], State]


def starting_state(initial: Tensor | None, zeros: Callable[[], Tensor], dtype: torch.dtype = torch.float32) -> Tensor:
    """The state a call starts from, in `dtype` (float32 by default) and a copy of the cache's tensor (which is
    written in place later)."""
    return zeros() if initial is None else initial.to(dtype, copy=True)


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype a recurrence computes in where transformers' kernel mixes float32 parameters with the model's
    tensors (torch's promotion): float32 for half precision, the model's dtype above it (float64)."""
    return torch.promote_types(dtype, torch.float32)


def refuse_packed(kwargs: dict[str, Any], names: Iterable[str], needs: str) -> None:
    """Raise for packed sequences, which the token loops (one sequence per batch row) cannot run."""
    for name in names:
        if kwargs.get(name) is not None:
            raise RecurrentHooksError(
                f"packed sequences ({name}) need {needs}; the token loop runs one sequence per batch row")


def version_of(window: Tensor) -> "int | Tensor":
    """What tells an in-place change of the window later: its version counter, or for an inference tensor
    (`torch.inference_mode()`, which has none) a copy of its values."""
    if torch.compiler.is_compiling():
        return 0  # unused: `handed_back_changed` tells a change by identity in a graph
    return window.clone() if window.is_inference() else window._version


def handed_back_changed(window: Tensor, version: "int | Tensor", written: Tensor) -> bool:
    """Whether `on_token` changed the window it was handed (`version`: `version_of` it before the call), in place
    or by returning another tensor; the same values in the same memory and layout count as unchanged."""
    if torch.compiler.is_compiling():  # no version counters in a graph; a hook's result is a new tensor there
        return written is not window
    if window._version != version if isinstance(version, int) else not torch.equal(window, version):
        return True
    return not (written is window or (written.data_ptr() == window.data_ptr() and written.stride() == window.stride()))


def causal_decay(cum: Tensor) -> Tensor:
    """`[i, j, ...]`: exp(cum_i - cum_j) where j <= i (the decay from token j to token i), 0 above the diagonal.

    `cum` is `[i, ...]`, the cumulative log decay from the chunk's start to each token."""
    size = cum.shape[0]
    causal = torch.ones(size, size, dtype=torch.bool, device=cum.device).tril()
    causal = causal.view(size, size, *(1,) * (cum.dim() - 1))
    return (cum[:, None] - cum[None, :]).masked_fill(~causal, -torch.inf).exp()
