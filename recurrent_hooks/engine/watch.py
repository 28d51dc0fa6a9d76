"""The `with` block: `Watch` / `watch(model, keep=...)` attaches a `RecurrentMixer` to every supported mixer of a
model and rebinds its family's kernels for the duration of the block.

The other entry points have their own modules: `standalone` (`register_state_hook`, a hook without a `with`
block), `support` (`support`, `route_kernels`).
"""

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .attaching import attach_handle
from .binding.rebinding import MISSING, Transient
from .binding.registry import FAMILIES, MixerClass, layer_in_path, mixer_of, unsupported_of
from .declare.kernels import KERNEL_IO
from .errors import InvalidValue, RecurrentHooksError, RecurrentHooksWarning, Unavailable, renamed
from .handle.arguments import (
    as_history,
    as_index,
    as_keep_device,
    normalize_keep,
    normalize_reduce,
    reduce_of_layer,
    renamed_keep,
)
from .handle.mixer import THREAD_RULE, RecurrentMixer, unseen_threads
from .policy import Paths, Policy, checked_paths
from .tracking.records import Memory


def _mixer_modules(model: nn.Module) -> list[tuple[str, nn.Module, MixerClass]]:
    return [(path, m, row) for path, m in model.named_modules() if (row := mixer_of(m)) is not None]


def _no_mixer_message(model: nn.Module) -> str:
    unsupported = sorted(
        {f"{row.mixer_class} ({row.reason})" for m in model.modules() if (row := unsupported_of(m)) is not None}
    )
    message = (
        f"{type(model).__name__} contains no recurrent mixer of a supported family (supported: {', '.join(FAMILIES)})"
    )
    if unsupported:
        message += f"; it has {', '.join(unsupported)}"
    return message


