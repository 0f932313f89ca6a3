"""The load (``model.load=streamed``, :mod:`hpc.models.streaming`): the same tensors as
``from_pretrained`` (the reference, ``model.load=transformers``) bit for bit, what a rank holds
while the model loads (torch's tracker, beside the memory plan's load phase), and one plan
computed per job and kept in its run file."""
import json
import os

import h5py
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import require_torchao, run_mpi
from hpc.models.loading import attach_lora, load_adapter, load_model, randomize_lora_b, \
    save_adapter
from hpc.models.parallelize import shard_units
from hpc.models.quantize import COPY
from hpc.runtime.errors import UserError
from hpc.toys.toy import build_tokenizer

CHECK = os.path.join(os.path.dirname(__file__), "mpi", "load_check.py")
COUNT = os.path.join(os.path.dirname(__file__), "mpi", "plan_count.py")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def qwen2_folder(folder, hidden=64, layers=2, intermediate=128, tied=True, dtype=torch.float32,
                 shard_size="", safe=True, adapter=None):
    """A random Qwen2 with the toy tokenizer saved to ``folder`` (``shard_size``: several weight
    files and their index; ``safe``: safetensors, else pytorch_model.bin); ``adapter``: also a
    LoRA adapter (random B) on q/k/v/o saved there. Returns ``folder``."""
    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tied, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(str(folder), safe_serialization=safe,
                          **({"max_shard_size": shard_size} if shard_size else {}))
    tok.save_pretrained(str(folder))
    if adapter:
        peft = attach_lora(model, 4, 8.0, TARGETS)
        randomize_lora_b(peft, 0.1, torch.Generator().manual_seed(1))
        save_adapter(peft, str(adapter))
    return str(folder)


def tensors(model) -> dict:
    return {name: (t.dequantize() if hasattr(t, "dequantize") else t).detach()
            for name, t in model.state_dict().items()}


def assert_same(a, b):
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("files", ["one", "index", "bin"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_load_is_from_pretrained_bitwise(tmp_path, files, tied, dtype):
    """Every checkpoint layout (one safetensors file, several and their index, PyTorch's .bin),
    tied or untied embeddings, a model dtype other than the stored one: the same parameters,
    buffers, config and generation config as from_pretrained, and the LM head still tied."""
    folder = qwen2_folder(tmp_path / "m", tied=tied, dtype=torch.bfloat16,
                          shard_size="40KB" if files == "index" else "", safe=files != "bin")
    ref, _ = load_model(folder, dtype, "cpu", load="transformers")
    ours, _ = load_model(folder, dtype, "cpu", load="streamed")
    assert_same(ref, ours)
    assert {n: b for n, b in ref.named_buffers()}.keys() == {n for n, _ in ours.named_buffers()}
    assert all(torch.equal(b, dict(ours.named_buffers())[n]) for n, b in ref.named_buffers())
    assert ref.config.to_dict() == ours.config.to_dict()
    assert ref.generation_config.to_dict() == ours.generation_config.to_dict()
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, ours(input_ids=ids).logits)


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_lora_and_quantisation_as_weights_arrive_are_the_references(tmp_path, quantize):
    """A fresh LoRA (the same seeded factors), a loaded adapter, int8 in place (ESSA) and the
    int8 rollout copy (F-GRPO, SFT), each linear quantised as its weight arrives: the same
    tensors as quantising after a whole from_pretrained."""
    if quantize != "none":
        require_torchao()
    folder = qwen2_folder(tmp_path / "m", dtype=torch.bfloat16, adapter=tmp_path / "a")
    fresh = lambda m: attach_lora(m, 4, 8.0, ["q_proj", "v_proj"], seed=3)  # noqa: E731
    loaded = lambda m: load_adapter(m, str(tmp_path / "a"))  # noqa: E731
    for wrap, copy in ((fresh, True), (loaded, False)):
        ref, _ = load_model(folder, "bfloat16", "cpu", load="transformers", wrap=wrap,
                            quantize=quantize, quantized_copy=copy)
        ours, _ = load_model(folder, "bfloat16", "cpu", load="streamed", wrap=wrap,
                             quantize=quantize, quantized_copy=copy)
        assert_same(ref, ours)
        copies = (ref.__dict__.get(COPY, {}), ours.__dict__.get(COPY, {}))
        assert copies[0].keys() == copies[1].keys() and bool(copies[0]) == (
            copy and quantize != "none")
        for name, linear in copies[0].items():
            assert torch.equal(linear.weight.dequantize(), copies[1][name].weight.dequantize())


def test_a_checkpoint_that_lacks_a_tensor_or_holds_another_shape_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = qwen2_folder(tmp_path / "m")
    weights = load_file(f"{folder}/model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k},
              f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"cannot load the model in .*: its weight files lack 1 "
                                        r"tensor\(s\) of the model, first "
                                        r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder, "float32", "cpu")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"tensor model\.norm\.weight is \(3,\) in the "
                                        r"checkpoint, \(64,\) in the model"):
        load_model(folder, "float32", "cpu")


