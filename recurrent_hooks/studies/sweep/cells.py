"""The cells of a patching sweep and the forwards that measure them (`patching_sweep`'s engine room).

Module contents:
- `Cell`: one cell, (pair n, layer index i, head h or None, position index j).
- `Plan`: what the probe learnt (the chosen layers, the bytes of a cell's memory, the heads and the window
  channels that feed each head) and what the sweep patches.
- `probe(...)`: a one-token clean forward that makes the `Plan`.
- `rounds(...)`: the cells in batches, grouped into rounds whose clean memories fit the budget.
- `clean_memories(...)`: one clean forward (the round's pairs as one batch) keeping the memories the round needs.
- `patched(...)`: one forward whose row r is the corrupt prompt of cell r's pair, patched at that cell.

Glossary (code name, shape):
    clean       {(memory, layer, token, head): value}   a clean memory, `[pairs in the round, *memory]`
                                                        (head: `mixer.head`, None but for per-head kernels)
    rows        [rows]                                  the batch rows patched after one token
    values      [rows, *memory]                         the clean memory each of those rows gets
    heads       [rows]                                  the head each row patches (heads=True)
    channels    [rows, channels per head]               the window channels of that head
"""

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ...engine.declare.kernels import CONV_MEMORY, STATE_MEMORY
from ...engine.declare.memory_parts import map_parts
from ...engine.errors import InvalidValue
from ...engine.policy import Paths
from ...engine.watch import one_mixer_per_layer, watch
from ..metrics import per_row

_WHERE = "patching_sweep"


class Cell(NamedTuple):
    pair: int
    layer: int  # an index into `Plan.layers`
    head: int | None
    position: int  # an index into `Plan.positions`


@dataclasses.dataclass
class Plan:
    """What one sweep patches and what the probe found out about the chosen layers."""

    layers: tuple[int, ...]
    positions: tuple[int, ...]
    memories: tuple[str, ...]  # the memories patched (STATE_MEMORY, CONV_MEMORY or both)
    memory: str  # as the result names them: "memory" (the whole memory), "state" or "window"
    sizes: dict[int, int]  # layer -> the bytes of one cell's memory at batch 1
    heads: int | None = None  # heads=True: the heads of every chosen layer
    channels: dict[int, Tensor] = dataclasses.field(default_factory=dict)  # layer -> [heads, channels per head]
    per_head_calls: dict[int, bool] = dataclasses.field(default_factory=dict)  # layer -> KERNEL_PER_HEAD
    # the cells run from the corrupt run's cache (`prefix`) unless `refusal` says why not
    refusal: str | None = "not probed"
    cache_name: str = ""  # the forward's cache keyword
    kinds: dict[int, type] = dataclasses.field(default_factory=dict)  # layer -> its mixer's kind
    cache_at: dict[int, Any] = dataclasses.field(default_factory=dict)  # layer -> its memory's `adapter.cache_index`
    carried: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # layer -> memories patched
    chunked: list[tuple[nn.Module, str]] = dataclasses.field(default_factory=list)  # chunk lengths to clamp
    positioned: bool = False  # the forward takes position_ids: each piece gets its own (bamba restarts at 0 otherwise)

    def cells(self, pairs: int) -> list[Cell]:
        """Every cell, pair-major then layer-major (few layers per batch, few pairs per round)."""
        heads = [None] if self.heads is None else range(self.heads)
        return [
            Cell(n, i, h, j)
            for n in range(pairs)
            for i in range(len(self.layers))
            for h in heads
            for j in range(len(self.positions))
        ]


def carried(mixer: Any, memories: tuple[str, ...], what: str) -> tuple[str, ...]:
    """The memories of `what` that the mixer's kind carries ("memory": all of them; "state" or "window" on a
    kind without it: the hook's registration says so)."""
    return tuple(m for m in memories if m in mixer.MEMORIES) if what == "memory" else memories


def keep_hooks(
    w: Any,
    cells: Mapping[int, Iterable[int]],
    memories: tuple[str, ...],
    what: str,
    into: dict[tuple[str, int, int, int | None], Tensor],
) -> None:
    """Read hooks that clone the memory after the given positions of each layer into `into`."""
    for layer, tokens in cells.items():
        for memory in carried(w.mixer(layer), memories, what):

            def keep(
                mixer: Any, call: int, token: int, state: Tensor, layer: int = layer, memory: str = memory
            ) -> None:
                into[memory, layer, token, mixer.head] = map_parts(torch.clone, state)

            w.mixer(layer).register_state_hook(keep, call=0, token=sorted(tokens), memory=memory)


