"""The GPU-check cost source: per-completion costs from one model's figures in a GPU check
JSON (benchmarks/gpu_check.py; ``hpc-scaling --gpu-check``), and the decode batch effect its
measured curve over rows shows.

Units: seconds, bytes, tokens/s of one GPU.
"""
from __future__ import annotations

import ast
import json
import re

import numpy as np

from compare.model import LinearCosts
from hpc.engine.shape import ModelShape
from hpc.runtime.errors import UserError

ADAPTER_VARIANTS = ("lora_fused", "lora_exact", "peft")  # ways to score members with adapters


class GpuCheck(LinearCosts):
    """Per-completion costs from one model's figures in a GPU check JSON
    (benchmarks/gpu_check.py): ESSA's scoring throughput from its members measurements (the
    best adapter variant and k), F-GRPO's from its timed step, per GPU."""

    def __init__(self, path: str, model: str | None = None):
        try:
            with open(path) as fh:
                report = json.load(fh)
        except FileNotFoundError:
            raise UserError(f"GPU check file not found: {path}") from None
        except (OSError, ValueError) as err:
            raise UserError(f"cannot read {path} as a GPU check JSON: {err}") from None
        results = report.get("results") if isinstance(report, dict) else None
        if not isinstance(results, list) or not results:
            raise UserError(f"{path} holds no GPU check results")
        names = [r.get("model") for r in results]
        if model is not None and model not in names:
            raise UserError(f"{path} has no results for model {model!r} (it has "
                            f"{', '.join(map(str, names))})")
        r = results[names.index(model) if model is not None else 0]
        self.path, self.machine, self.result = path, report.get("machine", "?"), r
        self.name = r.get("model")
        missing = [k for k in ("shape", "prompt_tokens", "new_tokens", "lora", "parameters",
                               "fgrpo_step", "members") if k not in r]
        if missing or "skipped" in r:
            raise UserError(f"{path}: model {self.name!r} was not measured "
                            f"({r.get('skipped') or 'lacks ' + ', '.join(missing)})")
        self.prompt, self.new = r["prompt_tokens"], r["new_tokens"]
        self._shape(r)
        self._fgrpo(r["fgrpo_step"])
        self._members(r["members"])

    def _shape(self, r: dict) -> None:
        s = r["shape"]
        match = re.fullmatch(r"r=(\d+) on (\[.*\])", r["lora"])
        if match is None:
            raise UserError(f"{self.path}: cannot read the LoRA of {self.name!r} ({r['lora']!r})")
        self.lora_rank, self.lora_targets = int(match[1]), ast.literal_eval(match[2])
        shape = ModelShape.from_config(s, f"{self.path}: model {self.name!r}")
        unknown = [t for t in self.lora_targets if t not in shape.module_shapes()]
        if unknown:
            raise UserError(f"{self.path}: LoRA targets {unknown} of {self.name!r} are not "
                            f"among {', '.join(shape.module_shapes())}")
        self.shape, self.kv_dim = s, shape.kv_heads * shape.head_dim
        self.lora_params = shape.lora_parameters(self.lora_rank, self.lora_targets)
        self.grad_bytes = 4.0 * self.lora_params  # fp32 gradients

    def _fgrpo(self, step: dict) -> None:
        if "hf" in step:  # an --engine-only check: the step with HF generate rollouts
            self.engine_step, step = step.get("engine"), step["hf"]
        else:
            self.engine_step = self.result.get("fgrpo_step_engine")
        if "phases_s" not in step:
            raise UserError(f"{self.path}: the F-GRPO step of {self.name!r} was not measured "
                            f"({step.get('skipped', 'no phases_s')})")
        phases, rows = step["phases_s"], step["rows"]
        self.step, self.fgrpo_rows = step, rows
        self.s_gen = (phases["generation"] + phases.get("reward", 0.0)) / rows
        self.s_train = phases["forward_backward"] / rows
        self.optimizer_s = phases["optimizer"]
        self.gen_tps = rows * self.new / phases["generation"]
        self.train_tps = rows * (self.prompt + self.new) / phases["forward_backward"]

    def _members(self, members: list) -> None:
        measured = [(m[v]["tokens_per_s"], v, m) for m in members if "skipped" not in m
                    for v in ADAPTER_VARIANTS if v in m]
        if not measured:
            raise UserError(f"{self.path}: no members measurement of {self.name!r}")
        self.essa_tps, self.essa_variant, self.essa_best = max(measured, key=lambda x: x[0])
        self.s_essa = self.new / self.essa_tps
        self.essa_smallest = min(measured, key=lambda x: (x[2]["rows"], -x[0]))
        done = sorted((m for m in members if "base" in m), key=lambda m: m["rows"])
        self.call_rows = np.array([m["rows"] for m in done], dtype=float)
        self.adapter_call_s = np.array([min(m[v]["s"] for v in ADAPTER_VARIANTS if v in m)
                                        for m in done])
        self.base_call_s = np.array([m["base"]["s"] for m in done])

    def call_seconds(self, rows: int, adapter: bool = True) -> float:
        """Seconds to generate ``self.new`` tokens on ``rows`` rows at once, on the measured
        curve over rows (best adapter variant, or ``base`` without LoRA): interpolated between
        the measured row counts, flat below the smallest, in passes of the largest above it."""
        seconds = self.adapter_call_s if adapter else self.base_call_s
        if rows > self.call_rows[-1]:
            return rows / self.call_rows[-1] * float(seconds[-1])
        return float(np.interp(rows, self.call_rows, seconds))

    def batch_effect(self, essa_rows: dict, fgrpo_rows: dict) -> str:
        """An assumption line: ESSA's scoring and F-GRPO's generation seconds a step on the
        measured curves over rows, against the table's linear costs; ``*_rows``: {GPUs: rows
        a GPU holds}."""
        gen_scale = self.step["phases_s"]["generation"] / self.call_seconds(self.fgrpo_rows,
                                                                            adapter=False)
        return (
            "not in the table, the decode batch effect: one call of "
            f"{self.new} new tokens took {self.adapter_call_s[0]:.2f} s on "
            f"{self.call_rows[0]:.0f} rows and {self.adapter_call_s[-1]:.2f} s on "
            f"{self.call_rows[-1]:.0f} (members measurements, best adapter variant); on that "
            "curve a GPU's ESSA scoring takes " + ", ".join(
                f"{self.call_seconds(r):.3g} s at {n} GPUs (table {r * self.s_essa:.3g})"
                for n, r in essa_rows.items()) +
            "; F-GRPO's generation, on the no-LoRA greedy ('base') curve scaled through its "
            "measured step, " + ", ".join(
                f"{gen_scale * self.call_seconds(r, adapter=False):.3g} s at {n} GPUs (table "
                f"{r * self.step['phases_s']['generation'] / self.fgrpo_rows:.3g})"
                for n, r in fgrpo_rows.items()) +
            "; forward+backward is left linear")

    def assumptions(self) -> list:
        s, r, step, best = self.shape, self.result, self.step, self.essa_best
        small_tps, small_variant, small = self.essa_smallest
        engine = self.engine_step if isinstance(self.engine_step, dict) else {}
        lines = [
            f"per-step costs from the GPU check {self.path} ({self.machine}), model "
            f"{self.name}: {r['parameters'] / 1e9:.2f}B parameters, {s['num_hidden_layers']} "
            f"layers, hidden {s['hidden_size']}, MLP {s['intermediate_size']}, K/V width "
            f"{self.kv_dim}, {r.get('dtype', '?')}; LoRA {r['lora']} = "
            f"{self.lora_params / 1e6:.2f}M parameters; the steps to target come from "
            "elsewhere (see below)",
            f"measured workload: prompts of {self.prompt} random tokens, exactly {self.new} new "
            "tokens a completion (fixed length, no EOS); every cost here is per completion of "
            "that length, one GPU, HF generate",
            f"ESSA scoring: {self.essa_tps:.0f} new tokens/s = {1e3 * self.s_essa:.2f} ms per "
            f"scored completion, the best of the members measurements ({self.essa_variant}, "
            f"k = {best['k']} members x {r.get('prompts_per_member', '?')} prompts = "
            f"{best['rows']} greedy rows at once; {r.get('members_that_fit', '?')} members "
            "fit)",
            f"F-GRPO step of {self.fgrpo_rows} sampled completions (the step after a warm-up "
            f"step): generation {step['phases_s']['generation']:.3f} s ({self.gen_tps:.0f} "
            f"new tokens/s) + reward {step['phases_s'].get('reward', 0.0):.4f} s = "
            f"{1e3 * self.s_gen:.2f} ms per completion; forward+backward "
            f"{step['phases_s']['forward_backward']:.3f} s ({self.train_tps:.0f} prompt+new "
            f"tokens/s) = {1e3 * self.s_train:.2f} ms per completion; AdamW "
            f"{1e3 * self.optimizer_s:.1f} ms an update",
            f"these costs are taken as linear in the completions a GPU does; they were "
            f"measured at {best['rows']} (ESSA) and {self.fgrpo_rows} (F-GRPO) rows a GPU, and "
            f"a GPU holding fewer rows is slower per completion than this says: at "
            f"{small['rows']} rows (k = {small['k']}, {small_variant}) a scored completion "
            f"took {1e3 * self.new / small_tps:.2f} ms, {self.essa_tps / small_tps:.1f}x the "
            "best",
            f"GRPO gradients: {self.grad_bytes / 1e6:.3g} MB (4 bytes a LoRA parameter) "
            "all-reduced per optimizer update (the check ran one rank: no all-reduce measured)",
        ]
        if "phases_s" in engine:
            lines.append(f"not used: an F-GRPO step with the decoding engine's rollouts, "
                         f"generation {engine['phases_s']['generation']:.3f} s for "
                         f"{engine['rows']} completions")
        return lines

