"""Linear probes of every token's state, kept as a reduction: `rh.probe(a, b)`.

    probe = rh.probe(a, b)                                  # a [heads, r, rows], b [heads, r, cols]
    with rh.watch(model, keep=("states",), reduce={"states": probe}) as w:
        model(ids)
    w.mixers[0].states                                      # [batch, seq, heads, r]:
                                                            # sum_ij a[h, k, i] S_t[h, i, j] b[h, k, j]

A linear readout <W_h, S_t,h> of a head's state, with W_h of rank r given as factors (W_h = sum_k a_hk b_hk^T), is
sum_k a_hk^T S_t,h b_hk: r numbers per head and token instead of the state (rows x cols). A full-rank W_h is rank
min(rows, cols): take a = the identity (rows x rows) and b = W_h^T's rows (`probe(torch.eye(rows).expand(heads, -1,
-1), W.transpose(-1, -2))`), which keeps rows numbers per head and token, and costs the einsum below (one pass
over the state per token, as a norm does).

Glossary (code name, symbol, shape):
    states    S_t     [batch, chunk, heads, rows, cols]   a chunk of kept states (the delta rules: key_dim x value_dim;
                                                          Mamba-2: head_dim x d_state); a state without heads,
                                                          [batch, chunk, rows, cols] (Mamba-1: d_inner x d_state), is
                                                          one head; zamba, whose kernel runs once per head, hands
                                                          every head's (head_dim x d_state)
    a         a_hk    [heads, r, rows]                   the left factors
    b         b_hk    [heads, r, cols]                   the right factors
    (result)  -       [batch, chunk, heads, r]            float32

The probe runs on each chunk of kept states (the general path of `reduce`: the states of a chunk are formed,
reduced, and dropped; without gradients, where the kind's all-states kernel hands its chunks over, on the chunks as
the kernel forms them, `Segments.on_chunk`; and for the delta rules and Mamba-2, whose chunk-wise kernels form the
readouts themselves, `Segments.readouts`, without forming the states at all). docs/api.md, "rh.probe", says what it
costs.
"""

import torch
from jaxtyping import Float
from torch import Tensor

from ..engine.errors import InvalidValue

__all__ = ["probe", "Probe"]


class Probe:
    """The reduction `rh.probe(a, b)` returns: `probe(states)` on `[batch, chunk, heads, rows, cols]` gives
    `[batch, chunk, heads, r]` (float32); `a`, `b` are moved to the states' device at the first call."""

    def __init__(self, a: Float[Tensor, "heads r rows"], b: Float[Tensor, "heads r cols"]) -> None:
        for name, value in (("a", a), ("b", b)):
            if not isinstance(value, Tensor) or value.dim() != 3 or not value.is_floating_point():
                got = (
                    f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                    if isinstance(value, Tensor)
                    else type(value).__name__
                )
                axes = "heads, r, rows" if name == "a" else "heads, r, cols"
                raise InvalidValue(f"rh.probe: expected {name} as a float tensor [{axes}], got {got}")
        if a.shape[:2] != b.shape[:2]:
            raise InvalidValue(
                f"rh.probe: expected a [heads, r, rows] and b [heads, r, cols] with the same heads and"
                f" rank, got a {tuple(a.shape)} and b {tuple(b.shape)}"
            )
        self.a, self.b = a.detach().float(), b.detach().float()

    @property
    def linear_factors(self) -> tuple[Tensor, Tensor]:
        """(a, b): what tells the engine this reduction is linear in the state, sum_ij a S b per head and rank, so
        that a kind whose chunk-wise kernel forms such readouts itself (`Segments.readouts`) never forms the states."""
        return self.a, self.b

    def __repr__(self) -> str:
        heads, rank, rows = self.a.shape
        return f"rh.probe(a [{heads}, {rank}, {rows}], b [{heads}, {rank}, {self.b.shape[2]}])"

    def __call__(self, states: Tensor) -> Float[Tensor, "batch chunk heads r"]:
        if not isinstance(states, Tensor):
            raise InvalidValue(
                f"{self!r}: expected states [batch, chunk, heads, rows, cols], got"
                f" {type(states).__name__} (a state of several parts: probe a part in a function of"
                " your own)"
            )
        heads, _, rows = self.a.shape
        cols = self.b.shape[2]
        if states.dim() == 4 and heads == 1:  # a state without heads (Mamba-1): one head
            states = states.unsqueeze(2)
        if states.dim() != 5 or tuple(states.shape[2:]) != (heads, rows, cols):
            raise InvalidValue(
                f"{self!r}: expected states [batch, chunk, {heads}, {rows}, {cols}] (heads, rows, cols"
                f" of the factors), got {tuple(states.shape)}"
            )
        if self.a.device != states.device:
            self.a, self.b = self.a.to(states.device), self.b.to(states.device)
        projected = torch.einsum("bthij,hkj->bthik", states.float(), self.b)  # b t h rows r   S_t b_k
        return torch.einsum("bthik,hki->bthk", projected, self.a)  # b t h r   a_k . S_t b_k


def probe(a: Float[Tensor, "heads r rows"], b: Float[Tensor, "heads r cols"]) -> Probe:
    """A reduction of every kept state to its rank-r linear readouts per head (the module docstring).

    with rh.watch(model, keep=("states",), reduce={"states": rh.probe(a, b)}) as w:
        model(ids)
    w.mixers[0].states            # [batch, seq, heads, r]
    # layers of different shapes: reduce={"states": {0: rh.probe(a0, b0), 2: rh.probe(a2, b2)}}
    """
    return Probe(a, b)