def probe(
    model: nn.Module,
    clean_ids: Tensor,
    choose: Callable[[list[int]], tuple[int, ...]],
    plan: Plan,
    heads: bool,
    paths: Paths | None,
    kwargs: Mapping[str, Any],
    check: Callable[..., str | None],
) -> Plan:
    """`plan` with its layers (`choose(recurrent layers)`), their cell bytes and, for `heads`, their heads, from a
    one-token clean forward; `plan.refusal` from `check(model, clean_ids, plan, mixers, heads, kwargs,
    every=the model's mixers)`."""
    kept: dict[tuple[str, int, int, int | None], Tensor] = {}
    with watch(model, paths=paths) as w, torch.no_grad():
        one_mixer_per_layer(w.mixers, _WHERE)  # cells are (layer, position): a layer must be one mixer
        plan.layers, every = choose([mixer.layer for mixer in w.mixers]), list(w.mixers)
        mixers = {layer: w.mixer(layer) for layer in plan.layers}
        # heads are counted on the state, also where only windows are patched
        memories = (STATE_MEMORY, CONV_MEMORY) if heads else plan.memories
        keep_hooks(w, {layer: [0] for layer in plan.layers}, memories, "memory" if heads else plan.memory, kept)
        model(clean_ids[:1, :1], **kwargs)
    plan.sizes = dict.fromkeys(plan.layers, 0)
    for (memory, layer, _, _), value in kept.items():
        plan.sizes[layer] += sum(part.nbytes for part in parts(value)) if memory in plan.memories else 0
    if heads:
        _find_heads(plan, mixers, kept)
    plan.refusal = check(model, clean_ids, plan, mixers, heads, kwargs, every=every)
    return plan


def _find_heads(plan: Plan, mixers: Mapping[int, Any], kept: Mapping[tuple[str, int, int, int | None], Tensor]) -> None:
    """The heads of every chosen layer and the window channels of each (the kinds' declarations)."""
    counts = {}
    for layer, mixer in mixers.items():
        if not mixer.HEADS:
            raise InvalidValue(
                f"{_WHERE}: heads=True needs a state with heads in every chosen layer; {mixer} has a"
                f" state of axes {mixer.STATE!r} without heads (choose other layers, or heads=False)"
            )
        per_head = plan.per_head_calls[layer] = mixer.KERNEL_PER_HEAD
        state = {head: value for (memory, at, _, head), value in kept.items() if memory == STATE_MEMORY and at == layer}
        first = parts(next(iter(state.values())))[0]
        counts[layer] = len(state) if per_head else first.shape[1]
        head_state = tuple(first.shape[1:] if per_head else first.shape[2:])
        window = [value for (memory, at, _, _), value in kept.items() if memory == CONV_MEMORY and at == layer]
        if window and CONV_MEMORY in plan.memories:
            channels = [
                list(mixer.adapter.head_channels(h, counts[layer], head_state, window[0].shape[1]))
                for h in range(counts[layer])
            ]
            plan.channels[layer] = torch.tensor(channels, dtype=torch.long)
    if len(set(counts.values())) > 1:
        raise InvalidValue(
            f"{_WHERE}: heads=True needs one number of heads in every chosen layer, got {counts}"
            " (layer: heads); choose layers with `layers=`"
        )
    plan.heads = next(iter(counts.values()))


def parts(value: Any) -> list[Tensor]:
    found: list[Tensor] = []
    map_parts(lambda part: found.append(part) or part, value)
    return found


def rounds(batches: list[list[Cell]], plan: Plan, budget: int) -> list[list[list[Cell]]]:
    """The batches grouped, in order, into rounds of whole batches whose clean memories fit `budget` bytes (the
    round's pairs, each with the memory after every (layer, position) the round patches); at least one a round."""

    def held(cells: Iterable[Cell]) -> int:
        cells = list(cells)
        memories = {(c.layer, c.position) for c in cells}
        return len({c.pair for c in cells}) * sum(plan.sizes[plan.layers[i]] for i, _ in memories)

    grouped: list[list[list[Cell]]] = []
    for batch in batches:
        if grouped and held([*(c for b in grouped[-1] for c in b), *batch]) <= budget:
            grouped[-1].append(batch)
        else:
            grouped.append([batch])
    return grouped


def clean_memories(
    model: nn.Module,
    clean_ids: Tensor,
    round_: list[list[Cell]],
    plan: Plan,
    paths: Paths | None,
    kwargs: Mapping[str, Any],
) -> tuple[dict[tuple[str, int, int, int | None], Tensor], dict[int, int]]:
    """One clean forward of the round's pairs (one batch) keeping the memory after every position the round
    patches in each layer: the memories, `[pairs in the round, *memory]` each, and each pair's row in them."""
    cells = [cell for batch in round_ for cell in batch]
    pairs = sorted({c.pair for c in cells})
    wanted: dict[int, set[int]] = {}
    for c in cells:
        wanted.setdefault(plan.layers[c.layer], set()).add(plan.positions[c.position])
    kept: dict[tuple[str, int, int, int | None], Tensor] = {}
    with watch(model, paths=paths) as w, torch.no_grad():
        keep_hooks(w, wanted, plan.memories, plan.memory, kept)
        model(clean_ids[pairs], **kwargs)
    return kept, {pair: row for row, pair in enumerate(pairs)}


