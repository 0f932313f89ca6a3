"""The preflight on every rank: the checks in the order a job meets them, one exchange of what
each rank found, rank 0's table and failure lines, and the same exit code on every rank.
Imported once the config is valid (torch, MPI)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from hpc.doctor import bandwidth, storage
from hpc.doctor.findings import Finding, failure_lines, share
from hpc.doctor.inputs import (check_data, check_same_model, checkpoint_need, data_text,
                               fingerprint, host_memory_for_load, model_folder_here, model_text,
                               plan_verdicts)
from hpc.doctor.ranks import pick_device, rank_facts, rank_rows
from hpc.runtime.dist import destroy_process_group, init_process_group
from hpc.runtime.errors import EXIT_USER_ERROR, UserError
from hpc.runtime.rendezvous import agree
from hpc.runtime.results import aligned
from hpc.runtime.world import get_world


def meet(world, backend: str) -> tuple:
    """(rendezvous or None, findings): the address the jobs' ranks meet at, agreed as a job
    agrees on it (:func:`hpc.runtime.rendezvous.agree`: every rank tries to connect within
    seconds, the same error on every rank when one cannot)."""
    try:
        world.rendezvous = agree(world, backend)
    except UserError as err:
        return None, [Finding("rendezvous", str(err), "", job_wide=True)] if world.is_root else []
    return world.rendezvous, []


def collectives(world, device, backend: str, rendezvous) -> dict:
    """The MPI all-reduce, then (where the rendezvous holds) torch.distributed's on
    ``backend``: {'sizes', 'mpi', 'torch': this rank's seconds per size, 'findings'}."""
    sizes = bandwidth.GPU_SIZES if backend == "nccl" else bandwidth.CPU_SIZES
    mpi, found = bandwidth.mpi_allreduce(world, sizes)
    measured = {"sizes": sizes, "mpi": mpi, "torch": None, "findings": found}
    if rendezvous is not None:
        init_process_group(world, device)
        measured["torch"], more = bandwidth.torch_allreduce(world, device, sizes)
        measured["findings"] += more
        destroy_process_group()
    return measured


def model_checks(world, cfg) -> tuple:
    """(this rank's model folder, rank 0's fingerprint or None, findings)."""
    folder, found = model_folder_here(cfg.model.path)
    mine = None
    if not found:
        try:
            mine = fingerprint(folder)
        except OSError as err:
            found = [Finding("model folder", f"{folder}: {err.strerror or err}",
                             "make the model folder readable on every node")]
    prints = share(world, mine)
    if mine is not None and prints[0] is not None:
        found += check_same_model(mine, prints[0])
    return folder, prints[0], found


def run_root_checks(world, root: str, need: int, why: str) -> list:
    """Writable here; the folder rank 0 wrote its token in; then room and HDF5 locking."""
    found = storage.check_writable(root)
    token = storage.write_token(root) if world.is_root and not found else {"name": "",
                                                                           "token": ""}
    written = share(world, token)[0]
    if not found:
        found = storage.check_same_folder(root, written)
    world.barrier()
    if world.is_root:
        storage.remove_token(root, written)
    if not found:
        found = storage.check_free_space(root, need, why) + storage.check_hdf5_locking(root)
    return found


@dataclass
class Seen:
    """What rank 0 reports: every rank's facts and findings, and its own view of the rest."""

    facts: list  # every rank's :func:`hpc.doctor.ranks.rank_facts`, with its interface
    everyone: list  # every rank's findings and all-reduce times
    rendezvous: object  # hpc.runtime.rendezvous.Rendezvous, or None where it failed
    backend: str
    sizes: list  # all-reduce message sizes, bytes
    root: str  # the run root
    need: tuple  # (bytes, how they add up) the run root should have free
    folder: str  # rank 0's model folder
    prints0: dict | None  # its fingerprint (:func:`hpc.doctor.inputs.fingerprint`)


def run(cfg, method_cfgs: dict, refusals: dict, config_path) -> int:
    """Every check on this rank; rank 0 prints the report. Returns 0, or 2 on every rank when
    any check failed on any rank."""
    world = get_world()
    world.timeout_s = cfg.run.collective_timeout_s
    device, found = pick_device(world, cfg.model.device)
    facts = share(world, rank_facts(world, device))
    world.hosts = [f["host"] for f in facts]
    backend = "nccl" if all(f["device_type"] == "cuda" for f in facts) else "gloo"
    tensors_on = device if backend == "nccl" else torch.device("cpu")
    rendezvous, more = meet(world, backend)
    measured = collectives(world, tensors_on, backend, rendezvous)
    folder, prints0, model_found = model_checks(world, cfg)
    need, why = checkpoint_need(cfg, method_cfgs, folder)
    root = storage.run_root(cfg.run.out)
    found += more + measured["findings"] + model_found
    found += run_root_checks(world, root, need, why)
    if world.is_root:
        found += plan_verdicts(method_cfgs, world, facts[0]["device_type"])
    found += host_memory_for_load(method_cfgs, world, facts[0]["device_type"])
    found += check_data(cfg)
    everyone = share(world, {"findings": [f.as_dict() for f in found],
                             "interface": rendezvous.ifname if rendezvous else "-",
                             "mpi": measured["mpi"], "torch": measured["torch"]})
    if world.is_root:
        for f, mine in zip(facts, everyone):
            f["interface"] = mine["interface"]
        seen = Seen(facts, everyone, rendezvous, backend, measured["sizes"], root, (need, why),
                    folder, prints0)
        print(report(cfg, config_path, seen, list(method_cfgs), refusals), flush=True)
        for line in failure_lines([r["findings"] for r in everyone], world.hosts):
            print(line, file=sys.stderr, flush=True)
    return EXIT_USER_ERROR if any(r["findings"] for r in everyone) else 0


def report(cfg, config_path, seen: Seen, methods: list, refusals: dict) -> str:
    """Rank 0's text: the rank table, the all-reduce table, then every check with its verdict
    and what it found (the failures' lines follow on stderr)."""
    hosts = [f["host"] for f in seen.facts]
    ranks, device_type = len(seen.facts), seen.facts[0]["device_type"]
    failed = {f["check"] for r in seen.everyone for f in r["findings"]}
    head, rows = rank_rows(seen.facts)
    checks = [("device", f"{seen.facts[0]['device']} on rank 0"),
              ("MPI all-reduce", f"sums checked at {len(seen.sizes)} sizes"),
              ("rendezvous", rendezvous_text(seen.rendezvous)),
              ("torch.distributed all-reduce", f"{seen.backend}, sums checked at "
                                               f"{len(seen.sizes)} sizes"
               if seen.rendezvous else "not run"),
              ("run root", root_text(seen.root, seen.need)),
              ("HDF5 file locking", storage.locking_text()),
              ("model folder", model_line(cfg, seen.folder, seen.prints0)),
              *((f"{method} on {ranks} ranks", plan_text(refusals.get(method), device_type))
                for method in methods),
              ("data files", data_text(cfg))]
    lines = [[name, "FAILED" if name in failed else "ok", detail] for name, detail in checks]
    verdict = ("hpc-doctor: every check holds" if not failed else
               f"hpc-doctor: {len(failed)} check(s) failed (one line each below)")
    return "\n".join([f"hpc-doctor: {ranks} rank(s) on {len(set(hosts))} node(s), config "
                      f"{config_path or '(defaults)'}", aligned(head, rows, left=len(head)), "",
                      bandwidth_text(seen, hosts), "",
                      aligned(["check", "", "what was found"], lines, left=3), verdict])


def rendezvous_text(rendezvous) -> str:
    if rendezvous is None:
        return "no address every rank reaches"
    return (f"{rendezvous.addr}:{rendezvous.port} ({rendezvous.how}); each rank's interface "
            f"toward it in the table")


def plan_text(refusal: str | None, device_type: str) -> str:
    """The config on this rank count and the memory plan, as the job checks them at start;
    where the job would refuse the config itself (an ESSA config before its SFT adapter
    exists), a note."""
    plan = ("the rank count and memory plan pass" if device_type == "cuda" else
            "the rank count passes; the jobs plan memory on CUDA only")
    return plan + (f"; note: the job refuses this config: {refusal}" if refusal else "")


def bandwidth_text(seen: Seen, hosts: list) -> str:
    columns = {"MPI": bandwidth.slowest([r["mpi"] for r in seen.everyone])}
    if seen.everyone[0]["torch"] is not None:
        columns[seen.backend] = bandwidth.slowest([r["torch"] for r in seen.everyone])
    head, rows = bandwidth.bandwidth_rows(seen.sizes, columns, len(seen.everyone), hosts)
    return ("all-reduce of float32 sums (time: the slowest rank's mean; busbw = algbw x "
            "2(n-1)/n, as nccl-tests)\n" + aligned(head, rows))


def root_text(root: str, need: tuple) -> str:
    free = storage.free_bytes(root)
    return (f"{root} ({os.path.abspath(root)}): {free / 2**30:.1f} GiB free on rank 0, the run "
            f"needs about {need[0] / 2**30:.2f} GiB ({need[1]})")


def model_line(cfg, folder: str, prints0) -> str:
    if prints0 is None:
        return f"{cfg.model.path}: not readable on rank 0"
    return model_text(cfg.model.path, folder, prints0)
