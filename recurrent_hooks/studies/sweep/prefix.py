"""Sweep cells run from the corrupt run's cache: the tokens before a cell's patch run once for all its cells.

Cell (L, p) is the corrupt prompt with the clean memory of layer L written after token p. Up to token p it is
the corrupt run, whatever L: that part is shared by every cell at p. Here the clean and the corrupt prompts of
a group of pairs run as one batch, piece by piece up to each swept position in increasing order, keeping the
model's own cache (every recurrent layer's memory, every attention layer's keys and values). At position p,
each batch of cells gets a copy of the corrupt rows of that cache (one row per cell), the clean memory of its
layer written into its row, and runs only tokens p + 1.. from there. Logits before p + 1 are the corrupt run's,
kept from the pieces (only the last `logits_to_keep` positions when the forward keyword asks for fewer).

A forward over p + 1 - q tokens costs about that share of a forward: a full sweep costs one clean and one
corrupt forward in pieces, and each cell about (T - p - 1) / T of a forward (docs/sweep.md, "Cost"). Split across
ranks, a rank is given the batches of its own positions only (`sweep._dealt`), and runs the pieces up to those.

It needs transformers' multi-token continuation over a cache, which the kinds declare (`CONTINUES_CACHE`), and a
cache whose memory tensors are the library's memories (the adapter's `cached_memory`), checked on a one-token forward by
`refusal`; `patching_sweep` takes the per-cell forwards of `cells` otherwise, and with `reuse_prefix=False`.

Glossary (code name, shape):
    group       [pairs]                       the pairs whose clean and corrupt prompts run as one batch
    cache       the model's Cache             rows: the group's clean prompts, then its corrupt prompts
    tail        [pairs, kept, vocab]          the corrupt logits of the positions the metric sees, filled piece by
                                              piece (`filled` of them so far)
    rows        [cells]                       a batch's cells, one row each in the copied cache
"""

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ...engine.watch import watch
from .cells import Cell, Plan, carried, keep_hooks, measure

# the names transformers' forwards take a cache under, the newest first
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_argument(model: nn.Module) -> str | None:
    """The keyword `model.forward` takes its cache under (None: none of `CACHE_ARGUMENTS`)."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in params), None)


def cache_of(output: Any) -> Any:
    """The cache a forward with `use_cache=True` returned (None: none)."""
    return next(
        (found for name in ("past_key_values", *CACHE_ARGUMENTS) if (found := getattr(output, name, None)) is not None),
        None,
    )


def refusal(
    model: nn.Module,
    clean_ids: Tensor,
    plan: Plan,
    mixers: Mapping[int, Any],
    heads: bool,
    kwargs: Mapping[str, Any],
    every: Iterable[Any] = (),
) -> str | None:
    """Why the cells cannot run from the corrupt run's cache (None: they can), recording in `plan.cache_at`
    where each chosen layer's memories are in the model's cache. One clean token runs watched with a cache,
    keeping each chosen memory after it: each must be, bit for bit, the cache's tensor `adapter.cached_memory` names.
    `every`: the model's mixers, chosen or not, which must all continue a cache (`CONTINUES_CACHE`), and whose
    chunk lengths (`Segments.chunk_argument`, a module attribute of that name) the pieces clamp."""
    if heads:
        return "heads=True patches a head's slice of a memory, which runs one forward per cell"
    given = [name for name in CACHE_ARGUMENTS if name in kwargs]
    if given:
        return f"forward_kwargs holds a cache ({given[0]})"
    keep = kwargs.get("logits_to_keep")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)):
        return f"forward_kwargs' logits_to_keep is {type(keep).__name__}, not an int"
    for mixer in [*every, *mixers.values()]:  # every layer runs the cells' tokens from the cache, chosen or not
        if not type(mixer).CONTINUES_CACHE:
            return (
                f"{mixer}: transformers' prompt calls of {type(mixer).__name__} do not continue a cached memory"
                " (the kind's CONTINUES_CACHE)"
            )
    name = cache_argument(model)
    if name is None:
        return f"{type(model).__name__}.forward takes no cache argument (one of {CACHE_ARGUMENTS})"
    kept: dict[tuple[str, int, int, int | None], Tensor] = {}
    try:
        with watch(model) as w, torch.no_grad():
            keep_hooks(w, {layer: [0] for layer in mixers}, plan.memories, plan.memory, kept)
            cache = cache_of(model(clean_ids[:1, :1], **_passed(kwargs), use_cache=True, logits_to_keep=1))
    except Exception as error:  # noqa: BLE001 -- e.g. transformers' all-linear Qwen3.5 cannot mask over its cache
        return f"{type(model).__name__} cannot run over a cache: {type(error).__name__}: {error}"
    if cache is None or not callable(getattr(cache, "reorder_cache", None)):
        return f"{type(model).__name__} returned no cache whose rows can be copied (reorder_cache)"
    plan.cache_name = name
    plan.positioned = "position_ids" in inspect.signature(model.forward).parameters
    plan.chunked = [
        (mixer.module, chunk)
        for mixer in every
        if (chunk := _chunk_argument(type(mixer))) is not None and isinstance(getattr(mixer.module, chunk, None), int)
    ]
    for layer, mixer in mixers.items():
        kind = plan.kinds[layer] = type(mixer)
        where = plan.cache_at[layer] = kind.adapter.cache_index(mixer.module, {})
        plan.carried[layer] = carried(mixer, plan.memories, plan.memory)
        for memory in plan.carried[layer]:
            found = kind.adapter.cached_memory(cache, where, memory) if where is not None else None
            mine = kept[memory, layer, 0, None]
            if not (isinstance(found, Tensor) and isinstance(mine, Tensor) and torch.equal(found, mine)):
                return f"{mixer}: its {memory} is not the cache's tensor at {where!r}"
    return None


def _chunk_argument(kind: type) -> str | None:
    """The chunk-length argument of the kind's chunked prompt kernel (None: none)."""
    return next(
        (
            kernel.segments.chunk_argument
            for kernel in kind.KERNELS
            if kernel.segments is not None and kernel.segments.chunk_argument
        ),
        None,
    )


