"""The toys' tokenizer: every token id of the MQAR vocabulary as a word, so prompts can be read and written.

    from recurrent_hooks.toys import MQAR, load_toy_tokenizer
    tok, batch = load_toy_tokenizer("gdn"), MQAR().sample(1, seed=0)
    tok.decode(batch.ids[0])                       # "<bos> k12 v3 k2 v0 ... k4 v15": the prompt in words
    tok("<bos> k3 v7 k3")["input_ids"]             # [1, 7, 27, 7]: the ids back

Words, by id (`MQAR()`'s vocabulary, shared by every toy): 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``,
3 ``<unk>`` (the id the task leaves unused: no training prompt contains it), then the keys ``k0`` ..
``k15`` (ids 4..19, ``k{i}`` is ``task.key_tokens[i]``), then the values ``v0`` .. ``v15`` (ids 20..35,
``v{i}`` is ``task.value_tokens[i]``). Ids of a model's embedding beyond the task's vocabulary, if
any, are ``<unused_{id}>``, so every id a model has decodes (the shipped toys have exactly the task's 36).

It is a `tokenizers` WordLevel model with a whitespace-split pre-tokenizer, wrapped as a
`transformers.PreTrainedTokenizerFast`: words are separated by whitespace, decode joins them with one
space, and nothing is added around a text (no BOS is prepended: a prompt's text starts with ``<bos>``
as its ids do), so ``tok(tok.decode(ids))["input_ids"] == ids``. A word outside the vocabulary
encodes as ``<unk>``. The special tokens are pad ``<pad>``, bos ``<bos>``, eos ``<eos>`` (what
`generate` stops at) and unk ``<unk>``; ``model_input_names`` is ``input_ids`` and ``attention_mask``,
so ``model(**tok(texts, return_tensors="pt", padding=True))`` works.

The files ship in ``recurrent_hooks/toys/weights/tokenizer/`` (``tokenizer.json`` and
``tokenizer_config.json``, readable by ``AutoTokenizer.from_pretrained`` from that folder as well);
`build_toy_tokenizer` makes the tokenizer from the task, `write_toy_tokenizer` writes those files
(``scripts/train_toys.py`` calls it, and ``--tokenizer-only`` regenerates them without training), and
a test checks the shipped files equal what `build_toy_tokenizer` makes now.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import transformers

from ._task import BOS, EOS, MQAR, PAD

__all__ = ["toy_vocabulary", "build_toy_tokenizer", "write_toy_tokenizer", "load_toy_tokenizer", "TOKENIZER_DIR"]

UNK = 3  # the id MQAR leaves unused
SPECIAL = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", UNK: "<unk>"}
TOKENIZER_DIR = "tokenizer"  # under recurrent_hooks/toys/weights/
_FILES = ("tokenizer.json", "tokenizer_config.json")


def toy_vocabulary(task: MQAR | None = None, vocab_size: int | None = None) -> dict[str, int]:
    """Word -> id for every id below `vocab_size` (default: the task's vocabulary size, 36 for `MQAR()`)."""
    task = MQAR() if task is None else task
    vocab_size = task.vocab_size if vocab_size is None else vocab_size
    if vocab_size < task.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the task's vocabulary ({task.vocab_size} ids)")
    words = dict(SPECIAL)
    words.update({token: f"k{i}" for i, token in enumerate(task.key_tokens)})
    words.update({token: f"v{i}" for i, token in enumerate(task.value_tokens)})
    missing = sorted(set(range(task.vocab_size)) - set(words))
    if missing:  # an id below the keys that the task does not name (none for MQAR as it is)
        raise RuntimeError(f"ids {missing} of the task have no word")
    words.update({token: f"<unused_{token}>" for token in range(task.vocab_size, vocab_size)})
    return {word: token for token, word in sorted(words.items())}


def _config() -> dict:
    """The tokenizer_config.json: what `PreTrainedTokenizerFast` needs on top of tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL[PAD],
        "bos_token": SPECIAL[BOS],
        "eos_token": SPECIAL[EOS],
        "unk_token": SPECIAL[UNK],
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def _tokenizer_json(task: MQAR | None, vocab_size: int | None) -> str:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = toy_vocabulary(task, vocab_size)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[UNK]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [word for word in vocab if word.startswith("<")]  # <pad> <bos> <eos> <unk> <unused_N>
    tokenizer.add_special_tokens([AddedToken(word, special=True, normalized=False) for word in specials])
    return tokenizer.to_str(pretty=True)


def _wrap(tokenizer_json: str, config: dict) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer

    kwargs = {k: v for k, v in config.items() if k != "tokenizer_class"}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), **kwargs)


def build_toy_tokenizer(
    task: MQAR | None = None, vocab_size: int | None = None
) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer of `task` (default `MQAR()`), naming every id below `vocab_size` (see the module docstring)."""
    return _wrap(_tokenizer_json(task, vocab_size), _config())


def write_toy_tokenizer(directory: str | Path, task: MQAR | None = None, vocab_size: int | None = None) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json of `build_toy_tokenizer(task, vocab_size)` into
    `directory` (created if needed); returns the paths. Deterministic: the same arguments write the same bytes."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    texts = (_tokenizer_json(task, vocab_size), json.dumps(_config(), indent=2))
    paths = []
    for name, text in zip(_FILES, texts):
        path = directory / name
        path.write_text(text + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def tokenizer_files():
    """The packaged tokenizer folder (an importlib.resources Traversable)."""
    return importlib.resources.files(__package__).joinpath("weights", TOKENIZER_DIR)


def load_toy_tokenizer(name: str) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer of toy `name`, loaded from the package (no network): ``decode`` turns a prompt's ids
    into words (``<bos> k3 v7 ...``), calling it on such a text gives the ids back. Every toy shares
    the vocabulary of `MQAR()`; see `recurrent_hooks.toys._tokenizer` for the words."""
    from ._models import toy_task

    toy_task(name)  # raises KeyError for a name that is not a shipped toy
    folder = tokenizer_files()
    tokenizer_json, config = (folder.joinpath(file).read_text(encoding="utf-8") for file in _FILES)
    return _wrap(tokenizer_json, json.loads(config))
