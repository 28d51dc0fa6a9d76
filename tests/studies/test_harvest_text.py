"""`rh.harvest` from text: documents tokenized, packed into contexts (an eos or bos between them, the last context
padded) or one to a row (truncated), each token with its id, document and position in it; a text dataset's other
columns and a batch's other keys kept per document (`data.documents`); the tokenizer and the text arguments are part
of the request (a resume with another tokenizer is refused by name); bad texts and arguments get errors naming what
came and where; token ids near a 250k vocabulary come back exact."""

import pathlib

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import build
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from torch import nn
from transformers import PreTrainedTokenizerFast

import recurrent_hooks as rh

VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 128)}


def _tokenizer(bos=False, eos=True, pad=True, vocab=VOCAB):
    """A whitespace WordLevel tokenizer over the tiny models' 128 ids: "w7" is id 7."""
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    special = {"bos_token": "<bos>"} if bos else {}
    special |= {"eos_token": "<eos>"} if eos else {}
    special |= {"pad_token": "<pad>"} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special)


TEXTS = ["w4 w5 w6", "w7 w8", "w9 w10 w11 w12 w13", "w14"]  # 3, 2, 5, 1 words


@pytest.fixture(scope="module")
def model():
    return build("mamba2")


def _files(out):
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(pathlib.Path(out).rglob("*")) if p.is_file()}


def test_packed_documents_keep_their_ids_documents_and_positions_and_the_rows_values(model, tmp_path):
    tok = _tokenizer()  # eos after each document: 4 + 3 + 6 + 2 = 15 tokens, 4 contexts of 4 (the last padded)
    h = rh.harvest(model, TEXTS, tmp_path / "text", tokenizer=tok, context=4, batch_size=3, progress=False)
    assert (h.tokens, h.docs, h.batches) == (15, 4, 2)
    data = rh.HarvestDataset(tmp_path / "text", layer=0)
    stream = [4, 5, 6, 2, 7, 8, 2, 9, 10, 11, 12, 13, 2, 14, 2]
    assert_equal("tokens", torch.tensor(stream), data.tokens)
    assert data.docs.tolist() == [0] * 4 + [1] * 3 + [2] * 6 + [3] * 2
    assert data.positions.tolist() == [*range(4), *range(3), *range(6), *range(2)]
    assert data[5]["token"] == 8 and data[[0, 14]]["token"].tolist() == [4, 2]
    # the same contexts as batches of ids: the same values at the same tokens
    ids = torch.tensor(stream + [0]).reshape(4, 4)
    mask = torch.ones(4, 4, dtype=torch.long)
    mask[3, 3] = 0
    rh.harvest(model, [ids[:3], {"input_ids": ids[3:], "attention_mask": mask[3:]}], tmp_path / "ids", progress=False)
    by_ids = rh.HarvestDataset(tmp_path / "ids", layer=0)
    assert_close("packed states", by_ids.take(range(15)), data.take(range(15)), rtol=0, atol=0)
    assert len(data.documents) == 4 and data.documents[2] == {} and data.documents.columns == ()


def test_a_tokenizer_with_bos_starts_each_document_with_it(model, tmp_path):
    rh.harvest(model, TEXTS[:2], tmp_path, tokenizer=_tokenizer(bos=True), context=3, progress=False)
    data = rh.HarvestDataset(tmp_path, layer=0)
    assert data.tokens.tolist() == [1, 4, 5, 6, 1, 7, 8]
    assert data.positions.tolist() == [0, 1, 2, 3, 0, 1, 2] and data.docs.tolist() == [0] * 4 + [1] * 3


