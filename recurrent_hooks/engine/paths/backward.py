"""The backward of a prompt kernel call run in pieces: one reverse sweep, for every backward that needs one.

    grad_state, collected = sweep(ranges, backward_one, grad_final)     # right to left over the pieces
    gradients = input_gradients(pieces, slots, saved, needed, grad_state, collected)

A call run as a `torch.autograd.Function` over its tensors (`tensor_slots` finds them, `with_tensors` puts others
in their place) keeps no graph forward; its backward walks its pieces right to left. Each piece is recomputed from
its boundary state under autograd (`recompute`: the bound kernel, chunks no longer than the piece), which gives
the gradients of its inputs and of the state it started from, given the gradients of its output and of the state it
ended with; what else a piece's backward does (the kind's adjoint recurrence, a token loop with a replacement) is
the caller's. Two take it: every state kept with gradients (`adjoint`: the adjoint fills d m / d S_t) and
attribution patching in pieces (`studies.attribution`: the adjoint, or Mamba-1's token loop, gives the terms).

Glossary (code name, meaning):
    ranges          the [start, end) token ranges of the call, in order, that `sweep` visits right to left
    boundary        the state a range starts from (the call's initial state for the first)
    grad_state      d m / d the state a range ended with, on the way left: d m / d its start state after it
    collected       input name -> [(start, end, gradient or None)] in token order: per-token inputs are put
                    back together along their token axis, the others summed (`input_gradients`)
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import Kernel, Pieces

Collected = dict[str, list[tuple[int, int, Tensor | None]]]
BackwardOne = Callable[[int, int, int, Tensor | None], tuple[Tensor | None, dict[str, Tensor | None]]]


def tensor_slots(args: tuple, kwargs: dict) -> tuple[list[tuple[int | None, str | None]], tuple[Tensor, ...]]:
    """Where a kernel call's tensors are, `(args index, None)` or `(None, key)`, and the tensors (for a Function
    that takes them as its inputs: `with_tensors` puts others in their place)."""
    slots = [(i, None) for i, a in enumerate(args) if isinstance(a, Tensor)]
    slots += [(None, k) for k, v in kwargs.items() if isinstance(v, Tensor)]
    return slots, tuple(args[i] if k is None else kwargs[k] for i, k in slots)


def with_tensors(
    kernel: Kernel, args: tuple, kwargs: dict, slots: list[tuple[int | None, str | None]], tensors: Iterable[Tensor]
) -> Pieces:
    """The call's `Pieces` with `tensors` in the places `slots` names."""
    args, kwargs = list(args), dict(kwargs)
    for (i, key), tensor in zip(slots, tensors):
        if key is None:
            args[i] = tensor
        else:
            kwargs[key] = tensor
    return Pieces(kernel, tuple(args), kwargs)


def slot_names(pieces: Pieces, slots: list[tuple[int | None, str | None]]) -> list[str]:
    """The argument name of each tensor slot."""
    names = [name for name in pieces.bound if name != "kwargs"]
    return [names[i] if key is None else key for i, key in slots]


def piece_leaves(
    pieces: Pieces, start: int, end: int, boundary: Tensor | None, wanted: set[str]
) -> tuple[list[Any], dict[str, Any], dict[str, Tensor], Tensor | None]:
    """The arguments of tokens [start, end) from `boundary`, the `wanted` floating tensors as fresh leaves (and
    the boundary state, as a leaf), chunks no longer than the piece (`Segments.chunk_argument`): `(leading, named,
    leaves by name, state)`. Call under `torch.enable_grad()`."""
    leading, named = pieces.call(start, end, None)
    leaves: dict[str, Tensor] = {}
    for i, name in enumerate(pieces.positional[: len(leading)]):
        if name in wanted and isinstance(leading[i], Tensor) and leading[i].is_floating_point():
            leading[i] = leaves[name] = leading[i].detach().requires_grad_()
    for name in list(named):
        if name in wanted and isinstance(named[name], Tensor) and named[name].is_floating_point():
            named[name] = leaves[name] = named[name].detach().requires_grad_()
    state = None if boundary is None else boundary.detach().requires_grad_()
    named[pieces.segments.state_in] = state
    chunk = pieces.segments.chunk_argument
    if chunk is not None and isinstance(named.get(chunk), int):  # (not padded to the call's chunk length)
        named[chunk] = min(named[chunk], end - start)
    return leading, named, leaves, state


