"""Attribution patching in one backward: the linear estimate of what patching each layer's memory would do.

    result = recurrent_hooks.attribute(model, clean_ids, corrupt_ids, metric)   # one pair: [seq] each
    result.state[i, t]    # estimated change of metric if layer result.layers[i]'s state after token t
                          # of the corrupt run were the clean run's (its window unchanged)
    result.window[i, t]   # the same for the convolution window alone
    result.memory         # state + window: the estimate for patching the whole memory
    many = recurrent_hooks.attribute(model, clean_pairs, corrupt_pairs, metric)  # [pairs, seq]: many.state[n, i, t]
    ig = recurrent_hooks.attribute(model, clean_ids, corrupt_ids, metric, steps=8)  # integrated gradients (below)

Glossary (code name, symbol, shape):
    clean_ids, corrupt_ids  x, x'       [seq] or [pairs, seq]   prompts of one length, row n paired with row n
    metric                  m           logits -> [pairs]       one value per pair (a scalar for one pair)
    S_t, S'_t               state       [pairs, *state]    the state after token t, clean and corrupt
    W_t, W'_t               window      [pairs, channels, kernel_size]
    state                   (S_t - S'_t) . dm/dS'_t        [pairs, layers, seq] ([layers, seq] for one pair),
                                                           summed over the state axes
    window                  (W_t - W'_t) . dm/dW'_t        the same shape

The pairs run as one batch; each pair's terms are its own metric's (the rows of a batch do not interact), equal
to attributing the pairs one at a time. A mean over pairs is `.mean(0)`.

Two ways to the same numbers (`method`):
- "pieces" (the default where every chosen mixer's kind has a prompt kernel that runs in pieces chaining its
  state, `Segments`: gated DeltaNet, Kimi delta attention, Mamba-2, Mamba-1): no state is kept. Each prompt
  call of a chosen mixer runs through a takeover (`engine.dispatch.takeover`): in the clean run, the bound kernel
  in pieces of `piece` tokens, keeping the states at the piece boundaries and the call's inputs; in the
  corrupt run, one `torch.autograd.Function` (`pieces.InPieces`) doing the same forward, whose
  backward is the engine's reverse sweep over pieces (`backward.sweep`, as for every state kept with gradients):
  each piece is recomputed from its boundary under autograd for the inputs' gradients, and the kind's adjoint
  gives mu_t = d metric / d S'_t, the `state` term at t being (S_t - S'_t) . mu_t (`AdjointPiece`); Mamba-1,
  which has no adjoint, runs its token loop under autograd with the state after token t replaced by
  S'_t + eps_t (S_t - S'_t), eps a zero leaf [batch, seq] (the values do not change), d metric / d eps_t being
  the term (`LoopSteps`). The clean states of a piece are recomputed from its clean boundary (the kind's
  chunk-wise `all_states`, no grad). Memory per chosen layer: the inputs (O(seq x width)), seq / piece boundary
  states of each run, and in the backward 2 x piece states plus
  the token loop's graph over min(piece, 32 MiB / state bytes) tokens (about 5 state-sized tensors a
  token; the piece's corrupt states are recomputed first, without grad, when a piece has more tokens);
  nothing of size seq x state. Windows are kept as in "states" (K columns a token).
- "states": one backward through the corrupt run with every state and window kept (kept states are read
  through one leaf per call in grad mode, so this works with frozen weights): memory seq x state per layer,
  with the token loop's whole graph. Every kind; the reference the other is tested against.
Patching the memory after t makes tokens t+1.. continue from the clean memory; the window term matters most
for the kernel_size - 1 tokens right after t, which read the window (docs/concepts.md, "Write semantics").

Integrated gradients (`steps=k`, EAP-IG; docs/attribution.md): the gradient of each term is the mean of the
gradients of k runs on the straight line between the two prompts' input embeddings, inputs_embeds(alpha) =
E(x') + alpha (E(x) - E(x')), E = `model.get_input_embeddings()`, alpha = 0, 1/k, ..., (k-1)/k (the left
points: alpha = 0 is the corrupt run, so steps=1 is the estimate above). The delta stays S_t - S'_t, the corrupt
run's memory: a forward of the corrupt ids without grad keeps it as the clean one's is kept ("pieces": its calls'
inputs and boundary states, `CleanPieces`, given to each `InPieces` call as its `reference`; "states": its kept
states and windows), while the gradients come from the k runs, one after the other, each graph freed before the
next; only the per-token terms add up.
"""

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ...engine.declare.kernels import CONV_MEMORY, STATE_MEMORY
from ...engine.declare.memory_parts import map_parts, parts_of
from ...engine.dispatch import takeover
from ...engine.errors import InvalidValue, renamed
from ...engine.handle.arguments import as_index
from ...engine.handle.mixer import RecurrentMixer
from ...engine.policy import Paths
from ...engine.watch import Watch, watch
from ..metrics import for_rows, per_row
from .pieces import CleanPieces, CorruptPieces, conv_kernel, runs_in_pieces, window_row