def test_unpacked_documents_are_rows_truncated_at_the_context(model, tmp_path):
    h = rh.harvest(model, TEXTS, tmp_path, tokenizer=_tokenizer(), context=4, packing=False, batch_size=2)
    assert (h.tokens, h.docs, h.batches) == (4 + 3 + 4 + 2, 4, 2)
    data = rh.HarvestDataset(tmp_path, layer=0)
    assert data.tokens.tolist() == [4, 5, 6, 2, 7, 8, 2, 9, 10, 11, 12, 14, 2]
    assert data.docs.tolist() == [0] * 4 + [1] * 3 + [2] * 4 + [3] * 2
    assert data.positions.tolist() == [*range(4), *range(3), *range(4), *range(2)]


def test_a_datasets_dataset_keeps_its_other_columns_per_document(model, tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets (the optional `test` extra) is not installed")
    rows = {"text": TEXTS, "label": [0, 1, 0, 1], "source": ["a", "b", "c", "d"]}
    for name, texts in [
        ("map", datasets.Dataset.from_dict(rows)),
        ("stream", datasets.Dataset.from_dict(rows).to_iterable_dataset()),
    ]:
        rh.harvest(model, texts, tmp_path / name, tokenizer=_tokenizer(), context=4, progress=False)
        documents = rh.HarvestDataset(tmp_path / name, layer=0).documents
        assert len(documents) == 4 and documents.columns == ("label", "source")
        assert documents[1] == {"label": 1, "source": "b"} and documents["label"] == [0, 1, 0, 1]
    with pytest.raises(rh.InvalidValue, match=r"text_column='body'.*\['text', 'label', 'source'\]"):
        rh.harvest(
            model,
            datasets.Dataset.from_dict(rows),
            tmp_path / "x",
            tokenizer=_tokenizer(),
            context=4,
            text_column="body",
        )


def test_a_batchs_other_keys_are_kept_per_document_and_refused_where_they_cannot_be(model, tmp_path):
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids, "idx": torch.tensor([7, 8]), "name": ["a", "b"]}, {"input_ids": ids[:1], "idx": [9]}]
    rh.harvest(model, batches, tmp_path / "ok", progress=False)
    documents = rh.HarvestDataset(tmp_path / "ok", layer=0).documents
    assert documents["idx"] == [7, 8, 9] and documents["name"] == ["a", "b", None] and documents[2] == {"idx": 9}
    with pytest.raises(
        rh.InvalidValue, match=r"batch 0: .*key 'idx' to hold one value per row \(2 rows\), got a Tensor of 3"
    ):
        rh.harvest(model, [{"input_ids": ids, "idx": torch.arange(3)}], tmp_path / "bad", progress=False)
    with pytest.raises(rh.InvalidValue, match=r"batch 0, doc 1: the column 'obj' holds a object"):
        rh.harvest(model, [{"input_ids": ids, "obj": [1, object()]}], tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").rglob("*.safetensors"))


@pytest.mark.parametrize(
    "texts, kwargs, message",
    [
        (["w4", ""], {}, r"document 1's text is empty"),
        (["w4", 5], {}, r"expected document 1's text a str, got int"),
        ([{"body": "w4"}], {}, r"document 0 has no column 'text' \(text_column=\); its columns: \['body'\]"),
        (TEXTS, {"context": 1}, r"context= the tokens per row, an integer of at least 2, got 1"),
        (TEXTS, {"batch_size": 0}, r"batch_size= rows per forward, an integer >= 1, got 0"),
        ("w4 w5", {}, r"expected batches= the texts.*got str: wrap one text in a list"),
        (
            TEXTS,
            {"tokenizer": _tokenizer(pad=False), "batch_size": 3},
            r"from document 3 on need padding.*has no pad token",
        ),
        (TEXTS, {"tokenizer": _tokenizer(eos=False)}, r"packing=True needs a separator.*neither a bos nor an eos"),
    ],
)
def test_bad_texts_and_arguments_are_refused_naming_what_and_where(model, tmp_path, texts, kwargs, message):
    kwargs = {"tokenizer": _tokenizer(), "context": 4, "progress": False} | kwargs
    with pytest.raises(rh.InvalidValue, match=message):
        rh.harvest(model, texts, tmp_path, **kwargs)
    with pytest.raises(rh.InvalidValue, match=r"context=4 is for texts: pass tokenizer="):
        rh.harvest(model, [torch.ones(1, 3, dtype=torch.long)], tmp_path, context=4)


def test_a_harvest_refused_for_want_of_a_pad_token_resumes_once_one_is_set(model, tmp_path):
    tok, args = _tokenizer(pad=False), {"context": 4, "batch_size": 3, "progress": False}
    with pytest.raises(rh.InvalidValue, match=r"need padding"):
        rh.harvest(model, TEXTS, tmp_path, tokenizer=tok, **args)  # (batch 0 written, batch 1 needs a pad)
    tok.pad_token = "<pad>"
    h = rh.harvest(model, TEXTS, tmp_path, tokenizer=tok, **args)
    assert (h.skipped, h.tokens) == (1, 15)


def test_unpacked_rows_of_one_length_need_no_pad_token(model, tmp_path):
    h = rh.harvest(model, ["w4 w5", "w6 w7"], tmp_path, tokenizer=_tokenizer(pad=False), context=8, packing=False)
    assert h.tokens == 6


def test_a_resume_keeps_the_text_shards_and_another_tokenizer_is_refused_by_name(model, tmp_path):
    texts = [f"w{4 + i % 100} w{5 + i % 90} w{6 + i % 80}" for i in range(40)]
    args = {"tokenizer": _tokenizer(), "context": 8, "batch_size": 2, "progress": False}
    rh.harvest(model, texts, tmp_path / "whole", **args)
    rh.harvest(model, texts, tmp_path / "resumed", **args)
    for name in ("manifest.json", "shards/000003.json", "shards/000003.safetensors", "shards/000009.json"):
        (tmp_path / "resumed" / name).unlink()
    resumed = rh.harvest(model, texts, tmp_path / "resumed", **args)
    # (batch 9's shard, whole without its record, is adopted: batch 3 alone runs again)
    assert resumed.skipped == resumed.batches - 1 and _files(tmp_path / "whole") == _files(tmp_path / "resumed")
    other = _tokenizer(vocab=VOCAB | {"w4": 5, "w5": 4})
    with pytest.raises(rh.InvalidValue, match=r"differs from this call's in: tokenizer sha256"):
        rh.harvest(model, texts, tmp_path / "resumed", **args | {"tokenizer": other})
    with pytest.raises(rh.InvalidValue, match=r"differs from this call's in: text context"):
        rh.harvest(model, texts, tmp_path / "resumed", **args | {"context": 6})


class _Wide(nn.Module):
    """An input embedding that takes ids of a 250k vocabulary (it embeds id % 128 with the tiny model's rows)."""

    def __init__(self, inner: nn.Embedding, count: int) -> None:
        super().__init__()
        self.inner, self.num_embeddings = inner, count

    def forward(self, ids):
        return self.inner(ids % self.inner.num_embeddings)


def test_token_ids_near_a_250k_vocabulary_come_back_exact(tmp_path):
    model = build("mamba2")
    model.set_input_embeddings(_Wide(model.get_input_embeddings(), 250_000))
    ids = torch.tensor([[249_999, 249_998, 131_072, 65_537, 3], [200_000, 249_997, 32_768, 128, 127]])
    rh.harvest(model, [ids], tmp_path, progress=False)
    data = rh.HarvestDataset(tmp_path, layer=0)
    assert_equal("token ids", ids.flatten(), data.tokens)
    assert data[[0, 6]]["token"].tolist() == [249_999, 249_997] and data.tokens.dtype == torch.int64
    with pytest.raises(rh.InvalidValue, match=r"token ids in \[0, 250000\).*got 250000 at row 0, position 1"):
        rh.harvest(model, [torch.tensor([[3, 250_000]])], tmp_path / "x", progress=False)
