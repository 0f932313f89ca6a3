"""The distributed parts of ``gpu_acceptance.py`` (NCCL on CUDA, gloo on CPU), and the ranks
the all-reduce part starts.

* :func:`nccl_all_reduce`: F-GRPO's gradient all-reduce as the trainer runs it
  (:meth:`hpc.models.parallelize.TrainedWeights.reduce_gradients`, i.e.
  :func:`hpc.runtime.dist.all_reduce_mean_`) on the gradients of a rank-8 q/k/v/o LoRA of the
  random shape: in a one-rank group in this process, then on two ranks sharing the device,
  started by mpirun (the package's bootstrap, :func:`hpc.runtime.dist.init_process_group`) or,
  without mpirun, by torchrun. Both ranks take ``cuda:0`` on purpose (a job's
  :func:`hpc.runtime.world.select_device` refuses more ranks than GPUs): whether NCCL allows
  it is the finding, and a refusal by NCCL (or ranks that hang in it until the launch's
  deadline) is recorded, not failed.
* :func:`fsdp2_step`: one training step of a LoRA model sharded by
  :func:`hpc.models.parallelize.shard_model` in a one-rank group: with fp32 compute its
  updated weights equal an unsharded step's; with bf16 compute (a job's on GPUs) the step is
  finite and moves the weights.

The ranks (never run alone):

    mpirun -n 2 python benchmarks/acceptance_ranks.py OUT.json --device cuda \\
        --launcher mpirun --lora-shape 1536 28 12 2
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from common import TARGETS, launch_mpi, launch_torchrun, mpirun_path
from communication import lora_grad_shapes

from hpc.runtime.world import World  # common.py: repo on sys.path

RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK")  # mpirun's, torchrun's
RANKS_TIMEOUT_S = 180.0  # the most the two-rank launch may take (a hung NCCL set-up is killed)
EXACT = 1e-6  # |all-reduced - expected mean| of fp32 gradients of unit scale
FSDP2_EXACT = 5e-5  # relative difference of one-rank FSDP2 and unsharded weights after a step
#   (tests/test_fsdp2.py holds sharded and DDP steps to the same bound)


def _lora_dims(s) -> list:
    """(hidden, layers, heads, kv heads) of the setup's random shape."""
    from gpu_check import SHAPES

    shape = SHAPES[s.shape]
    return [shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads")]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_rank(s) -> dict:
    """The all-reduce in a one-rank group in this process. all_reduce_mean_ returns at once on
    one rank, so the group's all_reduce it runs on more ranks is called here directly."""
    from memory_tracker import one_real_rank

    shapes = lora_grad_shapes(*_lora_dims(s))
    gen = torch.Generator().manual_seed(0)
    flat = torch.cat([torch.randn(shape, generator=gen).reshape(-1) for shape in shapes])
    flat = flat.to(s.device)
    expected = flat.clone()
    if s.device.type == "cuda":
        torch.cuda.set_device(s.device)
    with one_real_rank(s.device.type):
        backend = dist.get_backend()
        dist.all_reduce(flat)  # the communicator is made on the first call
        flat.copy_(expected)
        _sync(s.device)
        start = time.perf_counter()
        dist.all_reduce(flat)
        _sync(s.device)
        seconds = time.perf_counter() - start
    return {"backend": backend, "bytes": flat.numel() * flat.element_size(),
            "seconds": seconds, "exact": torch.equal(flat, expected)}


def _launcher() -> tuple:
    """(name, launch function) of the rank launcher here: mpirun, else torchrun, else None."""
    if mpirun_path():
        return "mpirun", launch_mpi
    if importlib.util.find_spec("torch.distributed.run") is not None:
        return "torchrun", launch_torchrun
    return None, None


def _two_ranks(s, budget) -> dict:
    """Two ranks on the one device (module docstring): their ``outcome``, ``passed``,
    ``refused`` (an error naming NCCL, CUDA only), ``hung`` (no end within the launch's
    deadline, CUDA only: NCCL neither refused nor finished; rank 0's ``stage`` says where) or
    ``failed``, what rank 0 wrote (``rank0``), the error it met and what the launcher said
    (``rank0_error``, ``launcher_error``: not under an ``error`` key, which would fail the
    part whatever the outcome)."""
    name, launch = _launcher()
    if launch is None:
        return {"skipped": "no rank launcher: neither mpirun nor torch's torchrun"}
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="acceptance-ranks-") as folder:
        path = os.path.join(folder, "rank0.json")
        argv = [os.path.abspath(__file__), path, "--device", s.device.type, "--launcher",
                name, "--lora-shape", *_lora_dims(s)]
        try:
            launch(2, argv, timeout=max(10.0, min(RANKS_TIMEOUT_S, budget.left())))
            error = ""
        except TimeoutError as err:
            error, timed_out = str(err), True
        except RuntimeError as err:
            error = str(err)
        report = {}
        if os.path.exists(path):
            with open(path) as fh:
                report = json.load(fh)
    rank_error = report.pop("error", "")
    out = {"launcher": name, "rank0": report, "rank0_error": rank_error,
           "launcher_error": error[-3000:]}
    passed = (not rank_error and not error and report.get("max_abs_error", 1.0) <= EXACT
              and report.get("bytes_counted") == report.get("bytes_expected"))
    if passed:
        out["outcome"] = "passed"
    elif s.device.type == "cuda" and "nccl" in (rank_error or error).lower():
        out["outcome"] = "refused"
    elif s.device.type == "cuda" and timed_out:
        out["outcome"] = "hung"
    else:
        out["outcome"] = "failed"
    return out


