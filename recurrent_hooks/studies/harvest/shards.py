"""The files of a harvest: safetensors shards, written atomically, read back mem-mapped.

A shard is a safetensors file: an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape
and byte range; `__metadata__`, a mapping of strings), then the tensors' bytes. Why safetensors and not Arrow:
transformers depends on safetensors already (no new dependency, where Arrow would add pyarrow and, for an HF
datasets directory, datasets), each value is a fixed-shape tensor with its exact dtype (bfloat16 included), and the
file maps into memory as it is, so a tensor is a view of the mapped bytes (no parse per item; a reader gathers
its rows out of it).

Module contents:
- `write_shard(path, tensors, metadata)`: the tensors in one file, via a temporary file renamed into place (a
  reader sees the whole shard or none), flushed to the disk before the rename; returns its size and SHA-256. The
  bytes depend on the tensors and metadata only (the header's keys sorted, the tensors in a fixed order), so the
  same batch gives the same file: a resumed harvest's files are an uninterrupted one's.
- `write_json(path, value)`: a JSON file, atomically in the same way.
- `MappedShard(path)`: a shard mapped into memory; `shard[name]` is a view of that tensor's bytes.
- `read_header(path)`: a shard's tensors, `{name: (dtype, shape)}`, and its `__metadata__` (the header only).
- `file_digest(path)`: the SHA-256 of a file's bytes.
- `shard_problem(path)`: what makes a file not a whole shard (an unreadable header, bytes missing), or None.
- `partial_name(path, rank)`: the temporary file a rank writes `path` through.
- `read_manifest(out)`: a finished harvest's manifest (`FORMAT`); `record_problem(shard, record)`: what is wrong with
  a shard its record describes; `check_shards(out)`: every shard of a finished harvest against its manifest.
"""

import hashlib
import itertools
import json
import os
import pathlib
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ...engine.errors import InvalidValue, Unavailable, add_note
from .lock import holders

__all__ = [
    "write_shard",
    "write_json",
    "MappedShard",
    "read_header",
    "file_digest",
    "partial_name",
    "shard_problem",
    "read_manifest",
    "record_problem",
    "check_shards",
    "FORMAT",
]

# safetensors' dtype names
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
PARTIAL = ".partial"  # the suffix of a file being written
FORMAT = "recurrent_hooks harvest 1"  # a manifest's request["format"]


def partial_name(path: pathlib.Path, rank: int = 0) -> pathlib.Path:
    """The temporary file `path` is written through by rank `rank` (each rank its own: ranks never share one)."""
    return path.with_name(f".{path.name}.rank{rank}{PARTIAL}")


