"""qwen3_5, the one family the tests of the public API run on (gated DeltaNet at layers 0 and 2): its modeling
module, what its two kernels are bound to now, and a forward and a greedy generate over random prompts of `T` tokens
(2 rows)."""

import importlib

import torch
from _models import PAD, random_ids

T = 13
MODULE = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def bindings():
    """What each of the two kernels' names in the modeling module holds now."""
    return {name: getattr(MODULE, name) for name in KERNELS}


def run(model, ids=None, **kwargs):
    """The logits of one forward over `ids` (a random prompt of T tokens if None), without gradients."""
    with torch.no_grad():
        return model(random_ids(2, T) if ids is None else ids, **kwargs).logits


def generate(model, n=4):
    """`n` greedily generated tokens after a random prompt of T tokens, without gradients."""
    with torch.no_grad():
        return model.generate(random_ids(2, T), max_new_tokens=n, do_sample=False, pad_token_id=PAD)
