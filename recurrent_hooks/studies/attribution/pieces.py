"""`attribute(method="pieces")`'s machinery: the takeovers of its runs and the backward of a call in pieces.

    clean = CleanPieces(piece)            # the clean run: the bound kernel in pieces, the boundary states kept
    corrupt = CorruptPieces(clean, piece, where)   # the corrupt run: each prompt call one `InPieces` Function

`InPieces`' backward is the engine's reverse sweep over the call's pieces (`engine.paths.backward.sweep`): with the
kind's adjoint (`AdjointPiece`: the state term (S_t - S'_t) . mu_t), or, for Mamba-1, its token loop under
autograd in steps with a zero leaf eps in the state (`LoopSteps`, `backward_step`). The prompt convolution's
window term comes from its inputs and the gradient of a zero leaf added before its activation (`ConvCall`,
`window_row`, the conv kernel's `Kernel.window_terms`). The package's `__init__` has the study (`attribute`) and
its module docstring the maths.
"""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ...engine.declare.kernels import CONV_MEMORY, STATE_MEMORY, Kernel, Pieces, Role
from ...engine.errors import InvalidValue
from ...engine.handle.mixer import RecurrentMixer
from ...engine.paths.backward import (
    input_gradients,
    piece_leaves,
    recompute,
    slot_names,
    sweep,
    tensor_slots,
    with_tensors,
)

STEP_BYTES = 32 * 2**20  # the states of the token loop's graph held at once in the backward of "pieces"


def conv_kernel(kind: type[RecurrentMixer]) -> Kernel | None:
    """The kind's prompt convolution when it declares its window term (`Kernel.window_terms`: the shared one),
    computed without a per-token step; None otherwise."""
    return next((kernel for kernel in kind.KERNELS if conv_takes(kernel)), None)


def conv_takes(kernel: Kernel) -> bool:
    return kernel.role is Role.PROMPT and kernel.memory == CONV_MEMORY and kernel.window_terms is not None


@dataclasses.dataclass
class ConvCall:
    """One prompt convolution call: its inputs (clean: to subtract; corrupt: with the zero leaf `shift` added
    before the activation, whose gradient is d m / d the convolution's output) and weight."""

    inputs: Tensor  # b c L
    weight: Tensor  # c K
    terms: Callable[..., Tensor]  # the kernel's `WindowTerms.terms`
    shift: Tensor | None = None  # b c L, the corrupt run's


