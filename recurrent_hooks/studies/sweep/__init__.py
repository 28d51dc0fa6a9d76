"""Activation patching over every (layer, position) of a prompt, or (layer, head, position), many cells per forward.

Module contents:
- `patching_sweep(model, clean_ids, corrupt_ids, metric, ...)`: patch the clean run's memory (or only
  its state, or only its conv window; or one head's) after each chosen position of each chosen recurrent layer
  into the corrupt run, and measure `metric` on each patched run's logits; over one prompt pair or many, in one
  process or split across the ranks of a `torch.distributed` group, resuming from a checkpoint.
- `Sweep`: what it returns: the `[layers, positions]` metric (`[pairs, layers, heads, positions]` at most) and the
  clean and corrupt baselines.

How a forward serves many cells: row r of a batch is cell r's pair's corrupt prompt, and is assigned that cell
(layer L_r, position p_r, head h_r). For each layer, one state hook targets the positions assigned to that layer
in the batch; at token t it replaces only the rows whose position is t (`index_copy` on the batch axis; with heads,
only the row's head of the state, or the window channels that feed it) with the clean memory after t. Every other
row, and every other token, keeps what the corrupt run made. `cells` holds that machinery, `ranks` the split
across processes (from the cache: by position, `_dealt`) and the checkpoint. docs/sweep.md has the long form,
with the cost in time and memory.

Where every recurrent layer's kind continues a cached memory in transformers (`CONTINUES_CACHE`), the cells run from the
corrupt run's cache instead (`prefix`): the prompts run once in pieces up to each position, and a cell at
position p runs only tokens p + 1.. from a copy of the corrupt cache with its layer's clean memory in its row.
"""

import dataclasses
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ...engine.declare.kernels import CONV_MEMORY, STATE_MEMORY
from ...engine.errors import InvalidValue, renamed
from ...engine.policy import Paths
from ..metrics import for_rows, mixes_pairs
from ..ranks import Checkpoint, Ranks, sweep_key
from . import prefix
from .cells import Cell, Plan, clean_memories, measure, patched, probe, rounds

