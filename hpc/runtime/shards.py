"""Per-rank checkpoint shards (FSDP2): each rank writes and reads only its own part of the state.

A layer over :mod:`hpc.runtime.checkpoint`: rank r's shards go to ``<dir>/rank-<rrrrr>/`` as
ordinary checkpoints (safetensors + JSON skeleton, checksummed, atomic, the same retention),
holding ``{"step", "ranks", "state"}``. The checkpoint in ``<dir>`` itself (rank 0's) is the
commit point: it is written after every rank's shard of that step is on disk (a barrier), and
names the rank count in ``shard_ranks``. On resume a shard newer than the committed step (a kill
between the shards and the commit) is an unfinished checkpoint and is removed; a shard of
another step or rank count is refused with one line.
"""
from __future__ import annotations

import os

from hpc.runtime.checkpoint import SUFFIX, list_checkpoints, load_latest, save_checkpoint
from hpc.runtime.errors import UserError


def shard_dir(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, f"rank-{rank:05d}")


def save_shard(ckpt_dir: str, world, step: int, state: dict, keep: int) -> None:
    """Write this rank's ``state`` for ``step``; returns once every rank has written its own."""
    save_checkpoint(shard_dir(ckpt_dir, world.rank), step,
                    {"step": step, "ranks": world.size, "state": state}, keep=keep)
    world.barrier()


def _step_of(path: str) -> int:
    return int(os.path.basename(path)[len("step-"):-len(SUFFIX)])


def load_shard(ckpt_dir: str, world, step: int, ranks: int) -> dict:
    """This rank's state of the committed checkpoint ``step``, written by ``ranks`` ranks."""
    if ranks != world.size:
        raise UserError(f"the checkpoint of step {step} in {ckpt_dir} is sharded over {ranks} "
                        f"ranks (fgrpo.parallelism=fsdp2); resume it on {ranks} ranks, not "
                        f"{world.size}")
    directory = shard_dir(ckpt_dir, world.rank)
    for path in list_checkpoints(directory):
        if _step_of(path) > step:  # written, never committed
            for stale in (path, path[:-len(SUFFIX)] + ".sha256"):
                if os.path.exists(stale):
                    os.remove(stale)
    shard = load_latest(directory, warn=True)
    if shard is None or shard["step"] != step or shard["ranks"] != ranks:
        found = "none" if shard is None else f"step {shard['step']}"
        raise UserError(f"rank {world.rank} has no intact shard of checkpoint step {step} in "
                        f"{directory} (found {found}); cannot resume", same_on_all_ranks=False)
    return shard["state"]