def _first_words(two: dict) -> str:
    """What went wrong on two ranks, short: where rank 0 hung; a rank's error (NCCL's own
    words, its ``Last error:`` line, where torch quotes them); else the launcher's last
    words."""
    if two.get("outcome") == "hung":
        return (f"no end within the launch's deadline (killed), rank 0 at its "
                f"'{two['rank0'].get('stage', 'start-up')}' stage")
    if two.get("rank0_error"):
        lines = [line.strip() for line in two["rank0_error"].splitlines() if line.strip()]
        last = next((i for i, line in enumerate(lines) if line.startswith("Last error")), None)
        if last is not None and last + 1 < len(lines):
            return f"{lines[0][:100]} ... {lines[last + 1][:160]}"
        return lines[0][:160]
    lines = [line for line in two.get("launcher_error", "").splitlines() if line.strip("=- ")]
    return lines[-1][:160] if lines else "wrong mean or byte count"


def nccl_all_reduce(s, budget) -> dict:
    """The gradient all-reduce (module docstring): exact on one rank; on two ranks the mean,
    with its bytes counted, unless NCCL refuses (or hangs with) two ranks on one GPU
    (recorded)."""
    from acceptance_parts import finish, ran

    out = {}
    budget.run(out, "one_rank", lambda: _one_rank(s))
    budget.run(out, "two_ranks", lambda: _two_ranks(s, budget))
    one, two = out["one_rank"], out["two_ranks"]
    failures = []
    if ran(one) and not one["exact"]:
        failures.append("one rank: the all-reduce changed the gradients")
    if two.get("outcome") == "failed":
        failures.append(f"two ranks: {_first_words(two)}")
    figures = [f"one rank ({one['backend']}): {one['bytes'] / 1e6:.2f} MB in "
               f"{one['seconds'] * 1e3:.2f} ms" if ran(one) else "one rank: not run"]
    if "outcome" not in two:
        figures.append(f"two ranks: not run ({two.get('skipped') or two.get('error')})")
    elif two["outcome"] == "passed":
        r = two["rank0"]
        figures.append(f"two ranks ({two['launcher']}, {r['backend']}): passed, "
                       f"{r['bytes_counted'] / 1e6:.2f} MB in {r['seconds'] * 1e3:.2f} ms")
    else:
        figures.append(f"two ranks ({two['launcher']}): {two['outcome']}: {_first_words(two)}")
    return finish(out, ("one_rank", "two_ranks"), failures, "; ".join(figures))


# --- FSDP2

def _lora_tiny(device: torch.device):
    """A tiny random Qwen2 with a random rank-4 LoRA on q/k/v/o, fp32, on ``device``."""
    from hpc.models.loading import attach_lora, randomize_lora_b
    from hpc.toys.toy import tiny_model

    model, _ = tiny_model(seed=0)
    model = attach_lora(model.to(device), 4, 8.0, TARGETS, seed=0)
    randomize_lora_b(model, 0.1, torch.Generator().manual_seed(0))
    return model


def _train_step(model, ids: torch.Tensor) -> tuple:
    """(loss, trained tensors before, after) of one AdamW step as F-GRPO takes it
    (:class:`hpc.models.parallelize.TrainedWeights`), on the mean log-partition of ``ids``."""
    from hpc.models.parallelize import TrainedWeights, _full

    weights = TrainedWeights([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                             weight_decay=0.0)
    before = [_full(m).detach().clone() for m in weights.masters]
    model.train()
    weights.zero_grad()
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    weights.reduce_gradients(World(None, 0, 1, 0, 1, socket.gethostname()))
    weights.step(1.0)
    after = [_full(m).detach().clone() for m in weights.masters]
    return loss.item(), before, after


def _fsdp2(s, compute: str) -> dict:
    from hpc.models.parallelize import shard_model
    from memory_tracker import one_real_rank

    if s.device.type == "cuda":
        torch.cuda.set_device(s.device)
    ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(1))
    ids = ids.to(s.device)
    with one_real_rank(s.device.type):
        model = _lora_tiny(s.device)
        reference = copy.deepcopy(model)
        shard_model(model, compute)
        loss, before, after = _train_step(model, ids)
        _, _, plain = _train_step(reference, ids)
        backend = dist.get_backend()
    diff = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(after, plain))
    return {"backend": backend, "compute_dtype": compute, "loss": loss,
            "moved": any(not torch.equal(a, b) for a, b in zip(after, before)),
            "relative_difference_to_unsharded_fp32": diff}