def patched(
    model: nn.Module,
    corrupt_ids: Tensor,
    batch: list[Cell],
    plan: Plan,
    clean: tuple[Mapping[tuple[str, int, int, int | None], Tensor], Mapping[int, int]],
    paths: Paths | None,
    kwargs: Mapping[str, Any],
    metric: Callable[[Tensor], Tensor],
) -> Tensor:
    """The metric of one forward whose row r is cell `batch[r]`'s pair's corrupt prompt patched at that cell."""
    ids = corrupt_ids[[cell.pair for cell in batch]]
    with watch(model, paths=paths) as w, torch.no_grad():
        for i in sorted({cell.layer for cell in batch}):
            layer = plan.layers[i]
            at: dict[int, list[tuple[int, Cell]]] = {}  # token -> (row, cell) patched after it
            for row, cell in enumerate(batch):
                if cell.layer == i:
                    at.setdefault(plan.positions[cell.position], []).append((row, cell))
            for memory in carried(w.mixer(layer), plan.memories, plan.memory):
                hook = _Patch(plan, layer, memory, at, clean, ids.device)
                w.mixer(layer).register_state_hook(hook, call=0, token=sorted(at), memory=memory)
        return measure(metric, model(ids, **kwargs).logits)


class _Patch:
    """The state hook of one layer and memory in a patched forward: after each token, the rows patched there get
    the clean memory of their cell's pair (the whole of it, or the cell's head: its slice of the state, or the
    window channels that feed it)."""

    def __init__(
        self,
        plan: Plan,
        layer: int,
        memory: str,
        at: Mapping[int, list[tuple[int, Cell]]],
        clean: tuple[Mapping[tuple[str, int, int, int | None], Tensor], Mapping[int, int]],
        device: torch.device,
    ) -> None:
        self.memory, self.layer, (self.kept, row_of) = memory, layer, clean
        by_head = plan.heads is not None
        # a per-head kernel's state hook runs once per head (`mixer.head`) with that head's state: its cells are
        # patched whole; otherwise a head's cell is its slice of the state, or its window channels
        self.whole = not by_head or plan.per_head_calls.get(layer, False) and memory == STATE_MEMORY
        self.split = split = by_head and self.whole  # the cells of each kernel call's head apart
        channels = plan.channels.get(layer) if memory != STATE_MEMORY else None
        self.index: dict[tuple[int, int | None], _Rows] = {}  # (token, head of the call or None) -> its rows
        for token, cells in at.items():
            for head in sorted({cell.head for _, cell in cells}) if split else [None]:
                mine = [(row, cell) for row, cell in cells if head is None or cell.head == head]
                tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
                heads = tensor([cell.head for _, cell in mine]) if by_head else None
                self.index[token, head] = _Rows(
                    tensor([row for row, _ in mine]),
                    tensor([row_of[cell.pair] for _, cell in mine]),
                    heads,
                    None if channels is None or heads is None else channels.to(device)[heads],
                )

    def __call__(self, mixer: Any, call: int, token: int, state: Any) -> Any:
        index = self.index.get((token, mixer.head if self.split else None))
        if index is None:  # no cell of this kernel call's head after this token
            return state
        value = self.kept[self.memory, self.layer, token, mixer.head]
        rows, pick = index.rows, index.pick
        if self.whole:
            return map_parts(lambda s, v: s.index_copy(0, rows, v.index_select(0, pick)), state, value)
        if index.channels is None:  # the cell's head of the state, axis 1 of every part
            return map_parts(lambda s, v: _assigned(s, (rows, index.heads), v[pick, index.heads]), state, value)
        return _assigned(state, (rows[:, None], index.channels), value[pick[:, None], index.channels])


class _Rows(NamedTuple):
    """The rows one hook call patches, made once per (token, head) when the hook is registered."""

    rows: Tensor  # [rows] of the batch
    pick: Tensor  # [rows]: each row's pair's row in the clean memories
    heads: Tensor | None  # [rows]: each row's head (heads=True)
    channels: Tensor | None  # [rows, channels per head]: the window channels of that head


def _assigned(state: Tensor, index: tuple[Tensor, ...], values: Tensor) -> Tensor:
    out = state.clone()
    out[index] = values
    return out


def measure(metric: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """`[rows]`: the metric per row of `logits`, detached (`metrics.per_row`'s contract)."""
    return per_row(metric, logits, _WHERE).detach()
