"""Every state of a prompt call kept with gradients on, without the token loop: the kind's chunk-wise
all-states kernel forward, its adjoint recurrence backward (`kernels.Segments.adjoint`).

    with rh.watch(model, keep=("states",)) as w:        # gradients on, every state kept
        metric = model(ids).logits[0, -1].logsumexp(-1)
    torch.autograd.grad(metric, w.mixers[0].states)     # d metric / d S_t at every t, one backward

Glossary (symbol, shape):
    S_t     the state after token t                  [batch, *state]
    X       every kept state, the tensor handed out  [batch, seq, *state]   (`.states`; `state_after(t)` is X_t)
    mu_t    d m / d S_t through the outputs after t  [batch, *state]        (what a write at t changes)
    G_t     the gradient a use of X_t itself sends   [batch, *state]        (a metric that reads a kept state)
    P_t     G_t + d S_{t+1} / d S_t ^T P_{t+1}       [batch, *state]        (those uses, through the later tokens)

What the token loop gives, this path gives: `autograd.grad(m, X)` is mu_t + P_t at every t, and gradients reach
the call's inputs (and so every earlier layer) through its output, its last state and the kept states. The graph:
- `_States` (inputs -> X): the all-states kernel (no graph of its own). A hook on X sees what reached it,
  mu_t + G_t: G = that - mu (nothing when nothing used X: it is mu, bit for bit); where G is not zero it
  adds P - G (the kind's adjoint with G as sources), and `_States`' backward sends the inputs the gradient of
  sum_t <G_t, S_t> through the kind's token loop under autograd (the slow path, only then);
- `_Readout` (inputs, X_0..X_{T-1} -> output, last state): hands out the output the forward computed. Its
  backward is the engine's reverse sweep over pieces of `PIECE` tokens (`backward.sweep`): each recomputed under
  autograd from its saved boundary state (the inputs' and the initial state's gradients, chunk-wise, as a plain
  backward: `backward.recompute`), then the kind's adjoint over it: d / d X_t = mu_t.
Known limit: where the value differentiated uses kept states themselves (G not zero), the gradient taken with
respect to `state_after(t)` (X_t, read before the hook on X) lacks P_t - G_t, and so does the one with respect to
`.states` when the same `autograd.grad` call also asks for an input's gradient (PyTorch takes a tensor's
gradient before its hooks when its node runs too); the inputs' gradients have it. A `RecurrentHooksWarning`
says so whenever G is not zero; the token loop (`Paths(rule="loop")`) has no such limit.
Memory: X (seq x state, kept by the user's request) plus, in the backward, one piece's recompute.
"""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import Kernel, Pieces
from ..errors import RecurrentHooksWarning
from .backward import input_gradients, recompute, slot_names, sweep, tensor_slots, with_tensors

PIECE = 64  # tokens per recomputed piece in the backward


@dataclasses.dataclass
class _Spec:
    """The non-tensor side of one call: how its tensors go back into the kernel's arguments, and what the
    Functions of one backward hand each other."""

    kernel: Kernel
    original: Callable[..., Any]
    args: tuple
    kwargs: dict
    slots: list[tuple[int | None, str | None]]  # where each tensor input goes: (args index, None) or (None, key)
    where: str = ""  # mixer and call, for the warning
    out: Any = None  # the forward's (output, last state), handed out by _Readout
    boundaries: list[Tensor | None] = dataclasses.field(default_factory=list)  # the state every PIECE tokens
    mu: Tensor | None = None  # d / d X from _Readout's backward, [batch, seq, *state]
    used: Tensor | None = None  # G, found by the hook on X

    def pieces(self, tensors: tuple[Tensor, ...]) -> Pieces:
        return with_tensors(self.kernel, self.args, self.kwargs, self.slots, tensors)


