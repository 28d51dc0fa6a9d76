"""Index, offset and byte arithmetic at the sizes real checkpoints and real harvests reach, pinned without
allocating those sizes.

`rh.harvest` crashed on every real checkpoint. Its weights digest picked the sampled indices with
`torch.linspace`, which works in float32, so above 2^24 elements the last index could round past the end: for
mamba2-130m's embedding, 50,288 x 768 = 38,621,184 values, it asked for index 38,621,184. This file pins:

- `harvest.sample_indices(count, samples)`: int64 indices, exact from 1 value to 2^40. The first is 0, the last
  is count - 1, and they are strictly increasing and evenly spaced. Also `weights_digest` on parameters past 2^24
  elements: 2^24 + 4, where float32 rounds the last index up to `count` (the old digest raised IndexError), and the
  embedding above. The digest reads the last value.
- shard offsets past 4 GiB, at the sizes of one batch of a real harvest (a 2 MiB state x 2,048 tokens = 4 GiB a
  layer, 48 layers). `write_shard`'s header is checked with meta tensors, so no data is written. A shard whose second
  layer starts past 4 GiB is read back through `MappedShard` and `HarvestDataset` from a sparse file, which maps
  only the pages it reads.
- `memory.held_bytes` (the path model's memory budget) at that state size. These are exact Python numbers,
  so the chunk-wise states path of 2,048 tokens bound for another device counts 2^32 + 16 states' bytes, which
  does not wrap past 4 GiB.
- `Ranks.mine`: the ranks' shares of 2^31 + 3 sweep cells (the cells are a strided view, so nothing is
  allocated) cover every cell once.
"""

import json
import os
import struct

import pytest
import torch
from torch import nn

import recurrent_hooks.engine.paths.budget as rh_memory
import recurrent_hooks.engine.paths.costs as rh_costs
import recurrent_hooks.engine.policy as rh_policy
from recurrent_hooks.studies.harvest import sample_indices, shards, weights_digest
from recurrent_hooks.studies.harvest.dataset import HarvestDataset
from recurrent_hooks.studies.harvest.shards import FORMAT
from recurrent_hooks.studies.ranks import Ranks

SAMPLED = 1024  # the weights digest's values per tensor
STATE = 2**19  # float32 elements of a 2 MiB state
TOKENS = 2048
LAYERS = 48


# -- the weights digest's sampled indices ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "count", [1, 2, 1023, 1024, 1025, 2**24 + 1, 2**24 + 4, 50_288 * 768, 151_936 * 2_048, 2**31 + 3, 2**40]
)
def test_sample_indices_are_exact(count):
    indices = sample_indices(count, SAMPLED)
    n = min(count, SAMPLED)
    assert indices.dtype == torch.int64 and indices.shape == (n,)
    assert int(indices[0]) == 0 and int(indices[-1]) == count - 1
    assert int(indices.min()) >= 0 and int(indices.max()) < count
    if n > 1:
        steps = indices.diff()
        assert bool((steps > 0).all())  # strictly increasing: no value read twice
        assert int(steps.max()) - int(steps.min()) <= 1  # evenly spaced: floor(i (count - 1) / (n - 1))
    if count <= SAMPLED:
        assert torch.equal(indices, torch.arange(count))  # a small tensor: every value


def test_sample_indices_of_nothing():
    assert sample_indices(0, SAMPLED).shape == (0,)