@pytest.fixture(scope="module")
def twelve_layers(tmp_path_factory):
    """A Qwen2 of 12 layers (11.8M parameters, 45 MiB in fp32) whose layers hold nearly all of
    it (the toy tokenizer's 52 tokens): a whole copy of the model is many layers, so a rank that
    held it during the load could not pass for one that holds its shard and a layer. Stored in
    bf16 over three files, with a LoRA adapter."""
    root = tmp_path_factory.mktemp("twelve")
    folder = qwen2_folder(root / "m", hidden=256, layers=12, intermediate=1024,
                          dtype=torch.bfloat16, shard_size="8MB", adapter=root / "a")
    return folder, str(root / "a")


def load_figures(folder, adapter, case, ranks, tmp_path) -> dict:
    out = tmp_path / f"{case}-{ranks}.json"
    proc = run_mpi(ranks, [CHECK, folder, str(out), case, adapter], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


SLACK = 1.05  # of the bound: buffers, the LoRA factors' copies, a tensor's host read


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp2_load_holds_a_shard_and_a_layer_never_the_whole_model(twelve_layers, tmp_path,
                                                                     ranks):
    """F-GRPO's LoRA policy under FSDP2 loaded through the job's path on 2 and 4 gloo ranks: while
    the weights stream in, each rank holds 1/N of the fp32 model plus at most one layer; the
    settling forward then adds the gathered root and three layers (torch's tracker); the plan's
    load phase is the larger within 5%, and the tensors are from_pretrained's."""
    figures = load_figures(*twelve_layers, "fsdp2-lora", ranks, tmp_path)
    share, layer = figures["model_bytes"] / ranks, figures["layer_parameters"] * 4
    root = figures["model_bytes"] - 12 * layer
    for rank in figures["ranks"]:
        assert rank["equal"]
        assert share <= rank["held"] <= SLACK * share
        assert rank["stream_peak"] <= SLACK * (share + layer)
        assert rank["settle_peak"] <= SLACK * (share + root + 3 * layer)
        peak = max(rank["stream_peak"], rank["settle_peak"])
        assert peak < 0.8 * figures["model_bytes"]  # the reference holds it all: 1.0 and more
        assert abs(figures["plan_load"] - peak) <= 0.05 * peak, (figures["plan_load"], peak)


@pytest.mark.mpi
def test_int8_load_holds_the_int8_model_and_one_bf16_linear(twelve_layers, tmp_path):
    """ESSA with model.quantize=int8 on 2 ranks: each linear quantised as it arrives, so a rank's
    peak is the int8 model, its adapter and one bf16 linear with torchao's temporaries, far
    below the bf16 model; the plan's load phase within 5%; the tensors are the reference's."""
    require_torchao()
    figures = load_figures(*twelve_layers, "ddp-int8", 2, tmp_path)
    arriving = figures["largest_linear"] * (2 + 8)
    for rank in figures["ranks"]:
        assert rank["equal"]
        assert rank["stream_peak"] <= SLACK * (rank["held"] + arriving)
        assert rank["stream_peak"] < 0.65 * figures["model_bytes"]
        assert abs(figures["plan_load"] - rank["stream_peak"]) <= 0.05 * rank["stream_peak"]


@pytest.mark.mpi
@pytest.mark.toy
def test_a_job_computes_its_plan_once_and_keeps_it_in_its_run_file(tmp_path):
    """An F-GRPO job on 2 ranks whose plan binds as on a GPU (auto offload, checkpointing and the
    kept rollout engine decided by it): each rank computes the plan once, at its start (every
    call of the method's plan function inside that one computation, none after), and the run
    file holds it."""
    from hpc.toys.toy import toy_model_path

    out = tmp_path / "run"
    proc = run_mpi(2, [COUNT, str(tmp_path / "counts"), "fgrpo", f"model.path={toy_model_path()}",
                       "task.n_train=32", "task.n_eval=8", "fgrpo.batch_prompts=4",
                       "fgrpo.sampling.num_generations=2", "fgrpo.steps=2", "eval.every=1",
                       "eval.n_samples=1", "run.progress=false", "plan.gpu_memory_gib=4",
                       f"run.out={out}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts.{rank}").read_text())
        assert counts["job_plan"] == 1 and counts["plan_inside"] >= 1
        assert counts["plan_after"] == 0
    with h5py.File(out / "fgrpo.h5", "r") as f:
        plan = json.loads(f.attrs["plan"])
    assert plan["enforced"] and plan["method"] == "fgrpo"
    assert list(plan["phases"])[0] == "load" and plan["peak"] == max(plan["phases"].values())
    assert set(plan["choices"]) == {"offload", "rollout_engine_kept"}
    assert "phase load:" in plan["text"]


def test_doctor_weighs_the_loads_host_memory_on_each_node(tmp_path):
    """hpc-doctor on a node's first rank: its ranks times the host memory the plan says a rank
    holds while it loads, against what the node has available. From_pretrained (the whole bf16
    32B model per rank) on 8 ranks fails it; the streamed load (one tensor a rank) on 2 passes."""
    from types import SimpleNamespace

    from hpc.doctor.inputs import host_memory_for_load
    from hpc.engine.shape import QWEN25
    from hpc.job.config import plan_job_class
    from hpc.runtime.config import load_config

    folder = tmp_path / "32B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(QWEN25["32B"], model_type="qwen2")))

    def findings(load, local_size, local_rank=0):
        cfg = load_config(plan_job_class(), os.path.join(os.path.dirname(__file__), "..",
                                                         "configs", "cluster", "math.yaml"),
                          [f"model.path={folder}", f"model.load={load}", "model.quantize=int8"])
        world = SimpleNamespace(size=16, local_rank=local_rank, local_size=local_size)
        return host_memory_for_load({"essa": cfg}, world, "cuda")

    [finding] = findings("transformers", 8)
    assert finding.check == "host memory for the load"
    assert finding.problem.startswith("8 ranks x 61.03 GiB = 488.22 GiB while the model loads")
    assert findings("streamed", 2) == [] and findings("transformers", 8, local_rank=1) == []


def test_a_weight_index_that_is_broken_or_points_outside_the_folder_is_one_line(tmp_path):
    folder = qwen2_folder(tmp_path / "m", shard_size="40KB")
    index = tmp_path / "m" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    index.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"names a weight file outside the folder: "
                                        r"'\.\./\.\./etc/passwd'"):
        load_model(folder, "float32", "cpu")
    index.write_text("{not json")
    with pytest.raises(UserError, match=r"model\.safetensors\.index\.json is not a weight index"):
        load_model(folder, "float32", "cpu")
