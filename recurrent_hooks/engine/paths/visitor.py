"""What a busy kernel call keeps and hands over, per memory: the `Taker` whose `on_token` the call's path runs.

At each token the taker calls the plans' hooks and writes, and keeps the states the plans keep (in grad mode
read through one zero leaf, filled by `finish` once the call is over), or hands them, `Reduction.CHUNK` tokens at
a time, to a plan's `reduce` (`Reduction`). A kind that runs its kernel once per head (`KERNEL_PER_HEAD`: zamba)
hands its reductions every head's states, `[batch, chunk, heads, *head_state]` as they are kept: the earlier
heads' states wait for the last head's kernel call (`HeldHeads`). The path runners of `runners` take it
(`BusyCall.takers`).
"""

from typing import Any

import torch
from torch import Tensor

from ..declare.kernels import STATE_MEMORY
from ..declare.memory_parts import State, is_parts, map_parts, parts_of, rebuild, stack_parts
from ..errors import InvalidValue, RecurrentHooksError, noted
from ..tracing import compiling
from ..tracking.threads import user_code
from ..tracking.tracker import Plan
from . import blocks as _blocks


class Taker:
    """The `on_token` a busy kernel call hands its loop for one memory: the plans' hooks and writes at each token,
    and the kept states (in grad mode read through one zero leaf, filled by `finish` once the call is over)."""

    def __init__(self, busy: list[Plan], tokens: int) -> None:
        self.busy, self.tokens = busy, tokens
        self.keeping = [plan for plan in busy if plan.keep]
        self.storing = [plan for plan in self.keeping if plan.reduce is None]  # the states themselves
        self.reducing = [Reduction(plan) for plan in self.keeping if plan.reduce is not None]
        self.kept_at = sorted(frozenset().union(*(plan.keep for plan in self.storing)))
        self.slot = {token: i for i, token in enumerate(self.kept_at)}
        # (under torch.compile, kept states are values: `compiled`)
        self.differentiable = torch.is_grad_enabled() and not compiling()
        # the states handed over are views of a block's buffer, which nothing changes later (`blocks`): a
        # reduction may hold them until its chunk is full
        self.borrowed = False
        # A state is one tensor or a NamedTuple of parts (`memory_parts`): each step below is done part by part.
        self.buffer: list[State] = []  # grad mode: one leaf for every kept state of the call, zeros when read
        self.slots: list[State] = []  # its per-token views
        self.filled: dict[int, State] = {}  # slot -> the state it holds
        self.last: list[State] = []
        self.moved: set[torch.device] = set()  # devices kept values were copied from without blocking

    def on_token(self, token: int, state: State) -> State:
        for plan in self.busy:
            state = plan.apply(token, state)
        if token in self.slot:
            slot = self.slot[token]
            # a slice of a kernel's larger tensor: keep only the state itself
            state = map_parts(own, state)
            # A tensor that only the later tokens read: the gradient with respect to a kept state is the
            # effect of changing it there (what a write does), not through token `token`'s own output.
            if self.differentiable:
                # ... read through a slot of one zero leaf, so that the stack of every kept state is a
                # tensor the forward used (autograd.grad(metric, mix.states)), with frozen weights too.
                # The slots come from one unbind: its backward stacks their gradients once (a slice
                # per token would add a whole-buffer gradient per token, quadratic in the tokens).
                if not self.buffer:
                    count = len(self.kept_at)
                    self.buffer.append(
                        map_parts(lambda s: s.new_zeros((s.shape[0], count, *s.shape[1:]), requires_grad=True), state)
                    )
                    views = [part.unbind(1) for _, part in parts_of(self.buffer[0])]
                    self.slots.extend(rebuild(state, per_token) for per_token in zip(*views))
                state = map_parts(torch.add, state, self.slots[slot])
                self.filled[slot] = state  # copied into the leaf once the kernel call is over
            else:
                state = map_parts(lambda s: s.view_as(s), state)
            for plan in self.storing:
                if token in plan.keep:
                    plan.kept[token] = self._moved(plan, token, state)
        for reduction in self.reducing:
            if token in reduction.plan.keep:
                reduction.add(token, state if self.borrowed else map_parts(own, state), self)
        if token == self.tokens - 1:
            self.last.append(state)
        return state

    def _moved(self, plan: Plan, token: int, value: State, graph: bool = False) -> State:
        """`value` on the plan's keep device (`watch(keep_device=...)`), copied without blocking (synchronized
        when the call is over). A state kept with gradients stays where the forward read it (`graph`: a
        reduction, whose copy keeps its graph)."""
        device = plan.device
        if device is None:
            return value
        source = parts_of(value)[0][1].device
        if source == device:
            return value
        if self.differentiable and not graph:
            raise InvalidValue(
                f"{plan.where}, call {plan.call}, token {token}: keep_device={str(device)!r} with gradients on: a"
                f" state kept in grad mode is the tensor the forward read (on {source}), which a copy on another"
                " device is not. Run the forward under torch.no_grad(), keep on the model's device (keep_device="
                "None), or keep a reduction (reduce=...), whose copy keeps its graph"
            )
        if source.type != "cpu":
            self.moved.add(source)
        return map_parts(lambda s: s.to(device, non_blocking=True), value)

    def finish(self) -> None:
        """The kernel call is over: the leaf holds the kept states from now on (the forward read it as zeros);
        the last chunk of each reduction is reduced; copies made without blocking are waited for."""
        for reduction in self.reducing:
            reduction.flush(self)
            if reduction.held_back():
                reduction.plan.kept = None  # an earlier head's: the last head's kernel call keeps every head's
        for plan in self.storing:  # (the chunk-wise states path keeps the states of a whole piece directly)
            if plan.device is not None:
                for token, value in plan.kept.items():
                    plan.kept[token] = self._moved(plan, token, value)
        for device in self.moved:
            torch.accelerator.synchronize(device)
        if self.buffer:
            with torch.no_grad():
                for i, state in self.filled.items():
                    map_parts(lambda leaf, s: leaf[:, i].copy_(s), self.buffer[0], state)
        for plan in self.keeping:
            if self.buffer and len(plan.keep) == len(self.kept_at) == self.tokens:
                plan.stacked = self.buffer[0]