def chunk_for(tokens: int, chunk: int) -> int:
    """The chunk length a call of `tokens` runs with: `chunk`, halved (down to 16) while padding the call to a
    multiple of it would add more than a quarter of its tokens."""
    while chunk > 16 and 4 * (-tokens % chunk) > tokens:
        chunk //= 2
    return chunk


@contextlib.contextmanager
def _chunks_within(chunked: Iterable[tuple[nn.Module, str]], tokens: int) -> Iterator[None]:
    """Chunk lengths that pad a call of `tokens` by at most a quarter (`chunk_for`) while it runs: transformers'
    chunked scan pads a call to a multiple of its chunk, and Mamba-2's (256 tokens in mamba2-130m) made a piece of
    32 tokens cost a 256-token forward. The same maths, rounded by other chunks; restored on exit."""
    changed = []
    try:
        for module, name in chunked:
            original = getattr(module, name)
            if chunk_for(tokens, original) != original:
                changed.append((module, name, original))
                setattr(module, name, chunk_for(tokens, original))
        yield
    finally:
        for module, name, original in reversed(changed):
            setattr(module, name, original)


def _positions(plan: Plan, ids: Tensor, start: int, end: int) -> dict[str, Tensor]:
    """The position ids of tokens start..end-1 of every row, where the forward takes them: transformers' forwards
    count positions from the cache's length when none are given, but some (bamba) restart at 0 over a cache."""
    if not plan.positioned:
        return {}
    return {"position_ids": torch.arange(start, end, device=ids.device).expand(ids.shape[0], -1)}


