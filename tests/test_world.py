"""MPI world, device binding, counted collectives and the torch.distributed bootstrap."""
import json

import pytest

from conftest import run_mpi
from hpc.runtime.world import split_evenly


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.mpi
def test_world_under_mpirun(tmp_path, n):
    out = tmp_path / "report.json"
    proc = run_mpi(n, ["tests/mpi/world_check.py", str(out)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == list(range(n))
    # one node: local ranks are a permutation of 0..n-1 (Open MPI may map them out of order)
    assert sorted(r["local_rank"] for r in reports) == list(range(n))
    for r in reports:
        assert r["size"] == n
        assert r["local_rank"] == int(r["env_local_rank"])
        assert r["device"] == "cpu"
        assert r["bcast_ok"]
        assert r["allgather"] == [[k, 10 * k] for k in range(n)]
        counts = split_evenly(7, n)
        assert r["allgatherv"] == [float(k) for k in range(n) for _ in range(counts[k])]
        mean = sum(range(1, n + 1)) / n
        assert r["allreduce"] == [mean] * 5
        assert r["backend"] == "gloo"
        b = r["bytes"]
        assert b["seeds"] == 10 * 8
        assert b["fit"] == n * 2 * 8
        assert b["fitv"] == 7 * 4
        assert b["grads"] == 5 * 4
        # rendezvous: each rank's report (1024 B, gathered), rank 0's decision (256 B) and each
        # rank's connection outcome (128 B, gathered); see hpc/runtime/rendezvous.py
        assert b["bootstrap"] == n * 1024 + 256 + n * 128


def test_split_evenly_uneven():
    assert split_evenly(7, 3) == [3, 2, 2]
    assert split_evenly(4, 4) == [1, 1, 1, 1]
    assert sum(split_evenly(97, 8)) == 97