def detached(
    pieces: Pieces, leading: list[Any], named: dict[str, Any], leaves: dict[str, Tensor]
) -> tuple[list[Any], dict[str, Any]]:
    """`piece_leaves`' arguments without their graphs (the leaves and the state detached)."""
    names = pieces.positional[: len(leading)]
    plain = [leaves[name].detach() if name in leaves else value for name, value in zip(names, leading)]
    state_in = pieces.segments.state_in
    named = {name: (leaves[name].detach() if name in leaves else value) for name, value in named.items()}
    if isinstance(named.get(state_in), Tensor):
        named[state_in] = named[state_in].detach()
    return plain, named


def recompute(
    pieces: Pieces,
    run: Callable[..., Any],
    start: int,
    end: int,
    boundary: Tensor | None,
    wanted: set[str],
    grad_out: Tensor | None,
    grad_state: Tensor | None,
) -> tuple[dict[str, Tensor | None], Tensor | None, tuple[list[Any], dict[str, Any]]]:
    """Tokens [start, end) by `run` (the bound kernel, or `Segments.kernel`) from `boundary` under autograd, given
    the gradients of the piece's output (`grad_out`, the piece's slice) and of the state it ends with: the gradients
    of the `wanted` inputs (each narrowed to the piece where it has a token axis), of `boundary`, and the piece's
    arguments without graphs (for what else the piece's backward runs)."""
    with torch.enable_grad():
        leading, named, leaves, state = piece_leaves(pieces, start, end, boundary, wanted)
        out, final = run(*leading, **named)
        outputs = [o for o, g in ((out, grad_out), (final, grad_state)) if g is not None]
        grads_in = [g for g in (grad_out, grad_state) if g is not None]
        targets = list(leaves.values()) + ([state] if state is not None else [])
        grads = (
            torch.autograd.grad(outputs, targets, grads_in, allow_unused=True)
            if outputs and targets
            else (None,) * len(targets)
        )
    plain = detached(pieces, leading, named, leaves)
    return dict(zip(leaves, grads[: len(leaves)])), (grads[-1] if state is not None else None), plain


def sweep(
    ranges: list[tuple[int, int]], backward_one: BackwardOne, grad_final: Tensor | None
) -> tuple[Tensor | None, Collected]:
    """Right to left over `ranges`: `backward_one(index, start, end, grad_state)` gives, from d m / d the state
    range `index` ended with, d m / d the state it started from and the gradients of the inputs it took (by name;
    per-token inputs narrowed to the range). Returns the call's initial state's gradient and what was collected."""
    collected: Collected = {}
    grad_state = grad_final
    for index in reversed(range(len(ranges))):
        start, end = ranges[index]
        grad_state, grads = backward_one(index, start, end, grad_state)
        for name, grad in grads.items():
            collected.setdefault(name, []).append((start, end, grad))
    for found in collected.values():
        found.reverse()  # token order
    return grad_state, collected


def input_gradients(
    pieces: Pieces,
    slots: list[tuple[int | None, str | None]],
    saved: tuple[Tensor, ...],
    needed: tuple[bool, ...],
    grad_state: Tensor | None,
    collected: Collected,
) -> list[Tensor | None]:
    """The gradient of each tensor slot of the call: its initial state's `grad_state`; a per-token input's ranges
    put back together along its token axis (zeros where a range gave none); another input's summed (right to
    left, as the sweep found them); None where not needed."""
    segments = pieces.segments
    result: list[Tensor | None] = []
    for name, tensor, need in zip(slot_names(pieces, slots), saved, needed):
        found = collected.get(name, [])
        if not need or not tensor.is_floating_point():
            result.append(None)
        elif name == segments.state_in:
            result.append(grad_state)
        elif name in segments.per_token:
            axis = segments.per_token[name]
            result.append(
                torch.cat(
                    [
                        torch.zeros_like(tensor.narrow(axis, start, end - start)) if grad is None else grad
                        for start, end, grad in found
                    ],
                    dim=axis,
                )
                if found
                else None
            )
        else:
            total = None
            for _, _, grad in reversed(found):
                if grad is not None:
                    total = grad if total is None else total + grad
            result.append(total)
    return result
