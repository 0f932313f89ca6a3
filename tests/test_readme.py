"""The README's config reference lists every key of every job, with its current default."""
import os

import pytest

from conftest import REPO
from essa.config import ESSAJobConfig
from fgrpo.config import FGRPOJobConfig
from hpc.runtime.config import reference_markdown
from hpc.sft_config import SFTJobConfig


@pytest.mark.parametrize("job", [SFTJobConfig, ESSAJobConfig, FGRPOJobConfig])
def test_every_key_is_documented(job):
    with open(os.path.join(REPO, "README.md")) as fh:
        readme = fh.read()
    assert readme.startswith("# ") and "make demo" in readme[:400] and "make test" in readme[:400]
    for row in reference_markdown(job).splitlines()[2:]:
        assert row in readme, f"README config reference is stale: {row}"
