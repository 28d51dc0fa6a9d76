"""Answer MQAR queries with greedy `generate` over a cache: each answer after the first is a decode step.

from recurrent_hooks.toys import MQAR, generate_answers, load_toy
task, model = MQAR(), load_toy("gdn")
batch = task.sample(8, seed=0)
answers = generate_answers(model, task, batch)      # [8, queries] generated value tokens
(answers == batch.answers).float().mean()
"""

from __future__ import annotations

import torch
import transformers

from ._task import MQAR, PAD, MQARBatch

__all__ = ["generate_answers", "ForceQueries"]


class ForceQueries(transformers.LogitsProcessor):
    """Forces the query tokens of `ids` at the task's query positions; leaves the answers to the model."""

    def __init__(self, task: MQAR, ids: torch.Tensor):
        self.ids = ids
        self.positions = set(task.query_positions.tolist())

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        position = input_ids.shape[1]  # the position of the token being chosen
        if position not in self.positions:
            return scores
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, self.ids[:, position, None].to(scores.device), 0.0)
        return forced


def generate_answers(
    model: transformers.PreTrainedModel, task: MQAR, batch: MQARBatch, **generate_kwargs
) -> torch.Tensor:
    """The answers greedy ``model.generate`` gives, as a [batch, queries] tensor of token ids.

    The prompt is the pairs and the first query (``batch.ids[:, :query_positions[0] + 1]``). Generation
    runs ``2 * num_queries - 1`` new tokens with the cache: answer 0 comes from the prompt's forward;
    query j >= 1 is forced (`ForceQueries`), and answer j is chosen by a one-token decode step over the
    cache. `generate_kwargs` go to `generate` (e.g. ``use_cache``).
    """
    start = int(task.query_positions[0]) + 1
    prompt = batch.ids[:, :start]
    kwargs = dict(
        max_new_tokens=2 * task.num_queries - 1,
        do_sample=False,
        pad_token_id=PAD,
        attention_mask=torch.ones_like(prompt),
        logits_processor=transformers.LogitsProcessorList([ForceQueries(task, batch.ids)]),
    )
    kwargs.update(generate_kwargs)
    out = model.generate(prompt, **kwargs)
    return out[:, task.answer_token_positions]