WHAT = {"memory": (STATE_MEMORY, CONV_MEMORY), "state": (STATE_MEMORY,), "window": (CONV_MEMORY,)}
_WHERE = "patching_sweep"


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The result of `patching_sweep`.

    - `values[i, j]`: `metric` of the corrupt run with the clean `memory` of layer `layers[i]` written after
      token `positions[j]` (tokens `positions[j] + 1..` continue from it); `[pairs, layers, positions]` for
      `[pairs, seq]` prompts (`values[n, i, j]`: pair n's); with `heads`, `[..., layers, heads, positions]`
      (`values[i, h, j]`: only head h of the layer patched);
    - `clean`, `corrupt`: `metric` of the clean and of the unpatched corrupt run (0-d tensors; `[pairs]`);
    - `layers`, `positions`, `memory`: the sweep's axes and what it patched ("memory": the whole memory, "state",
      "window"); `heads`: the number of heads of the per-head sweep (None: whole layers).
    """

    values: Float[Tensor, "*pairs layers positions"]  # no pairs axis for one pair given as [seq]; [.., heads, ..]
    clean: Float[Tensor, "*pairs"]
    corrupt: Float[Tensor, "*pairs"]
    layers: tuple[int, ...]
    positions: tuple[int, ...]
    memory: str
    heads: int | None = None

    @property
    def what(self) -> str:
        """The former name of `memory`."""
        renamed("Sweep.what", "Sweep.memory")
        return self.memory

    def normalized(self) -> Tensor:
        """`(values - corrupt) / (clean - corrupt)` (per pair): 0 where patching changes nothing, 1 where it restores
        the clean metric (inf or nan where the two baselines are equal)."""
        cells = self.values.dim() - self.clean.dim()
        clean, corrupt = (x.reshape(*x.shape, *[1] * cells) for x in (self.clean, self.corrupt))
        return (self.values - corrupt) / (clean - corrupt)

    def to_dict(self) -> dict[str, Any]:
        """Tensors, ints and strings only: `torch.save(sweep.to_dict(), path)` loads back with
        `Sweep.from_dict(torch.load(path, weights_only=True))`."""
        return {
            "values": self.values,
            "clean": self.clean,
            "corrupt": self.corrupt,
            "layers": list(self.layers),
            "positions": list(self.positions),
            "memory": self.memory,
            "heads": self.heads,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Sweep":
        """The result `to_dict` gave; one saved before the rename holds "what" where it now holds "memory"."""
        memory = data["memory"] if "memory" in data else data["what"]
        return cls(
            data["values"],
            torch.as_tensor(data["clean"]),
            torch.as_tensor(data["corrupt"]),
            tuple(int(layer) for layer in data["layers"]),
            tuple(int(p) for p in data["positions"]),
            str(memory),
            None if data.get("heads") is None else int(data["heads"]),
        )


def _as_prompts(ids: Any, name: str) -> Tensor:
    """The pairs' prompts as `[pairs, seq]`: one pair's `[seq]` as `[1, seq]`."""
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        got = f"a {ids.dtype} tensor" if isinstance(ids, Tensor) else type(ids).__name__
        raise InvalidValue(
            f"{_WHERE}: expected {name} as an integer tensor of token ids, [seq] (one pair) or [pairs, seq], got {got}"
        )
    if ids.dim() not in (1, 2) or 0 in ids.shape:
        raise InvalidValue(
            f"{_WHERE}: expected {name} of shape [seq] (one pair) or [pairs, seq] (the sweep makes the"
            f" batch), got shape {tuple(ids.shape)}"
        )
    return ids if ids.dim() == 2 else ids[None]


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or isinstance(value, float):
        raise InvalidValue(f"{_WHERE}: expected {what} as an int, got {type(value).__name__} {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidValue(f"{_WHERE}: expected {what} as an int, got {type(value).__name__} {value!r}") from None


def _as_list(value: Any, what: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return [_as_int(value, what)]
    items = [_as_int(item, what) for item in value]
    if not items:
        raise InvalidValue(f"{_WHERE}: expected {what}s as an int or a non-empty list of ints, got {value!r}")
    return items


def _positions(positions: Any, tokens: int) -> tuple[int, ...]:
    if positions is None:
        return tuple(range(tokens))
    items = _as_list(positions, "position")
    outside = [p for p in items if not -tokens <= p < tokens]
    if outside:
        raise InvalidValue(
            f"{_WHERE}: expected positions in 0..{tokens - 1} (or -{tokens}..-1) of the {tokens}-token"
            f" prompt, got position {outside[0]}"
        )
    items = [p % tokens for p in items]
    if len(set(items)) != len(items):
        twice = next(p for p in items if items.count(p) > 1)
        raise InvalidValue(f"{_WHERE}: expected each position once, got position {twice} twice")
    return tuple(items)


def _layers(layers: Any, recurrent: list[int]) -> tuple[int, ...]:
    if layers is None:
        return tuple(recurrent)
    items = _as_list(layers, "layer")
    unknown = [layer for layer in items if layer not in recurrent]
    if unknown:
        raise InvalidValue(
            f"{_WHERE}: expected layers among the recurrent layers {recurrent} (attention layers"
            f" cannot be patched), got layer {unknown[0]}"
        )
    if len(set(items)) != len(items):
        twice = next(layer for layer in items if items.count(layer) > 1)
        raise InvalidValue(f"{_WHERE}: expected each layer once, got layer {twice} twice")
    return tuple(items)


# The default batch: rows per forward while one row's patched memory is small. Below it a row's token-loop step
# in the patched layer is Python-bound, and more rows cost little; at Qwen3.5 dims (2 MiB a cell) a row's forward
# is compute-bound, rows cost as much as forwards, and batch 1 was measured fastest (docs/sweep.md, "Cost").
BATCH_BYTES = 1 << 20
MAX_BATCH = 32
# The default budget for the clean memories held at once: one clean forward produces the memories of as many
# whole batches of cells as fit (at least one batch).
BUDGET_BYTES = 256 << 20


def _default_batch_size(cell_bytes: int) -> int:
    """The batch `patching_sweep(batch_size=None)` takes for cells of `cell_bytes` (the largest chosen layer's
    state and window at batch 1): `BATCH_BYTES // cell_bytes`, clamped to 1..`MAX_BATCH`."""
    return max(1, min(MAX_BATCH, BATCH_BYTES // max(1, cell_bytes)))


def _batches(cells: list[Cell], batch_size: int, mixed: bool) -> list[list[Cell]]:
    """`cells` in order, `batch_size` a batch; a batch holds one pair's cells unless `mixed`."""
    batches: list[list[Cell]] = []
    for cell in cells:
        if batches and len(batches[-1]) < batch_size and (mixed or batches[-1][-1].pair == cell.pair):
            batches[-1].append(cell)
        else:
            batches.append([cell])
    return batches


