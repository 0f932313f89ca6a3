"""--resume names each key whose value differs from the run file's (hpc.job.inputs.resume_notes):
a run begun before a preset changed (issue 50) does not take the new values silently."""
import h5py
import yaml

from fgrpo.config import FGRPOJobConfig
from hpc.job.inputs import resume_notes
from hpc.runtime.config import config_to_yaml, load_config


def _run_file(path, config: dict) -> str:
    with h5py.File(path, "w") as f:
        f.attrs["config"] = yaml.safe_dump(config)
    return str(path)


def test_a_changed_preset_value_gets_one_line_each(tmp_path):
    now = config_to_yaml(load_config(FGRPOJobConfig, None, ["fgrpo.algorithm=grpo"]))
    before = yaml.safe_load(now)
    before["fgrpo"]["advantage"]["gamma"] = 1.0  # the grpo preset's earlier values
    before["fgrpo"]["loss"]["clip"]["epsilon_high"] = 0.28
    del before["reward"]  # a section the earlier version had not: no line
    notes = resume_notes(_run_file(tmp_path / "fgrpo.h5", before), now)
    assert notes == [
        "note: --resume: fgrpo.advantage.gamma=0.5 here, 1.0 in the run file; the run goes on "
        "with 0.5 (give fgrpo.advantage.gamma=1.0 to keep the run's value)",
        "note: --resume: fgrpo.loss.clip.epsilon_high=0.2 here, 0.28 in the run file; the run "
        "goes on with 0.2 (give fgrpo.loss.clip.epsilon_high=0.28 to keep the run's value)"]


def test_an_unchanged_config_and_a_moved_key_get_none(tmp_path):
    now = config_to_yaml(load_config(FGRPOJobConfig, None, []))
    before = yaml.safe_load(now)
    before["fgrpo"]["gamma"] = before["fgrpo"]["advantage"].pop("gamma")  # the flat layout
    assert resume_notes(_run_file(tmp_path / "fgrpo.h5", before), now) == []
    assert resume_notes(str(tmp_path / "missing.h5"), now) == []
