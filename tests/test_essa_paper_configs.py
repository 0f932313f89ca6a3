"""configs/paper/essa-*.yaml: the ESSA paper's (arXiv 2507.04453) settings for GSM8K on
Qwen2.5-Math-7B, PRM800K on 7B and 32B and IFEval on LLaMA-3.1-8B (the warm start's disjoint SFT
split and epochs, the search), and hpc-plan's verdict on the GPUs each config's header names."""
import glob
import json
import re

import pytest

from conftest import REPO
from essa.config import ESSAJobConfig
from hpc.runtime.config import load_config
from sft.config import SFTJobConfig
from test_memory_plan import model_folder

PAPER = {name: f"{REPO}/configs/paper/essa-{name}.yaml"
         for name in ("gsm8k-qwen2.5-math-7b", "prm800k-qwen2.5-7b", "prm800k-qwen2.5-32b",
                      "ifeval-llama3.1-8b")}
SHAPE = {"gsm8k-qwen2.5-math-7b": "7B", "prm800k-qwen2.5-7b": "7B", "prm800k-qwen2.5-32b": "32B",
         "ifeval-llama3.1-8b": "llama-3.1-8B"}
LLAMA_31_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
                   intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=128256,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                   tie_word_embeddings=False, torch_dtype="bfloat16")  # its config.json's shape


def shape_folder(tmp_path, size: str) -> str:
    """A folder with only the config.json of ``size`` (what hpc-plan reads)."""
    if size != "llama-3.1-8B":
        return model_folder(tmp_path, size)
    folder = tmp_path / size
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return str(folder)
ADAPTER = ["lora.adapter=runs/sft/adapter"]  # ESSA needs one; the config leaves it to the user


def test_the_configs_hold_the_papers_settings():
    assert sorted(glob.glob(f"{REPO}/configs/paper/essa-*.yaml")) == sorted(PAPER.values())
    for name, path in PAPER.items():
        sft = load_config(SFTJobConfig, path, [])
        essa = load_config(ESSAJobConfig, path, ADAPTER)
        assert sft.task == essa.task  # SFT and ESSA read the same split
        assert (essa.model.dtype, essa.lora.targets, essa.essa.optimizer, essa.essa.space,
                essa.essa.population) == ("bfloat16", ["q_proj", "k_proj", "v_proj",
                                                       "o_proj"], "cma", "sv", 96), name
        assert (sft.sft.batch_size, sft.sft.lr) == (16, 1e-4), name
        for line in open(path).read().splitlines():  # every key says where it comes from
            if re.match(r"^\s+\w+:\s*\S", line) and "_path:" not in line:  # files
                assert "paper" in line or "not stated" in line, line
    gsm = load_config(SFTJobConfig, PAPER["gsm8k-qwen2.5-math-7b"], [])
    assert (gsm.model.path, gsm.task.name, gsm.task.n_train, gsm.task.sft_split,
            gsm.sft.epochs) == ("Qwen/Qwen2.5-Math-7B", "gsm8k", 0, 1495, 1)
    for name, epochs, model in (("prm800k-qwen2.5-7b", 1, "Qwen/Qwen2.5-Math-7B"),
                                ("prm800k-qwen2.5-32b", 3, "Qwen/Qwen2.5-32B")):
        cfg = load_config(SFTJobConfig, PAPER[name], [])
        assert (cfg.model.path, cfg.task.name, cfg.task.eval_path, cfg.task.n_train,
                cfg.task.sft_split, cfg.sft.epochs) == (model, "math",
                                                        "data/math500/test.jsonl", 11500,
                                                        3600, epochs), name
    ife = load_config(SFTJobConfig, PAPER["ifeval-llama3.1-8b"], [])
    assert (ife.model.path, ife.task.name, ife.task.ifeval_check, ife.task.sft_split,
            ife.sft.epochs) == ("meta-llama/Llama-3.1-8B-Instruct", "ifeval", "strict", 1495, 1)
    big = load_config(ESSAJobConfig, PAPER["prm800k-qwen2.5-32b"], ADAPTER)
    assert (big.lora.rank, big.essa.alpha, big.essa.target_accuracy) == (16, 1.0, 0.835)
    # the search dimension the paper counts: 64 layers x 4 matrices x 2 factors x rank 16
    assert 64 * len(big.lora.targets) * 2 * big.lora.rank == 8192


def the_ranks(path):
    """The GPU count the config's header names (its hpc-plan command's --ranks)."""
    return int(re.search(r"hpc-plan \S+ --ranks (\d+)", open(path).read()).group(1))


@pytest.mark.parametrize("name", sorted(PAPER))
def test_hpc_plan_says_essa_fits_the_gpus_the_header_names(name, tmp_path, capsys):
    from hpc.commands import plan as main
    ranks = the_ranks(PAPER[name])
    assert ranks == (16 if "32b" in name else 8)
    main([PAPER[name], f"model.path={shape_folder(tmp_path, SHAPE[name])}", *ADAPTER,
          "--ranks", str(ranks)])
    out = capsys.readouterr().out
    assert "GPU memory assumed: 80 GiB" in out and f"ranks: {ranks}" in out
    essa = out[out.index("ESSA per GPU"):out.index("F-GRPO per GPU")]
    peak = next(line for line in essa.splitlines() if line.strip().startswith("peak"))
    assert peak.rstrip().endswith("of 72.00 GiB usable: fits"), peak
