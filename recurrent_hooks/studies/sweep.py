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
      token `positions[j]` (tokens `positions[j] + 1..` continue from it);
    - `clean`, `corrupt`: `metric` of the clean and of the unpatched corrupt run (0-d tensors);
    - `layers`, `positions`, `what`: the sweep's axes and what it patched.
    """

    values: Tensor
    clean: Tensor
    corrupt: Tensor
    layers: tuple[int, ...]
    positions: tuple[int, ...]
    what: str

    def normalized(self) -> Tensor:
        """`(values - corrupt) / (clean - corrupt)`: 0 where patching changes nothing, 1 where it restores the
        clean metric (inf or nan where the two baselines are equal)."""
        return (self.values - self.corrupt) / (self.clean - self.corrupt)


def _as_prompt(ids: Any, name: str) -> Tensor:
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        got = f"a {ids.dtype} tensor" if isinstance(ids, Tensor) else type(ids).__name__
        raise InvalidValue(f"{_WHERE}: expected {name} as an integer tensor of token ids, [seq] or [1, seq], got {got}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise InvalidValue(f"{_WHERE}: expected {name} of shape [seq] or [1, seq] (one prompt; the sweep makes the"
                           f" batch), got shape {tuple(ids.shape)}")
    return ids


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


def patching_sweep(model: nn.Module, clean_ids: Tensor, corrupt_ids: Tensor, metric: Callable[[Tensor], Tensor], *,
                   layers: int | Iterable[int] | None = None, positions: int | Iterable[int] | None = None,
                   what: str = "memory", batch_size: int = 32, progress: bool = True,
                   forward_kwargs: Mapping[str, Any] | None = None, paths: Paths | None = None) -> Sweep:
    """Patch the clean run into the corrupt run at every (layer, position); return `metric` per cell.

        sweep = rh.patching_sweep(model, clean_ids, corrupt_ids, lambda logits: logits[:, -1, answer])
        sweep.values          # [layers, positions]
        sweep.normalized()    # 0: no effect, 1: the clean metric restored

    - `clean_ids`, `corrupt_ids`: one prompt each, `[seq]` or `[1, seq]`, of the same length.
    - `metric(logits) -> Tensor[batch]`: takes the logits of a batch of patched runs, `[batch, seq, vocab]`
      (`[batch, k, vocab]` with `forward_kwargs={"logits_to_keep": k}`), and returns one value per row.
      Rows are independent runs: a metric must not mix them.
    - `layers`: decoder layer indices of recurrent mixers (default: all of them; attention layers are not
      patchable); `positions`: tokens of the prompt (default: all; negative counts from the end).
    - `what`: "memory" writes the state and the conv window after the position (`set_memory_after`), the
      whole of what the next token continues from; "state" only the recurrent state (`set_state_after`),
      "window" only the conv window (`set_conv_state_after`).
    - `batch_size`: cells per forward. Each forward repeats the corrupt prompt `batch_size` times.
    - `progress`: a tqdm bar over the cells; `forward_kwargs`: passed to every forward, after
      `use_cache=False`; `paths`: how the watched calls run (`recurrent_hooks.Paths`, as for `watch`).

    Cell (L, p) equals one forward of the corrupt prompt with the clean `what` of layer L written after
    token p by the public writes: bit for bit where both take the same kernel path at the same batch
    shape, else within float32 rounding (a single write runs the chunked kernel in two segments, hooks at
    many positions the token loop; CPU matrix products round by batch size; docs/sweep.md). Runs under
    `torch.no_grad()`. `forward_kwargs` go to batch-1 and batch-`batch_size` forwards alike, so they must
    not hold per-row tensors (one prompt has no padding: no attention mask is needed).
    """
    clean_ids, corrupt_ids, batch_size = _checked(model, clean_ids, corrupt_ids, metric, what, batch_size, progress,
                                                  forward_kwargs)
    kwargs = {"use_cache": False, **(forward_kwargs or {})}
    tokens = clean_ids.shape[1]
    positions = _positions(positions, tokens)
    memories = WHAT[what]
    layers, clean, clean_metric = _clean_run(model, clean_ids, metric, layers, positions, memories, what, kwargs,
                                             paths)
    with torch.no_grad():
        corrupt_metric = _measure(metric, model(corrupt_ids, **kwargs).logits, 1)[0]

    from tqdm.auto import tqdm  # a dependency of transformers

    cells = [(i, j) for i in range(len(layers)) for j in range(len(positions))]  # layer-major: few layers per batch
    values = torch.empty(len(layers), len(positions), dtype=clean_metric.dtype, device=clean_metric.device)
    with tqdm(total=len(cells), desc=_WHERE, unit="cell", disable=not progress) as bar:
        for start in range(0, len(cells), batch_size):
            batch = cells[start:start + batch_size]
            with watch(model, paths=paths) as w, torch.no_grad():
                for i in sorted({i for i, _ in batch}):
                    rows: dict[int, list[int]] = {}  # token -> the rows patched after it
                    for row, (li, j) in enumerate(batch):
                        if li == i:
                            rows.setdefault(positions[j], []).append(row)
                    _patch_rows(w.mixer(layers[i]), layers[i], rows, clean, memories, what, corrupt_ids.device)
                ids = corrupt_ids.expand(len(batch), tokens)
                measured = _measure(metric, model(ids, **kwargs).logits, len(batch))
            for row, (i, j) in enumerate(batch):
                values[i, j] = measured[row]
            bar.update(len(batch))
    return Sweep(values, clean_metric, corrupt_metric, layers, positions, what)


def _checked(model: Any, clean_ids: Any, corrupt_ids: Any, metric: Any, what: Any, batch_size: Any, progress: Any,
             forward_kwargs: Any) -> tuple[Tensor, Tensor, int]:
    """`patching_sweep`'s arguments checked: the two prompts as `[1, seq]` and the batch size as an int."""
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
    batch_size = _as_int(batch_size, "batch_size")
    if batch_size < 1:
        raise InvalidValue(f"{_WHERE}: expected batch_size >= 1, got batch_size={batch_size}")
    if not isinstance(progress, bool):
        raise InvalidValue(f"{_WHERE}: expected progress=True or progress=False, got progress={progress!r}")
    if forward_kwargs is not None and not isinstance(forward_kwargs, Mapping):
        raise InvalidValue(f"{_WHERE}: expected forward_kwargs as a mapping of keyword arguments, got"
                           f" {type(forward_kwargs).__name__}")
    return clean_ids, corrupt_ids, batch_size


