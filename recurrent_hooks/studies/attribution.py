"""Attribution patching in one backward: the linear estimate of what patching each layer's memory would do.

    result = recurrent_hooks.attribute(model, clean_ids, corrupt_ids, metric)
    result.state[i, t]    # estimated change of metric if layer result.layers[i]'s state after token t
                          # of the corrupt run were the clean run's (its window unchanged)
    result.window[i, t]   # the same for the convolution window alone
    result.memory         # state + window: the estimate for patching the whole memory

Glossary (code name, symbol, shape):
    clean_ids, corrupt_ids  x, x'       [batch, seq]       two prompts of one length, row b paired with row b
    metric                  m           logits -> [batch] or a scalar; its mean over rows is attributed
    S_t, S'_t               state       [batch, *state]    the state after token t, clean and corrupt
    W_t, W'_t               window      [batch, channels, kernel_size]
    state                   (S_t - S'_t) . dm/dS'_t        [layers, seq], summed over rows and state axes
    window                  (W_t - W'_t) . dm/dW'_t        [layers, seq]

The gradients come from one backward through the corrupt run with every state and window kept (kept
states are read through one leaf per call in grad mode, so this works with frozen weights). Patching the
memory after t makes tokens t+1.. continue from the clean memory; the window term matters most for the
kernel_size - 1 tokens right after t, which read the window (docs/concepts.md, "Write semantics").
"""

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..engine.errors import InvalidValue
from ..engine.arguments import as_index
from ..engine.kernels import CONV_MEMORY, STATE_MEMORY
from ..engine.mixer import RecurrentMixer
from ..engine.parts import map_parts, parts_of
from ..engine.strategies import Paths
from ..engine.watch import watch

_MEMORIES = (STATE_MEMORY, CONV_MEMORY)  # the rows `state` and `window`
Metric = Callable[[Tensor], Tensor]  # logits [batch, seq, vocab] -> [batch] or a scalar


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Per recurrent layer and token: the estimated change of the metric from patching clean into corrupt."""

    layers: tuple[int, ...]  # the decoder layer of each row
    state: Float[Tensor, "layers seq"]
    window: Float[Tensor, "layers seq"]
    clean: float  # the metric of the clean run (mean over rows)
    corrupt: float  # the metric of the corrupt run

    @property
    def memory(self) -> Float[Tensor, "layers seq"]:
        """The estimate for patching the whole memory (state and window) after each token."""
        return self.state + self.window


def attribute(model: nn.Module, clean_ids: Tensor, corrupt_ids: Tensor, metric: Metric, *,
              layers: Iterable[int] | None = None, forward_kwargs: Mapping[str, Any] | None = None,
              paths: Paths | None = None) -> Attribution:
    """Attribution patching of every recurrent layer x token, from one clean forward and one forward and
    backward of the corrupt run.

        result = rh.attribute(model, clean, corrupt, lambda logits: logits[:, -1, answer] - logits[:, -1, wrong])
        result.memory        # [layers, seq]: compare with rh.patching_sweep's exact effects

    `metric(logits)` returns one value per row (or a scalar); the mean over rows is attributed. Extra
    `forward_kwargs` go to both forwards (e.g. `use_cache=False`); `paths` sets how their calls run
    (`recurrent_hooks.Paths`, as for `watch`). The weights need not require grad.
    """
    where = "attribute"
    for name, ids in (("clean_ids", clean_ids), ("corrupt_ids", corrupt_ids)):
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            raise InvalidValue(f"{where}: expected {name} as a [batch, seq] tensor of token ids,"
                               f" got {type(ids).__name__}{'' if not isinstance(ids, Tensor) else tuple(ids.shape)}")
    if clean_ids.shape != corrupt_ids.shape:
        raise InvalidValue(f"{where}: clean_ids {tuple(clean_ids.shape)} and corrupt_ids {tuple(corrupt_ids.shape)}"
                           " must have the same shape (row b of one is patched into row b of the other)")
    if not callable(metric):
        raise InvalidValue(f"{where}: expected a callable metric(logits) -> [batch] or a scalar, got {metric!r}")
    kwargs = dict(forward_kwargs or {})
    keep = ("states", "windows")  # a memory a mixer's kind does not carry is not kept (normalize_keep)
    with torch.no_grad(), watch(model, keep=keep, paths=paths) as clean_watch:
        clean_value = _mean(metric(model(clean_ids, **kwargs).logits), where)
    with torch.enable_grad(), watch(model, keep=keep, paths=paths) as corrupt_watch:
        corrupt_value = _mean(metric(model(corrupt_ids, **kwargs).logits), where)
    chosen = _chosen(corrupt_watch.mixers, layers, where)
    pairs = [(clean_watch.mixer(m.layer), m) for m in chosen]
    # every part of every memory the kinds carry (a memory a kind lacks contributes zeros; see engine.parts)
    inputs = [leaf for _, m in pairs for memory in _MEMORIES if memory in m.MEMORIES
              for buffer in m.calls[0].differentiable(memory) for _, leaf in parts_of(buffer)]
    grads = iter(torch.autograd.grad(corrupt_value, inputs, allow_unused=True))
    state_rows, window_rows = [], []
    for clean, corrupt in pairs:
        for memory, rows in zip(_MEMORIES, (state_rows, window_rows)):
            total = torch.zeros(clean_ids.shape[1], dtype=torch.float32, device=clean_ids.device)
            if memory in corrupt.MEMORIES:
                buffers = corrupt.calls[0].differentiable(memory)
                reference = clean.calls[0]._all(memory)
                for head, buffer in enumerate(buffers):
                    clean_part = reference if len(buffers) == 1 else map_parts(lambda r: r[:, :, head], reference)
                    for (_, leaf), (_, clean_leaf) in zip(parts_of(buffer), parts_of(clean_part)):
                        grad = next(grads)
                        if grad is None:  # the metric does not depend on this memory
                            continue
                        delta = clean_leaf.to(torch.float32) - leaf.detach().to(torch.float32)  # b t *memory
                        total = total + (delta * grad.to(torch.float32)).flatten(2).sum(-1).sum(0).to(total.device)  # t
            rows.append(total)
    return Attribution(tuple(m.layer for m in chosen), torch.stack(state_rows), torch.stack(window_rows),
                       float(clean_value), float(corrupt_value.detach()))


def _mean(value: Any, where: str) -> Tensor:
    if not isinstance(value, Tensor) or value.dim() > 1:
        raise InvalidValue(f"{where}: metric(logits) must return a [batch] tensor or a scalar, got"
                           f" {type(value).__name__}{tuple(value.shape) if isinstance(value, Tensor) else ''}")
    return value.mean() if value.dim() == 1 else value


def _chosen(mixers: list[RecurrentMixer], layers: Iterable[int] | None, where: str) -> list[RecurrentMixer]:
    if layers is None:
        return list(mixers)
    wanted = [as_index(layer, "layer", where) for layer in layers]
    known = {m.layer: m for m in mixers}
    missing = [layer for layer in wanted if layer not in known]
    if missing:
        raise InvalidValue(f"{where}: no recurrent mixer at layers {missing}; recurrent layers: {sorted(known)}")
    return [known[layer] for layer in wanted]
