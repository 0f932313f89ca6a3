"""F-GRPO's surrogates are components: each one file with its formula and its own keys,
registered in fgrpo.surrogates.SURROGATES (another package's through an entry point); the loss
and the config find them there."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from fgrpo.config import FGRPOJobConfig
from fgrpo.surrogates import SURROGATES, from_config, surrogates
from fgrpo.surrogates.cispo import CISPO
from fgrpo.surrogates.clip import Clip
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError


def test_each_surrogate_reads_its_own_section():
    """fgrpo.loss nests one section per registered surrogate, the surrogate's class itself;
    the loss calls the one fgrpo.loss.surrogate names, with its section's values."""
    assert SURROGATES == {"clip": Clip, "cispo": CISPO} and set(surrogates()) >= set(SURROGATES)
    cfg = load_config(FGRPOJobConfig, None, ["fgrpo.loss.clip.epsilon=0.1",
                                             "fgrpo.loss.clip.epsilon_high=0.3",
                                             "fgrpo.loss.clip.ratio_c=3",
                                             "fgrpo.loss.cispo.epsilon_high=2"]).fgrpo
    assert from_config(cfg.loss) == Clip(0.1, 0.3, 3.0)
    assert from_config(cfg.loss) is cfg.loss.clip
    cfg = load_config(FGRPOJobConfig, None, ["fgrpo.algorithm=cispo",
                                             "fgrpo.loss.cispo.epsilon_high=2"]).fgrpo
    assert from_config(cfg.loss) == CISPO(1.0, 2.0)
    assert cfg.loss.clip == Clip()  # the clip section is not read under cispo


def test_a_surrogate_checks_its_own_values():
    with pytest.raises(UserError, match=r"'fgrpo.loss.clip.ratio_c': 0.5 must be 0 .* or > 1"):
        load_config(FGRPOJobConfig, None, ["fgrpo.loss.clip.ratio_c=0.5"])
    assert load_config(FGRPOJobConfig, None, ["fgrpo.loss.clip.ratio_c=3"]).fgrpo.loss.clip \
        .ratio_c == 3.0


TOY_LOSS = '''
"""A toy surrogate: REINFORCE, -scale * A * log pi, no ratio and no clip."""
from dataclasses import dataclass

from hpc.runtime.config import param


@dataclass
class Reinforce:
    scale: float = param(1.0, "the loss's factor", min=0.0, max=10.0)

    def __call__(self, logp, ratio, adv):
        import torch

        none = torch.zeros_like(ratio, dtype=torch.bool)
        return -self.scale * adv * logp, none, none
'''

PROBE = '''
import json

import torch
from fgrpo.config import FGRPOJobConfig
from fgrpo.loss import policy_loss
from fgrpo.surrogates import from_config
from hpc.runtime.config import load_config

cfg = load_config(FGRPOJobConfig, None, ["fgrpo.loss.surrogate=reinforce",
                                         "fgrpo.loss.reinforce.scale=2"]).fgrpo
logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
adv = torch.tensor([1.0, -2.0])
loss, stats = policy_loss(logp, logp.detach() - 0.3, adv, torch.ones(2, 2), "token-mean",
                          from_config(cfg.loss))
loss.backward()
default = load_config(FGRPOJobConfig, None, []).fgrpo.loss
print(json.dumps([float(loss), logp.grad.tolist(), float(stats["clip_fraction"]),
                  type(from_config(default)).__name__]))
'''


@pytest.mark.subprocess
def test_another_package_plugs_a_surrogate_in_through_its_entry_point(tmp_path):
    """A surrogate in another package's module, declared in its fgrpo.surrogates entry-point
    group (here by a dist-info folder beside it, as pip would write for that package): the config
    accepts its name and its own key (fgrpo.loss.reinforce.scale), and the loss computes with
    it, -scale * A * logp over the valid tokens. Its entry point named clip (as a stale
    egg-info of this package would hold) does not replace the in-tree clip."""
    (tmp_path / "toyloss.py").write_text(TOY_LOSS)
    info = tmp_path / "toyloss-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyloss\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fgrpo.surrogates]\nreinforce = toyloss:Reinforce\n"
                                           "clip = toyloss:Reinforce\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loss, grad, clipped, default = json.loads(proc.stdout)
    # token-mean of -2 * A * logp over 4 tokens: 2 * (1 + 2 - 2 * 0.5 - 2 * 0.1) / 4
    assert loss == pytest.approx(2 * (1.0 + 2.0 - 1.0 - 0.2) / 4)
    assert grad == [[-0.5, -0.5], [1.0, 1.0]] and clipped == 0 and default == "Clip"
    help_text = subprocess.run([sys.executable, "-m", "fgrpo", "--help"], capture_output=True,
                               text=True, timeout=120, env=env, cwd=tmp_path).stdout
    assert "fgrpo.loss.surrogate = 'clip'  (one of cispo, clip, reinforce)" in help_text
    assert "fgrpo.loss.reinforce.scale = 1.0  (>= 0.0 <= 10.0)" in help_text


def test_the_loss_has_no_branch_per_surrogate():
    """fgrpo/loss.py and fgrpo/gradients.py pick no surrogate by name: each lives in its own
    file and is found through SURROGATES."""
    for name in ("loss.py", "gradients.py"):
        with open(os.path.join(REPO, "fgrpo", name)) as fh:
            text = fh.read()
        assert "surrogate ==" not in text and not re.search(r"surrogates\.(clip|cispo)", text)
    assert torch.equal(Clip()(torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))[0],
                       -torch.ones(1, 1))