def _clean_run(model: nn.Module, clean_ids: Tensor, metric: Callable[[Tensor], Tensor], layers: Any,
               positions: tuple[int, ...], memories: tuple[str, ...], what: str, kwargs: dict[str, Any],
               paths: Paths | None) -> tuple[tuple[int, ...], dict[tuple[str, int, int, int | None], Tensor], Tensor]:
    """The clean run, once: the layers swept, the memory after each chosen position (read hooks keep it, per head
    for zamba) by (memory, layer, token, head), and the clean metric."""
    clean: dict[tuple[str, int, int, int | None], Tensor] = {}
    with watch(model, paths=paths) as w, torch.no_grad():
        w._one_mixer_per_layer("patching_sweep")  # cells are (layer, position): a layer must be one mixer
        layers = _layers(layers, [mixer.layer for mixer in w.mixers])
        for layer in layers:
            for memory in _carried(w.mixer(layer), memories, what):
                def keep(mixer: Any, call: int, token: int, state: Tensor, layer: int = layer,
                         memory: str = memory) -> None:
                    clean[memory, layer, token, mixer.head] = map_parts(torch.clone, state)

                w.mixer(layer).register_state_hook(keep, call=0, token=positions, which=memory)
        clean_metric = _measure(metric, model(clean_ids, **kwargs).logits, 1)[0]
    return layers, clean, clean_metric


def _patch_rows(mixer: Any, layer: int, rows: dict[int, list[int]], clean: dict, memories: tuple[str, ...],
                what: str, device: torch.device) -> None:
    """Register, on one layer's mixer of a batch's watch, the hooks that write the clean memory after token t
    into the rows `rows[t]` patched after it (every other row keeps the corrupt run's)."""
    at = {token: torch.tensor(r, device=device) for token, r in rows.items()}
    for memory in _carried(mixer, memories, what):
        def patch(mixer: Any, call: int, token: int, state: Tensor, layer: int = layer,
                  memory: str = memory, at: dict[int, Tensor] = at) -> Tensor:
            value = clean[memory, layer, token, mixer.head]
            index = at[token]
            return map_parts(lambda s, v: s.index_copy(0, index, v.expand(len(index), *v.shape[1:])), state, value)

        mixer.register_state_hook(patch, call=0, token=sorted(rows), which=memory)