class _Weights(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        # a buffer that is a broadcast view (stride 0) of one value, as an expanded tensor is
        self.register_buffer("expanded", torch.ones(1, dtype=weight.dtype).expand(weight.numel()))


@pytest.mark.parametrize(
    "shape, dtype",
    [((2**24 + 4,), torch.float32), ((50_288, 768), torch.bfloat16)],
    ids=["2^24+4 float32", "mamba2-130m embedding bf16"],
)
def test_weights_digest_reads_the_last_value_past_2_24(shape, dtype):
    # 64 MiB / 74 MiB; float32 indices over 2^24 + 4 values end at index 2^24 + 4, one past the last
    model = _Weights(torch.zeros(shape, dtype=dtype))
    first = weights_digest(model)
    assert first == weights_digest(model) and len(first) == 64
    with torch.no_grad():
        model.weight.view(-1)[-1] = 1.0  # the last value is sampled: the digest changes
    assert weights_digest(model) != first


def test_weights_digest_reads_views_and_scalars_as_they_are():
    """A transposed weight (a tied or transposed view) is sampled in its logical order without a copy of it, and a
    0-d buffer is one value: each digest changes with the value it samples last."""
    model = _Weights(torch.arange(12.0).reshape(3, 4).t())
    model.register_buffer("scale", torch.tensor(2.0))
    first = weights_digest(model)
    with torch.no_grad():
        model.weight[-1, -1] = -1.0  # (logically last: the transposed view's, not the storage's)
    second = weights_digest(model)
    model.scale.fill_(3.0)
    assert len({first, second, weights_digest(model)}) == 3


# -- shard offsets past 4 GiB ---------------------------------------------------------------------------------


def _write_header_only(path, tensors, monkeypatch):
    """`write_shard(path, tensors)` with no tensor's bytes (meta tensors have none): the file holds the header
    alone. Returns the header and where the tensors' bytes start."""
    monkeypatch.setattr(shards, "_bytes_of", lambda tensor: memoryview(b""))
    shards.write_shard(path, tensors, {"tokens": str(TOKENS)})
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return json.loads(file.read(length)), 8 + length


def _harvest_batch(layers):
    """One batch of one row as a harvest writes it, as meta tensors: `doc`, `position` (int64) and each layer's
    2 MiB float32 states per token."""
    tensors = {
        "doc": torch.empty(TOKENS, dtype=torch.long, device="meta"),
        "position": torch.empty(TOKENS, dtype=torch.long, device="meta"),
    }
    for layer in range(layers):
        tensors[f"{layer}/states"] = torch.empty(TOKENS, STATE, device="meta")
    return tensors


def test_shard_header_offsets_past_4_gib(tmp_path, monkeypatch):
    """The header of one batch of 48 layers of 2 MiB states x 2,048 tokens: each tensor's bytes where its size
    says, one after another, up to 48 x 4 GiB and 32 KiB."""
    tensors = _harvest_batch(LAYERS)
    header, _ = _write_header_only(tmp_path / "000000.safetensors", tensors, monkeypatch)
    ranges = sorted((entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    assert sorted(name for _, name in ranges) == sorted(tensors)
    end = 0
    for (begin, stop), name in ranges:
        assert begin == end and stop - begin == tensors[name].numel() * tensors[name].element_size()
        assert header[name]["shape"] == list(tensors[name].shape)
        end = stop
    assert end == 16 * TOKENS + LAYERS * 2**32  # 192 GiB and 32 KiB
    assert header["47/states"]["dtype"] == "F32" and header["doc"]["dtype"] == "I64"
    dtypes, metadata = shards.read_header(tmp_path / "000000.safetensors")
    assert dtypes["47/states"] == (torch.float32, [TOKENS, STATE]) and metadata == {"tokens": str(TOKENS)}


def test_harvest_dataset_reads_a_layer_past_4_gib(tmp_path, monkeypatch):
    """A shard of two layers of 2 MiB states x 2,048 tokens (8 GiB, sparse): layer 1 starts past 4 GiB, and its
    rows read back through `MappedShard` and `HarvestDataset` are the ones written there."""
    (tmp_path / "shards").mkdir()
    path = tmp_path / "shards" / "000000.safetensors"
    header, start = _write_header_only(path, _harvest_batch(2), monkeypatch)
    end = start + header["1/states"]["data_offsets"][1]
    assert header["1/states"]["data_offsets"][0] > 2**32
    rows = {}
    try:
        with open(path, "r+b") as file:
            try:
                file.truncate(end)  # a hole: no disk blocks, and no memory once mapped
            except OSError as error:  # (a file system with a 4 GiB file limit)
                pytest.skip(f"this file system holds no file of 8 GiB: {error}")
            for name, values in [("doc", torch.zeros(TOKENS, dtype=torch.long)), ("position", torch.arange(TOKENS))]:
                file.seek(start + header[name]["data_offsets"][0])
                file.write(values.numpy().tobytes())
            for name, token in [("0/states", TOKENS - 1), ("1/states", 0), ("1/states", TOKENS - 1)]:
                row = torch.arange(STATE, dtype=torch.float32) + 1000 * token + int(name[0])
                file.seek(start + header[name]["data_offsets"][0] + token * STATE * 4)
                file.write(row.numpy().tobytes())
                rows[name, token] = row
        if os.stat(path).st_blocks * 512 > 256 * 2**20:
            pytest.skip("this file system allocates the holes of sparse files: the shard would take 8 GiB of disk")
        (tmp_path / "manifest.json").write_text(
            json.dumps(
                {
                    "request": {"format": FORMAT},
                    "batches": 1,
                    "tokens": TOKENS,
                    "docs": 1,
                    "mixers": {
                        str(layer): {"layer": layer, "path": f"layers.{layer}", "kind": "K"} for layer in range(2)
                    },
                    "values": {f"{layer}/states": {"dtype": "float32", "shape": [STATE]} for layer in range(2)},
                    "shards": [{"batch": 0, "file": "shards/000000.safetensors", "docs": [0, 1], "tokens": TOKENS}],
                }
            )
        )

        mapped = shards.MappedShard(path)
        assert mapped["1/states"].shape == (TOKENS, STATE)
        assert torch.equal(mapped["1/states"][TOKENS - 1], rows["1/states", TOKENS - 1])
        assert torch.equal(mapped["0/states"][TOKENS - 1], rows["0/states", TOKENS - 1])

        data = HarvestDataset(tmp_path, layer=1)
        assert len(data) == TOKENS
        item = data[TOKENS - 1]
        assert (item["doc"], item["position"]) == (0, TOKENS - 1)
        assert torch.equal(item["value"], rows["1/states", TOKENS - 1])
        taken = data.take([TOKENS - 1, 0, -1])
        assert torch.equal(
            taken, torch.stack([rows["1/states", TOKENS - 1], rows["1/states", 0], rows["1/states", TOKENS - 1]])
        )
        batch = data.__getitems__([TOKENS - 1, 0])  # (what a DataLoader asks for)
        assert [(item["doc"], item["position"]) for item in batch] == [(0, TOKENS - 1), (0, 0)]
        assert torch.equal(batch[0]["value"], rows["1/states", TOKENS - 1])
        assert torch.equal(HarvestDataset(tmp_path, layer=0)[-1]["value"], rows["0/states", TOKENS - 1])
    finally:
        path.unlink(missing_ok=True)  # (pytest keeps the last runs' directories)


# -- the path model's bytes at a real state -------------------------------------------------------------------


def test_held_bytes_at_a_real_state_size():
    """A gated DeltaNet call of 32 heads of 128 x 128 (a 2 MiB float32 state) on 2,048 tokens: the chunk-wise states
    bound for another device hold 2,048 + 16 states, 4 GiB and 32 MiB, exactly (`held_bytes`' docstring)."""
    shape = rh_costs.Shape("delta rule", 1, 32, 128, 128, 64, graph=2.0, loop_graph=1.0)
    state = 2**21
    held = rh_memory.held_bytes(shape, TOKENS, [], grad=False, elsewhere=True, reducing=True)
    assert held[rh_policy.Strategy.STATES] == (TOKENS + rh_costs.STATES_CHUNK) * state == 2**32 + 2**25
    assert held[rh_policy.Strategy.CHUNKS] == 2 * rh_costs.STATES_CHUNK * state
    with_grad = rh_memory.held_bytes(shape, TOKENS, [], grad=True, kept=TOKENS)[rh_policy.Strategy.LOOP]
    assert with_grad == int(with_grad) > 2**32  # a copy of every kept state: past 4 GiB, exact
    assert (
        rh_memory.held_bytes(shape, TOKENS, [], grad=False)[rh_policy.Strategy.STATES]
        < 2**32
        <= held[rh_policy.Strategy.STATES]
    )


# -- a sweep's cells across ranks -----------------------------------------------------------------------------


def test_rank_shares_of_more_than_2_31_cells():
    cells = 2**31 + 3
    todo = torch.zeros((), dtype=torch.long).expand(cells)  # (a view: nothing allocated)
    shares = [len(Ranks(rank, 8).mine(todo)) for rank in range(8)]
    assert sum(shares) == cells and max(shares) - min(shares) <= 1
