"""Toy models that ship: an MQAR task, the init that makes tiny recurrent models learn it, and trained
transformers models of each recurrent kind whose weights are in the package (no download).

    from recurrent_hooks.toys import MQAR, load_toy, load_toy_tokenizer
    task, model = MQAR(), load_toy("gdn")          # Qwen3_5ForCausalLM [linear_attention, full_attention]
    model = load_toy("gdn_recall")                 # [linear, linear, full (no-op)]: recall in the state
    clean, corrupt = task.contrast(16, seed=0)     # one pair's value differs; one answer changes
    logits = model(clean.ids).logits[:, task.answer_positions]
    tok = load_toy_tokenizer("gdn")                # the vocabulary as words: tok.decode(clean.ids[0]) = "<bos> k.."

See `MQAR` (the task), `init_for_recall` (the init), `load_toy` / `TOYS` (the models) and
`load_toy_tokenizer` (the tokenizer they share: ``<pad> <bos> <eos> <unk> k0..k15 v0..v15``).
"""

from ._generate import ForceQueries, generate_answers
from ._init import CONV_FACTOR, SLOW_DECAY_FACTOR, init_for_recall
from ._models import TOYS, build_toy, load_toy, toy_config, toy_task
from ._task import MQAR, MQARBatch
from ._tokenizer import build_toy_tokenizer, load_toy_tokenizer, toy_vocabulary, write_toy_tokenizer

__all__ = [
    "MQAR",
    "MQARBatch",
    "init_for_recall",
    "SLOW_DECAY_FACTOR",
    "CONV_FACTOR",
    "TOYS",
    "load_toy",
    "build_toy",
    "toy_config",
    "toy_task",
    "load_toy_tokenizer",
    "build_toy_tokenizer",
    "write_toy_tokenizer",
    "toy_vocabulary",
    "generate_answers",
    "ForceQueries",
]
