"""Running a test model without gradients: its logits, and its greedy generate."""

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