def write_shard(
    path: pathlib.Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str], rank: int = 0
) -> tuple[int, str]:
    """`tensors` (on the CPU) and `metadata` in the shard `path`, all or nothing: on an error (a full disk) the
    temporary file is removed and `path` is untouched. Returns the file's size and SHA-256."""
    # the tensors by element size, largest first, so that each starts at a multiple of its element size
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        size = tensors[name].numel() * tensors[name].element_size()
        header[name] = {
            "dtype": _NAMES[tensors[name].dtype],
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # (the tensors' bytes start 8-aligned)
    chunks = itertools.chain((struct.pack("<Q", len(encoded)), encoded), (_bytes_of(tensors[name]) for name in order))
    return _write_atomically(path, chunks, rank)


def _write_atomically(path: pathlib.Path, chunks: Iterable[bytes | memoryview], rank: int) -> tuple[int, str]:
    """`chunks` in `path` through this rank's temporary file, flushed to the disk, then renamed (all or nothing: on
    an error the temporary file is removed and `path` is untouched); returns the size and SHA-256 written."""
    partial = partial_name(path, rank)
    digest, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as file:
            for chunk in chunks:  # (a generator: each tensor's bytes are made when written)
                file.write(chunk)
                digest.update(chunk)
                size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException as error:
        partial.unlink(missing_ok=True)
        if isinstance(error, OSError):
            add_note(error, f"writing {path} (through {partial.name}) failed: {path} is as it was")
        raise
    return size, digest.hexdigest()


def _bytes_of(tensor: Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_json(path: pathlib.Path, value: Any, rank: int = 0) -> None:
    """`value` as JSON in `path`, all or nothing (as `write_shard`); keys sorted, so equal values give equal files."""
    _write_atomically(path, [(json.dumps(value, indent=1, sort_keys=True) + "\n").encode()], rank)


def _header(path: pathlib.Path) -> tuple[dict[str, Any], int]:
    """A shard's JSON header and where its tensors' bytes start."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return json.loads(file.read(length)), 8 + length


def read_header(path: pathlib.Path) -> tuple[dict[str, tuple[torch.dtype, list[int]]], dict[str, str]]:
    header, _ = _header(path)
    metadata = header.pop("__metadata__", None) or {}
    return {name: (_DTYPES[entry["dtype"]], entry["shape"]) for name, entry in header.items()}, metadata


def file_digest(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class MappedShard:
    """A shard mapped into memory, privately: nothing is ever written back to the file.

        shard = MappedShard(path)
        shard["doc"]                 # int64 [tokens], a view of the mapped bytes
        shard["doc"].index_select(0, rows)   # a copy of some rows (HarvestDataset hands out only copies)

    A view is for reading in this process only. Written to, it changes this process's copy of the page (and every
    later read of it here), not the file; sent to another process (a `DataLoader` worker's queue), it fails, as
    torch cannot share the storage of a file mapping. Copy what leaves the reader.
    """

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        problem = shard_problem(path)
        if problem is not None:
            raise InvalidValue(
                f"{path} {problem}: not a whole shard (Harvest.verify() checks every shard;"
                " rh.harvest called again with the same arguments writes a damaged one anew)"
            )
        header, self.start = _header(path)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header
        size = path.stat().st_size
        self._bytes = (
            torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        self._tensors: dict[str, Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._tensors:
            entry = self.header[name]
            begin, end = entry["data_offsets"]
            dtype = _DTYPES[entry["dtype"]]
            raw = self._bytes[self.start + begin : self.start + end]
            if (self.start + begin) % dtype.itemsize:  # (safetensors aligns its tensors; one that does not: copied)
                raw = raw.clone()
            self._tensors[name] = raw.view(dtype).view(entry["shape"])
        return self._tensors[name]


def shard_problem(path: pathlib.Path) -> str | None:
    """What makes `path` not a whole shard (its header unreadable, its size not the header's), or None (its bytes
    are not read: `file_digest` against a record says whether they changed)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
        if length > size - 8:
            return f"has {size} bytes, fewer than its header's length says ({length} after the first 8)"
        header, start = _header(path)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as error:
        return f"has no readable safetensors header ({type(error).__name__}: {error})"
    if start + max(ends, default=0) != size:
        return f"has {size} bytes where its header says {start + max(ends, default=0)} (truncated or extended)"
    return None


def read_manifest(out: pathlib.Path) -> dict[str, Any]:
    path = out / "manifest.json"
    if not path.is_file():
        shards = len(list((out / "shards").glob("*.json"))) if (out / "shards").is_dir() else 0
        running = holders(out)
        if running:
            who = running[0]
            raise Unavailable(
                f"{out}: no manifest.json yet ({shards} batches on disk): a harvest is writing it now"
                f" (process {who.get('pid', '?')} on {who.get('host', '?')}, since"
                f" {who.get('since', '?')}); its manifest is written when every batch is on disk"
            )
        raise Unavailable(
            f"{out}: no manifest.json, so no complete harvest ({shards} batches on disk): an interrupted"
            " rh.harvest finishes when called again with the same arguments"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise InvalidValue(
            f"{path}: expected a harvest's manifest (JSON), got a file that does not parse ({error})"
        ) from None
    if manifest.get("request", {}).get("format") != FORMAT:
        raise InvalidValue(
            f"{path}: expected a {FORMAT!r} manifest, got format {manifest.get('request', {}).get('format')!r}"
        )
    return manifest


def record_problem(shard: pathlib.Path, record: Mapping[str, Any]) -> str | None:
    """What is wrong with a shard its record describes (missing, another size, other bytes), or None."""
    if not shard.is_file():
        return "is missing"
    size = shard.stat().st_size
    if size != record["bytes"]:
        return f"has {size} bytes where its record says {record['bytes']}"
    if file_digest(shard) != record["sha256"]:
        return "does not match its record's SHA-256 (its bytes changed on disk)"
    return None


def check_shards(out: pathlib.Path) -> None:
    """Every shard of the finished harvest in `out` checked against its manifest (`Harvest.verify`)."""
    manifest = read_manifest(out)
    bad = []
    for record in manifest["shards"]:
        shard = out / record["file"]
        problem = record_problem(shard, record)
        if problem is not None:
            bad.append(f"batch {record['batch']}'s shard {shard} {problem}")
    stats = manifest.get("stats")
    if stats and record_problem(out / stats["file"], stats) is not None:  # (the shards' statistics, merged)
        bad.append(f"the statistics {out / stats['file']} {record_problem(out / stats['file'], stats)}")
    if bad:
        raise InvalidValue(
            f"verify: {len(bad)} of {len(manifest['shards'])} shards in {out} are damaged: "
            + "; ".join(bad)
            + ". Call rh.harvest again with the same arguments to write them anew"
        )
