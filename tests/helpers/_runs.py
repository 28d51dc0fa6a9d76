"""Running a test model without gradients: its logits, its greedy generate (also under a watch, or made to run all
its steps), every state of a forward, the left-padding check's runs, the sparse-path check's generate, a forward under
a halving hook, and the calls a model's modules receive."""

import copy
import dataclasses
from typing import Any

import torch
from _models import PAD, random_ids

import recurrent_hooks as rh


def logits_of(model, ids, **kwargs):
    """The logits of one forward over `ids`, without gradients."""
    with torch.no_grad():
        return model(ids, **kwargs).logits


def greedy(model, ids, n, **kwargs):
    """`n` greedily generated tokens after `ids` (the generate's output: `sequences`, or all it returns)."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=PAD, **kwargs)


def greedy_exactly(model, ids, n, **kwargs):
    """`greedy` made to generate all `n` tokens (`min_new_tokens=n`: an end-of-sequence token does not stop it)."""
    return greedy(model, ids, n, min_new_tokens=n, **kwargs)


def states_of(model, ids, **kwargs):
    """Every state of every mixer (by layer) of one plain forward, kept alone in its own watch."""
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        logits = model(ids, **kwargs).logits
    return logits, {m.layer: m.states for m in w.mixers}


@dataclasses.dataclass
class LeftPadded:
    """A batch of a left-padded row (`pads` pad tokens, then the short row) and, where `rows` is 2, a full row,
    generated from once in a watch (`batch`) and once as the short row alone (`alone`), each keeping what was asked,
    with each decode step's logits (`padded`, `single`); and the batch's plain forward (no position ids: `forward`,
    its logits `logits`; the short row's alone: `short_logits`)."""

    ids: torch.Tensor  # [rows, tokens]
    mask: torch.Tensor  # [rows, tokens]: 0 at the pads
    pads: int
    steps: int  # the calls of each generate: the prompt and steps - 1 decode steps
    batch: Any
    padded: tuple  # the batch's logits, a step each
    alone: Any
    single: tuple  # the short row's logits, a step each
    forward: Any
    logits: torch.Tensor  # the batch's plain forward's logits
    short_logits: torch.Tensor  # the short row's plain forward's logits

    def generates(self, model, keep, n: int = 4):
        """`n` greedy tokens after the batch (with its mask): unwatched, in a watch keeping `keep`, and in a watch
        with a no-op hook on every mixer."""
        plain = greedy(model, self.ids, n, attention_mask=self.mask)
        with rh.watch(model, keep=keep):
            kept = greedy(model, self.ids, n, attention_mask=self.mask)
        with rh.watch(model) as w:
            for mixer in w.mixers:
                mixer.register_state_hook(lambda m, c, t, s: None)
            hooked = greedy(model, self.ids, n, attention_mask=self.mask)
        return plain, kept, hooked


def left_padded(model, keep, tokens: int, pads: int = 4, rows: int = 2, steps: int = 3) -> LeftPadded:
    """The left-padding check's runs (the short row and the full row: `random_ids` seeds 3 and 4): a generate of
    `steps` calls from the batch and from the short row alone, and the batch's plain forward."""
    short = random_ids(1, tokens - pads, seed=3)
    full = random_ids(1, tokens, seed=4)
    ids = torch.cat([torch.cat([torch.full((1, pads), PAD, device=short.device), short], dim=1), full])[:rows]
    mask = (ids != PAD).long()
    mask[1:] = 1
    per_step = dict(output_logits=True, return_dict_in_generate=True)
    with rh.watch(model, keep=keep) as batch:
        padded = greedy(model, ids, steps, attention_mask=mask, **per_step).logits
    with rh.watch(model, keep=keep) as alone:
        single = greedy(model, short, steps, **per_step).logits
    with rh.watch(model, keep=keep) as forward:
        logits = logits_of(model, ids, attention_mask=mask)
    return LeftPadded(ids, mask, pads, steps, batch, padded, alone, single, forward, logits, logits_of(model, short))


def sparse_generate(model, ids, keep, paths, state, window=None):
    """The sparse-path check's generate (4 tokens, with their logits) in a watch keeping `keep` through `paths`: it
    writes `state` (and `window`) to the first mixer after token 7 of the prompt and `state` at decode call 2, and a
    hook on the last mixer at prompt tokens 3 and -2 records the state's norm and scales it by 0.9. Returns the watch,
    the generate's output and the norms."""
    seen = []
    with rh.watch(model, keep=keep, paths=paths) as w, torch.no_grad():
        w.mixers[0].set_state_after(7, state)
        if window is not None:
            w.mixers[0].set_window_after(7, window)
        w.mixers[-1].register_state_hook(lambda m, c, t, s: seen.append(float(s.norm())) or s * 0.9, token=[3, -2])
        w.mixers[0].set_state_after(0, state, call=2)
        out = model.generate(
            ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True
        )
    return w, out, seen


def watched_logits(model, ids, keep):
    """The logits of `ids` unwatched, in an idle watch and in a watch keeping `keep`; and that last watch."""
    plain = logits_of(model, ids)
    with rh.watch(model):
        idle = logits_of(model, ids)
    with rh.watch(model, keep=keep) as w:
        kept = logits_of(model, ids)
    return plain, idle, kept, w


def watched_greedy(model, keep, tokens: int, n: int):
    """The watch (keeping `keep`) of `n` greedily generated tokens after `random_ids(2, tokens)`."""
    with rh.watch(model, keep=keep) as w:
        greedy(model, random_ids(2, tokens), n)
    return w


def greedy_under_replacing_hooks(model, ids, n, mixers_of, **kwargs):
    """`greedy` in a watch whose hook replaces every state of the mixers `mixers_of(watch)` by a copy of it."""
    with rh.watch(model) as w:
        for mixer in mixers_of(w):
            mixer.register_state_hook(lambda m, c, t, s: s.clone())
        return greedy(model, ids, n, **kwargs)


def halved(model, ids):
    """The logits of one forward over `ids` whose first mixer's states a hook halves, and its watch (keeping the
    states)."""
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 0.5)
        return model(ids).logits, w


def halved_around(a, b, ids, projection):
    """`halved(a, ids)` while a torch hook on `projection` (a module inside A's mixer) runs model B over `ids`: A's
    watch and the logits of B's runs."""
    inner = []
    handle = projection.register_forward_hook(lambda mod, args, out: inner.append(b(ids).logits))
    try:
        _, w = halved(a, ids)
    finally:
        handle.remove()
    return w, inner


def calls_of(modules, run):
    """Every call of `modules` during `run()`: (module, args, kwargs), copied as they came (tensors cloned, the
    cache, by position or as `cache=`, deep-copied)."""
    seen = []

    def pre(m, args, kwargs):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else copy.deepcopy(a) for a in args)
        kwargs = dict(kwargs)
        if kwargs.get("cache") is not None:
            kwargs["cache"] = copy.deepcopy(kwargs["cache"])
        seen.append((m, args, kwargs))

    handles = [module.register_forward_pre_hook(pre, with_kwargs=True) for module in modules]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen
