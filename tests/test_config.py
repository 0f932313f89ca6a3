"""Config: YAML + overrides, validation errors naming the key, reference table."""
import pytest

from hpc.runtime.config import config_to_yaml, load_config, reference_markdown
from hpc.runtime.errors import UserError
from hpc.evaluate import EvalJobConfig


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lora:\n  rank: 4\n  targets: [q_proj, v_proj]\ntask:\n  n_eval: 10\n")
    cfg = load_config(EvalJobConfig, str(path), ["lora.rank=16", "eval.temperature=5e-1",
                                                 "lora.targets=q_proj,k_proj"])
    assert cfg.lora.rank == 16 and cfg.task.n_eval == 10 and cfg.eval.temperature == 0.5
    assert cfg.lora.targets == ["q_proj", "k_proj"]
    again = tmp_path / "again.yaml"
    again.write_text(config_to_yaml(cfg))
    assert load_config(EvalJobConfig, str(again)) == cfg


@pytest.mark.parametrize("override, words", [
    ("lora.rnak=4", ["lora.rnak", "does not exist"]),
    ("lorra.rank=4", ["unknown section", "lorra"]),
    ("lora.rank=four", ["lora.rank", "integer"]),
    ("lora.rank=0", ["lora.rank", "minimum"]),
    ("eval.top_p=1.5", ["eval.top_p", "maximum"]),
    ("eval.temperature=nan", ["eval.temperature", "finite"]),
    ("eval.temperature=1e-", ["eval.temperature", "number"]),
    ("model.dtype=float8", ["model.dtype", "not one of"]),
    ("run.progress=maybe", ["run.progress", "true/false"]),
    ("rank=4", ["section.key"]),
    ("lora.rank", ["section.key=value"]),
])
def test_bad_values_name_the_key(override, words):
    with pytest.raises(UserError) as info:
        load_config(EvalJobConfig, None, [override])
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(EvalJobConfig, str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(EvalJobConfig, str(bad))
    flat = tmp_path / "flat.yaml"
    flat.write_text("rank: 4\n")
    with pytest.raises(UserError, match="must be a mapping"):
        load_config(EvalJobConfig, str(flat))


def test_reference_lists_every_key():
    table = reference_markdown(EvalJobConfig)
    for key in ("model.path", "lora.rank", "task.name", "eval.n_samples", "run.out"):
        assert f"`{key}`" in table


def test_every_method_declares_its_sections():
    """The sections a method adds to the shared ones are the entry points (setup.py) that
    other methods' jobs check them by, so no method's section goes unchecked in a file."""
    import dataclasses

    from essa.config import ESSAJobConfig
    from fgrpo.config import FGRPOJobConfig
    from hpc.runtime.config import JobConfig, method_sections
    from sft.config import SFTJobConfig

    shared = {f.name for f in dataclasses.fields(JobConfig)}
    declared = {}
    for job in (SFTJobConfig, ESSAJobConfig, FGRPOJobConfig):
        for f in dataclasses.fields(job):
            if f.name not in shared:
                declared[f.name] = type(getattr(job(), f.name))
    assert declared.keys() == method_sections().keys()
    for name, cls in declared.items():
        assert method_sections()[name].load() is cls


def test_other_methods_sections_are_checked_then_skipped(tmp_path):
    """A file may hold every method's sections (a sweep submits it to each): another method's
    section is checked against its own keys and values, then skipped; on the command line
    another method's key changes nothing, so it is refused."""
    from essa.config import ESSAJobConfig
    from sft.config import SFTJobConfig

    path = tmp_path / "experiment.yaml"
    path.write_text("essa:\n  population: 8\nfgrpo:\n  steps: 3\nsft:\n  steps: 2\n")
    cfg = load_config(ESSAJobConfig, str(path), ["lora.adapter=x"])
    assert cfg.essa.population == 8
    assert load_config(SFTJobConfig, str(path)).sft.steps == 2
    with pytest.raises(UserError, match="essa.popsize"):
        load_config(ESSAJobConfig, str(path), ["essa.popsize=3", "lora.adapter=x"])
    for job, override in ((ESSAJobConfig, "fgrpo.gamma=2"), (SFTJobConfig, "essa.population=8")):
        with pytest.raises(UserError, match=f"'{override.split('=')[0]}' is not read by this job"):
            load_config(job, None, [override, "lora.adapter=x"])
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("fgrpo:\n  gama: 1.0\n")
    with pytest.raises(UserError, match="'fgrpo.gama' does not exist"):
        load_config(ESSAJobConfig, str(misspelt), ["lora.adapter=x"])
    misspelt.write_text("fgrpo:\n  gamma: -1\n")
    with pytest.raises(UserError, match="fgrpo.gamma"):
        load_config(SFTJobConfig, str(misspelt))