class Reduction:
    """A reducing plan's kept states of one kernel call, `CHUNK` tokens at a time: each full chunk
    `[batch, chunk, *state]` goes through the plan's `reduce` function, and the plan keeps, per token, its
    slice of the result (`[batch, ...]`). At most one chunk of states is held (O(chunk x state)). On the
    chunk-wise reductions' path (`runners.reduce_in_chunks`) the kernel's own chunks go to `reduce` directly."""

    CHUNK = _blocks.BLOCK

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.tokens: list[int] = []
        self.states: list[State] = []

    def add(self, token: int, state: State, taker: "Taker") -> None:
        self.tokens.append(token)
        self.states.append(state)
        if len(self.tokens) == self.CHUNK:
            self.flush(taker)

    def flush(self, taker: "Taker") -> None:
        if not self.tokens:
            return
        tokens, states = self.tokens, self.states
        self.tokens, self.states = [], []
        chunk = stack_parts(states, dim=1)  # [batch, chunk, *state]
        del states  # (the stacked copy is all `reduce` needs: the chunk's states are held once)
        self.reduce(tokens, chunk, taker)

    def reduce(
        self,
        tokens: "list[int] | range",
        chunk: State,
        taker: "Taker",
        buffer: Tensor | None = None,
        every_head: bool = False,
    ) -> None:
        """Keep, per token of `tokens`, its slice of the plan's `reduce(chunk)` (`chunk`: those tokens' states,
        `[batch, chunk, *state]`). `buffer`: the tensor `chunk` is a view of, which the kernel overwrites with the
        next chunk (`Segments.on_chunk`): a result in its memory (the chunk itself, or a view of it) is copied.
        `every_head`: a kernel run once per head, whose `chunk` already stacks every head's states (its last head's
        call formed them, `runners.reduce_heads_in_chunks`)."""
        plan = self.plan
        heads = None if every_head else held_heads(plan)
        if heads is not None:  # a kernel run once per head: the reduction sees every head's states at once
            chunk = heads.gather(
                f"{plan.where}, call {plan.call}",
                plan.owner.head,
                plan.owner.forward.kernel_calls,
                tokens,
                chunk,
                buffer,
            )
            if chunk is None:
                return  # an earlier head's: held until the last head's kernel call forms the same tokens
            buffer = None  # (the heads' stack is a tensor of its own)
        where = f"{plan.where}, call {plan.call}, tokens {tokens[0]}..{tokens[-1]}: the reduction {_name(plan.reduce)}"
        with user_code(), noted(lambda: f"raised in {where}"):
            reduced = plan.reduce(chunk)
        del chunk
        for name, part in parts_of(reduced) if is_parts(reduced) else [("", reduced)]:
            if not isinstance(part, Tensor) or part.dim() < 2 or part.shape[1] != len(tokens):
                got = f"a tensor of shape {tuple(part.shape)}" if isinstance(part, Tensor) else type(part).__name__
                raise InvalidValue(
                    f"{where} returned {got}{f' in part {name!r}' if name else ''}; expected a tensor"
                    f" [batch, chunk, ...] with chunk = {len(tokens)} (a result per token of the"
                    " chunk of states [batch, chunk, *state] it was given)"
                )
        if buffer is not None:
            memory = buffer.untyped_storage().data_ptr()
            reduced = map_parts(lambda r: r.clone() if r.untyped_storage().data_ptr() == memory else r, reduced)
        self.keep(tokens, reduced, taker)

    def held_back(self) -> bool:
        """Whether this kernel call is an earlier head of a kernel run once per head: its states wait in
        `HeldHeads`, and the last head's kernel call keeps the reductions of every head."""
        owner = self.plan.owner
        return held_heads(self.plan) is not None and owner.head < owner.forward.kernel_calls - 1

    def keep(self, tokens: "list[int] | range", reduced: State, taker: "Taker") -> None:
        """Keep, per token of `tokens`, its slice of `reduced` (`[batch, chunk, ...]`, the chunk's results)."""
        plan = self.plan
        reduced = taker._moved(plan, tokens[0], reduced, graph=True)
        per_token = zip(*(part.unbind(1) for _, part in parts_of(reduced)))  # one view per token of each part
        plan.kept.update((token, rebuild(reduced, parts)) for token, parts in zip(tokens, per_token))


