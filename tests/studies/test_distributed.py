"""Tensor parallelism: scripts/tp_watch.py under torchrun, two CPU processes over gloo.

The script loads a tiny qwen3_5 with transformers' `tp_plan="auto"` on each rank and checks, inside a
watch, that states, windows, a write, a hook and greedy generate equal a single-process run; it exits
non-zero on a mismatch. The processes talk over 127.0.0.1 only, on a port that was free a moment ago.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tp_watch.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.full  # (7 s, two processes: .ci/run runs it after the default suite)
def test_tensor_parallel_watch_equals_one_process(tmp_path):
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # the CPU path (gloo), whatever the machine has
        "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo",  # loopback only
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(SCRIPT),
        "--dir",
        str(tmp_path),
    ]
    result = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # 10-15 s on 2 cores
        cwd=tmp_path,
    )
    assert result.returncode == 0, (
        f"torchrun exited with {result.returncode}:\n{result.stdout}\n{result.stderr[-6000:]}"
    )
    for rank in (0, 1):
        assert f"rank {rank}/2 (cpu, gloo)" in result.stdout, f"rank {rank} did not report:\n{result.stdout}"
    assert result.stdout.count("equal the single-process run") == 2, result.stdout


def test_a_sweep_and_a_harvest_split_across_two_processes_equal_one_process_and_resume(tmp_path):
    """scripts/harvest_ranks.py --sweep, one start of two gloo processes for both: the batches of a harvest split
    across the ranks give the files one process writes, byte for byte, and a harvest stopped on both ranks resumes
    from the shards each wrote, and a harvest of texts through a tokenizer split across the ranks gives one process's
    files too; then scripts/sweep_ranks.py's checks: the cells split across the ranks, every rank
    gets the single-process result, and a sweep stopped after its first round resumes from the ranks' checkpoint
    files; from the corrupt run's cache, each rank runs fewer forwards than one process (the pieces and cells of its
    own positions only), also when it resumes."""
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(ROOT / "scripts" / "harvest_ranks.py"),
        "--dir",
        str(tmp_path),
        "--sweep",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, (
        f"torchrun exited with {result.returncode}:\n{result.stdout}\n{result.stderr[-6000:]}"
    )
    done = "the split harvest and the resumed one equal the single-process run, from ids and from texts"
    assert result.stdout.count(done) == 2, result.stdout
    assert result.stdout.count("the split sweeps and the resumed one equal the single-process run") == 2, result.stdout
    counts = re.findall(r"rank (\d)/2: from the cache, (\d+) forwards split, (\d+) in one process", result.stdout)
    assert sorted(rank for rank, _, _ in counts) == ["0", "1"], result.stdout
    for rank, split, alone in counts:
        assert int(split) < int(alone), f"rank {rank}: {split} forwards from the cache, one process {alone}"
