"""docs/config.md is what the config classes generate (the same source as every job's --help)."""
import os

from conftest import REPO
from hpc.commands import config_reference
from hpc.runtime.cli import job_help
from hpc.runtime.config import reference_markdown
from sft.config import SFTJobConfig

PAGE = os.path.join(REPO, "docs", "config.md")


def test_config_page_is_what_the_generator_prints():
    with open(PAGE) as fh:
        page = fh.read()
    assert page == config_reference(), (
        "docs/config.md differs from the config classes: regenerate it with `make docs` "
        "(python -c 'from hpc.commands import config_reference; print(config_reference(), end=\"\")')")


def test_config_page_has_every_key_of_every_job_once():
    from essa.config import ESSAJobConfig
    from fgrpo.config import FGRPOJobConfig

    page = config_reference()
    for job in (SFTJobConfig, ESSAJobConfig, FGRPOJobConfig):
        for row in reference_markdown(job).splitlines()[2:]:
            assert page.count(row) == 1, row
    for command in ("## `hpc-sft`", "## `essa`", "## `fgrpo`", "`hpc-eval` has these sections only"):
        assert command in page


def test_help_points_at_the_config_page():
    assert "docs/config.md" in job_help("hpc-sft", "about", SFTJobConfig)


def test_architecture_page_names_the_floors_of_the_import_graph_test():
    from test_import_graph import FLOORS

    with open(os.path.join(REPO, "docs", "architecture.md")) as fh:
        text = fh.read()
    table = text[text.index("| floor (bottom first)"):].split("\n\n")[0]  # the first table
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ")][1:]
    assert [name.split(",")[0].strip() for name, _ in rows] == [name for name, _ in FLOORS]
    for (_, modules), (_, prefixes) in zip(rows, FLOORS):
        for prefix in prefixes:
            path = prefix.replace(".", "/")
            assert f"`{path}/`" in modules or f"`{path}.py`" in modules, (prefix, modules)
