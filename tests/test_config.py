"""Config: YAML + overrides, validation errors naming the key, reference table."""
import pytest

from hpc.job.config import JobConfig
from hpc.runtime.config import config_to_yaml, get_key, load_config, reference_markdown, stored_config
from hpc.runtime.errors import UserError


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lora:\n  rank: 4\n  targets: [q_proj, v_proj]\ntask:\n  n_eval: 10\n")
    cfg = load_config(JobConfig, str(path), ["lora.rank=16", "eval.temperature=5e-1",
                                                 "lora.targets=q_proj,k_proj"])
    assert cfg.lora.rank == 16 and cfg.task.n_eval == 10 and cfg.eval.temperature == 0.5
    assert cfg.lora.targets == ["q_proj", "k_proj"]
    again = tmp_path / "again.yaml"
    again.write_text(config_to_yaml(cfg))
    assert load_config(JobConfig, str(again)) == cfg


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
        load_config(JobConfig, None, [override])
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(JobConfig, str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(JobConfig, str(bad))
    flat = tmp_path / "flat.yaml"
    flat.write_text("rank: 4\n")
    with pytest.raises(UserError, match="must be a mapping"):
        load_config(JobConfig, str(flat))


def test_reference_lists_every_key():
    table = reference_markdown(JobConfig)
    for key in ("model.path", "lora.rank", "task.name", "eval.n_samples", "run.out"):
        assert f"`{key}`" in table


def test_every_method_declares_its_sections():
    """The sections a method adds to the shared ones are the entry points (setup.py) that
    other methods' jobs check them by, so no method's section goes unchecked in a file."""
    import dataclasses

    from essa.config import ESSAJobConfig
    from fgrpo.config import FGRPOJobConfig
    from hpc.job.config import JobConfig
    from hpc.runtime.methods import methods
    from sft.config import SFTJobConfig

    shared = {f.name for f in dataclasses.fields(JobConfig)}
    declared = {}
    for job in (SFTJobConfig, ESSAJobConfig, FGRPOJobConfig):
        for f in dataclasses.fields(job):
            if f.name not in shared:
                declared[f.name] = type(getattr(job(), f.name))
    assert declared.keys() == methods().keys()
    for name, cls in declared.items():
        assert methods()[name].section_class() is cls
        assert dataclasses.fields(methods()[name].job_class()) == dataclasses.fields(
            {"sft": SFTJobConfig, "essa": ESSAJobConfig, "fgrpo": FGRPOJobConfig}[name])


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
    for job, override in ((ESSAJobConfig, "fgrpo.advantage.gamma=2"),
                          (SFTJobConfig, "essa.population=8")):
        with pytest.raises(UserError, match=f"'{override.split('=')[0]}' is not read by this job"):
            load_config(job, None, [override, "lora.adapter=x"])
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("fgrpo:\n  gama: 1.0\n")
    with pytest.raises(UserError, match="'fgrpo.gama' does not exist"):
        load_config(ESSAJobConfig, str(misspelt), ["lora.adapter=x"])
    misspelt.write_text("fgrpo:\n  gamma: -1\n")
    with pytest.raises(UserError, match="fgrpo.advantage.gamma"):
        load_config(SFTJobConfig, str(misspelt))


# ------------------------------------------------------------ sections nested in a section

NESTED = """fgrpo:
  steps: 3
  advantage:
    gamma: 2.0
  loss:
    aggregation: seq-mean-token-mean
    clip:
      epsilon_high: 0.3
"""


def test_nested_sections_from_file_and_command_line(tmp_path):
    """A method's section nests sections by concern: YAML mappings in the file, dotted keys on
    the command line; the stored YAML loads back to the same config."""
    from fgrpo.config import FGRPOJobConfig

    path = tmp_path / "c.yaml"
    path.write_text(NESTED)
    cfg = load_config(FGRPOJobConfig, str(path), ["fgrpo.loss.clip.epsilon=0.1",
                                                  "fgrpo.optim.micro_batch=4"])
    f = cfg.fgrpo
    assert (f.steps, f.advantage.gamma, f.loss.aggregation, f.loss.clip.epsilon,
            f.loss.clip.epsilon_high, f.optim.micro_batch) == \
        (3, 2.0, "seq-mean-token-mean", 0.1, 0.3, 4)
    again = tmp_path / "again.yaml"
    again.write_text(config_to_yaml(cfg))
    assert load_config(FGRPOJobConfig, str(again)) == cfg


@pytest.mark.parametrize("override, line", [
    ("fgrpo.loss=3", "config key 'fgrpo.loss' is a section, not a key (its keys: surrogate, "),
    ("fgrpo.steps.x=1", "config key 'fgrpo.steps.x': fgrpo.steps is a key, not a section"),
    ("fgrpo.loss.clip.eps=1", "does not exist (keys of fgrpo.loss.clip: epsilon, epsilon_high, "
                              "ratio_c); did you mean fgrpo.loss.clip.epsilon?"),
    ("fgrpo.loss.gama=1", "did you mean fgrpo.advantage.gamma?"),
    ("fgrpo.optim.micro_batch=0", "config key 'fgrpo.optim.micro_batch': 0 is below the "
                                  "minimum 1"),
])
def test_nested_key_mistakes_name_the_key(override, line):
    from fgrpo.config import FGRPOJobConfig

    with pytest.raises(UserError) as err:
        load_config(FGRPOJobConfig, None, [override])
    assert line in str(err.value) and "\n" not in str(err.value)


def test_renamed_keys_are_read_at_their_new_place_with_a_line_each(tmp_path):
    """The flat fgrpo keys of earlier versions (fgrpo.gamma, fgrpo.epsilon, ...) still run, in
    a file or on the command line, each with one line naming the new key; a preset treats them
    as given, and the run file stores the new names."""
    from fgrpo.config import RENAMED, FGRPOJobConfig

    path = tmp_path / "old.yaml"
    path.write_text("fgrpo:\n  gamma: 0.5\n  num_generations: 4\n  epsilon: 0.1\n")
    notes = []
    cfg = load_config(FGRPOJobConfig, str(path), ["fgrpo.algorithm=dapo", "fgrpo.epsilon=0.15",
                                                  "fgrpo.parallelism=ddp"], notes=notes)
    f = cfg.fgrpo
    assert (f.advantage.gamma, f.sampling.num_generations, f.loss.clip.epsilon,
            f.parallel.strategy) == (0.5, 4, 0.15, "ddp")  # dapo's 0.2 does not override it
    assert notes == [
        "config key 'fgrpo.gamma' is now 'fgrpo.advantage.gamma' (read as that; the run "
        "file's config has the new name)",
        "config key 'fgrpo.num_generations' is now 'fgrpo.sampling.num_generations' (read as "
        "that; the run file's config has the new name)",
        "config key 'fgrpo.epsilon' is now 'fgrpo.loss.clip.epsilon' (read as that; the run "
        "file's config has the new name)",
        "config key 'fgrpo.parallelism' is now 'fgrpo.parallel.strategy' (read as that; the "
        "run file's config has the new name)"]
    stored = stored_config(config_to_yaml(cfg))["fgrpo"]
    assert stored["advantage"]["gamma"] == 0.5 and not set(stored) & set(RENAMED)
    every = load_config(FGRPOJobConfig, None, [f"fgrpo.{old}={value}" for old, value in
                                               OLD_VALUES.items()])
    assert {new: get_key(every.fgrpo, new) for new in RENAMED.values()} == \
        {RENAMED[old]: value for old, value in OLD_VALUES.items()}


# a value of every old flat key, none its default
OLD_VALUES = {
    "num_generations": 4, "temperature": 0.7, "top_p": 0.9, "dynamic_sampling": True,
    "max_refills": 3, "filtered_share": 0.5, "success_threshold": 0.5, "overlong_buffer": 4,
    "overlong_penalty": 0.5, "gamma": 2.0, "scale_rewards": "batch", "advantage_epsilon": 1e-6,
    "surrogate": "cispo", "loss_type": "seq-mean-token-sum", "beta": 0.1,
    "overlong_filter": True, "epsilon": 0.1, "epsilon_high": 0.3, "clip_ratio_c": 3.0,
    "cispo_epsilon_low": 0.5, "cispo_epsilon_high": 2.0, "learning_rate": 1e-4,
    "weight_decay": 0.1, "max_grad_norm": 0.5, "num_iterations": 2, "micro_batch": 8,
    "parallelism": "ddp", "offload": "none"}


def test_a_stored_config_of_an_old_run_file_reads_in_todays_layout():
    """Reports read a run file's config with stored_config: the flat fgrpo keys an older run
    file holds are at their new place, a new file's are as they are."""
    from fgrpo.config import FGRPOJobConfig

    old = "fgrpo:\n  steps: 5\n  gamma: 0.5\n  num_iterations: 2\n  clip_ratio_c: 3.0\n" \
          "run:\n  seed: 7\n"
    data = stored_config(old)
    assert data == {"fgrpo": {"steps": 5, "advantage": {"gamma": 0.5},
                              "optim": {"num_iterations": 2}, "loss": {"clip": {"ratio_c": 3.0}}},
                    "run": {"seed": 7}}
    new = config_to_yaml(load_config(FGRPOJobConfig, None, ["fgrpo.advantage.gamma=0.5"]))
    assert stored_config(new)["fgrpo"]["advantage"]["gamma"] == 0.5
    assert stored_config("") == {}


def test_a_config_of_eval_batch_size_alone_keeps_its_old_meaning_with_a_note(tmp_path):
    """model.decode_batch was split off eval.batch_size (param(follows=...)): a config that
    sets only the old key decodes training batches of that size, as before, and says so in
    one line; one that sets both keeps them apart, without a line."""
    old = tmp_path / "old.yaml"
    old.write_text("eval:\n  batch_size: 32\n")
    notes = []
    cfg = load_config(JobConfig, str(old), [], notes=notes)
    assert (cfg.model.decode_batch, cfg.eval.batch_size) == (32, 32)
    assert notes == ["note: model.decode_batch=32, from eval.batch_size as before "
                     "model.decode_batch existed; give model.decode_batch to set the two apart"]
    notes = []
    cfg = load_config(JobConfig, str(old), ["model.decode_batch=8"], notes=notes)
    assert (cfg.model.decode_batch, cfg.eval.batch_size, notes) == (8, 32, [])
    assert load_config(JobConfig, None, []).model.decode_batch == 64
