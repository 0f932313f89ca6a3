"""``hpc-doctor CONFIG.yaml [section.key=value ...]``: the preflight of a cluster for the jobs
this config would run, started by ``srun`` or ``mpirun`` exactly as they are.

Rank 0 prints one table: per rank its host, global and local rank, device, torch / CUDA / NCCL
versions, its interface toward the rendezvous and the MPI library; an MPI and a
torch.distributed all-reduce (the job's backend) over message sizes with nccl-tests' bus
bandwidth and the slowest rank; the rendezvous the jobs use; the run root (writable, the same
folder on every node, free space against the run's checkpoints, HDF5 file locking); the model
folder on every node (present, the same config.json, tokenizer and weight sizes) and the memory
plan's verdict for this rank count; the data files on every node. Exit 0 when every check
holds, else 2 with one line per failed check naming the node and the fix. It takes seconds on
CPU and needs no GPU.

The config is read as every job reads it, with the sections of every installed method; each
method's own job config (its validation, presets and memory plan) is built from it.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys

from hpc.runtime.cli import EXIT_CODES_HELP, OneLineParser, plain
from hpc.job.config import JobConfig
from hpc.runtime.config import load_config
from hpc.runtime.methods import methods
from hpc.runtime.errors import UserError, user_errors_exit

EXIT_HELP = (f"{EXIT_CODES_HELP}; 2 also when a check fails (one line each, naming the node "
             f"and the fix)")


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="hpc-doctor", description=plain(__doc__), epilog=EXIT_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                        help="the jobs' config file, then overrides, as a job takes them")
    return parser


def doctor_job_class():
    """A job config with the sections every job shares and those of every installed method
    (:func:`hpc.runtime.methods.methods`), so one experiment file and any job's key are read."""
    fields = [(name, cls, dataclasses.field(default_factory=cls))
              for name, cls in ((name, spec.section_class()) for name, spec in methods().items())]
    return dataclasses.make_dataclass("DoctorJobConfig", fields, bases=(JobConfig,))


def method_configs(cfg) -> tuple:
    """({method: its job config, with ``cfg``'s sections}, {method: the line its job would
    refuse this config with}), for every installed method (:func:`hpc.runtime.methods.methods`). A refusal
    is a note, not a failed check: an ESSA config names an adapter that SFT writes later."""
    configs, refusals = {}, {}
    for method, spec in methods().items():
        job = spec.job_class()()
        for f in dataclasses.fields(job):
            setattr(job, f.name, copy.deepcopy(getattr(cfg, f.name)))
        try:
            if hasattr(job, "validate"):
                job.validate()
        except UserError as err:
            refusals[method] = str(err)
        configs[method] = job
    return configs, refusals


@user_errors_exit
def main(argv=None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    config_path = next((i for i in args.items if "=" not in i), None)
    overrides = [i for i in args.items if "=" in i]
    extra = [i for i in args.items if "=" not in i and i != config_path]
    if extra:
        raise UserError(f"hpc-doctor: one config file, then section.key=value overrides; "
                        f"{extra[0]!r} is neither")
    cfg = load_config(doctor_job_class(), config_path, overrides)
    configs, refusals = method_configs(cfg)
    from hpc.doctor.run import run  # torch, MPI: only once the config is valid

    code = run(cfg, configs, refusals, config_path)
    if code:
        sys.exit(code)
    return 0


if __name__ == "__main__":
    main()