def _by_position(
    cells: list[Cell], batch_size: int, mixed: bool
) -> list[tuple[list[int], dict[int, list[list[Cell]]]]]:
    """The cells as (a group of pairs, position index -> that position's batches of the group's cells): groups of
    `batch_size` pairs (one pair unless `mixed`), whose prompts run once for all their cells."""
    pairs = sorted({cell.pair for cell in cells})
    out = []
    for group in [pairs[k : k + batch_size] for k in range(0, len(pairs), batch_size if mixed else 1)]:
        at: dict[int, list[Cell]] = {}
        for cell in cells:
            if cell.pair in group:
                at.setdefault(cell.position, []).append(cell)
        out.append((group, {j: _batches(mine, batch_size, mixed) for j, mine in at.items()}))
    return out


def _baselines(
    model: nn.Module,
    clean_ids: Tensor,
    corrupt_ids: Tensor,
    metric: Callable[[Tensor], Tensor],
    one_pair: bool,
    kwargs: Mapping[str, Any],
) -> tuple[Tensor, Tensor]:
    """The metric of the clean and of the corrupt run of every pair, `[pairs]` each (all pairs in one batch where
    the metric allows, else one forward per pair)."""
    pairs = list(range(clean_ids.shape[0]))
    groups = [pairs] if mixes_pairs(metric) else [[n] for n in pairs]
    out = []
    with torch.no_grad():
        for ids in (clean_ids, corrupt_ids):
            out.append(
                torch.cat(
                    [
                        measure(for_rows(metric, None if one_pair else group), model(ids[group], **kwargs).logits)
                        for group in groups
                    ]
                )
            )
    return out[0], out[1]


def _plan(
    model: nn.Module,
    clean_ids: Tensor,
    chosen: tuple[Any, Any, str, bool],
    paths: Paths | None,
    kwargs: Mapping[str, Any],
    reuse_prefix: bool | None,
) -> Plan:
    """The sweep's plan from the probe (`chosen`: the layers, positions, memory and heads asked for);
    `reuse_prefix=True` refused where the cells cannot run from the corrupt run's cache."""
    layers, positions, memory, heads = chosen
    plan = Plan((), _positions(positions, clean_ids.shape[1]), WHAT[memory], memory, {})
    plan = probe(
        model,
        clean_ids,
        lambda recurrent: _layers(layers, recurrent),
        plan,
        heads,
        paths,
        kwargs,
        check=prefix.refusal if reuse_prefix is not False else lambda *_, **__: "reuse_prefix=False",
    )
    if reuse_prefix and plan.refusal is not None:
        raise InvalidValue(
            f"{_WHERE}: reuse_prefix=True runs each cell from the corrupt run's cache, which needs"
            f" transformers to continue every layer's memory from a cache; here: {plan.refusal}"
            " (reuse_prefix=None takes one forward per cell then)"
        )
    return plan


