"""Activation patching over every (layer, position) of a prompt, many cells per forward.

Module contents:
- `patching_sweep(model, clean_ids, corrupt_ids, metric, ...)`: patch the clean run's memory (or only
  its state, or only its conv window) after each chosen position of each chosen recurrent layer into
  the corrupt run, and measure `metric` on each patched run's logits.
- `Sweep`: what it returns: the `[layers, positions]` metric and the clean and corrupt baselines.

How a forward serves many cells: the corrupt prompt is repeated over a batch, and row r is assigned one
cell (layer L_r, position p_r). For each layer, one state hook targets the positions assigned to that
layer in the batch; at token t it replaces only the rows whose position is t (`index_copy` on the batch
axis) with the clean memory after t. Every other row, and every other token, keeps what the corrupt
run made. The library's writes (`set_state_after`) write one value for the whole batch; per-row
writes are what the hooks add. docs/sweep.md has the long form, with the cost in time and memory.
"""

import dataclasses
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..engine.errors import InvalidValue
from ..engine.kernels import CONV_MEMORY, STATE_MEMORY
from ..engine.parts import map_parts
from ..engine.strategies import Paths
from ..engine.watch import watch

WHAT = {"memory": (STATE_MEMORY, CONV_MEMORY), "state": (STATE_MEMORY,), "window": (CONV_MEMORY,)}
_WHERE = "patching_sweep"


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The result of `patching_sweep`.

    - `values[i, j]`: `metric` of the corrupt run with the clean `what` of layer `layers[i]` written after
      token `positions[j]` (tokens `positions[j] + 1..` continue from it); `[pairs, layers, positions]` for
      `[pairs, seq]` prompts (`values[n, i, j]`: pair n's);
    - `clean`, `corrupt`: `metric` of the clean and of the unpatched corrupt run (0-d tensors; `[pairs]`);
    - `layers`, `positions`, `what`: the sweep's axes and what it patched.
    """

    values: Float[Tensor, "*pairs layers positions"]  # no pairs axis for one pair given as [seq]
    clean: Float[Tensor, "*pairs"]
    corrupt: Float[Tensor, "*pairs"]
    layers: tuple[int, ...]
    positions: tuple[int, ...]
    what: str

    def normalized(self) -> Tensor:
        """`(values - corrupt) / (clean - corrupt)` (per pair): 0 where patching changes nothing, 1 where it restores
        the clean metric (inf or nan where the two baselines are equal)."""
        clean, corrupt = self.clean[..., None, None], self.corrupt[..., None, None]
        return (self.values - corrupt) / (clean - corrupt)

    def to_dict(self) -> dict[str, Any]:
        """Tensors, ints and strings only: `torch.save(sweep.to_dict(), path)` loads back with
        `Sweep.from_dict(torch.load(path, weights_only=True))`."""
        return {"values": self.values, "clean": self.clean, "corrupt": self.corrupt, "layers": list(self.layers),
                "positions": list(self.positions), "what": self.what}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Sweep":
        """The result `to_dict` gave."""
        return cls(data["values"], torch.as_tensor(data["clean"]), torch.as_tensor(data["corrupt"]),
                   tuple(int(layer) for layer in data["layers"]), tuple(int(p) for p in data["positions"]),
                   str(data["what"]))


def _as_prompt(ids: Any, name: str) -> Tensor:
    """One pair's prompt `[seq]` as the `[1, seq]` batch its forwards take (`patching_sweep` splits `[pairs, seq]`)."""
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        got = f"a {ids.dtype} tensor" if isinstance(ids, Tensor) else type(ids).__name__
        raise InvalidValue(f"{_WHERE}: expected {name} as an integer tensor of token ids, [seq] (one pair) or"
                           f" [pairs, seq], got {got}")
    if ids.dim() != 1 or ids.shape[0] == 0:
        raise InvalidValue(f"{_WHERE}: expected {name} of shape [seq] (one pair) or [pairs, seq] (the sweep makes the"
                           f" batch), got shape {tuple(ids.shape)}")
    return ids[None]


def _for_pair(metric: Callable[[Tensor], Tensor], pair: int) -> Callable[[Tensor], Tensor]:
    """The metric pair `pair`'s cells are measured by: `metric.for_pair(pair)` where it has one (`rh.metrics`' do,
    picking that pair's answer), else `metric` itself."""
    for_pair = getattr(metric, "for_pair", None)
    return for_pair(pair) if callable(for_pair) else metric


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
        raise InvalidValue(f"{_WHERE}: expected positions in 0..{tokens - 1} (or -{tokens}..-1) of the {tokens}-token"
                           f" prompt, got position {outside[0]}")
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
        raise InvalidValue(f"{_WHERE}: expected layers among the recurrent layers {recurrent} (attention layers"
                           f" cannot be patched), got layer {unknown[0]}")
    if len(set(items)) != len(items):
        twice = next(layer for layer in items if items.count(layer) > 1)
        raise InvalidValue(f"{_WHERE}: expected each layer once, got layer {twice} twice")
    return tuple(items)


def _measure(metric: Callable[[Tensor], Tensor], logits: Tensor, rows: int) -> Tensor:
    value = metric(logits)
    if not isinstance(value, Tensor) or tuple(value.shape) != (rows,):
        got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise InvalidValue(f"{_WHERE}: expected metric(logits) to return one value per row, a tensor of shape"
                           f" ({rows},) for logits of shape {tuple(logits.shape)}, got {got}")
    return value.detach()


def _carried(mixer: Any, memories: tuple[str, ...], what: str) -> tuple[str, ...]:
    """The memories of `what` that the mixer's kind carries ("memory": all of them; "state" or "window" on a
    kind without it: the hook's registration says so)."""
    return tuple(m for m in memories if m in mixer.MEMORIES) if what == "memory" else memories


# The default batch: rows per forward while one row's patched memory is small. Below it a row's token-loop step
# in the patched layer is Python-bound, and more rows cost little; at Qwen3.5 dims (2 MiB a cell) a row's forward
# is compute-bound, rows cost as much as forwards, and batch 1 was measured fastest (docs/sweep.md, "Cost").
BATCH_BYTES = 1 << 20
MAX_BATCH = 32
# The default budget for the clean memories held at once: one clean forward produces the memories of as many
# whole batches of cells as fit (at least one batch).
BUDGET_BYTES = 256 << 20


def _keep_hooks(w: Any, cells: Mapping[int, Iterable[int]], memories: tuple[str, ...], what: str,
                into: dict[tuple[str, int, int, int | None], Tensor]) -> None:
    """Read hooks that clone the memory after the given positions of each layer into `into`."""
    for layer, tokens in cells.items():
        for memory in _carried(w.mixer(layer), memories, what):
            def keep(mixer: Any, call: int, token: int, state: Tensor, layer: int = layer,
                     memory: str = memory) -> None:
                into[memory, layer, token, mixer.head] = map_parts(torch.clone, state)

            w.mixer(layer).register_state_hook(keep, call=0, token=sorted(tokens), which=memory)


def _probe(model: nn.Module, clean_ids: Tensor, layers: Any, memories: tuple[str, ...], what: str,
           paths: Paths | None, kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...], dict[int, int]]:
    """The chosen layers and the bytes of one cell's memory per layer, read from a one-token clean forward."""
    kept: dict[tuple[str, int, int, int | None], Tensor] = {}
    with watch(model, paths=paths) as w, torch.no_grad():
        w._one_mixer_per_layer("patching_sweep")  # cells are (layer, position): a layer must be one mixer
        layers = _layers(layers, [mixer.layer for mixer in w.mixers])
        _keep_hooks(w, {layer: [0] for layer in layers}, memories, what, kept)
        model(clean_ids[:, :1], **kwargs)
    sizes = dict.fromkeys(layers, 0)
    for (_, layer, _, _), value in kept.items():
        sizes[layer] += sum(part.nbytes for part in _parts(value))
    return layers, sizes