def keep_every_state(
    kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict, where: str = ""
) -> tuple[Any, Tensor, tuple[Tensor, ...]]:
    """Run a prompt call keeping every state with gradients: the kernel's result, X `[batch, seq, *state]`, and
    X_t for every t (the views the graph reads: `state_after(t)`). `where` names the mixer and call."""
    slots, tensors = tensor_slots(args, kwargs)
    spec = _Spec(kernel, original, args, kwargs, slots, where)
    anchor = torch.zeros((), device=tensors[0].device, requires_grad=True)  # X requires grad when no input does
    states = _States.apply(spec, anchor, *tensors)
    states.register_hook(lambda grad: _through_uses(spec, tensors, grad))
    per_token = _PerToken.apply(spec, states)
    out, final = _Readout.apply(spec, *tensors, *per_token)
    return spec.pieces(tensors).result([out], final), states, per_token


def _through_uses(spec: _Spec, tensors: tuple[Tensor, ...], grad: Tensor) -> Tensor | None:
    """The hook on X: where the value differentiated used kept states itself (G), add their effect through
    the later tokens (P - G), and leave G for `_States`' backward."""
    if spec.mu is None:  # (_Readout's backward did not run: nothing reached the outputs)
        spec.used = grad
        mu = torch.zeros_like(grad)
    else:
        mu, spec.mu = spec.mu, None
        if grad is mu or torch.equal(grad, mu):
            return None
        spec.used = grad - mu
    used = spec.used
    tokens = [t for t in range(used.shape[1]) if bool(used[:, t].any())]
    warnings.warn(
        RecurrentHooksWarning(
            f"{spec.where}: the value differentiated uses this call's kept states themselves (tokens {tokens[:8]}"
            f"{' ...' if len(tokens) > 8 else ''}). The inputs' gradients include that use; gradients taken with"
            " respect to kept states do not include its effect through the later tokens on this path (every state"
            " kept with gradients, chunk-wise): state_after(t) never, .states when the same autograd.grad call also"
            " takes an input's gradient. For those, keep with paths=rh.Paths(rule='loop')"
        ),
        stacklevel=2,
    )
    detached = tuple(t.detach() for t in tensors)
    pieces = spec.pieces(detached)
    leading, named = pieces.call(0, pieces.tokens, pieces.state)
    through = torch.empty_like(used)  # P

    def visit(t: int, later: Tensor) -> Tensor:  # later: d S_{t+1} / d S_t ^T P_{t+1} (G_{T-1} at the last token)
        if t != pieces.tokens - 1:
            later = later + used[:, t]  # P_t
        through[:, t].copy_(later)
        return later

    with torch.no_grad():
        spec.kernel.segments.adjoint(*leading, grad_output=None, grad_final=used[:, -1], visit=visit, **named)
    return mu + through


class _States(torch.autograd.Function):
    """inputs -> X, by the all-states kernel; the backward sends the inputs what a use of X itself adds."""

    @staticmethod
    def forward(ctx: Any, spec: _Spec, anchor: Tensor, *tensors: Tensor) -> Tensor:
        pieces = spec.pieces(tensors)
        leading, named = pieces.call(0, pieces.tokens, pieces.state)
        (out, final), every = spec.kernel.segments.all_states(*leading, **named)  # t b *state
        spec.out = (out, final)
        spec.boundaries = [pieces.state] + [every[end - 1].clone() for end in range(PIECE, pieces.tokens, PIECE)]
        ctx.spec = spec
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)
        return every.movedim(0, 1).contiguous()  # (at batch 1 the view itself: no copy)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Any, ...]:
        spec = ctx.spec
        used, spec.used = spec.used, None
        if used is None or not any(ctx.needs_input_grad[2:]):
            return (None,) * (2 + len(ctx.saved_tensors))
        return (None, None, *_through_the_loop(spec, ctx.saved_tensors, ctx.needs_input_grad[2:], used))


