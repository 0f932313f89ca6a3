"""Run under mpirun: a job whose plan computations are counted. ``plan_count.py OUT METHOD
ARGS...`` runs METHOD's job (``essa.trainer``, ``fgrpo.trainer``) with ARGS, its plan taken as on
a GPU (the device type ``cuda`` handed to :func:`hpc.plan.registry.job_plan`, so the plan binds
and decides, as it does on CUDA), and counts each rank's calls of ``job_plan`` and of the
method's ``plan`` function inside it and after it returned. Each rank writes its counts as JSON
to OUT.<rank> when it exits.
"""
import atexit
import importlib
import json
import sys

import hpc.job.lifecycle as lifecycle
import hpc.plan.registry as registry
from hpc.runtime.world import get_world

out, method, args = sys.argv[1], sys.argv[2], sys.argv[3:]
counts = {"job_plan": 0, "plan_inside": 0, "plan_after": 0}
state = {"inside": False}
real_job_plan = registry.job_plan
module = registry.method_plans()[method]
real_plan = module.plan


def counted_job_plan(cfg, name, ranks, device_type):
    counts["job_plan"] += 1
    state["inside"] = True
    try:
        return real_job_plan(cfg, name, ranks, "cuda")
    finally:
        state["inside"] = False


def counted_plan(*a, **k):
    counts["plan_inside" if state["inside"] else "plan_after"] += 1
    return real_plan(*a, **k)


lifecycle.job_plan = counted_job_plan
module.plan = counted_plan  # the module's own calls (its auto choices) go through it too
rank = get_world().rank
atexit.register(lambda: json.dump(counts, open(f"{out}.{rank}", "w")))
importlib.import_module(f"{method}.trainer").main(args)