_MEMORIES = (STATE_MEMORY, CONV_MEMORY)  # the rows `state` and `window`
Metric = Callable[[Tensor], Tensor]  # logits [batch, seq, vocab] -> [batch] or a scalar


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Per recurrent layer and token: the estimated change of the metric from patching clean into corrupt."""

    layers: tuple[int, ...]  # the decoder layer of each row
    state: Float[Tensor, "*pairs layers seq"]  # no pairs axis for one pair given as [seq]; heads=True: [.., heads, ..]
    window: Float[Tensor, "*pairs layers seq"]
    clean: Float[Tensor, "*pairs"]  # the metric of the clean run, per pair (0-d for one pair, as `Sweep.clean`)
    corrupt: Float[Tensor, "*pairs"]  # the metric of the corrupt run
    heads: int | None = None  # heads=True: the heads of every layer (state, window: [*pairs, layers, heads, seq])

    @property
    def memory(self) -> Float[Tensor, "*pairs layers seq"]:
        """The estimate for patching the whole memory (state and window) after each token."""
        return self.state + self.window

    def normalized(self) -> Tensor:
        """`memory / (clean - corrupt)` (per pair): the estimated share of the clean metric each cell's patch
        restores, on `Sweep.normalized()`'s scale (0: no effect, 1: the clean metric restored; inf or nan where the
        two baselines are equal)."""
        gap = self.clean - self.corrupt
        return self.memory / gap.reshape(*gap.shape, *[1] * (self.memory.dim() - gap.dim()))

    def to_dict(self) -> dict[str, Any]:
        """Tensors, ints and strings only: `torch.save(result.to_dict(), path)` loads back with
        `Attribution.from_dict(torch.load(path, weights_only=True))`."""
        return {
            "layers": list(self.layers),
            "state": self.state,
            "window": self.window,
            "clean": self.clean,
            "corrupt": self.corrupt,
            "heads": self.heads,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Attribution":
        """The result `to_dict` gave."""
        return cls(
            tuple(int(layer) for layer in data["layers"]),
            data["state"],
            data["window"],
            torch.as_tensor(data["clean"]),
            torch.as_tensor(data["corrupt"]),
            None if data.get("heads") is None else int(data["heads"]),
        )


METHODS = ("auto", "pieces", "states")


def attribute(
    model: nn.Module,
    clean_ids: Tensor,
    corrupt_ids: Tensor,
    metric: Metric,
    *,
    layers: Iterable[int] | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    paths: Paths | None = None,
    method: str = "auto",
    piece: int = 64,
    steps: int = 1,
    heads: bool = False,
    budget_bytes: int | None = None,
    chunk: int | None = None,
) -> Attribution:
    """Attribution patching of every recurrent layer x token, from one clean forward and one forward and
    backward of the corrupt run (`steps` of them on the way from the corrupt input to the clean one).

        result = rh.attribute(model, clean, corrupt, rh.metrics.logit_difference(answer, wrong))
        result.memory        # [layers, seq] for [seq] prompts: compare with rh.patching_sweep's exact effects
        result = rh.attribute(model, clean, corrupt, metric, steps=8)   # integrated gradients (EAP-IG)

    `clean_ids` and `corrupt_ids`: one pair, `[seq]` each, or N pairs, `[N, seq]` (results with a leading pairs
    axis, also for N = 1). `metric(logits)` returns one value per pair (`[N]`; a scalar for one pair). Extra
    `forward_kwargs` go to both forwards (e.g. `use_cache=False`); `paths` sets how their calls run
    (`recurrent_hooks.Paths`, as for `watch`). The weights need not require grad. `method`: "pieces"
    (no state of every token is kept: the module docstring), "states" (every state kept, any kind), or
    "auto": "pieces" where every chosen mixer's kind has it; `piece`: the piece length of "pieces" (`method="chunks"`
    and `chunk=` are their former names).
    `steps`: how many gradients each term averages (integrated gradients). steps=1 (the default): the gradient
    of the corrupt run, from its ids. steps=k: the gradients of k runs of the input embeddings
    E(corrupt) + alpha (E(clean) - E(corrupt)), alpha = 0, 1/k, ..., (k-1)/k (E = `model.get_input_embeddings()`;
    the model's forward must take `inputs_embeds`), each term (clean - corrupt memory) . their mean, where the
    corrupt memory is the corrupt run's (kept, as the clean run's, by a forward without grad). k forwards and
    backwards one after the other, in the memory of one (docs/attribution.md).
    `heads`: `state` and `window` per head, `[layers, heads, seq]` (after the pairs axis), summing over heads to
    the per-layer result: a head's state term is over its slice of the state; its window term over the window
    channels that feed it (the kind's declaration, as `patching_sweep(heads=True)` patches them), a channel that
    feeds several heads (a key head's q and k, a Mamba-2 group's B and C) split equally among them.
    `budget_bytes`: the states the backward holds at once for all the pairs of a batch (two pieces' states per
    pair, clean and corrupt: 2 x piece x state bytes; "states": of every token). Over more pairs than fit, the
    pairs run in groups one after the other, each with its metric's rows (`metric.for_rows(pairs)` where it has
    it, as `rh.metrics`' do; a plain metric is one metric for every pair, as `patching_sweep` takes it) and its
    rows of the `forward_kwargs` tensors whose first axis has the pairs' length (a mask). None: `BUDGET_BYTES`,
    256 MiB. The results are the same as in one batch (the rows of a batch do not interact; docs/attribution.md).
    """
    where = "attribute"
    method, piece = _renamed(method, piece, chunk, where)
    for name, ids in (("clean_ids", clean_ids), ("corrupt_ids", corrupt_ids)):
        if not isinstance(ids, Tensor) or ids.dim() not in (1, 2):
            raise InvalidValue(
                f"{where}: expected {name} as a [seq] (one pair) or [pairs, seq] tensor of token ids,"
                f" got {type(ids).__name__}{'' if not isinstance(ids, Tensor) else tuple(ids.shape)}"
            )
    if clean_ids.shape != corrupt_ids.shape:
        raise InvalidValue(
            f"{where}: clean_ids {tuple(clean_ids.shape)} and corrupt_ids {tuple(corrupt_ids.shape)}"
            " must have the same shape (row b of one is patched into row b of the other)"
        )
    if clean_ids.dim() == 1:  # one pair: the results without the pairs axis
        return _one_pair(
            attribute(
                model,
                clean_ids[None],
                corrupt_ids[None],
                metric,
                layers=layers,
                forward_kwargs=forward_kwargs,
                paths=paths,
                method=method,
                piece=piece,
                steps=steps,
                heads=heads,
                budget_bytes=budget_bytes,
            )
        )
    if not callable(metric):
        raise InvalidValue(f"{where}: expected a callable metric(logits) -> [rows] or a 0-d tensor, got {metric!r}")
    budget = _checked_options(method, piece, steps, heads, budget_bytes, where)
    kwargs = dict(forward_kwargs or {})
    layers = None if layers is None else tuple(layers)
    chosen = _probe(model, clean_ids, layers, heads, paths, kwargs, where)
    kinds = [type(m) for m in chosen]
    if method != "states":
        in_pieces = all(runs_in_pieces(kind) for kind in kinds) and len(_layers(chosen)) == len(chosen)
        if method == "pieces" and not in_pieces:
            slow = sorted({kind.__name__ for kind in kinds if not runs_in_pieces(kind)}) or ["a layer of several"]
            raise InvalidValue(
                f"{where}: method='pieces' needs one mixer a layer and a prompt kernel that runs in"
                f" pieces from a state; {', '.join(slow)} has none: use method='states' (or 'auto')"
            )
        method = "pieces" if in_pieces else "states"
    held = min(piece, clean_ids.shape[1]) if method == "pieces" else clean_ids.shape[1]
    pair_bytes = 2 * held * max((_row_bytes(m) for m in chosen), default=0) if clean_ids.shape[0] > 1 else 0
    group = clean_ids.shape[0] if pair_bytes == 0 else max(1, budget // pair_bytes)
    shared_conv = all(conv_kernel(kind) is not None for kind in kinds)
    parts = []
    for first in range(0, clean_ids.shape[0], group):
        pairs = list(range(first, min(first + group, clean_ids.shape[0])))
        rows = None if len(pairs) == clean_ids.shape[0] else pairs
        mine = kwargs if rows is None else _rows_of(kwargs, rows, clean_ids.shape[0])
        runs = _Runs(model, for_rows(metric, rows), layers, mine, paths, corrupt_ids[pairs], where, heads)
        clean, corrupt = clean_ids[pairs], corrupt_ids[pairs]
        inputs = _line(model, clean, corrupt, steps, mine, where)
        parts.append(
            _attribute_in_pieces(runs, clean, corrupt, piece, shared_conv, inputs, steps)
            if method == "pieces"
            else _attribute_with_states(runs, clean, corrupt, inputs, steps)
        )
    return parts[0] if len(parts) == 1 else _concatenated(parts)


def _renamed(method: Any, piece: Any, chunk: Any, where: str) -> tuple[Any, Any]:
    """`method` and `piece` from their former names, which warn: method="chunks" (now "pieces"), `chunk=`."""
    if method == "chunks":
        renamed(f"{where}(method='chunks')", f"{where}(method='pieces')", stacklevel=4)
        method = "pieces"
    if chunk is not None:
        renamed(f"{where}(chunk=...)", f"{where}(piece=...)", stacklevel=4)
        piece = chunk
    return method, piece


def _checked_options(method: Any, piece: Any, steps: Any, heads: Any, budget_bytes: Any, where: str) -> int:
    """Refuse a bad method, piece, steps, heads or budget_bytes; return the budget."""
    if method not in METHODS:
        raise InvalidValue(f"{where}: expected method in {METHODS}, got {method!r}")
    if isinstance(piece, bool) or not isinstance(piece, int) or piece < 1:
        raise InvalidValue(f"{where}: expected piece as a positive int (tokens per piece), got {piece!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidValue(
            f"{where}: expected steps as a positive int (the gradients averaged on the way from the"
            f" corrupt to the clean input embeddings; 1: attribution patching), got {steps!r}"
        )
    if heads is not True and heads is not False:
        raise InvalidValue(f"{where}: expected heads=True or heads=False, got heads={heads!r}")
    budget = BUDGET_BYTES if budget_bytes is None else budget_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidValue(
            f"{where}: expected budget_bytes as an int >= 0 (or None: {BUDGET_BYTES}), got"
            f" budget_bytes={budget_bytes!r}"
        )
    return budget


def _probe(
    model: nn.Module,
    clean_ids: Tensor,
    layers: tuple[int, ...] | None,
    heads: bool,
    paths: Paths | None,
    kwargs: Mapping[str, Any],
    where: str,
) -> list[RecurrentMixer]:
    """The chosen mixers, checked for heads; over several pairs, with one row's memory kept (`_row_bytes`)."""
    with torch.no_grad(), watch(model, keep={"states": [0], "windows": [0]}, paths=paths) as probe:
        chosen = _chosen(probe.mixers, layers, where)
        headless = next((m for m in chosen if heads and not m.HEADS), None)
        if headless is not None:
            raise InvalidValue(
                f"{where}: heads=True needs a state with heads in every chosen layer; {headless} has a"
                f" state of axes {headless.STATE!r} without heads (choose other layers, or heads=False)"
            )
        if clean_ids.shape[0] > 1:
            model(clean_ids[:1], **_rows_of(kwargs, [0], clean_ids.shape[0]))
    return chosen


BUDGET_BYTES = 256 << 20  # attribute(budget_bytes=None): the states held at once for the pairs of a batch


def _row_bytes(mixer: RecurrentMixer) -> int:
    """The float32 bytes of one row's memory (state and window) of `mixer`, from the probe's token 0."""
    memory = mixer.memory_after(0)
    return 4 * sum(part.numel() for value in memory if value is not None for _, part in parts_of(value))


def _rows_of(kwargs: Mapping[str, Any], rows: list[int], pairs: int) -> dict[str, Any]:
    """`forward_kwargs` for the pairs `rows`: a tensor whose first axis has the pairs' length (an attention mask,
    position ids) is taken as one row per pair, and indexed."""
    return {
        name: value[rows] if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == pairs else value
        for name, value in kwargs.items()
    }


def _concatenated(parts: list[Attribution]) -> Attribution:
    """The results of groups of pairs, in order, as one (on the pairs axis)."""
    return Attribution(
        parts[0].layers,
        *(torch.cat([getattr(part, name) for part in parts]) for name in ("state", "window", "clean", "corrupt")),
        parts[0].heads,
    )


@dataclasses.dataclass(frozen=True)
class _Runs:
    """What every forward of one `attribute` call shares: the model, the metric, the chosen layers, the forward's
    keyword arguments and paths; `ids` (any of the two prompts) gives the pairs."""

    model: nn.Module
    metric: Metric
    layers: tuple[int, ...] | None
    kwargs: dict[str, Any]
    paths: Paths | None
    ids: Tensor
    where: str
    heads: bool = False  # the terms per head

    def value(self, *args: Any, **inputs: Any) -> Tensor:
        """`[pairs]`: the metric of one forward of `args` (the ids) or `inputs` (inputs_embeds=)."""
        return per_row(self.metric, self.model(*args, **inputs, **self.kwargs).logits, self.where)

    def chosen(self, handle: Any) -> list[RecurrentMixer]:
        return _chosen(handle.mixers, self.layers, self.where)


Inputs = Callable[[int], tuple[tuple, dict[str, Tensor]]]  # step -> the positional and keyword inputs of its forward
Terms = tuple[Tensor, tuple[int, ...], Tensor, Tensor]  # one gradient run's metric, layers, state and window terms


def _line(
    model: nn.Module, clean_ids: Tensor, corrupt_ids: Tensor, steps: int, kwargs: Mapping[str, Any], where: str
) -> Inputs:
    """The inputs of gradient run `step` (0..steps-1): the corrupt ids at steps=1; else the input embeddings at
    alpha = step / steps on the straight line E(corrupt) + alpha (E(clean) - E(corrupt)), `[pairs, seq, hidden]`
    (alpha = 0 first: the corrupt run's own embeddings)."""
    if steps == 1:
        return lambda step: ((corrupt_ids,), {})
    embedding = _embedding(model, steps, kwargs, where)
    with torch.no_grad():
        start = embedding(corrupt_ids)
        towards = embedding(clean_ids).float() - start.float()  # pairs seq hidden
    return lambda step: ((), {"inputs_embeds": (start.float() + (step / steps) * towards).to(start.dtype)})


def _embedding(model: nn.Module, steps: int, kwargs: Mapping[str, Any], where: str) -> nn.Module:
    """The model's input embedding, once its forward is seen to take `inputs_embeds`."""
    given = sorted({"input_ids", "inputs_embeds"} & set(kwargs))
    if given:
        raise InvalidValue(
            f"{where}: expected no {given[0]} in forward_kwargs (steps={steps} passes inputs_embeds"
            " made from clean_ids and corrupt_ids), got one"
        )
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    try:
        takes = "inputs_embeds" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not isinstance(embedding, nn.Module) or not takes:
        missing = (
            "no get_input_embeddings() module"
            if not isinstance(embedding, nn.Module)
            else "a forward without an inputs_embeds argument"
        )
        raise InvalidValue(
            f"{where}: steps={steps} runs the model on input embeddings (model(inputs_embeds=...)),"
            f" expected a model that takes them; {type(model).__name__} has {missing}: use steps=1"
        )
    return embedding


def _averaged(
    gradient: Callable[[tuple, dict[str, Tensor]], Terms],
    inputs: Inputs,
    steps: int,
    clean_value: Tensor,
    corrupt_value: Tensor | None,
    where: str,
) -> Attribution:
    """The terms of the `steps` gradient runs, one run after the other, averaged (their sum / steps; at steps=1
    the one run's terms as they are). `corrupt_value`: the corrupt run's metric (None at steps=1: the gradient
    run is the corrupt run)."""
    for step in range(steps):
        args, named = inputs(step)
        value, layers, state, window = gradient(args, named)
        if step == 0:
            corrupt_value = value if corrupt_value is None else _same_start(value, corrupt_value, steps, where)
            state_sum, window_sum = state, window
        else:
            state_sum, window_sum = state_sum + state, window_sum + window
    if steps > 1:
        state_sum, window_sum = state_sum / steps, window_sum / steps
    heads = state_sum.shape[2] if state_sum.dim() == 4 else None  # pairs layers heads seq
    return Attribution(
        layers, state_sum, window_sum, clean_value.detach().float(), corrupt_value.detach().float(), heads
    )


def _same_start(value: Tensor, corrupt: Tensor, steps: int, where: str) -> Tensor:
    """The corrupt run's metric, once the run of alpha = 0, E(corrupt) as inputs_embeds, is seen to give it."""
    if not torch.allclose(value.float(), corrupt.float(), rtol=1e-3, atol=1e-3, equal_nan=True):
        raise InvalidValue(
            f"{where}: steps={steps}: expected model(inputs_embeds=E(corrupt_ids)) to be the forward of"
            f" corrupt_ids (E = model.get_input_embeddings()), got metrics {value.tolist()} from the"
            f" embeddings and {corrupt.tolist()} from the ids: use steps=1"
        )
    return corrupt


def _attribute_with_states(
    runs: _Runs, clean_ids: Tensor, corrupt_ids: Tensor, inputs: Inputs, steps: int
) -> Attribution:
    """method="states": each gradient run keeps every state and window differentiably; the clean run (and, at
    steps > 1, the corrupt one) keeps them without grad."""
    keep = ("states", "windows")  # a memory a mixer's kind does not carry is not kept (normalize_keep)
    clean_value, clean = _kept_run(runs, clean_ids, keep)
    corrupt_value, reference = _kept_run(runs, corrupt_ids, keep) if steps > 1 else (None, None)
    gradient = functools.partial(_gradient_with_states, runs, keep, clean, reference)
    return _averaged(gradient, inputs, steps, clean_value, corrupt_value, runs.where)


def _kept_run(runs: _Runs, ids: Tensor, keep: tuple[str, ...]) -> tuple[Tensor, Watch]:
    """A forward of `ids` without grad keeping `keep`: its metric and its watch."""
    with torch.no_grad(), watch(runs.model, keep=keep, paths=runs.paths) as kept:
        value = runs.value(ids)
    return value, kept


def _gradient_with_states(
    runs: _Runs, keep: tuple[str, ...], clean: Watch, reference: Watch | None, args: tuple, named: dict[str, Tensor]
) -> Terms:
    """One gradient run of "states": its terms (clean - reference memory) . gradient, with the reference the
    corrupt run's kept memory (None: the run's own)."""
    with torch.enable_grad(), watch(runs.model, keep=keep, paths=runs.paths) as run:
        value = runs.value(*args, **named)
    chosen = runs.chosen(run)
    # every part of every memory the kinds carry (a memory a kind lacks contributes zeros; see engine.parts)
    leaves = [
        leaf
        for m in chosen
        for memory in _MEMORIES
        if memory in m.MEMORIES
        for buffer in m.calls[0].differentiable(memory)
        for _, leaf in parts_of(buffer)
    ]
    grads = iter(torch.autograd.grad(value.sum(), leaves, allow_unused=True))
    same = {id(m): k for k, m in enumerate(run.mixers)}  # the same mixer in the other runs' watches: by its place
    rows = [
        [
            _memory_row(
                clean.mixers[same[id(m)]],
                m,
                memory,
                grads,
                runs.ids,
                None if reference is None else reference.mixers[same[id(m)]],
                _kept_layout(m) if runs.heads else None,
            )
            for memory in _MEMORIES
        ]
        for m in chosen
    ]  # in `leaves`' order: mixer by mixer, state then window
    return (
        value.detach(),
        _layers(chosen),
        _stacked([state for state, _ in rows], chosen, runs.where),
        _stacked([window for _, window in rows], chosen, runs.where),
    )


def _memory_row(
    clean: RecurrentMixer,
    corrupt: RecurrentMixer,
    memory: str,
    grads: Iterable,
    ids: Tensor,
    reference: RecurrentMixer | None = None,
    layout: "_Heads | None" = None,
) -> Tensor:
    """`[pairs, seq]`: the sum over the memory axes of (clean - corrupt) * gradient, per pair and token, from kept
    states (next(grads) per part of every buffer of `memory`, in the order of the gradient run's leaves); the
    corrupt memory is `reference`'s kept one where given, else the gradient run's own. With a `layout`, `[pairs,
    heads, seq]`: the state's sum per head (axis 2 of a kept state; a buffer a head for per-head kernels), the
    window's per channel, shared among the heads by `layout.shares`."""
    total = torch.zeros(
        *ids.shape, *([] if layout is None else [layout.heads]), dtype=torch.float32, device=ids.device
    )  # b t (heads)
    if memory not in corrupt.MEMORIES:
        return total if layout is None else total.movedim(2, 1)
    buffers = corrupt.calls[0].differentiable(memory)
    cleans = _per_buffer(clean.calls[0].kept(memory), len(buffers))
    minus = buffers if reference is None else _per_buffer(reference.calls[0].kept(memory), len(buffers))
    for head, (buffer, clean_part, minus_part) in enumerate(zip(buffers, cleans, minus)):
        for (_, leaf), (_, clean_leaf), (_, minus_leaf) in zip(
            parts_of(buffer), parts_of(clean_part), parts_of(minus_part)
        ):
            grad = next(grads)
            if grad is None:  # the metric does not depend on this memory
                continue
            delta = clean_leaf.to(torch.float32) - minus_leaf.detach().to(torch.float32)  # b t *memory
            product = delta * grad.to(torch.float32)  # b t *memory
            if layout is None:
                total = total + product.flatten(2).sum(-1).to(total.device)  # b t
            elif memory == CONV_MEMORY:  # b t channels kernel_size
                total = total + (product.sum(-1) @ layout.shares.to(product)).to(total.device)  # b t heads
            elif len(buffers) > 1:  # one kernel call per head: this buffer is head `head`'s state
                total[..., head] += product.flatten(2).sum(-1).to(total.device)
            else:  # b t heads *state
                total = total + product.flatten(3).sum(-1).to(total.device)
    return total if layout is None else total.movedim(2, 1)  # b (heads) t


@dataclasses.dataclass(frozen=True)
class _Heads:
    """A layer's heads for the per-head terms: their number and `shares[c, h]`, the share of window channel c's
    term that goes to head h (the channels that feed h, `kind.adapter.head_channels`, each split equally among
    the heads it feeds; None where the layer has no window)."""

    heads: int
    shares: Tensor | None


def _layout(kind: type[RecurrentMixer], heads: int, head_state: tuple[int, ...], channels: int | None) -> _Heads:
    if channels is None or CONV_MEMORY not in kind.MEMORIES:
        return _Heads(heads, None)
    feeds = torch.zeros(channels, heads)
    for head in range(heads):
        feeds[list(kind.adapter.head_channels(head, heads, head_state, channels)), head] = 1.0
    count = feeds.sum(1, keepdim=True)  # the heads a channel feeds; one no head reads goes to all alike
    return _Heads(heads, torch.where(count > 0, feeds / count.clamp(min=1), 1.0 / heads))


def _kept_layout(mixer: RecurrentMixer) -> _Heads:
    """The layout of a mixer whose states (and windows) were kept: `[batch, seq, heads, *head_state]`."""
    state = parts_of(mixer.calls[0].kept(STATE_MEMORY))[0][1]
    window = mixer.calls[0].kept(CONV_MEMORY) if CONV_MEMORY in mixer.MEMORIES else None
    return _layout(type(mixer), state.shape[2], tuple(state.shape[3:]), None if window is None else window.shape[2])


def _layers(chosen: list[RecurrentMixer]) -> tuple[int, ...]:
    """The decoder layers of the chosen mixers, each once, in order (a layer may have several mixers)."""
    return tuple(dict.fromkeys(m.layer for m in chosen))


def _stacked(rows: list[Tensor], chosen: list[RecurrentMixer], where: str) -> Tensor:
    """The layers' rows stacked on axis 1, once their shapes (their numbers of heads) are seen to agree. The rows
    of a layer's several mixers (inkling's convolution windows) are summed: the linear estimate of patching every
    memory of the layer, as a layer's cell is (per head, their heads need not match: refused)."""
    by_layer: dict[int, list[tuple[RecurrentMixer, Tensor]]] = {}
    for m, row in zip(chosen, rows):
        by_layer.setdefault(m.layer, []).append((m, row))
    several = [pairs for pairs in by_layer.values() if len(pairs) > 1]
    if several and rows[0].dim() > 2:
        raise InvalidValue(
            f"{where}: heads=True needs one mixer a layer; layer {several[0][0][0].layer} has"
            f" {', '.join(f'{m}' for m, _ in several[0])}: attribute without heads (each layer's"
            " mixers summed)"
        )
    chosen = [pairs[0][0] for pairs in by_layer.values()]
    rows = [sum(r for _, r in pairs) for pairs in by_layer.values()]
    shapes = {f"{m}": tuple(row.shape[1:-1]) for m, row in zip(chosen, rows)}
    if len(set(shapes.values())) > 1:
        raise InvalidValue(
            f"{where}: heads=True needs one number of heads in every chosen layer, got"
            f" {', '.join(f'{m}: {shape[0]}' for m, shape in shapes.items())}; choose layers with"
            " `layers=`"
        )
    return torch.stack(rows, dim=1)


def _per_buffer(kept: Any, buffers: int) -> list[Any]:
    """A kept memory `[batch, seq, heads, ...]` cut as the differentiable buffers are: whole for one, else per head."""
    return [kept] if buffers == 1 else [map_parts(lambda r, head=head: r[:, :, head], kept) for head in range(buffers)]


@dataclasses.dataclass
class _Recorded:
    """A run of "pieces" without grad (the clean one; the corrupt one at steps > 1): its metric, its chosen
    layers' calls in pieces (their pieces' inputs and boundary states, the convolutions' inputs) and its watch
    (its kept windows where the convolution is not the shared one)."""

    value: Tensor
    pieces: dict[int, "CleanPieces"]
    watch: Watch


def _attribute_in_pieces(
    runs: _Runs, clean_ids: Tensor, corrupt_ids: Tensor, piece: int, shared_conv: bool, inputs: Inputs, steps: int
) -> Attribution:
    """method="pieces": the state term through `InPieces` calls, the window term from the convolution's inputs
    and output gradients (`Kernel.window_terms`) where every chosen kind's conv is the shared one (`shared_conv`),
    else from kept windows."""
    keep = () if shared_conv else ("windows",)  # the state kernels' calls (and the shared convs) go to the takeovers
    clean = _recorded_run(runs, clean_ids, keep, piece, shared_conv)
    reference = _recorded_run(runs, corrupt_ids, keep, piece, shared_conv) if steps > 1 else None
    gradient = functools.partial(_gradient_in_pieces, runs, keep, piece, shared_conv, clean, reference)
    return _averaged(gradient, inputs, steps, clean.value, None if reference is None else reference.value, runs.where)


def _recorded_run(runs: _Runs, ids: Tensor, keep: tuple[str, ...], piece: int, shared_conv: bool) -> _Recorded:
    """A forward of `ids` without grad, each chosen prompt call in pieces, recorded (`CleanPieces`)."""
    with torch.no_grad(), watch(runs.model, keep=keep, paths=runs.paths) as kept, contextlib.ExitStack() as stack:
        recorders = {m.layer: CleanPieces(piece, shared_conv) for m in runs.chosen(kept)}
        for m in runs.chosen(kept):
            stack.enter_context(takeover.active(m, recorders[m.layer]))
        value = runs.value(ids)
    return _Recorded(value, recorders, kept)


def _gradient_in_pieces(
    runs: _Runs,
    keep: tuple[str, ...],
    piece: int,
    shared_conv: bool,
    clean: _Recorded,
    reference: _Recorded | None,
    args: tuple,
    named: dict[str, Tensor],
) -> Terms:
    """One gradient run of "pieces": its terms (clean - reference memory) . gradient, with the reference the
    corrupt run's recorded memory (None: the run's own)."""
    where = runs.where
    with torch.enable_grad(), watch(runs.model, keep=keep, paths=runs.paths) as run, contextlib.ExitStack() as stack:
        chosen = runs.chosen(run)
        corrupts = {
            m.layer: CorruptPieces(
                clean.pieces[m.layer],
                piece,
                f"{m}",
                None if reference is None else reference.pieces[m.layer],
                runs.heads and not m.KERNEL_PER_HEAD,
            )
            for m in chosen
        }
        for m in chosen:
            stack.enter_context(takeover.active(m, corrupts[m.layer]))
        value = runs.value(*args, **named)
    for m in chosen:
        corrupt, recorded = corrupts[m.layer], clean.pieces[m.layer]
        if not corrupt.eps or len(corrupt.eps) != len(recorded.records):
            raise InvalidValue(
                f"{where}: {m}: its prompt kernel ran {len(corrupt.eps)} time(s) through the pieces"
                f" path in the corrupt run and {len(recorded.records)} in the clean one (another"
                " handle watching it, or a path the study cannot see): use method='states'"
            )
    windows = (
        []
        if shared_conv
        else [
            leaf
            for m in chosen
            if CONV_MEMORY in m.MEMORIES
            for buffer in m.calls[0].differentiable(CONV_MEMORY)
            for _, leaf in parts_of(buffer)
        ]
    )
    eps = [e for m in chosen for e in corrupts[m.layer].eps]
    shifts = [call.shift for m in chosen for call in corrupts[m.layer].convs]
    grads = torch.autograd.grad(value.sum(), [*eps, *shifts, *windows], allow_unused=True)
    eps_grads, shift_grads = iter(grads[: len(eps)]), iter(grads[len(eps) : len(eps) + len(shifts)])
    window_grads = iter(grads[len(eps) + len(shifts) :])
    state_rows, window_rows = [], []
    for m in chosen:
        layout = _recorded_layout(m, clean) if runs.heads else None
        state_rows.append(_eps_row(m, [next(eps_grads) for _ in corrupts[m.layer].eps], runs.ids, layout))
        if shared_conv:
            window_rows.append(
                window_row(
                    clean.pieces[m.layer],
                    corrupts[m.layer],
                    shift_grads,
                    runs.ids,
                    f"{where}: {m}",
                    None if reference is None else reference.pieces[m.layer],
                    layout,
                )
            )
        else:
            window_rows.append(
                _memory_row(
                    clean.watch.mixer(m.layer),
                    m,
                    CONV_MEMORY,
                    window_grads,
                    runs.ids,
                    None if reference is None else reference.watch.mixer(m.layer),
                    layout,
                )
            )
    return value.detach(), _layers(chosen), _stacked(state_rows, chosen, where), _stacked(window_rows, chosen, where)


def _eps_row(mixer: RecurrentMixer, grads: list[Tensor | None], ids: Tensor, layout: "_Heads | None") -> Tensor:
    """`[pairs, seq]` (`[pairs, heads, seq]` with a layout): the state term, the eps gradients of the layer's
    prompt kernel calls summed (per head: each `[pairs, seq, heads]`, or one call a head for per-head kernels)."""
    total = torch.zeros(
        *ids.shape, *([] if layout is None else [layout.heads]), dtype=torch.float32, device=ids.device
    )  # b t (heads)
    for head, grad in enumerate(grads):
        if grad is None:
            continue
        if layout is not None and mixer.KERNEL_PER_HEAD:
            total[..., head] += grad.to(total.device)
        else:
            total = total + grad.to(total.device)
    return total if layout is None else total.movedim(2, 1)


def _recorded_layout(mixer: RecurrentMixer, clean: "_Recorded") -> "_Heads":
    """The heads of a layer from its recorded clean calls: the boundary states `[batch, heads, *head_state]` (a call
    a head for per-head kernels) and the convolution's channels."""
    recorded = clean.pieces[mixer.layer]
    state = recorded.records[0].boundaries[-1]
    if mixer.KERNEL_PER_HEAD:
        heads, head_state = len(recorded.records), tuple(state.shape[1:])
    else:
        heads, head_state = state.shape[1], tuple(state.shape[2:])
    if recorded.convs:
        channels = recorded.convs[0].inputs.shape[1]
    elif CONV_MEMORY in mixer.MEMORIES:
        channels = clean.watch.mixer(mixer.layer).calls[0].kept(CONV_MEMORY).shape[2]
    else:
        channels = None
    return _layout(type(mixer), heads, head_state, channels)


def _one_pair(result: Attribution) -> Attribution:
    return Attribution(
        result.layers, result.state[0], result.window[0], result.clean[0], result.corrupt[0], result.heads
    )


def _chosen(mixers: list[RecurrentMixer], layers: Iterable[int] | None, where: str) -> list[RecurrentMixer]:
    if layers is None:
        return list(mixers)
    wanted = [as_index(layer, "layer", where) for layer in layers]
    known = {m.layer for m in mixers}
    missing = [layer for layer in wanted if layer not in known]
    if missing:
        raise InvalidValue(f"{where}: no recurrent mixer at layers {missing}; recurrent layers: {sorted(known)}")
    return [m for layer in dict.fromkeys(wanted) for m in mixers if m.layer == layer]  # (every mixer of a layer)
