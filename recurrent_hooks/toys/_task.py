"""Multi-query associative recall (MQAR): key-value pairs, then queries of keys; answer each key's value.

    from recurrent_hooks.toys import MQAR
    task = MQAR()                                   # 8 pairs, 4 queries, 16 keys, 16 values, vocab 36
    batch = task.sample(64, seed=0)                 # batch.ids: [64, 25] token ids, deterministic in seed
    logits = model(batch.ids).logits
    task.accuracy(logits, batch)                    # fraction of queries answered right (argmax)
    clean, corrupt = task.contrast(16, seed=1)      # corrupt: one pair's value changed, one answer changes
    logits[:, task.answer_positions]                # the positions whose logits predict the answers

A prompt is laid out as (positions are the same in every row)::

    BOS  k_0 v_0  k_1 v_1 ... k_{P-1} v_{P-1}   q_0 a_0  q_1 a_1 ... q_{Q-1} a_{Q-1}
    0    1   2    3   4       2P-1    2P        2P+1 ...

- The keys of one prompt are distinct; values are drawn with replacement; key and value tokens are
  disjoint ranges of the vocabulary (`task.key_tokens`, `task.value_tokens`).
- Each query q_j is the key of a distinct pair (`batch.query_pairs[:, j]`), and a_j is that pair's
  value. The answers are in the prompt (teacher forcing), so one forward scores every query: the
  logits at q_j's position (`task.answer_positions[j]`) must put their maximum on a_j.
- `task.key_positions[i]`, `task.value_positions[i]`: where pair i sits; `task.query_positions[j]`
  (= `answer_positions[j]`) and `task.answer_token_positions[j]` (= that + 1): query j and its answer.

Fewer queries than pairs by default: when every pair is queried, the last query can be answered by
elimination (the one value not yet answered), and a tiny model learns that shortcut instead of
recall (measured: last query 100%, first query 26%).

`contrast` makes clean/corrupt pairs: the corrupt row changes the value of one queried pair (the
pair asked by query `query`, default the last one) to a different value token, and the answer
token of that query to match, so the corrupt prompt is itself a correct MQAR prompt. The two rows
differ at exactly two positions, `value_positions[pair]` and `answer_token_positions[query]`; the
expected answers differ at query `query` only. With the default `query=-1`, `ids[:, :-1]` (the prompt
without its final answer token) differs in exactly one token, the changed value.

Vocabulary: 0 pad, 1 bos, 2 eos (unused by the task, kept for `generate`), 3 unused (the tokenizer's
``<unk>``), then the key tokens, then the value tokens; `load_toy_tokenizer` names them ``k0`` .. and
``v0`` .. (``tok.decode(batch.ids[0])``). Everything is deterministic given `seed` (or a `torch.Generator`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

__all__ = ["MQAR", "MQARBatch"]

PAD, BOS, EOS = 0, 1, 2
_FIRST_KEY = 4


@dataclass(frozen=True)
class MQARBatch:
    """A batch of MQAR prompts. All tensors are int64 on the CPU.

    ``ids`` [batch, seq]: the prompts, answers included. ``pair_keys`` / ``pair_values`` [batch, pairs]:
    the key and value token of each pair, in prompt order. ``query_pairs`` [batch, queries]: which pair
    query j asks for. ``answers`` [batch, queries]: the value token query j must produce.
    """

    ids: Int[torch.Tensor, "batch seq"]
    pair_keys: Int[torch.Tensor, "batch pairs"]
    pair_values: Int[torch.Tensor, "batch pairs"]
    query_pairs: Int[torch.Tensor, "batch queries"]
    answers: Int[torch.Tensor, "batch queries"]

    def __len__(self) -> int:
        return self.ids.shape[0]


def _generator(seed: int | torch.Generator | None) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    if seed is None:
        raise TypeError("pass seed= (an int) or generator= (a torch.Generator): MQAR prompts are never unseeded")
    return torch.Generator().manual_seed(int(seed))


class MQAR:
    """The MQAR task: `num_pairs` key-value pairs, then `num_queries` queries (see the module docstring).

    ``num_queries <= num_pairs <= num_keys`` (keys are distinct within a prompt, and so are the pairs
    that are queried).
    """

    def __init__(self, num_pairs: int = 8, num_queries: int = 4, num_keys: int = 16, num_values: int = 16):
        if not 1 <= num_queries <= num_pairs <= num_keys:
            raise ValueError(
                f"need 1 <= num_queries ({num_queries}) <= num_pairs ({num_pairs}) <= num_keys ({num_keys})"
            )
        if num_values < 2:
            raise ValueError(f"need num_values >= 2 (contrast changes a value), got {num_values}")
        self.num_pairs, self.num_queries = num_pairs, num_queries
        self.num_keys, self.num_values = num_keys, num_values
        self.key_tokens = range(_FIRST_KEY, _FIRST_KEY + num_keys)
        self.value_tokens = range(self.key_tokens.stop, self.key_tokens.stop + num_values)
        self.vocab_size = self.value_tokens.stop
        self.seq_len = 1 + 2 * num_pairs + 2 * num_queries
        self.key_positions = torch.arange(num_pairs) * 2 + 1
        self.value_positions = self.key_positions + 1
        self.query_positions = 1 + 2 * num_pairs + torch.arange(num_queries) * 2
        self.answer_positions = self.query_positions  # the logits there predict the answers
        self.answer_token_positions = self.query_positions + 1

    def __repr__(self) -> str:
        return (
            f"MQAR(num_pairs={self.num_pairs}, num_queries={self.num_queries}, num_keys={self.num_keys},"
            f" num_values={self.num_values})"
        )

    def _build(self, keys, values, query_pairs) -> MQARBatch:
        n = keys.shape[0]
        answers = values.gather(1, query_pairs)
        ids = torch.empty(n, self.seq_len, dtype=torch.long)
        ids[:, 0] = BOS
        ids[:, self.key_positions] = keys
        ids[:, self.value_positions] = values
        ids[:, self.query_positions] = keys.gather(1, query_pairs)
        ids[:, self.answer_token_positions] = answers
        return MQARBatch(ids=ids, pair_keys=keys, pair_values=values, query_pairs=query_pairs, answers=answers)

    def sample(
        self, batch_size: int, seed: int | None = None, *, generator: torch.Generator | None = None
    ) -> MQARBatch:
        """`batch_size` fresh prompts, a function of `seed` (or of the state of `generator`) only."""
        gen = _generator(generator if generator is not None else seed)
        keys = torch.rand(batch_size, self.num_keys, generator=gen).argsort(dim=1)[:, : self.num_pairs]
        keys = keys + self.key_tokens.start
        values = torch.randint(
            self.value_tokens.start, self.value_tokens.stop, (batch_size, self.num_pairs), generator=gen
        )
        query_pairs = torch.rand(batch_size, self.num_pairs, generator=gen).argsort(dim=1)[:, : self.num_queries]
        return self._build(keys, values, query_pairs)

    def contrast(
        self, batch_size: int, seed: int | None = None, *, query: int = -1, generator: torch.Generator | None = None
    ) -> tuple[MQARBatch, MQARBatch]:
        """(clean, corrupt): the corrupt row gives the pair asked by query `query` a different value.

        The rows differ at ``value_positions[clean.query_pairs[:, query]]`` and
        ``answer_token_positions[query]`` only; ``corrupt.answers`` differs from ``clean.answers`` in
        column `query` only. The changed pair of row b is ``clean.query_pairs[b, query]``.
        """
        if not -self.num_queries <= query < self.num_queries:
            raise IndexError(f"query {query} out of range for {self.num_queries} queries")
        gen = _generator(generator if generator is not None else seed)
        clean = self.sample(batch_size, generator=gen)
        pair = clean.query_pairs[:, query]
        old = clean.pair_values.gather(1, pair[:, None])[:, 0]
        shift = torch.randint(1, self.num_values, (batch_size,), generator=gen)  # never 0: the value changes
        new = (old - self.value_tokens.start + shift) % self.num_values + self.value_tokens.start
        values = clean.pair_values.clone()
        values.scatter_(1, pair[:, None], new[:, None])
        return clean, self._build(clean.pair_keys, values, clean.query_pairs)

    def answer_logits(
        self, logits: Float[torch.Tensor, "batch seq vocab"]
    ) -> Float[torch.Tensor, "batch queries vocab"]:
        """The logits that predict the answers: ``logits[:, answer_positions]``."""
        return logits[:, self.answer_positions]

    def loss(self, logits: Float[torch.Tensor, "batch seq vocab"], batch: MQARBatch) -> torch.Tensor:
        """Mean cross-entropy of the answers (the only positions that are trained)."""
        scores = self.answer_logits(logits).float()
        return torch.nn.functional.cross_entropy(scores.flatten(0, 1), batch.answers.flatten())

    def accuracy(self, logits: Float[torch.Tensor, "batch seq vocab"], batch: MQARBatch) -> float:
        """Fraction of queries whose argmax over the whole vocabulary is the right value."""
        return (self.answer_logits(logits).argmax(-1) == batch.answers).float().mean().item()