def conv_call(kernel: Kernel, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = kernel.layout.bind(args, kwargs)
    bound.pop("kwargs", None)
    return bound


def window_row(
    clean: "CleanPieces",
    corrupt: "CorruptPieces",
    grads: Iterable,
    ids: Tensor,
    where: str,
    reference: "CleanPieces | None" = None,
    layout: "Any" = None,
) -> Tensor:
    """`[pairs, seq]`: the window term per pair and token, from each prompt convolution call's inputs and gradient;
    the corrupt inputs are `reference`'s where given (the corrupt run's, at steps > 1), else the gradient run's.
    With a layout, `[pairs, heads, seq]`: each channel's term shared among the heads it feeds."""
    shares = None if layout is None else layout.shares
    total = torch.zeros(
        *ids.shape, *([] if layout is None else [layout.heads]), dtype=torch.float32, device=ids.device
    )  # b t (heads)
    minus = corrupt.convs if reference is None else reference.convs
    if len(clean.convs) != len(corrupt.convs) or len(minus) != len(corrupt.convs):
        raise InvalidValue(
            f"{where}: its prompt convolution ran {len(corrupt.convs)} time(s) in the corrupt run and"
            f" {len(clean.convs)} in the clean one: use method='states'"
        )
    for before, after, base in zip(clean.convs, corrupt.convs, minus):
        grad = next(grads)
        if grad is None:
            continue
        if before.inputs.shape != after.inputs.shape or before.inputs.shape[-1] != ids.shape[1]:
            raise InvalidValue(
                f"{where}: its prompt convolution covers {tuple(after.inputs.shape)} in the corrupt run"
                f" and {tuple(before.inputs.shape)} in the clean one, for a {ids.shape[1]}-token"
                " prompt (a cached prefix?): use method='states'"
            )
        delta = before.inputs.to(torch.float32) - base.inputs.to(torch.float32)  # b c L
        total = total + after.terms(delta, grad, after.weight, shares).to(total.device)
    return total if layout is None else total.movedim(2, 1)


def runs_in_pieces(kind: type[RecurrentMixer]) -> bool:
    """Whether the kind's state kernel of prompts runs in pieces from a state (a state of one tensor)."""
    return kind.STATE_TYPE is None and any(takes(kernel) for kernel in kind.KERNELS)


def takes(kernel: Kernel) -> bool:
    return kernel.role is Role.PROMPT and kernel.memory == STATE_MEMORY and kernel.segments is not None


def token_ranges(tokens: int, piece: int) -> list[tuple[int, int]]:
    return [(start, min(start + piece, tokens)) for start in range(0, tokens, piece)]


@dataclasses.dataclass
class CleanCall:
    """What the backward needs of one clean prompt call: its pieces (inputs) and boundary states."""

    pieces: Pieces
    boundaries: list[Any]

    def states(self, kernel: Kernel, index: int, start: int, end: int, out: Tensor | None = None) -> Tensor:
        """The clean states after tokens start..end-1 (piece `index`), token first, recomputed without grad."""
        leading, named = self.pieces.call(start, end, self.boundaries[index])
        with torch.no_grad():
            return piece_states(kernel, leading, named, out)


def piece_states(kernel: Kernel, leading: list[Any], named: dict[str, Any], out: Tensor | None = None) -> Tensor:
    """Every state of a piece, token first: the kind's chunk-wise `all_states` (into `out`: a kind with an
    adjoint takes one), or its token loop."""
    if kernel.segments.all_states is not None:
        _, states = kernel.segments.all_states(*leading, **named, **({} if out is None else {"out": out}))
        return states if isinstance(states, Tensor) else torch.stack(list(states))
    kept: list[Tensor] = []
    kernel.loop(*leading, on_token=lambda t, s: kept.append(s.clone()) or s, **named)
    return torch.stack(kept)


class CleanPieces:
    """The clean run's takeover: the bound kernel in pieces, no grad; keeps what `CleanCall` holds."""

    path = "attribution: pieces (clean)"

    def __init__(self, piece: int, convs: bool = False) -> None:
        self.piece, self.taking_convs = piece, convs
        self.records: list[CleanCall] = []
        self.convs: list[ConvCall] = []

    def takes(self, kernel: Kernel) -> bool:
        return takes(kernel) or self.taking_convs and conv_takes(kernel)

    def run(self, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if kernel.memory == CONV_MEMORY:  # the shared prompt convolution: its inputs
            bound = conv_call(kernel, args, kwargs)
            self.convs.append(
                ConvCall(bound["hidden_states"].detach(), bound["weight"].detach(), kernel.window_terms.terms)
            )
            return original(*args, **kwargs)
        pieces = Pieces(kernel, args, kwargs)
        if isinstance(pieces.state, Tensor):  # a cache's tensor, updated in place later
            pieces.state = pieces.state.clone()
        outputs, boundaries = pieces.run(kernel.segments.kernel or original, self.piece)
        self.records.append(CleanCall(pieces, boundaries))
        return pieces.result(outputs, boundaries[-1])


class CorruptPieces:
    """The corrupt run's takeover: each prompt call as one `InPieces` Function, with its zero leaf eps."""

    path = "attribution: pieces (corrupt)"

    def __init__(
        self, clean: CleanPieces, piece: int, where: str, reference: CleanPieces | None = None, heads: bool = False
    ) -> None:
        self.clean, self.piece, self.where, self.heads = clean, piece, where, heads  # heads: an eps per head
        self.reference = reference  # the corrupt run's records (steps > 1): the delta is clean minus them
        self.eps: list[Tensor] = []
        self.convs: list[ConvCall] = []

    def takes(self, kernel: Kernel) -> bool:
        return self.clean.takes(kernel)

    def run(self, kernel: Kernel, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if kernel.memory == CONV_MEMORY:  # the shared prompt convolution, with a zero leaf before its activation
            bound = conv_call(kernel, args, kwargs)
            x, weight = bound["hidden_states"], bound["weight"]
            shift = torch.zeros(x.shape, dtype=torch.float32, device=x.device, requires_grad=True)
            self.convs.append(ConvCall(x.detach(), weight.detach(), kernel.window_terms.terms, shift))
            return kernel.window_terms.shifted(x, weight, bound.get("bias"), bound.get("activation"), shift=shift)
        index = len(self.eps)
        if index >= len(self.clean.records):
            raise InvalidValue(
                f"attribute: {self.where}: prompt kernel call {index} of the corrupt run has no clean"
                f" counterpart (the clean run made {len(self.clean.records)})"
            )
        clean = self.clean.records[index]
        if self.reference is not None and index >= len(self.reference.records):
            raise InvalidValue(
                f"attribute: {self.where}: prompt kernel call {index} of a gradient run has no"
                f" counterpart in the corrupt run (which made {len(self.reference.records)})"
            )
        reference = None if self.reference is None else self.reference.records[index]
        pieces = Pieces(kernel, args, kwargs)
        if pieces.tokens != clean.pieces.tokens:
            raise InvalidValue(
                f"attribute: {self.where}: prompt kernel call {index} covers {pieces.tokens} tokens"
                f" in the corrupt run and {clean.pieces.tokens} in the clean one"
            )
        slots, tensors = tensor_slots(args, kwargs)
        state = pieces.state
        batch = next(t for t in tensors if t.dim() > 0).shape[0] if state is None else state.shape[0]
        per_head = [clean.boundaries[-1].shape[1]] if self.heads else []  # b i (heads)
        eps = torch.zeros(
            batch, pieces.tokens, *per_head, dtype=torch.float32, device=tensors[0].device, requires_grad=True
        )
        self.eps.append(eps)
        spec = Spec(kernel, original, args, kwargs, slots, clean, self.piece, reference, heads=self.heads)
        out, final = InPieces.apply(spec, eps, *tensors)
        return pieces.result([out], final)


@dataclasses.dataclass
class Spec:
    """The non-tensor side of one `InPieces` call."""

    kernel: Kernel
    original: Callable[..., Any]
    args: tuple
    kwargs: dict
    slots: list[tuple[int | None, str | None]]  # where each tensor input goes: (args index, None) or (None, key)
    clean: CleanCall
    piece: int
    reference: CleanCall | None = None  # the corrupt run's call (steps > 1); None: the delta is from the run's own
    boundaries: list[Any] = dataclasses.field(default_factory=list)
    heads: bool = False  # eps per head: d metric / d eps_t is the term of each head (axis 1 of the state)

    def pieces(self, tensors: Iterable[Tensor]) -> Pieces:
        return with_tensors(self.kernel, self.args, self.kwargs, self.slots, tensors)


class InPieces(torch.autograd.Function):
    """One prompt kernel call of the corrupt run: the bound kernel in pieces forward; backward from the piece
    boundaries with the token loop, the state after each token t replaced by S'_t + eps_t (S_t - S'_t)."""

    @staticmethod
    def forward(ctx: Any, spec: Spec, eps: Tensor, *tensors: Tensor) -> tuple[Tensor, Tensor]:
        pieces = spec.pieces(tensors)
        outputs, spec.boundaries = pieces.run(spec.kernel.segments.kernel or spec.original, spec.piece)
        final = spec.boundaries[-1]
        # the spec (on ctx) keeps no output of the Function: output -> graph -> ctx -> spec -> output is a cycle the
        # garbage collector did not always free, and with it the call's inputs and boundary states
        spec.boundaries[-1] = final.detach()
        ctx.spec = spec
        ctx.save_for_backward(*tensors)
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=spec.kernel.segments.out_axis)
        return out, final

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None, grad_final: Tensor | None) -> tuple[Any, ...]:
        spec = ctx.spec
        saved = tuple(t.detach() for t in ctx.saved_tensors)
        needed = ctx.needs_input_grad[2:]
        pieces = spec.pieces(saved)
        state_in = spec.kernel.segments.state_in
        wanted = {
            name
            for name, need, tensor in zip(slot_names(pieces, spec.slots), needed, saved)
            if need and tensor.is_floating_point() and name != state_in
        }
        eps_parts: list[Tensor] = []  # right to left
        if spec.kernel.segments.adjoint is not None:  # the kind's adjoint recurrence: no token loop under autograd
            ranges, backward_one = (
                token_ranges(pieces.tokens, spec.piece),
                AdjointPiece(spec, pieces, wanted, grad_out, eps_parts),
            )
        else:  # the token loop under autograd, in steps of as many tokens as STEP_BYTES of states
            loop = LoopSteps(spec, pieces, wanted, grad_out, eps_parts)
            ranges, backward_one = loop.ranges, loop
        grad_state, collected = sweep(ranges, backward_one, grad_final)
        eps_grad = torch.cat(list(reversed(eps_parts)), dim=1)
        return (None, eps_grad, *input_gradients(pieces, spec.slots, saved, needed, grad_state, collected))


class AdjointPiece:
    """A piece's backward by the kind's adjoint (`backward.sweep`'s `backward_one`): the inputs' and the boundary
    state's gradients from the piece's kernel recomputed under autograd (chunk-wise, `backward.recompute`), the eps
    gradients (S_t - S'_t) . mu_t from the adjoint recurrence, S_t the clean states (recomputed from the clean
    boundary), S'_t the corrupt run's (steps > 1: the reference's) or, for none, the run's own from `all_states`.
    Two state buffers of a piece each, reused piece after piece."""

    def __init__(
        self, spec: Spec, pieces: Pieces, wanted: set[str], grad_out: Tensor | None, eps_parts: list[Tensor]
    ) -> None:
        self.spec, self.pieces, self.wanted, self.grad_out, self.eps_parts = spec, pieces, wanted, grad_out, eps_parts
        self.buffers: list[Tensor] = []

    def __call__(self, index: int, start: int, end: int, grad_state: Tensor | None) -> tuple[Any, Any]:
        spec, pieces = self.spec, self.pieces
        kernel, segments = spec.kernel, spec.kernel.segments
        if not self.buffers:
            last = spec.boundaries[-1]
            self.buffers = [last.new_empty((spec.piece, *last.shape), dtype=torch.float32) for _ in range(2)]
        clean = spec.clean.states(kernel, index, start, end, self.buffers[0])  # i b *state
        minus = None if spec.reference is None else spec.reference.states(kernel, index, start, end, self.buffers[1])
        piece_grad = None if self.grad_out is None else self.grad_out.narrow(segments.out_axis, start, end - start)
        grads, state_grad, (leading, named) = recompute(
            pieces,
            segments.kernel or spec.original,
            start,
            end,
            spec.boundaries[index],
            self.wanted,
            piece_grad,
            grad_state,
        )
        with torch.no_grad():
            corrupt = piece_states(kernel, leading, named, self.buffers[1]) if minus is None else minus
            delta = clean.sub_(corrupt)  # i b *state   S_t - S'_t
            eps = delta.new_zeros(delta.shape[1], end - start, *([delta.shape[2]] if spec.heads else []))  # b i (h)

            def visit(t: int, mu: Tensor) -> None:  # (S_t - S'_t) . mu_t per row (and head)
                if spec.heads:
                    eps[:, t] = (delta[t] * mu).flatten(2).sum(-1)
                else:
                    eps[:, t] = torch.linalg.vecdot(delta[t].flatten(1), mu.flatten(1))

            initial = segments.adjoint(*leading, grad_output=piece_grad, grad_final=grad_state, visit=visit, **named)
        self.eps_parts.append(eps)
        has_state = spec.boundaries[index] is not None
        return (state_grad if state_grad is not None else initial) if has_state else None, grads


class LoopSteps:
    """A piece's backward through the kind's token loop under autograd (Mamba-1: no adjoint), in steps of at most
    `STEP_BYTES` of states (`backward.sweep`'s `backward_one`, over the steps of every piece): in each, the state
    after token t is replaced by s + eps_t (S_t - S'_t), S'_t the run's own state or the reference's, which leaves
    the values as they are and makes d m / d eps_t the term. A piece's corrupt states at its steps' boundaries are
    recomputed first, without grad, when it has more than one step."""

    def __init__(
        self, spec: Spec, pieces: Pieces, wanted: set[str], grad_out: Tensor | None, eps_parts: list[Tensor]
    ) -> None:
        self.spec, self.pieces, self.wanted, self.grad_out, self.eps_parts = spec, pieces, wanted, grad_out, eps_parts
        last = spec.boundaries[-1]
        self.step = min(spec.piece, max(1, STEP_BYTES // (last.numel() * last.element_size())))
        self.ranges: list[tuple[int, int]] = []
        self.piece_of: list[tuple[int, int]] = []  # per step: its piece, and its first token within the piece
        for index, (start, end) in enumerate(token_ranges(pieces.tokens, spec.piece)):
            for first, last_token in token_ranges(end - start, self.step):
                self.ranges.append((start + first, start + last_token))
                self.piece_of.append((index, first))
        self.cached: tuple[int, Tensor, Tensor | None, Tensor | None] | None = None  # a piece's states

    def _piece_states(self, index: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The piece's clean states, the reference's (or None) and its corrupt states at its steps (or None)."""
        if self.cached is None or self.cached[0] != index:
            spec, kernel = self.spec, self.spec.kernel
            start, end = token_ranges(self.pieces.tokens, spec.piece)[index]
            clean = spec.clean.states(kernel, index, start, end)  # i b *state
            minus = None if spec.reference is None else spec.reference.states(kernel, index, start, end)
            with torch.no_grad():
                leading, named = self.pieces.call(start, end, spec.boundaries[index])
                corrupt = piece_states(kernel, leading, named) if end - start > self.step else None
            self.cached = (index, clean, minus, corrupt)
        return self.cached[1:]

    def __call__(self, step: int, start: int, end: int, grad_state: Tensor | None) -> tuple[Any, Any]:
        spec = self.spec
        index, first = self.piece_of[step]
        clean, minus, corrupt = self._piece_states(index)
        boundary = spec.boundaries[index] if first == 0 else corrupt[first - 1]
        last = first + end - start
        grad_state, eps_part, grads = backward_step(
            spec.kernel,
            self.pieces,
            start,
            end,
            boundary,
            clean[first:last],
            self.wanted,
            self.grad_out,
            grad_state,
            None if minus is None else minus[first:last],
            spec.heads,
        )
        self.eps_parts.append(eps_part)
        return grad_state, grads


def backward_step(
    kernel: Kernel,
    pieces: Pieces,
    start: int,
    end: int,
    boundary: Any,
    clean: Tensor,
    wanted: set[str],
    grad_out: Tensor | None,
    grad_state: Tensor | None,
    minus: Tensor | None = None,
    heads: bool = False,
) -> tuple[Tensor | None, Tensor, dict[str, Tensor | None]]:
    """Tokens [start, end) of the call through the token loop, from `boundary`, with the eps replacement
    s + eps_t (clean_t - S'_t), S'_t the run's own state or, where given, `minus[t]` (the corrupt run's): the
    gradients of the boundary state, of eps over these tokens, and of the wanted inputs' pieces."""
    segments = kernel.segments
    with torch.enable_grad():
        leading, named, leaves, state = piece_leaves(pieces, start, end, boundary, wanted)
        per_head = [clean.shape[2]] if heads else []  # an eps per head: axis 1 of the state
        eps = torch.zeros(
            clean.shape[1], end - start, *per_head, dtype=torch.float32, device=clean.device, requires_grad=True
        )

        def on_token(t: int, s: Tensor) -> Tensor:
            scale = eps[:, t].reshape(s.shape[0], *per_head, *([1] * (s.dim() - 1 - len(per_head)))).to(s.dtype)
            return s + scale * (clean[t].to(s.dtype) - (s.detach() if minus is None else minus[t].to(s.dtype)))

        out, final = kernel.loop(*leading, on_token=on_token, **named)
        outputs, grads_in = (
            [out],
            [torch.zeros_like(out) if grad_out is None else grad_out.narrow(segments.out_axis, start, end - start)],
        )
        if grad_state is not None:
            outputs.append(final)
            grads_in.append(grad_state)
        targets = [eps, *leaves.values()] + ([state] if state is not None else [])
        grads = torch.autograd.grad(outputs, targets, grads_in, allow_unused=True)
    eps_grad = grads[0] if grads[0] is not None else torch.zeros_like(eps)
    state_grad = grads[-1] if state is not None else None
    return state_grad, eps_grad, dict(zip(leaves, grads[1 : 1 + len(leaves)]))
