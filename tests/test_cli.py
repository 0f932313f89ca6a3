"""Every console command answers --help without importing torch (what makes it answer at once),
and a job's help lists its config keys and the exit codes."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

with open(os.path.join(REPO, "setup.py")) as fh:  # the console scripts, not other entry points
    ENTRY_POINTS = re.findall(r'"([\w-]+)=([\w.]+):(\w+)"',
                              re.search(r'"console_scripts": \[(.*?)\]', fh.read(), re.S).group(1))

# Calls the entry point as the console script would, then reports what it imported.
PROBE = """
import sys
from {module} import {function} as main
sys.argv = ["{name}", "--help"]
try:
    code = main()
except SystemExit as stop:
    code = stop.code
print("EXIT", code or 0, "SCIPY", "scipy" in sys.modules, "TORCH", "torch" in sys.modules,
      "TRANSFORMERS", "transformers" in sys.modules)
"""


def test_every_console_command_is_probed():
    names = {name for name, _, _ in ENTRY_POINTS}
    assert {"essa", "fgrpo", "hpc-sft", "hpc-eval", "hpc-toy", "hpc-report", "hpc-scaling",
            "hpc-plan", "hpc-data", "hpc-doctor"} <= names


@pytest.mark.parametrize("name,module,function", ENTRY_POINTS)
@pytest.mark.subprocess
def test_help_without_torch(name, module, function):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(**locals())], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("EXIT 0 SCIPY False TORCH False TRANSFORMERS False"), \
        proc.stdout
    assert "exit codes: 0 done; 2 user error" in proc.stdout.replace("\n", " ")
    assert not re.search(r":[a-z]+:`|``", proc.stdout), proc.stdout  # plain text, no roles


@pytest.mark.parametrize("name, argv, words", [
    ("hpc-report", ["sumary"], ["invalid choice: 'sumary'", "usage: hpc-report"]),
    ("hpc-report", ["summary", "x.h5", "--plts", "d"], ["unrecognized arguments: --plts"]),
    ("hpc-scaling", ["--nope"], ["unrecognized arguments: --nope", "see hpc-scaling --help"]),
    ("hpc-plan", ["--config", "x"], ["unrecognized arguments: --config"]),
    ("hpc-data", ["chek"], ["invalid choice: 'chek'"]),
    ("hpc-toy", ["--rebuilt"], ["unrecognized arguments: --rebuilt"]),
    ("hpc-doctor", ["c.yaml", "--rank", "2"], ["unrecognized arguments: --rank"]),
])
@pytest.mark.subprocess
def test_a_mistyped_subcommand_or_flag_is_one_line(name, argv, words):
    module, function = next((m, f) for n, m, f in ENTRY_POINTS if n == name)
    proc = subprocess.run([sys.executable, "-c", f"from {module} import {function} as main; "
                           f"main({argv!r})"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc
    assert lines[0].startswith(f"error: {name}: ") and all(w in lines[0] for w in words), lines


@pytest.mark.subprocess
def test_hpc_scaling_takes_its_config_first_like_every_command():
    proc = subprocess.run([sys.executable, "-c", "from compare.options import build_parser; "
                           "from compare.scaling import main; "
                           "print(build_parser().parse_args(['c.yaml']).config_file); "
                           "main(['a.yaml', '--config', 'b.yaml'])"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout == "c.yaml\n" and proc.returncode == 2, proc
    assert "two configs, a.yaml and --config b.yaml" in proc.stderr


@pytest.mark.parametrize("name,keys", [
    ("essa", ["essa.population = 96", "lora.adapter = ''", "plan.gpu_memory_gib = 80.0"]),
    ("fgrpo", ["fgrpo.optim.micro_batch = 64", "fgrpo.loss.aggregation = 'token-mean'"]),
    ("hpc-sft", ["sft.steps = 40", "task.max_new_tokens = 8"]),
    ("hpc-eval", ["eval.n_samples = 8", "model.path = 'toy'"]),
])
@pytest.mark.subprocess
def test_job_help_lists_config_keys_and_preemption_code(name, keys):
    module, function = next((m, f) for n, m, f in ENTRY_POINTS if n == name)
    proc = subprocess.run([sys.executable, "-c", PROBE.format(**locals())], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    for key in keys:
        assert key in proc.stdout
    assert "3 preempted" in proc.stdout
