"""Running a test model without gradients: its logits, its greedy generate, and the left-padding check's runs."""

import dataclasses
from typing import Any

import torch

from _models import PAD


def logits_of(model, ids, **kwargs):
    """The logits of one forward over `ids`, without gradients."""
    with torch.no_grad():
        return model(ids, **kwargs).logits


def greedy(model, ids, n, **kwargs):
    """`n` greedily generated tokens after `ids` (the generate's output: `sequences`, or all it returns)."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=PAD, **kwargs)


@dataclasses.dataclass
class LeftPadded:
    """A batch of a left-padded row (`pads` pad tokens, then the short row) and a full row, and the short row alone,
    each run once in its own watch (`batch`, `alone`) keeping what was asked, with their logits."""

    ids: torch.Tensor  # [2, tokens]
    mask: torch.Tensor  # [2, tokens]: 0 at the pads
    pads: int
    batch: Any
    padded: torch.Tensor  # the batch's logits
    alone: Any
    single: torch.Tensor  # the short row's logits


def left_padded(model, keep, tokens: int, pads: int = 4) -> LeftPadded:
    """The left-padding check's two runs (the short row and the full row: `random_ids` seeds 3 and 4)."""
    import recurrent_hooks as rh
    from _models import random_ids

    short = random_ids(1, tokens - pads, seed=3)
    full = random_ids(1, tokens, seed=4)
    ids = torch.cat([torch.cat([torch.full((1, pads), PAD), short], dim=1), full])
    mask = (ids != PAD).long()
    mask[1] = 1
    with rh.watch(model, keep=keep) as batch:
        padded = logits_of(model, ids, attention_mask=mask)
    with rh.watch(model, keep=keep) as alone:
        single = logits_of(model, short)
    return LeftPadded(ids, mask, pads, batch, padded, alone, single)