def _what(memory: Any, what: Any) -> str:
    """The memories a sweep patches ("memory": the whole memory; "state"; "window") from `memory=` or its former
    name `what=` (which warns)."""
    if what is not None:
        if memory is not None:
            raise InvalidValue(
                f"{_WHERE}: memory={memory!r} and what={what!r}: `what` is the former name of"
                " `memory`; pass memory= alone"
            )
        renamed(f"{_WHERE}(what=...)", f"{_WHERE}(memory=...)", stacklevel=4)
        if what not in WHAT:
            raise InvalidValue(f"{_WHERE}: expected what in {tuple(WHAT)}, got what={what!r}")
        return what
    if memory is not None and (memory not in WHAT or memory == "memory"):
        raise InvalidValue(
            f"{_WHERE}: expected memory= None (the whole memory), 'state' or 'window', got memory={memory!r}"
        )
    return "memory" if memory is None else memory


def _checked(
    model: Any,
    clean_ids: Any,
    corrupt_ids: Any,
    metric: Any,
    batch_size: Any,
    budget_bytes: Any,
    flags: Mapping[str, Any],
    forward_kwargs: Any,
    checkpoint: Any,
) -> tuple[Tensor, Tensor, int | None, int]:
    """The arguments of `patching_sweep` checked: the prompts as `[pairs, seq]`, the batch size (None: by default)
    and the budget."""
    if not isinstance(model, nn.Module):
        raise InvalidValue(f"{_WHERE}: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    clean, corrupt = _as_prompts(clean_ids, "clean_ids"), _as_prompts(corrupt_ids, "corrupt_ids")
    if clean.shape != corrupt.shape:
        if clean_ids.dim() == corrupt_ids.dim() == 1:
            raise InvalidValue(
                f"{_WHERE}: expected clean_ids and corrupt_ids of the same length (positions are"
                f" shared), got shapes {tuple(clean.shape)} and {tuple(corrupt.shape)}"
            )
        raise InvalidValue(
            f"{_WHERE}: expected clean_ids and corrupt_ids of one shape [pairs, seq], got shapes"
            f" {tuple(clean_ids.shape)} and {tuple(corrupt_ids.shape)}"
        )
    if not callable(metric):
        raise InvalidValue(f"{_WHERE}: expected metric as a callable logits -> one value per row, got {metric!r}")
    if batch_size is not None:
        batch_size = _as_int(batch_size, "batch_size")
        if batch_size < 1:
            raise InvalidValue(
                f"{_WHERE}: expected batch_size >= 1 (or None: chosen from the shapes), got batch_size={batch_size}"
            )
    budget = BUDGET_BYTES if budget_bytes is None else _as_int(budget_bytes, "budget_bytes")
    if budget < 0:
        raise InvalidValue(f"{_WHERE}: expected budget_bytes >= 0 (or None: {BUDGET_BYTES}), got budget_bytes={budget}")
    for name, value in flags.items():
        allowed = (True, False, None) if name in ("distributed", "reuse_prefix") else (True, False)
        if not any(value is a for a in allowed):
            expected = " or ".join(f"{name}={a}" for a in allowed)
            raise InvalidValue(f"{_WHERE}: expected {expected}, got {name}={value!r}")
    if forward_kwargs is not None and not isinstance(forward_kwargs, Mapping):
        raise InvalidValue(
            f"{_WHERE}: expected forward_kwargs as a mapping of keyword arguments, got {type(forward_kwargs).__name__}"
        )
    for name, value in (forward_kwargs or {}).items():
        if isinstance(value, Tensor) and value.dim() > 1:  # [batch, seq]: an attention mask, position ids
            raise InvalidValue(
                f"{_WHERE}: forward_kwargs[{name!r}] is a tensor of shape {tuple(value.shape)}; expected keyword"
                " arguments without per-row or per-token tensors: they go to the one-token probe and to every"
                " forward alike, whose batch and length differ (a sweep's prompts have no padding: no attention"
                " mask is needed)"
            )
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise InvalidValue(
            f"{_WHERE}: expected checkpoint as a file path (str or os.PathLike) or None, got"
            f" {type(checkpoint).__name__}"
        )
    return clean, corrupt, batch_size, budget


def patching_sweep(
    model: nn.Module,
    clean_ids: Tensor,
    corrupt_ids: Tensor,
    metric: Callable[[Tensor], Tensor],
    *,
    layers: int | Iterable[int] | None = None,
    positions: int | Iterable[int] | None = None,
    memory: str | None = None,
    heads: bool = False,
    batch_size: int | None = None,
    budget_bytes: int | None = None,
    progress: bool = True,
    forward_kwargs: Mapping[str, Any] | None = None,
    paths: Paths | None = None,
    distributed: bool | None = None,
    checkpoint: str | os.PathLike | None = None,
    reuse_prefix: bool | None = None,
    what: str | None = None,
) -> Sweep:
    """Patch the clean run into the corrupt run at every (layer, position); return `metric` per cell.

        sweep = rh.patching_sweep(model, clean_ids, corrupt_ids, lambda logits: logits[:, -1, answer])
        sweep.values          # [layers, positions]
        sweep.normalized()    # 0: no effect, 1: the clean metric restored

    - `clean_ids`, `corrupt_ids`: one pair of prompts, `[seq]` each, of the same length; or N pairs, `[N, seq]`:
      every result gets a leading pairs axis, also for N = 1, equal to one sweep per pair stacked. Rows of several
      pairs share a batch where the metric has `for_rows` (`rh.metrics`' do); the pairs' baselines are one batch.
    - `metric(logits) -> Tensor[batch]`: takes the logits of a batch of patched runs, `[batch, seq, vocab]`
      (`[batch, k, vocab]` with `forward_kwargs={"logits_to_keep": k}`), and returns one value per row.
      Rows are independent runs: a metric must not mix them. For N pairs, the metric of a batch whose row r is
      pair n_r's is `metric.for_rows(n)` where it has that method, else `metric.for_pair(n)` (a batch then holds
      one pair's cells), else `metric` itself (the same metric for every pair).
    - `layers`: decoder layer indices of recurrent mixers (default: all of them; attention layers are not
      patchable); `positions`: tokens of the prompt (default: all; negative counts from the end).
    - `memory`: None writes the state and the conv window after the position (`set_memory_after`), the whole of
      what the next token continues from; "state" the state only, "window" the window only. The result's `memory`
      says which ("memory", "state", "window"); `what=` is the former name of `memory` ("memory" for None).
    - `heads`: one cell per (layer, head, position), `values` `[layers, heads, positions]`: a cell patches that
      head's slice of the state and (for "memory", "window") the window channels that feed the head, as the kind
      declares them (its adapter's `head_channels`; docs/sweep.md, "Heads"), and nothing else.
    - `batch_size`: cells per forward. None: `BATCH_BYTES` (1 MiB) // the bytes of one cell's memory (its state
      and window at batch 1), clamped to 1..32: 1 at Qwen3.5 dims, 32 on tiny models.
    - `budget_bytes`: with one forward per cell, the clean memories held at once (None: `BUDGET_BYTES`, 256 MiB):
      one clean forward keeps the memories of as many whole batches as fit, at least one batch.
    - `reuse_prefix`: None: where all the mixers' kinds continue a cache (`CONTINUES_CACHE`), without `heads`,
      the prompts run once in pieces and a cell at p runs tokens p + 1.. from the corrupt run's cache holding its
      layer's clean memory (`prefix`), else one forward per cell; True: the cache or an error; False: not.
    - `distributed`: under an initialized `torch.distributed` process group (None, the default: unless the model is
      tensor-parallel), the cells are split across its ranks (from the cache, by position: a rank runs the prompts
      up to its own positions only), and every rank, which must make the same call, returns the whole result;
      False: this process runs every cell.
    - `checkpoint`: a file path: the finished cells are saved there after each round (or position), and a
      sweep restarted with the same path (and prompts, layers, positions, memory, heads) runs only the others.
    - `progress`: a tqdm bar over the cells (rank 0's); `forward_kwargs`: passed to every forward, after
      `use_cache=False`; `paths`: how the watched calls run (`recurrent_hooks.Paths`, as for `watch`).

    Cell (L, p) equals one forward of the corrupt prompt with the clean `memory` of layer L written after
    token p by the public writes: from the cache, within float32 rounding (other kernels, the prompt in pieces);
    one forward per cell, bit for bit where both take the same kernel path at the same batch
    shape, else within float32 rounding (a single write runs the chunked kernel in two segments, hooks at
    many positions the token loop; CPU matrix products round by batch size; docs/sweep.md). Runs under
    `torch.no_grad()`. `forward_kwargs` go to the one-token probe and every forward alike, so they must not hold
    per-row or per-token tensors (one prompt has no padding: no attention mask is needed; a tensor of two or more
    axes is refused).
    """
    memory = _what(memory, what)
    flags = {"heads": heads, "progress": progress, "distributed": distributed, "reuse_prefix": reuse_prefix}
    one_pair = isinstance(clean_ids, Tensor) and clean_ids.dim() == 1
    clean_ids, corrupt_ids, batch_size, budget = _checked(
        model, clean_ids, corrupt_ids, metric, batch_size, budget_bytes, flags, forward_kwargs, checkpoint
    )
    kwargs = {"use_cache": False, **(forward_kwargs or {})}
    plan = _plan(model, clean_ids, (layers, positions, memory, heads), paths, kwargs, reuse_prefix)
    batch_size = batch_size or _default_batch_size(max(plan.sizes.values()))
    clean_metric, corrupt_metric = _baselines(model, clean_ids, corrupt_ids, metric, one_pair, kwargs)
    cells = plan.cells(clean_ids.shape[0])
    shape = (clean_ids.shape[0], len(plan.layers), *([plan.heads] if heads else []), len(plan.positions))
    values, done = (torch.zeros(shape, dtype=t, device=clean_metric.device) for t in (clean_metric.dtype, torch.bool))
    ranks = Ranks.of(distributed, model)
    saved = Checkpoint(
        checkpoint,
        ranks,
        sweep_key(
            clean_ids,
            corrupt_ids,
            layers=list(plan.layers),
            positions=list(plan.positions),
            memory=memory,
            heads=plan.heads,
        ),
    )
    saved.load(values, done)
    # every rank splits the same cells: the union of what each read (none writes before every rank has read)
    if checkpoint is not None:
        values, done = ranks.gathered(values, done)
    todo = [cells[k] for k in torch.nonzero(~done.flatten().cpu()).flatten().tolist()]
    _measure_cells(
        model,
        (clean_ids, corrupt_ids),
        plan,
        (todo, ranks),
        metric,
        one_pair,
        (batch_size, budget),
        paths,
        kwargs,
        progress and ranks.rank == 0,
        (values, done),
        saved,
    )
    values, _ = ranks.gathered(values, done)
    saved.finish(values)
    if one_pair:
        return Sweep(values[0], clean_metric[0], corrupt_metric[0], plan.layers, plan.positions, memory, plan.heads)
    return Sweep(values, clean_metric, corrupt_metric, plan.layers, plan.positions, memory, plan.heads)


def _measure_cells(
    model: nn.Module,
    prompts: tuple[Tensor, Tensor],
    plan: Plan,
    share: tuple[list[Cell], Ranks],
    metric: Callable[[Tensor], Tensor],
    one_pair: bool,
    sizes: tuple[int, int],
    paths: Paths | None,
    kwargs: Mapping[str, Any],
    progress: bool,
    into: tuple[Tensor, Tensor],
    saved: Checkpoint,
) -> None:
    """Measure this rank's cells of `share` (the cells still to run, and the ranks that split them) into `into`
    (values, done), round after round (`sizes`: the batch size and the budget), saving the finished cells after
    each round."""
    (clean_ids, corrupt_ids), (batch_size, budget), (values, done), (todo, ranks) = prompts, sizes, into, share

    from tqdm.auto import tqdm  # a dependency of transformers

    def record(batch: list[Cell], measured: Tensor) -> None:
        for row, cell in enumerate(batch):
            index = (cell.pair, cell.layer, *([] if cell.head is None else [cell.head]), cell.position)
            values[index], done[index] = measured[row], True
        bar.update(len(batch))

    mixed = one_pair or mixes_pairs(metric)
    metric_of = lambda batch: for_rows(metric, None if one_pair else [cell.pair for cell in batch])  # noqa: E731
    if plan.refusal is None:  # every cell from the corrupt run's cache
        groups = _dealt(_by_position(todo, batch_size, mixed), plan, ranks)
        total = sum(len(batch) for _, at in groups for batches in at.values() for batch in batches)
        with tqdm(total=total, desc=_WHERE, unit="cell", disable=not progress) as bar:
            for group, batches in groups:
                last = None
                for j, batch, measured in prefix.measured(model, prompts, group, batches, plan, kwargs, metric_of):
                    if last is not None and j != last:  # a position done
                        saved.save(values, done)
                    record(batch, measured)
                    last = j
                saved.save(values, done)
        return
    mine = [todo[k] for k in ranks.mine(torch.arange(len(todo))).tolist()]
    with tqdm(total=len(mine), desc=_WHERE, unit="cell", disable=not progress) as bar:
        for round_ in rounds(_batches(mine, batch_size, mixed), plan, budget):
            clean = clean_memories(model, clean_ids, round_, plan, paths, kwargs)
            for batch in round_:
                record(batch, patched(model, corrupt_ids, batch, plan, clean, paths, kwargs, metric_of(batch)))
            del clean  # before the next round's clean forward: one round's memories at a time
            saved.save(values, done)


def _dealt(
    groups: list[tuple[list[int], dict[int, list[list[Cell]]]]], plan: Plan, ranks: Ranks
) -> list[tuple[list[int], dict[int, list[list[Cell]]]]]:
    """This rank's share of `_by_position`'s groups, for the cells run from the cache: whole (group, position)
    units, so that a rank runs a group's prompts in pieces up to its own positions only (one forward up to the first,
    then a piece to each next one), and each unit's batches are the ones a single process makes.

    The units are dealt in prompt order (group by group), snake-wise (`Ranks.dealt`): a cell at position p runs
    T - p - 1 tokens, so the units cost less and less along the prompt, and each run of 2W units gives every rank
    one unit of its first half and the mirror unit of its second; the ranks' tail tokens come out nearly equal, and
    their numbers of units (a piece and its batches each) differ by one at most. Each rank's pieces then reach about
    the end of the prompt: two rows a pair, about one clean and one corrupt forward in all. A contiguous split would
    spare the first ranks the late pieces, but to balance the tail tokens it gives the last ranks many more units,
    so many more forwards. With fewer units than ranks (a few positions over many layers), each unit's batches are
    cut into as many contiguous parts as it takes for every rank to get one, rather than leave ranks idle: a part
    costs its own piece, one forward of two rows a pair.

    A rank runs the prompts in other pieces than one process (tokens 0..p in one forward where one process stops at
    every swept position before p), which rounds otherwise: its cells equal one process's within float32 rounding."""
    units = [
        (g, j, batches)
        for g, (_, at) in enumerate(groups)
        for j, batches in sorted(at.items(), key=lambda unit: plan.positions[unit[0]])
    ]
    if 0 < len(units) < ranks.world:
        parts = -(-ranks.world // len(units))
        units = [
            (g, j, batches[k * len(batches) // parts : (k + 1) * len(batches) // parts])
            for g, j, batches in units
            for k in range(parts)
        ]
        units = [unit for unit in units if unit[2]]
    mine: dict[int, dict[int, list[list[Cell]]]] = {}  # group index -> position index -> this rank's batches
    for k in ranks.dealt(len(units)):
        g, j, batches = units[k]
        mine.setdefault(g, {}).setdefault(j, []).extend(batches)
    return [(groups[g][0], at) for g, at in sorted(mine.items())]