def _passed(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The forward keywords every piece gets: the sweep's, but for the cache and the logits kept."""
    return {k: v for k, v in kwargs.items() if k not in ("use_cache", "logits_to_keep")}


def measured(
    model: nn.Module,
    prompts: tuple[Tensor, Tensor],
    pairs: list[int],
    batches: Mapping[int, list[list[Cell]]],
    plan: Plan,
    kwargs: Mapping[str, Any],
    metric_of: Callable[[list[Cell]], Callable[[Tensor], Tensor]],
) -> Iterator[tuple[int, list[Cell], Tensor]]:
    """(position index, batch, metric per row) for every batch of `batches` (position index -> the batches of
    cells of `pairs` at that position), positions in prompt order: the group's clean and corrupt prompts run in
    pieces up to each position, and each batch from a copy of the cache there."""
    clean_ids, corrupt_ids = prompts
    tokens, group = clean_ids.shape[1], len(pairs)
    row_of = {pair: row for row, pair in enumerate(pairs)}
    keep = kwargs.get("logits_to_keep") or tokens
    first_kept = tokens - min(keep, tokens)  # the first position whose logits the metric sees
    passed, ids = _passed(kwargs), torch.cat([clean_ids[pairs], corrupt_ids[pairs]])
    cache, done, tail, filled = None, 0, None, 0
    with torch.no_grad():
        for j in sorted(batches, key=lambda j: plan.positions[j]):
            p = plan.positions[j]
            seen = p + 1 - max(done, first_kept)  # the piece's positions the metric sees
            with _chunks_within(plan.chunked, p + 1 - done):
                out = model(
                    ids[:, done : p + 1],
                    **{plan.cache_name: cache},
                    **passed,
                    use_cache=True,
                    logits_to_keep=max(1, seen),
                    **_positions(plan, ids, done, p + 1),
                )
            cache, done = cache_of(out), p + 1
            if seen > 0:
                if tail is None:  # written once per piece, not concatenated again at every position
                    tail = out.logits.new_empty(group, tokens - first_kept, out.logits.shape[-1])
                tail[:, filled : filled + seen] = out.logits[group:, -seen:]
                filled += seen
            kept = None if tail is None else tail[:, :filled]  # [pairs, positions first_kept..p, vocab]
            for batch in batches[j]:
                logits = _continued(
                    model, corrupt_ids, batch, plan, cache, (row_of, group), kept, passed, (p, tokens, keep)
                )
                yield j, batch, measure(metric_of(batch), logits)


def _continued(
    model: nn.Module,
    corrupt_ids: Tensor,
    batch: list[Cell],
    plan: Plan,
    cache: Any,
    rows: tuple[Mapping[int, int], int],
    kept: Tensor | None,
    passed: Mapping[str, Any],
    where: tuple[int, int, int],
) -> Tensor:
    """The logits the metric reads for one batch of cells at position p: the corrupt rows of `cache`, one per
    cell, each with its layer's clean memory, run over tokens p + 1.. (after the kept corrupt logits)."""
    (row_of, group), (p, tokens, keep) = rows, where
    pick = torch.tensor([group + row_of[cell.pair] for cell in batch], device=corrupt_ids.device)
    if p + 1 == tokens:  # nothing runs after the last token: the cells are the corrupt run
        return kept.index_select(0, pick - group)
    cells = copy.deepcopy(cache)
    cells.reorder_cache(pick)
    for i in sorted({cell.layer for cell in batch}):
        layer = plan.layers[i]
        mine = torch.tensor([r for r, cell in enumerate(batch) if cell.layer == i], device=corrupt_ids.device)
        clean = torch.tensor([row_of[cell.pair] for cell in batch if cell.layer == i], device=corrupt_ids.device)
        kind, at = plan.kinds[layer], plan.cache_at[layer]
        for memory in plan.carried[layer]:
            into = kind.adapter.cached_memory(cells, at, memory)
            into.index_copy_(0, mine, kind.adapter.cached_memory(cache, at, memory).index_select(0, clean))
    after = tokens - p - 1
    ids = corrupt_ids[[cell.pair for cell in batch], p + 1 :]
    with _chunks_within(plan.chunked, after):
        logits = model(
            ids,
            **{plan.cache_name: cells},
            **passed,
            use_cache=True,
            logits_to_keep=min(keep, after),
            **_positions(plan, ids, p + 1, tokens),
        ).logits
    if after >= keep:
        return logits
    return torch.cat([kept.index_select(0, pick - group), logits], dim=1)
