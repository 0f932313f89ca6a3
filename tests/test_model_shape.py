"""One model shape (:class:`hpc.engine.shape.ModelShape`) and one per-token memory formula:
the engine, the memory plan, ESSA's members per pass and the scaling model read the same
figures for every released Qwen2.5 shape."""
import os
import re

import pytest
from transformers import Qwen2Config

from compare.roofline import Model
from hpc.engine.hf_backend import members_that_fit
from hpc.engine.memory import ENGINE_MEMORY_SHARE, engine_memory
from hpc.engine.shape import QWEN25, ModelShape
from hpc.plan.terms import engine_parts
from hpc.job.config import plan_job_class
from hpc.runtime.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_package_has_one_model_shape():
    classes = []
    for package in ("hpc", "sft", "essa", "fgrpo", "compare"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name)) as fh:
                        classes += [(name, m) for m in re.findall(r"^class (\w*Shape)\b",
                                                                  fh.read(), re.M)]
    assert classes == [("shape.py", "ModelShape")]


@pytest.mark.parametrize("size", sorted(QWEN25))
def test_engine_plan_essa_and_scaling_agree_on_the_bytes_of_a_token(size, tmp_path):
    shape = ModelShape.qwen25(size)
    q = QWEN25[size]
    # the engine builds its shape from the model's HF config object
    assert ModelShape.from_config(Qwen2Config(**q)) == shape
    kv = 2 * q["num_hidden_layers"] * q["num_key_value_heads"] * (
        q["hidden_size"] // q["num_attention_heads"]) * 2  # K and V, bf16
    assert shape.kv_token_bytes(2) == kv
    # the engine: 16 slots of 1,024 positions hold 16 * 1,024 tokens' keys and values
    assert engine_memory(shape, 16, 1024)["kv_cache"] == 16 * 1024 * kv
    # the plan: one phase's engine parts are the engine's own formula on the same shape
    cfg = load_config(plan_job_class(), None, ["model.dtype=bfloat16", "model.engine_slots=16",
                                               "plan.max_prompt_tokens=512",
                                               "task.max_new_tokens=512"])
    parts = engine_parts(shape, cfg, "test", 16, 0, 1 << 50)
    mine = engine_memory(shape, 16, 1024, 0, 2, prompt_tokens=512)
    assert parts[0][1] == mine["kv_cache"] + mine["members"] + mine["slot_buffers"]
    # ESSA's members per pass: the same KV and activation bytes a token, the engine's share
    per_member = 128 * (kv + shape.activation_token_bytes(2)) + 4 * shape.vocab
    free = 10 * per_member
    assert members_that_fit(shape, 2, 0, int(free / ENGINE_MEMORY_SHARE), 100, 1, 128) == 10
    # the scaling model, given the widths alone
    model = Model(params=float(shape.parameters()), layers=shape.layers, hidden=shape.hidden,
                  intermediate=shape.intermediate, kv_dim=shape.kv_heads * shape.head_dim,
                  lora_rank=8)
    assert model.kv_bytes_per_token == kv
    assert model.lora_params == shape.lora_parameters(8, shape.module_shapes())