class HeldHeads:
    """A reduction's states on a kind that runs its kernel once per head, head after head (`KERNEL_PER_HEAD`:
    zamba's forward calls the scan for head 0 over every token, then head 1, ...): the earlier heads' states, per
    token, until the last head's kernel call forms the same tokens, which then go to the reduction stacked as the
    kept states are, `[batch, chunk, heads, *head_state]`. What it holds, up to (heads - 1) / heads of the call's
    states, is freed as the last head's chunks are reduced (docs/concepts.md, "Known limits")."""

    def __init__(self) -> None:
        self.held: list[dict[int, State]] = []  # per earlier head, token -> its state [batch, *head_state]
        self.calls: list[Any] = []  # or, on the chunk-wise reductions' path, per earlier head its kernel call's pieces

    def gather(
        self, where: str, head: int, heads: int, tokens: "list[int] | range", chunk: State, buffer: Tensor | None
    ) -> State | None:
        """Hold head `head`'s chunk (`[batch, chunk, *head_state]`, the states of `tokens`; `buffer`: the kernel's
        buffer it is a view of) and return None, or, for the last head, every head's `[batch, chunk, heads, ...]`
        (`where`: the call, for messages)."""
        if head < heads - 1:
            if buffer is not None:  # the kernel overwrites its buffer with the next chunk
                chunk = map_parts(torch.clone, chunk)
            self.held.extend({} for _ in range(head + 1 - len(self.held)))
            per_token = zip(*(part.unbind(1) for _, part in parts_of(chunk)))
            self.held[head].update((token, rebuild(chunk, parts)) for token, parts in zip(tokens, per_token))
            return None
        if self.calls:
            raise RecurrentHooksError(
                f"{where}: head {head} (the last of {heads}) took another path than the"
                " chunk-wise reductions' that its earlier heads' kernel calls took; a reduction"
                " sees every head's states at once, so every head's kernel call must take one"
                " path"
            )
        missing = [
            (h, token) for h in range(heads - 1) for token in tokens if h >= len(self.held) or token not in self.held[h]
        ]
        if missing:
            h, token = missing[0]
            raise RecurrentHooksError(
                f"{where}: head {head} (the last of {heads}) formed the state after token"
                f" {token}, which head {h}'s kernel call did not: a reduction sees every head's"
                " states at once, so each head's kernel call must form the same tokens"
            )
        earlier = [stack_parts([held.pop(token) for token in tokens], dim=1) for held in self.held[: heads - 1]]
        return stack_parts([*earlier, chunk], dim=2)


def held_heads(plan: Plan) -> HeldHeads | None:
    """The states a reduction of `plan` waits on, where its kernel runs once per head (else None)."""
    owner = plan.owner
    if owner.head is None or owner.forward is None:
        return None
    return owner.held_heads.setdefault(STATE_MEMORY, HeldHeads())  # (a head is of the state's kernel calls)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def own(state: Tensor) -> Tensor:
    """A kept state of its own: a slice of a kernel's larger tensor is copied (a compiled graph copies always:
    it cannot ask for the storage)."""
    if compiling() or state.untyped_storage().nbytes() > state.nbytes:
        return state.clone()
    return state
