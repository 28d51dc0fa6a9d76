"""One request owns a harvest directory: a refused call writes nothing; a second harvest into a directory being
written is refused by name and deletes nothing, and a dead one's lock is taken over; damaged shards are found
(`Harvest.verify`, and a resume, which writes them anew); a shorter request never shrinks the harvest; every
write error names its path and every bad batch its index, with what was expected and what came."""

import errno
import json
import os
import pathlib
import signal
import time

import pytest
import torch
import transformers
from _models import build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.studies.harvest import lock as lock_impl


@pytest.fixture(scope="module")
def model():
    return build("qwen3_5")


def _batches(count=4):
    return [random_ids(2, 5, seed=seed) for seed in range(count)]


def _files(out):
    return {
        path.relative_to(out).as_posix(): path.read_bytes()
        for path in sorted(pathlib.Path(out).rglob("*"))
        if path.is_file()
    }


def _harvest(model, batches, out, **kwargs):
    return rh.harvest(model, batches, out, keep=("states",), progress=False, **kwargs)


@pytest.fixture(scope="module")
def whole(model, tmp_path_factory):
    """The files of an uninterrupted harvest of `_batches()`."""
    out = tmp_path_factory.mktemp("whole")
    _harvest(model, _batches(), out)
    return _files(out)


def test_a_refused_first_call_writes_nothing_and_the_corrected_call_runs(model, tmp_path, whole):
    wrong = rh.probe(torch.ones(4, 2, 5), torch.ones(4, 2, 8))  # (the key dim is 8: refused at the first batch)
    with pytest.raises(rh.InvalidValue, match=r"expected states \[batch, chunk, 4, 5, 8\]"):
        rh.harvest(model, _batches(), tmp_path, keep=("states",), reduce=wrong, progress=False)
    assert _files(tmp_path) == {}
    right = rh.probe(torch.ones(4, 2, 8), torch.ones(4, 2, 8))
    harvested = rh.harvest(model, _batches(), tmp_path, keep=("states",), reduce=right, progress=False)
    assert harvested.batches == 4 and harvested.values["0/states"] == ("float32", (4, 2))


