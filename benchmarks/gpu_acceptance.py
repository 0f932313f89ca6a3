"""GPU acceptance: every part of the package that runs only on a GPU, checked in one call.

    python benchmarks/gpu_acceptance.py OUT --device cuda [--minutes 8] [--toy FOLDER]
    python benchmarks/gpu_acceptance.py OUT --device cpu      # the same parts on tiny shapes

Parts, in this order, each on the smallest shape that shows it (the trained toy model, and
random weights of Qwen2.5-1.5B's shape on CUDA or of a tiny Qwen2 on CPU):

  engine_vs_hf      the decoding engine against HF generate: greedy tokens identical on the
                    toy; tokens/s of both, and the share of tokens that agree on random weights
  cuda_graphs       the engine with CUDA graphs against without: the self-check passes, some
                    decode step is replayed, the toy's tokens are identical (CUDA only)
  quantized_decode  torchao INT8 and INT4 weight-only decoding against bf16: the toy's tokens
                    that agree (INT8 >= 90%, INT4 >= 50%), tokens/s (INT4: CUDA only)
  memory_plan       the memory plan's peak against the measured one (torch.cuda.
                    max_memory_allocated on CUDA) of an ESSA scoring pass and an F-GRPO step:
                    measured <= plan <= 1.15 x measured
  nccl_all_reduce   F-GRPO's gradient all-reduce: one rank in this process, then two ranks
                    on the one device (NCCL may refuse them: recorded, not failed)
  fsdp2_step        one FSDP2 training step in a one-rank group: fp32 equals unsharded
  backends          benchmarks/backends.py: ESSA scoring, F-GRPO rollouts and evaluation on
                    every decoding backend installed (engine, hf, vllm): tokens/s and ratios

Each part gets its share of ``--minutes`` and what the parts before it left unspent; one whose
time is spent, or whose dependency is missing (torchao, CUDA, a launcher), is skipped with the
reason. OUT/gpu_acceptance-<device>-<date>.json is rewritten as each part starts (verdict
``running``) and ends, so a killed run keeps what it measured and names the part it ended in;
the table at the end gives each part's verdict (ok, FAILED, skipped)
and its key figures or reason. Exit status: 0 when every part that ran passed, 1 when one
failed (the JSON and the table say what it found), 2 for a bad argument (one line).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # hpc from this checkout, before torch is imported (by common.py)

from hpc.models.folders import check_model_folder  # noqa: E402 (torch-free)
from hpc.runtime.cli import OneLineParser  # noqa: E402
from hpc.runtime.errors import UserError, user_errors_exit  # noqa: E402

PARTS = (("engine_vs_hf", 0.15), ("cuda_graphs", 0.15), ("quantized_decode", 0.15),
         ("memory_plan", 0.20), ("nccl_all_reduce", 0.15), ("fsdp2_step", 0.10),
         ("backends", 0.10))
MIN_PART_S = 5.0  # a part given less than this is skipped
RUNNING = ("the run ended during this part (killed at a time limit, or the process died): "
           "what it measured is lost, the parts before it are kept")


def parse_args(argv=None):
    p = OneLineParser(prog="gpu_acceptance.py", description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder of the JSON (benchmarks/results to keep it)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the real shapes; cpu: tiny shapes, the CUDA-only parts skipped")
    p.add_argument("--minutes", type=float, default=8.0, help="the whole run's time budget")
    p.add_argument("--toy", metavar="FOLDER",
                   help="the trained toy model (default: where hpc-toy builds it)")
    args = p.parse_args(argv)
    if not (math.isfinite(args.minutes) and args.minutes > 0):
        raise UserError(f"--minutes must be a positive number, not {args.minutes}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"OUT {args.out} is a file, not a folder")
    if args.toy is not None:  # before torch is imported (the default's place needs it)
        check_model_folder(args.toy)
    return args


def device_words(device) -> str:
    """'h200' for an NVIDIA H200, 'cpu' on CPU: the device in the JSON's name."""
    import torch

    if device.type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).lower().replace("nvidia", "").split()
    return "-".join(words) or "cuda"


def run_part(fn, setup, seconds: float) -> dict:
    """``fn(setup, budget)`` within ``seconds``: its result, or skipped / FAILED with why."""
    from acceptance_parts import PartBudget, Skipped, describe

    if seconds < MIN_PART_S:
        return {"verdict": "skipped", "summary": "",
                "reason": f"time budget spent ({max(seconds, 0):.0f} s left for this part)"}
    try:
        return fn(setup, PartBudget(seconds))
    except Skipped as why:
        return {"verdict": "skipped", "reason": str(why), "summary": ""}
    except Exception as err:  # noqa: BLE001 - a part that breaks is a finding, not the end
        return {"verdict": "FAILED", "reason": describe(err), "summary": "",
                "traceback": traceback.format_exc()[-4000:]}


def table(parts: dict) -> str:
    lines = [f"{'part':<17} {'verdict':<8} key figures, or why"]
    for name, r in parts.items():
        lines.append(f"{name:<17} {r['verdict']:<8} "
                     f"{r['summary'] if r['verdict'] == 'ok' else r['reason']}")
    return "\n".join(lines)


@user_errors_exit
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    import torch

    from hpc.runtime.atomic import write_bytes

    if args.toy is None:
        from hpc.toys.toy import cache_dir

        args.toy = cache_dir()
        if not os.path.isdir(args.toy):
            raise UserError(f"no trained toy model in {args.toy}: build it with hpc-toy, or "
                            f"name its folder with --toy")
        check_model_folder(args.toy)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible here (--device cpu runs "
                        "the CPU mode)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")

    import acceptance_parts
    import acceptance_ranks
    from common import machine

    setup = acceptance_parts.Setup.for_device(device, args.toy)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_acceptance-{device_words(device)}-"
                                  f"{datetime.date.today().isoformat()}.json")
    report = {"machine": machine(), "device": device_words(device),
              "command": " ".join(["python benchmarks/gpu_acceptance.py"] + argv),
              "minutes": args.minutes, "toy": args.toy,
              "random_shape": {"name": setup.shape, "rows": setup.rows,
                               "prompt_tokens": setup.lengths[0],
                               "new_tokens": setup.lengths[1]},
              "parts": {}, "exit_status": None}

    def save():
        write_bytes(path, json.dumps(report, indent=1).encode())

    print(f"machine: {report['machine']}", flush=True)
    total, unspent = 60 * args.minutes, 0.0
    for name, share in PARTS:
        began = time.perf_counter()
        seconds = min(share * total + unspent, start + total - began)
        fn = getattr(acceptance_parts, name, None) or getattr(acceptance_ranks, name)
        report["parts"][name] = {"verdict": "running", "summary": "", "budget_s":
                                 round(seconds, 1), "reason": RUNNING}
        save()
        result = run_part(fn, setup, seconds)
        used = time.perf_counter() - began
        unspent = max(0.0, seconds - used)
        report["parts"][name] = dict(result, budget_s=round(seconds, 1), seconds=round(used, 1))
        save()
        print(f"{name}: {result['verdict']} ({used:.0f} s of {max(seconds, 0):.0f})", flush=True)
    setup.release()
    failed = any(r["verdict"] == "FAILED" for r in report["parts"].values())
    report["exit_status"] = int(failed)
    save()
    print(table(report["parts"]))
    print(f"wrote {path}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