def _reorder_recorder(mixers: list[RecurrentMixer], stack: contextlib.ExitStack) -> Callable[[object], None]:
    """For the mixers of one watch: a function that, the first time a cache is seen, wraps its `reorder_cache` (beam
    search) and its `crop` (assisted decoding's rollback) to tell the mixers how its rows moved and how far back its
    memories went; the watch's exit (`stack`) unwraps the caches still alive. The caches are held weakly: one the
    model lets go of (each forward's own) is freed inside the block, as without the watch."""
    # cache -> {method: its own entry before (or MISSING)}
    wrapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def reorder_cache(reorder: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(reorder)
        def wrapper(beam_idx: Tensor, *args: object, **kwargs: object) -> object:
            for mixer in mixers:
                mixer.tracker.reordered(beam_idx)
            return reorder(beam_idx, *args, **kwargs)

        return wrapper

    def crop(original: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(original)
        def wrapper(tokens_to_remove: int, *args: object, **kwargs: object) -> object:
            result = original(tokens_to_remove, *args, **kwargs)  # (it raises on what it refuses: nothing noted)
            if isinstance(tokens_to_remove, int) and tokens_to_remove < 0:
                for mixer in mixers:
                    mixer.tracker.lineage.cropped(-tokens_to_remove)
            return result

        return wrapper

    def saw_cache(cache: object) -> None:
        if cache in wrapped:
            return
        wrapped[cache] = {}
        for name, wrap in (("reorder_cache", reorder_cache), ("crop", crop)):
            original = getattr(cache, name, None)
            if callable(original):
                wrapped[cache][name] = vars(cache).get(name, MISSING)
                setattr(cache, name, Transient(wrap(original), original))

    def unwrap() -> None:
        for cache, methods in list(wrapped.items()):
            for name, before in methods.items():
                if before is MISSING:
                    delattr(cache, name)
                else:
                    setattr(cache, name, before)
        wrapped.clear()

    stack.callback(unwrap)
    return saw_cache


def _forget_cache_recorder(mixers: list[RecurrentMixer]) -> None:
    for mixer in mixers:
        mixer.tracker.saw_cache = None


class Watch:
    """A `with` block in which every supported recurrent mixer of `model` can be read and written per token.

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states          # [batch, seq, heads, key_dim, value_dim]: the state after every token
        w.mixer(2).calls[0].inputs  # the mixer of decoder layer 2: its first call's kernel arguments
        w.mixer("model.layers.2.linear_attn")   # the same mixer, by its module path

    On entry the family's kernel names are rebound (module globals of its transformers modeling module),
    and so is its mixer classes' `__call__` (each forward marks itself as running: what kernel calls belong
    to), and each mixer module gets forward hooks; on exit, also on an exception and when nested, exactly
    the previous objects are bound again and the module hooks are removed. Hooks and
    writes registered on `w.mixers[i]` live until the block ends; what the mixers kept stays readable.
    Like every PyTorch hook, the block's effects are global: the model is changed for anyone who calls
    it inside the block.

    `keep` names what to keep of every call, and a watch keeps nothing else: "states" (the state after
    every token), "windows" (the convolution window after every token), "inputs" and "outputs" (the
    kernel's arguments and results, by reference; `values()` needs both). A mapping keeps some tokens
    only (`{"states": [4, -1]}`). Each call's metadata (`call.kernel`, `call.tokens`, `call.index`) is
    always there: each `Call` is the record of one forward, and what it holds beyond that is what was kept.
    `record=True` is the former spelling of keeping "inputs" and "outputs" (it warns).

    At real sizes: `keep_device="cpu"` moves each kept state there as it is kept (a model on a GPU keeps its
    states in host memory; with gradients on, kept states are refused on another device, reductions keep their
    graph), and `reduce={"states": fn}` keeps `fn(states)` instead of the states, `fn` taking a chunk of kept
    tokens' states `[batch, chunk, *state]` and returning `[batch, chunk, ...]` (a per-token norm:
    `lambda s: s.flatten(2).norm(dim=-1)`): `mix.states` is then the stacked reductions, `state_after(t)`
    the reduction at t, and at most one chunk of states is held at a time. The chunk may be a view of the kernel's
    buffer, which its next chunk overwrites: `fn` reads it and must not keep it, or a view of it (a result that is
    the chunk, or a view of it, is copied).

    The block sees the forwards of the thread that entered it; a model run inside a hook, or a model
    that is not watched, runs its kernels untouched. Writes aimed at calls that never ran (a generation
    that stopped early) give one `RecurrentHooksWarning` on exit; hooks aimed at them are not an error.
    Kept positions outside every call a mixer saw (`{"states": [100]}` on 12 tokens) give another, and so do
    watched mixers run by another thread, which the block did not see (`generate` in a `threading.Thread`).

    `history=N` keeps the records of each mixer's last N calls only (None: every call's): an older call is
    dropped with what it kept, and reading it raises `Unavailable`; `call.index` still counts every call.

    What it costs: a call nothing is asked of runs the kernel bound before the watch. A busy call takes
    the path a cost model of its shapes finds cheapest among those it can take (the paths and what each costs:
    docs/performance.md). `paths` (a `Paths`) sets how: `Paths(rule="loop")` runs every busy call through the token
    loop, `Paths(rule="fixed")` takes the rule without a cost model, `Paths(force="segments")` takes that path
    wherever a call can; each kernel call's `path` says which it took.
    """

    def __init__(
        self,
        model: nn.Module,
        keep: Sequence[str] | Mapping[str, Iterable[int] | None] = (),
        record: bool = False,
        paths: Paths | None = None,
        keep_device: "str | torch.device | None" = None,
        reduce: "Mapping[str, Callable[[Any], Any]] | Callable[[Any], Any] | None" = None,
        layers: Iterable[int] | None = None,
        history: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidValue(f"watch: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
        self.paths = checked_paths(paths, "watch")
        if not isinstance(record, bool):
            raise InvalidValue(f"watch: expected record=True or record=False, got record={record!r}")
        if record:
            renamed("watch(record=True)", "watch(keep=('inputs', 'outputs'))", stacklevel=4)
        if not isinstance(keep, (str, Sequence, Mapping)):
            raise InvalidValue(
                f"watch: expected keep as a tuple of names or a mapping of names to tokens, got {type(keep).__name__}"
            )
        keep = renamed_keep(keep)  # a former name warns once, here
        memories, _ = normalize_keep(keep)  # checked here, before anything is acquired
        self.keep_device = as_keep_device(keep_device)
        self.reduce = normalize_reduce(reduce, memories)
        self.layers = _checked_layers(layers)
        self.history = as_history(history, "watch")  # each mixer keeps its last `history` calls' records
        keep = (keep,) if isinstance(keep, str) else dict(keep) if isinstance(keep, Mapping) else tuple(keep)
        self.model = model
        self.keep = keep
        self.record = record
        # what each mixer keeps: `keep`, plus the kernels' inputs and outputs for record=True
        self._kept = (
            ({**dict.fromkeys(KERNEL_IO), **keep} if isinstance(keep, dict) else (*KERNEL_IO, *keep))
            if record
            else keep
        )
        self.mixers: list[RecurrentMixer] = []
        self._by_path: dict[str, RecurrentMixer] = {}  # module path -> its (first) mixer, in module order
        self._stack: contextlib.ExitStack | None = None

    def __repr__(self) -> str:
        state = "active" if self._stack is not None else "inactive"
        mixers = ", ".join(f"layer {m.layer}: {len(m.calls)} calls" for m in self.mixers)
        return f"Watch({type(self.model).__name__}, {state}, keep={self.keep}, mixers=[{mixers}])"

    def _kept_by(self, layer: int | None) -> Any:
        """What the mixer of decoder layer `layer` keeps: `keep`, or nothing if `layers` leaves it out."""
        return self._kept if self.layers is None or layer in self.layers else ()

    def _check_layers(self, found: list) -> None:
        if self.layers is None:
            return
        recurrent = sorted({layer for layer in (layer_in_path(path) for path, _, _ in found) if layer is not None})
        unknown = sorted(self.layers - set(recurrent))
        if unknown:
            raise Unavailable(
                f"watch: layers={sorted(self.layers)}, but layers {unknown} have no recurrent mixer;"
                f" recurrent layers: {recurrent}"
            )

    def _handle(self, path: str, module: nn.Module, row: MixerClass, cache_index: Any, thread: int) -> RecurrentMixer:
        """The handle of one mixer module (of one of its passes, `cache_index`), made with what this watch asks of
        it: its keep and its policy (`policy.Request`, the value its tracker is made with)."""
        in_path = layer_in_path(path)
        layer = getattr(module, row.kind.LAYER_ATTRIBUTE, in_path)  # as the handle reads it (`RecurrentMixer.layer`)
        policy = Policy(self.paths, self.keep_device, reduce_of_layer(self.reduce, layer))
        return row.kind(
            module,
            row.name,
            keep=self._kept_by(in_path),
            thread=thread,
            layer=in_path,
            cache_index=cache_index,
            policy=policy,
            calls_kept=self.history,
        )

    def mixer(self, layer: int | str) -> RecurrentMixer:
        """The mixer of decoder layer `layer` (the transformers `layer_idx`; the first one, in module order,
        where a layer has several, as inkling's four convolution windows), or of the module at a path as
        `model.named_modules()` names it.

            w.mixer(0)                                # by layer
            w.mixer("model.layers.0.linear_attn")     # by module path
        """
        if isinstance(layer, str):
            if layer not in self._by_path:
                raise Unavailable(
                    f"Watch.mixer: no recurrent mixer at module path {layer!r}; the mixer paths"
                    f" are {list(self._by_path)}" + ("" if self._by_path else " (enter the watch first)")
                )
            return self._by_path[layer]
        layer = as_index(layer, "layer", "Watch.mixer")
        for mixer in self.mixers:
            if mixer.layer == layer:
                return mixer
        raise Unavailable(f"no recurrent mixer at layer {layer}; recurrent layers: {[m.layer for m in self.mixers]}")

    def memory_after(self, token: int, call: int | None = None) -> dict[int, Memory]:
        """The whole memory (state and conv window) after `token` of every mixer, by layer.

        Needs `keep=("states", "windows")`; pass the result to another watch's `set_memory_after`.
        A model with several mixers per layer (inkling's four windows) has no memory per layer: use
        `w.mixers[i].memory_after` there.
        """
        one_mixer_per_layer(self.mixers, "Watch.memory_after")
        return {mixer.layer: mixer.memory_after(token, call) for mixer in self.mixers}

    def set_memory_after(self, token: int, memories: Mapping[int, Memory], call: int = 0) -> list[RemovableHandle]:
        """Write each layer's whole memory after `token` of call `call` (the activation-patching move).

        with rh.watch(model, keep=("states", "windows")) as a:
            model(run_a)
        with rh.watch(model) as b:
            b.set_memory_after(7, a.memory_after(7))   # every recurrent layer continues as in run A
            model(run_b)
        """
        if not isinstance(memories, Mapping):
            raise InvalidValue(
                f"Watch.set_memory_after: expected a mapping of layer -> Memory (as memory_after"
                f" returns), got {type(memories).__name__}"
            )
        one_mixer_per_layer(self.mixers, "Watch.set_memory_after")
        unknown = sorted(set(memories) - {mixer.layer for mixer in self.mixers})
        if unknown:
            raise Unavailable(
                f"set_memory_after: no recurrent mixer at layers {unknown};"
                f" recurrent layers: {[m.layer for m in self.mixers]}"
            )
        return [self.mixer(layer).set_memory_after(token, memory, call) for layer, memory in memories.items()]

    def __enter__(self) -> "Watch":
        if self._stack is not None:
            raise RecurrentHooksError("this watch is active already: enter a new watch(model) instead")
        found = _mixer_modules(self.model)
        if not found:
            raise Unavailable(_no_mixer_message(self.model))
        thread = threading.get_ident()
        self._check_layers(found)
        rows = sorted(
            (
                (self._handle(path, m, row, index, thread), row)
                for path, m, row in found
                for index in row.kind.adapter.instances(m, self.model)
            ),
            key=lambda pair: (pair[0].layer is None, pair[0].layer or 0),
        )
        mixers = [mixer for mixer, _ in rows]
        paths = {path: next(mixer for mixer in mixers if mixer.module is m) for path, m, _ in found}
        stack = contextlib.ExitStack()
        try:  # all or nothing: a failure releases what was acquired so far
            for mixer, row in rows:
                attach_handle(mixer, row, stack)
                stack.callback(mixer.mark_detached)
        except BaseException:
            stack.close()
            raise
        saw_cache = _reorder_recorder(mixers, stack)
        for mixer in mixers:
            mixer.tracker.saw_cache = saw_cache
        stack.callback(_forget_cache_recorder, mixers)  # it refers to the mixers: a cycle once the block is over
        self.mixers, self._stack, self._by_path = mixers, stack, paths
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        if exc_type is None:
            problems = [p for mixer in self.mixers for p in mixer.unapplied()]
            if problems:
                shown = "; ".join(problems[:_WRITES_SHOWN])
                more = f"; and {len(problems) - _WRITES_SHOWN} more" if len(problems) > _WRITES_SHOWN else ""
                warnings.warn(
                    f"{len(problems)} write{'s' if len(problems) != 1 else ''} never ran: {shown}{more}."
                    " The calls they target did not happen: generation may have stopped early (EOS or"
                    " max_new_tokens)",
                    RecurrentHooksWarning,
                    stacklevel=2,
                )
            unkept = [p for mixer in self.mixers for p in mixer.unkept()]
            if unkept:
                shown = "; ".join(unkept[:_WRITES_SHOWN])
                more = f"; and {len(unkept) - _WRITES_SHOWN} more mixers" if len(unkept) > _WRITES_SHOWN else ""
                warnings.warn(
                    f"{shown}{more}. Positions count from each call's first token (negative: from its last)",
                    RecurrentHooksWarning,
                    stacklevel=2,
                )
            if (unseen := _unseen_message(self.mixers)) is not None:
                warnings.warn(unseen, RecurrentHooksWarning, stacklevel=2)


_WRITES_SHOWN = 2  # writes named in the warning about writes that never ran


def _unseen_message(mixers: Sequence[RecurrentMixer]) -> str | None:
    """The warning about the watched mixers that other threads ran, which the watch did not see (None: none)."""
    threads: dict[tuple[int, str], list[tuple[RecurrentMixer, int]]] = {}
    for mixer in mixers:
        for thread, forwards in unseen_threads(mixer).items():
            threads.setdefault(thread, []).append((mixer, forwards))
    if not threads:
        return None
    ran = "; ".join(
        f"thread {name!r} ran {_forwards(sum(n for _, n in seen))} of"
        f" {', '.join(str(mixer) for mixer, _ in seen[:_WRITES_SHOWN])}"
        + (f" and {len(seen) - _WRITES_SHOWN} more mixers" if len(seen) > _WRITES_SHOWN else "")
        for (_, name), seen in threads.items()
    )
    return (
        f"{ran}, which this watch did not see: they fired no hook and kept nothing, because {THREAD_RULE}."
        " (Another watch entered in that thread sees them.)"
    )


def _forwards(count: int) -> str:
    return f"{count} forward{'s' if count != 1 else ''}"


def _checked_layers(layers: Any) -> frozenset[int] | None:
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise InvalidValue(f"watch: expected layers= decoder layer indices (as [0, 2]) or None, got {layers!r}")
    return frozenset(as_index(layer, "layers", "watch") for layer in layers)


def one_mixer_per_layer(mixers: Sequence[RecurrentMixer], method: str) -> None:
    """Refuse, for `method`, a model whose layers hold several watched mixers (a memory per layer is ambiguous)."""
    layers = [mixer.layer for mixer in mixers]
    shared = sorted({layer for layer in layers if layers.count(layer) > 1})
    if shared:
        raise Unavailable(
            f"{method}: layers {shared} have several mixers each"
            f" ({', '.join(str(m) for m in mixers if m.layer == shared[0])}), so a memory per"
            " layer would be ambiguous; read and write each mixer's own (w.mixers[i].memory_after,"
            " w.mixers[i].set_memory_after)"
        )


def watch(
    model: nn.Module,
    keep: Sequence[str] | Mapping[str, Iterable[int] | None] = (),
    record: bool = False,
    paths: Paths | None = None,
    keep_device: "str | torch.device | None" = None,
    reduce: "Mapping[str, Callable[[Any], Any]] | Callable[[Any], Any] | None" = None,
    layers: Iterable[int] | None = None,
    history: int | None = None,
) -> Watch:
    """Watch every supported recurrent mixer of `model` for the duration of a `with` block.

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            w.mixers[1].set_state_after(4, value)          # call 0 (the prompt): tokens 5.. continue from value
            h = w.mixers[1].register_state_hook(fn)        # fn(mixer, call, token, state) at every token
            out = model.generate(ids, max_new_tokens=8)    # call 0 is the prompt, call k decode step k
        w.mixers[0].states                                  # the state after every token of the last call

    See `Watch` for what happens on entry and exit and for `paths` (how busy calls run: `Paths`), and
    docs/concepts.md for calls, tokens and writes.
    """
    return Watch(model, keep, record, paths, keep_device, reduce, layers, history)