def fsdp2_step(s, budget) -> dict:
    """One FSDP2 training step in a one-rank group (module docstring)."""
    from acceptance_parts import finish, ran

    out = {}
    budget.run(out, "float32", lambda: _fsdp2(s, "float32"))
    budget.run(out, "bfloat16", lambda: _fsdp2(s, "bfloat16"))
    failures = []
    for name, r in out.items():
        if not ran(r):
            continue
        if not (r["moved"] and torch.isfinite(torch.tensor(r["loss"]))):
            failures.append(f"{name} compute: the step left the weights or its loss is "
                            f"{r['loss']}")
        if name == "float32" and not r["relative_difference_to_unsharded_fp32"] <= FSDP2_EXACT:
            failures.append(f"float32 compute: sharded weights differ from unsharded by "
                            f"{r['relative_difference_to_unsharded_fp32']:.2g} (relative)")
    figures = [f"{name}: " + (f"{r['backend']}, loss {r['loss']:.3f}, "
                              f"{r['relative_difference_to_unsharded_fp32']:.1g} from unsharded"
                              if ran(r) else "not run")
               for name, r in out.items()]
    return finish(out, ("float32", "bfloat16"), failures, "; ".join(figures))


# --- the ranks

class _TorchrunWorld(World):
    """The world of a rank torchrun started: no MPI, so the named arrival before a collective
    (an MPI barrier that names a missing rank) is left out and a failed collective is raised."""

    def arrive(self, label: str, timeout_s: float, poll_s: float = 0.001) -> None:
        pass

    def abort_failed(self, label: str, err: Exception) -> None:
        raise err


def _world_and_group(launcher: str, device: torch.device) -> World:
    """This rank's world, joined to the default process group (NCCL on CUDA, else gloo) by
    the package's bootstrap (:func:`hpc.runtime.dist.init_process_group`: a job's timeout,
    ``device_id`` and teardown). Under mpirun the ranks agree on rank 0's address over MPI, as
    a job's do; under torchrun the address is the one torchrun gives (``MASTER_ADDR``,
    ``MASTER_PORT``: its agent's store, which torch's ``tcp://`` rendezvous joins as it does
    ``env://``)."""
    from hpc.runtime.dist import init_process_group

    if launcher == "mpirun":
        from hpc.runtime.world import get_world

        world = get_world()
    else:
        from hpc.runtime.rendezvous import Rendezvous

        env = os.environ
        world = _TorchrunWorld(None, int(env["RANK"]), int(env["WORLD_SIZE"]),
                               int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]),
                               socket.gethostname())
        world.rendezvous = Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), "")
    init_process_group(world, device)
    return world


def rank_main(argv=None) -> int:
    """One rank: all-reduce rank-seeded LoRA gradients as F-GRPO does, twice (the second
    timed; the mean of equal values is unchanged), against the mean computed here; rank 0
    writes what happened, stage by stage, to OUT.json. Exit 1 on an error, at once."""
    from hpc.models.parallelize import TrainedWeights
    from hpc.runtime.atomic import write_bytes

    p = argparse.ArgumentParser(description="one rank of gpu_acceptance.py's all-reduce")
    p.add_argument("out")
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--launcher", choices=["mpirun", "torchrun"], required=True)
    p.add_argument("--lora-shape", type=int, nargs=4, required=True,
                   metavar=("HIDDEN", "LAYERS", "HEADS", "KV_HEADS"))
    args = p.parse_args(argv)
    report = {"stage": "process group"}
    rank = next((int(os.environ[v]) for v in RANK_VARS if v in os.environ), 0)

    def save():
        if rank == 0:
            write_bytes(args.out, json.dumps(report).encode())

    save()
    try:
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        world = _world_and_group(args.launcher, device)
        report.update(stage="all-reduce", backend=dist.get_backend(), ranks=world.size)
        save()
        shapes = lora_grad_shapes(*args.lora_shape)

        def grads_of(r):
            gen = torch.Generator().manual_seed(r)
            return [torch.randn(shape, generator=gen) for shape in shapes]

        params = [torch.zeros(shape, device=device, requires_grad=True) for shape in shapes]
        for param, grad in zip(params, grads_of(world.rank)):
            param.grad = grad.to(device)
        weights = TrainedWeights(params, lr=1e-3, weight_decay=0.0)
        weights.reduce_gradients(world)
        _sync(device)
        start = time.perf_counter()
        weights.reduce_gradients(world)
        _sync(device)
        seconds = time.perf_counter() - start
        expected = [sum(g) / world.size for g in zip(*(grads_of(r) for r in range(world.size)))]
        report.update(stage="done", seconds=seconds, max_abs_error=max(
            float((p.grad.cpu() - e).abs().max()) for p, e in zip(params, expected)),
            bytes_counted=world.take_bytes().get("grad_allreduce", 0) // 2,
            bytes_expected=sum(p.numel() * 4 for p in params))
    except Exception as err:  # noqa: BLE001 - what a rank met is the finding
        report["error"] = f"{type(err).__name__}: {err}"[:3000]
        save()
        sys.stderr.flush()
        os._exit(1)  # a broken group's teardown (atexit) can hang: leave without it
    save()
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