def _through_the_loop(
    spec: _Spec, saved: tuple[Tensor, ...], needed: tuple[bool, ...], used: Tensor
) -> list[Tensor | None]:
    """The inputs' gradients of sum_t <G_t, S_t>, through the kind's token loop under autograd."""
    with torch.enable_grad():
        leaves = [
            t.detach().requires_grad_() if need and t.is_floating_point() else t.detach()
            for t, need in zip(saved, needed)
        ]
        pieces = spec.pieces(tuple(leaves))
        leading, named = pieces.call(0, pieces.tokens, pieces.state)
        total: list[Tensor] = []

        def on_token(t: int, state: Tensor) -> Tensor:
            total.append((state * used[:, t].to(state.dtype)).sum())
            return state

        spec.kernel.loop(*leading, on_token=on_token, **named)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad(torch.stack(total).sum(), wanted, allow_unused=True) if wanted else ())
    return [next(grads) if leaf.requires_grad else None for leaf in leaves]


class _PerToken(torch.autograd.Function):
    """X -> X_0 .. X_{T-1}, the views `state_after(t)` returns. Its backward hands back `_Readout`'s gradient
    buffer itself when the views' gradients are its own views, unchanged (nothing else used the states): an
    unbind's backward would stack them into a second seq x state tensor."""

    @staticmethod
    def forward(ctx: Any, spec: _Spec, states: Tensor) -> tuple[Tensor, ...]:
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return states.unbind(1)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        mu = ctx.spec.mu
        if mu is not None and all(
            g is not None and g.data_ptr() == m.data_ptr() and g.stride() == m.stride()
            for g, m in zip(grads, mu.unbind(1))
        ):
            return None, mu
        first = next((g for g in grads if g is not None), None)
        if first is None:
            return None, None
        return None, torch.stack([torch.zeros_like(first) if g is None else g for g in grads], dim=1)


class _Readout(torch.autograd.Function):
    """(inputs, X_0..X_{T-1}) -> (output, last state): the forward's; the backward by pieces and the adjoint."""

    @staticmethod
    def forward(ctx: Any, spec: _Spec, *tensors_and_states: Tensor) -> tuple[Tensor, Tensor]:
        tensors = tensors_and_states[: len(spec.slots)]
        ctx.spec = spec
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)
        out, final = spec.out
        spec.out = None
        return out, final

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None, grad_final: Tensor | None) -> tuple[Any, ...]:
        spec = ctx.spec
        saved = tuple(t.detach() for t in ctx.saved_tensors)
        needed = ctx.needs_input_grad[1 : 1 + len(saved)]
        segments = spec.kernel.segments
        pieces = spec.pieces(saved)
        run = segments.kernel or spec.original
        tokens = pieces.tokens
        wanted = {name for name, need in zip(slot_names(pieces, spec.slots), needed) if need}
        mu: list[Tensor] = []  # d / d X_t, [batch, seq, *state], made at the first visit and filled piece by piece

        def backward_one(index: int, start: int, end: int, grad_state: Tensor | None) -> tuple[Any, Any]:
            piece_grad = None if grad_out is None else grad_out.narrow(segments.out_axis, start, end - start)
            grads, state_grad, (leading, named) = recompute(
                pieces, run, start, end, spec.boundaries[index], wanted, piece_grad, grad_state
            )

            def visit(t: int, m: Tensor) -> None:
                if not mu:
                    mu.append(m.new_empty((m.shape[0], tokens, *m.shape[1:])))
                mu[0][:, start + t].copy_(m)

            with torch.no_grad():
                segments.adjoint(*leading, grad_output=piece_grad, grad_final=grad_state, visit=visit, **named)
            return state_grad, grads

        ranges = [(start, min(start + PIECE, tokens)) for start in range(0, tokens, PIECE)]
        grad_state, collected = sweep(ranges, backward_one, grad_final)
        spec.mu = mu[0]
        return (None, *input_gradients(pieces, spec.slots, saved, needed, grad_state, collected), *spec.mu.unbind(1))