def test_a_request_json_without_files_is_replaced(model, tmp_path, whole):
    """An earlier release wrote request.json before validating: a directory holding only that is taken over."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "request.json").write_text(json.dumps({"format": "recurrent_hooks harvest 1", "keep": ["key"]}))
    _harvest(model, _batches(), tmp_path)
    assert _files(tmp_path) == whole


def _hold_the_lock(out: pathlib.Path) -> int:
    """Another process (forked: no imports to pay) holding `out`'s rank-0 lock, with a temporary shard of its own,
    until killed; its pid."""
    ready, told = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            with lock_impl.DirectoryLock(out, 0):
                (out / "shards").mkdir(exist_ok=True)
                (out / "shards" / ".000000.safetensors.rank0.partial").write_bytes(b"being written")
                os.write(told, b"1")
                time.sleep(600)
        finally:
            os._exit(0)
    os.close(told)
    assert os.read(ready, 1) == b"1"
    os.close(ready)
    return pid


def test_a_second_harvest_is_refused_by_name_deletes_nothing_and_takes_over_a_dead_ones_lock(model, tmp_path, whole):
    holder = _hold_the_lock(tmp_path)
    try:
        before = _files(tmp_path)
        with pytest.raises(
            rh.Unavailable,
            match=rf"harvest: {tmp_path} is being written by another harvest \(process"
            rf" {holder} on .* holds .*\.lock\.rank0\): wait for it to finish",
        ):
            _harvest(model, _batches(), tmp_path)
        assert _files(tmp_path) == before  # (its temporary shard too)
        with pytest.raises(
            rh.Unavailable,
            match=rf"no manifest.json yet \(0 batches on disk\): a harvest is writing"
            rf" it now \(process {holder} on ",
        ):
            rh.HarvestDataset(tmp_path, layer=0)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    assert (tmp_path / ".lock.rank0").exists()  # (a killed harvest's lock file stays, unlocked)
    _harvest(model, _batches(), tmp_path)
    assert _files(tmp_path) == whole  # (the dead one's temporary shard removed, its lock file too)


def test_the_lock_is_exclusive_within_a_process_and_released_on_an_error(tmp_path):
    with lock_impl.DirectoryLock(tmp_path, 0):
        with pytest.raises(rh.Unavailable, match="is being written by another harvest"):
            with lock_impl.DirectoryLock(tmp_path, 0):
                pass
        with lock_impl.DirectoryLock(tmp_path, 1):  # (another rank's)
            assert len(lock_impl.holders(tmp_path)) == 2
    assert lock_impl.holders(tmp_path) == [] and not list(tmp_path.iterdir())
    with pytest.raises(KeyError):
        with lock_impl.DirectoryLock(tmp_path, 0):
            raise KeyError
    with lock_impl.DirectoryLock(tmp_path, 0):
        pass


def _damage(path: pathlib.Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[-40:-8] = bytes(b ^ 0xFF for b in data[-40:-8])
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "missing":
        path.unlink()
    else:  # its record unreadable
        path.with_suffix(".json").write_text("{")


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing", "record"])
def test_a_damaged_shard_is_named_by_verify_and_written_anew_by_a_resume(model, tmp_path, whole, how):
    _harvest(model, _batches(), tmp_path)
    assert rh.Harvest.open(tmp_path).verify().batches == 4
    shard = tmp_path / "shards" / "000002.safetensors"
    _damage(shard, how)
    if how != "record":  # (the manifest holds the records: a damaged record file is for the resume to find)
        why = {
            "flipped": "does not match its record's SHA-256",
            "truncated": r"has \d+ bytes where its record says",
            "missing": "is missing",
        }[how]
        with pytest.raises(
            rh.InvalidValue,
            match=rf"verify: 1 of 4 shards in .* are damaged: batch 2's shard"
            rf" {shard} {why}.*Call rh.harvest again with the same arguments",
        ):
            rh.Harvest.open(tmp_path).verify()
        with pytest.raises(rh.InvalidValue, match=rf"batch 2's shard {shard} {why}"):
            rh.HarvestDataset(tmp_path, layer=0, verify=True)
        if how == "truncated":  # (unverified: refused when first read, naming the file)
            with pytest.raises(
                rh.InvalidValue,
                match=rf"{shard} has \d+ bytes where its header says \d+ \(truncated"
                r" or extended\): not a whole shard",
            ):
                rh.HarvestDataset(tmp_path, layer=0).take(range(20))
    (tmp_path / "manifest.json").unlink()  # (a resume need not start from a finished harvest)
    with (
        pytest.warns(
            rh.RecurrentHooksWarning,
            match=r"batch 2's shard .*000002.safetensors .*: running batch 2"
            r" again",
        )
        if how != "record"
        else _no_warning()
    ):
        resumed = _harvest(model, _batches(), tmp_path)
    # (a shard whose record is unreadable is whole: adopted, as one whose record a kill prevented)
    assert (resumed.skipped, resumed.written > 0) == ((3, True) if how != "record" else (4, False))
    assert _files(tmp_path) == whole


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_truncated_shard_without_a_record_is_written_anew(model, tmp_path, whole):
    _harvest(model, _batches(), tmp_path)
    shard = tmp_path / "shards" / "000001.safetensors"
    shard.with_suffix(".json").unlink()
    _damage(shard, "truncated")
    (tmp_path / "manifest.json").unlink()
    assert _harvest(model, _batches(), tmp_path).skipped == 3
    assert _files(tmp_path) == whole


def test_a_shorter_request_is_refused_and_a_longer_one_extends(model, tmp_path, whole):
    _harvest(model, _batches(3), tmp_path)
    manifest = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(
        rh.InvalidValue,
        match=r"holds batches up to 2 \(shards 000002 to 000002 on disk\), but this"
        r" call passed 2: pass every batch of the harvest",
    ):
        _harvest(model, _batches(2), tmp_path)
    assert (tmp_path / "manifest.json").read_bytes() == manifest
    assert _harvest(model, _batches(4), tmp_path).batches == 4
    assert _files(tmp_path) == whole


@pytest.mark.parametrize("name", ["request.json", "manifest.json", "shards/000001.json"])
def test_a_write_error_names_its_path_and_loses_nothing(model, tmp_path, whole, monkeypatch, name):
    target = tmp_path / name
    replace = os.replace

    def full_disk(source, destination):
        if pathlib.Path(destination) == target:
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(source, destination)

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left on device") as error:
        _harvest(model, _batches(), tmp_path)
    assert any(
        f"writing {target} (through .{target.name}.rank0.partial) failed" in note for note in error.value.__notes__
    ), error.value.__notes__
    monkeypatch.setattr(os, "replace", replace)
    _harvest(model, _batches(), tmp_path)
    assert _files(tmp_path) == whole


def test_bad_batches_are_named_with_what_was_expected_and_what_came(model, tmp_path):
    ids = random_ids(2, 5)

    def refused(batches, match):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        with pytest.raises(rh.InvalidValue, match=match):
            _harvest(model, batches, out)
        bad = int(match.partition("batch ")[2][:1]) if match.startswith("batch ") else 0
        assert (
            sorted(_files(out))
            == [
                name
                for index in range(bad)
                for name in ("request.json", f"shards/{index:06d}.json", f"shards/{index:06d}.safetensors")
            ][: 3 * bad]
        )

    refused(
        [ids, torch.zeros(2, 0, dtype=torch.long)],
        r"batch 1: expected at least one token, got input ids of"
        r" shape \(2, 0\)",
    )
    big = ids.clone()
    big[1, 3] = 128
    refused(
        [ids, big],
        r"batch 1: expected token ids in \[0, 128\) \(the model's vocabulary\), got 128 at row 1,"
        r" position 3",
    )
    negative = ids.clone()
    negative[0, 1] = -1
    refused([negative], r"batch 0: expected token ids in \[0, 128\) .*, got -1 at row 0, position 1")
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 2] = 2
    refused(
        [{"input_ids": ids, "attention_mask": mask}],
        r"batch 0: expected attention_mask of 0s \(pads\) and 1s,"
        r" got 2 at row 0, position 2",
    )
    encoding = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    refused(
        encoding,
        r"expected batches= an iterable of batches, got one batch \(a BatchEncoding with keys"
        r" \['attention_mask', 'input_ids'\]\): wrap it in a list, \[batch\]",
    )
    refused(ids, r"expected batches= an iterable of batches, got one tensor of shape \(2, 5\): pass \[ids\]")
    refused(5, r"expected batches= an iterable of batches .*, got int")


def test_one_dimensional_ids_take_a_one_dimensional_mask(model, tmp_path):
    ids = random_ids(1, 6)[0]
    mask = torch.tensor([1, 1, 1, 1, 0, 0])
    harvested = rh.harvest(
        model, [{"input_ids": ids, "attention_mask": mask}], tmp_path, keep=("states",), progress=False
    )
    assert (harvested.tokens, harvested.docs) == (4, 1)
