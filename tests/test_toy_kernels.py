"""The toy's build is the same on every x86-64 CPU: ``hpc-toy`` started under torch's baseline,
AVX2 and AVX-512 kernels (what a CPU without AVX2, one without AVX-512 and one with it run;
MKL's instruction set to match) builds the same toy: held-out greedy accuracy within 1 point
(the bound the demo needs) and, since the build runs under the pinned kernels whatever the
caller's, the same weights bytes. Training under the caller's own kernels would not be: a
50-step build already differs in its bytes between AVX2 and AVX-512 kernels.

Three full builds (about a CPU minute each, once per session) one after another: in parallel
they would share the two cores their two threads each use."""
import json
import os

import pytest
import torch

from conftest import require, run_cli
from hpc.toys import cache, pinned, toy

KERNELS = {"default": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512"}  # ATen -> MKL
ORDER = list(KERNELS)  # ascending: a CPU runs its own capability and every one below it
TIMEOUT_S = 3600  # a full build on a busy 2-core machine


def _env(capability: str, cache_root) -> dict:
    return {"ATEN_CPU_CAPABILITY": capability, "MKL_ENABLE_INSTRUCTIONS": KERNELS[capability],
            "HPC_CACHE": str(cache_root)}


def _require_supported(capability: str) -> None:
    here = torch.backends.cpu.get_cpu_capability().lower()
    require(here in ORDER and ORDER.index(capability) <= ORDER.index(here),
            f"a CPU with {capability} kernels (this one runs {here})")


def _capability_under(env: dict) -> str:
    proc = run_cli(["-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                   env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()[-1]


@pytest.fixture(scope="session")
def toy_builds(tmp_path_factory) -> dict:
    """``{capability: toy_info}`` of ``python -m hpc.toys.toy`` run under each capability
    this CPU supports, each with its own ``HPC_CACHE``."""
    here = torch.backends.cpu.get_cpu_capability().lower()
    infos = {}
    for capability in ORDER[: ORDER.index(here) + 1] if here in ORDER else []:
        env = _env(capability, tmp_path_factory.mktemp(f"toy-{capability}"))
        assert _capability_under(env) == capability.upper()  # the caller's kernels differ
        proc = run_cli(["-m", "hpc.toys.toy"], env=env, timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-3000:]
        folder = os.path.join(env["HPC_CACHE"], toy.VERSION)
        infos[capability] = dict(cache.check_built(folder, toy.VERSION, toy.STEPS, "REBUILD"),
                                 sha_now=cache.weights_sha256(folder))
    return infos


@pytest.mark.parametrize("capability", ORDER)
def test_the_toy_is_the_same_build_under_every_kernel(toy_builds, capability):
    _require_supported(capability)
    info, reference = toy_builds[capability], toy_builds["default"]
    print(f"{capability}: held-out greedy accuracy {info['heldout_accuracy']:.3f}, "
          f"probe {info['probe_accuracy']:.3f}, {info['build_seconds']} s, "
          f"weights {info['weights_sha256'][:12]}")
    assert info["kernels"] == pinned.pinned_description()
    assert abs(info["heldout_accuracy"] - reference["heldout_accuracy"]) <= 0.01
    assert info["weights_sha256"] == info["sha_now"] == reference["weights_sha256"]
    assert 0.3 <= info["heldout_accuracy"] <= 0.75  # room for SFT, ESSA and F-GRPO to gain


def test_the_callers_own_kernels_would_change_the_build(tmp_path):
    """Why the build is pinned: the same 50 seeded steps trained in the caller's process
    under AVX2 and AVX-512 kernels give different weights."""
    _require_supported("avx512")
    shas = set()
    for capability in ("avx2", "avx512"):
        out = tmp_path / capability
        proc = run_cli(["-c", f"from hpc.toys import toy; toy.train_toy({str(out)!r}, 50, "
                              f"log=lambda msg: None)"],
                       env=dict(_env(capability, tmp_path), OMP_WAIT_POLICY="PASSIVE"),
                       timeout=900)  # passive: its 2 threads sleep, not spin, on a busy machine
        assert proc.returncode == 0, proc.stderr[-2000:]
        info = json.loads((out / cache.INFO_FILE).read_text())
        assert info["kernels"] == "native"
        shas.add(info["weights_sha256"])
    assert len(shas) == 2