def _parts(value: Any) -> list[Tensor]:
    parts: list[Tensor] = []
    map_parts(lambda part: parts.append(part) or part, value)
    return parts


def _default_batch_size(cell_bytes: int) -> int:
    """The batch `patching_sweep(batch_size=None)` takes for cells of `cell_bytes` (the largest chosen layer's
    state and window at batch 1): `BATCH_BYTES // cell_bytes`, clamped to 1..`MAX_BATCH`."""
    return max(1, min(MAX_BATCH, BATCH_BYTES // max(1, cell_bytes)))


def _rounds(cells: list[tuple[int, int]], batch_size: int, cost: Callable[[int], int],
            budget: int) -> list[list[list[tuple[int, int]]]]:
    """The batches of `cells` (in order, `batch_size` each), grouped into rounds of whole batches whose memories
    (`cost(i)` bytes for a cell of layer i) fit `budget`; a round holds at least one batch."""
    batches = [cells[start:start + batch_size] for start in range(0, len(cells), batch_size)]
    rounds: list[list[list[tuple[int, int]]]] = []
    held = 0
    for batch in batches:
        size = sum(cost(i) for i, _ in batch)
        if rounds and held + size <= budget:
            rounds[-1].append(batch)
            held += size
        else:
            rounds.append([batch])
            held = size
    return rounds


def _clean_memories(model: nn.Module, clean_ids: Tensor, cells: Mapping[int, Iterable[int]],
                    memories: tuple[str, ...], what: str, paths: Paths | None,
                    kwargs: Mapping[str, Any]) -> dict[tuple[str, int, int, int | None], Tensor]:
    """One clean forward keeping the memory after `cells[layer]` positions of each layer (per head for zamba):
    `{(memory, layer, token, head): value}`."""
    kept: dict[tuple[str, int, int, int | None], Tensor] = {}
    with watch(model, paths=paths) as w, torch.no_grad():
        _keep_hooks(w, cells, memories, what, kept)
        model(clean_ids, **kwargs)
    return kept


def _patched(model: nn.Module, ids: Tensor, batch: list[tuple[int, int]],
             cells: tuple[tuple[int, ...], tuple[int, ...]], clean: Mapping[tuple[str, int, int, int | None], Tensor], memories: tuple[str, ...], what: str,
             paths: Paths | None, kwargs: Mapping[str, Any], metric: Callable[[Tensor], Tensor]) -> Tensor:
    """The metric of one forward whose row r is the corrupt prompt patched at cell `batch[r]`."""
    layers, positions = cells
    with watch(model, paths=paths) as w, torch.no_grad():
        for i in sorted({i for i, _ in batch}):
            layer = layers[i]
            rows: dict[int, list[int]] = {}  # token -> the rows patched after it
            for row, (li, j) in enumerate(batch):
                if li == i:
                    rows.setdefault(positions[j], []).append(row)
            at = {token: torch.tensor(r, device=ids.device) for token, r in rows.items()}
            for memory in _carried(w.mixer(layer), memories, what):
                def patch(mixer: Any, call: int, token: int, state: Tensor, layer: int = layer,
                          memory: str = memory, at: dict[int, Tensor] = at) -> Tensor:
                    value = clean[memory, layer, token, mixer.head]
                    index = at[token]
                    return map_parts(lambda s, v: s.index_copy(0, index, v.expand(len(index), *v.shape[1:])),
                                     state, value)

                w.mixer(layer).register_state_hook(patch, call=0, token=sorted(rows), which=memory)
        return _measure(metric, model(ids.expand(len(batch), ids.shape[1]), **kwargs).logits, len(batch))


def _checked(model: Any, clean_ids: Any, corrupt_ids: Any, metric: Any, what: Any, batch_size: Any,
             budget_bytes: Any, progress: Any, forward_kwargs: Any) -> tuple[Tensor, Tensor, int | None, int]:
    """The arguments of `patching_sweep` checked: the two prompts, the batch size (None: by default) and the budget."""
    if not isinstance(model, nn.Module):
        raise InvalidValue(f"{_WHERE}: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    clean_ids, corrupt_ids = _as_prompt(clean_ids, "clean_ids"), _as_prompt(corrupt_ids, "corrupt_ids")
    if clean_ids.shape != corrupt_ids.shape:
        raise InvalidValue(f"{_WHERE}: expected clean_ids and corrupt_ids of the same length (positions are shared),"
                           f" got shapes {tuple(clean_ids.shape)} and {tuple(corrupt_ids.shape)}")
    if not callable(metric):
        raise InvalidValue(f"{_WHERE}: expected metric as a callable logits -> one value per row, got {metric!r}")
    if what not in WHAT:
        raise InvalidValue(f"{_WHERE}: expected what in {tuple(WHAT)}, got what={what!r}")
    if batch_size is not None:
        batch_size = _as_int(batch_size, "batch_size")
        if batch_size < 1:
            raise InvalidValue(f"{_WHERE}: expected batch_size >= 1 (or None: chosen from the shapes), got"
                               f" batch_size={batch_size}")
    budget = BUDGET_BYTES if budget_bytes is None else _as_int(budget_bytes, "budget_bytes")
    if budget < 0:
        raise InvalidValue(f"{_WHERE}: expected budget_bytes >= 0 (or None: {BUDGET_BYTES}), got budget_bytes={budget}")
    if not isinstance(progress, bool):
        raise InvalidValue(f"{_WHERE}: expected progress=True or progress=False, got progress={progress!r}")
    if forward_kwargs is not None and not isinstance(forward_kwargs, Mapping):
        raise InvalidValue(f"{_WHERE}: expected forward_kwargs as a mapping of keyword arguments, got"
                           f" {type(forward_kwargs).__name__}")
    return clean_ids, corrupt_ids, batch_size, budget


def patching_sweep(model: nn.Module, clean_ids: Tensor, corrupt_ids: Tensor, metric: Callable[[Tensor], Tensor], *,
                   layers: int | Iterable[int] | None = None, positions: int | Iterable[int] | None = None,
                   what: str = "memory", batch_size: int | None = None, budget_bytes: int | None = None,
                   progress: bool = True, forward_kwargs: Mapping[str, Any] | None = None,
                   paths: Paths | None = None) -> Sweep:
    """Patch the clean run into the corrupt run at every (layer, position); return `metric` per cell.

        sweep = rh.patching_sweep(model, clean_ids, corrupt_ids, lambda logits: logits[:, -1, answer])
        sweep.values          # [layers, positions]
        sweep.normalized()    # 0: no effect, 1: the clean metric restored

    - `clean_ids`, `corrupt_ids`: one pair of prompts, `[seq]` each, of the same length; or N pairs, `[N, seq]`:
      one sweep per pair (the metric of pair n is `metric.for_pair(n)` where it has that method, as `rh.metrics`'
      do), stacked on a leading pairs axis of every result, also for N = 1.
    - `metric(logits) -> Tensor[batch]`: takes the logits of a batch of patched runs, `[batch, seq, vocab]`
      (`[batch, k, vocab]` with `forward_kwargs={"logits_to_keep": k}`), and returns one value per row.
      Rows are independent runs: a metric must not mix them.
    - `layers`: decoder layer indices of recurrent mixers (default: all of them; attention layers are not
      patchable); `positions`: tokens of the prompt (default: all; negative counts from the end).
    - `what`: "memory" writes the state and the conv window after the position (`set_memory_after`), the
      whole of what the next token continues from; "state" only the recurrent state (`set_state_after`),
      "window" only the conv window (`set_window_after`).
    - `batch_size`: cells per forward; each forward repeats the corrupt prompt `batch_size` times. None:
      `BATCH_BYTES` (1 MiB) // the bytes of one cell's memory (its state and window at batch 1), clamped to
      1..32: 1 at Qwen3.5 dims, 32 on tiny models.
    - `budget_bytes`: the clean memories held at once (None: `BUDGET_BYTES`, 256 MiB). One clean forward
      keeps the memories of as many whole batches as fit, at least one batch; the sweep holds no more,
      whatever the number of positions.
    - `progress`: a tqdm bar over the cells; `forward_kwargs`: passed to every forward, after
      `use_cache=False`; `paths`: how the watched calls run (`recurrent_hooks.Paths`, as for `watch`).

    Cell (L, p) equals one forward of the corrupt prompt with the clean `what` of layer L written after
    token p by the public writes: bit for bit where both take the same kernel path at the same batch
    shape, else within float32 rounding (a single write runs the chunked kernel in two segments, hooks at
    many positions the token loop; CPU matrix products round by batch size; docs/sweep.md). Runs under
    `torch.no_grad()`. `forward_kwargs` go to the one-token probe, the batch-1 and the batch-`batch_size`
    forwards alike, so they must not hold per-row or per-token tensors (one prompt has no padding: no
    attention mask is needed).
    """
    if isinstance(clean_ids, Tensor) and isinstance(corrupt_ids, Tensor) and clean_ids.dim() == 2:
        if clean_ids.shape != corrupt_ids.shape or clean_ids.shape[0] == 0:
            raise InvalidValue(f"{_WHERE}: expected clean_ids and corrupt_ids of one shape [pairs, seq], got shapes"
                               f" {tuple(clean_ids.shape)} and {tuple(corrupt_ids.shape)}")
        sweeps = [patching_sweep(model, clean_ids[n], corrupt_ids[n], _for_pair(metric, n), layers=layers,
                                 positions=positions, what=what, batch_size=batch_size, budget_bytes=budget_bytes,
                                 progress=progress, forward_kwargs=forward_kwargs, paths=paths)
                  for n in range(clean_ids.shape[0])]
        first = sweeps[0]
        return Sweep(torch.stack([s.values for s in sweeps]), torch.stack([s.clean for s in sweeps]),
                     torch.stack([s.corrupt for s in sweeps]), first.layers, first.positions, first.what)
    clean_ids, corrupt_ids, batch_size, budget = _checked(model, clean_ids, corrupt_ids, metric, what, batch_size,
                                                          budget_bytes, progress, forward_kwargs)
    kwargs = {"use_cache": False, **(forward_kwargs or {})}
    positions = _positions(positions, clean_ids.shape[1])
    memories = WHAT[what]
    layers, sizes = _probe(model, clean_ids, layers, memories, what, paths, kwargs)
    if batch_size is None:
        batch_size = _default_batch_size(max(sizes.values()))
    with torch.no_grad():
        clean_metric = _measure(metric, model(clean_ids, **kwargs).logits, 1)[0]
        corrupt_metric = _measure(metric, model(corrupt_ids, **kwargs).logits, 1)[0]

    from tqdm.auto import tqdm  # a dependency of transformers

    cells = [(i, j) for i in range(len(layers)) for j in range(len(positions))]  # layer-major: few layers per batch
    values = torch.empty(len(layers), len(positions), dtype=clean_metric.dtype, device=clean_metric.device)
    with tqdm(total=len(cells), desc=_WHERE, unit="cell", disable=not progress) as bar:
        for round_ in _rounds(cells, batch_size, lambda i: sizes[layers[i]], budget):
            wanted: dict[int, list[int]] = {}
            for i, j in (cell for batch in round_ for cell in batch):
                wanted.setdefault(layers[i], []).append(positions[j])
            clean = _clean_memories(model, clean_ids, wanted, memories, what, paths, kwargs)
            for batch in round_:
                measured = _patched(model, corrupt_ids, batch, (layers, positions), clean, memories, what, paths,
                                    kwargs, metric)
                for row, (i, j) in enumerate(batch):
                    values[i, j] = measured[row]
                bar.update(len(batch))
            del clean  # before the next round's clean forward: one round's memories at a time
    return Sweep(values, clean_metric, corrupt_metric, layers, positions, what)
