"""Every generated figure of README.md and docs/*.md is what its results file or hpc-plan gives
(tools/docs/pages.py; `make docs` writes them): a typed figure that differs, or a quoted
results file of an older toy build whose block does not name that build, fails here."""
import json
import os
import sys

import numpy as np
import pytest

from conftest import REPO
from hpc.toys import TOY_VERSION

sys.path.insert(0, REPO)  # tools/ is the checkout's own, not installed with the package
from tools.docs import pages  # noqa: E402


def _text(page):
    with open(os.path.join(REPO, page)) as fh:
        return fh.read()


@pytest.mark.parametrize("page", pages.pages())
def test_page_blocks_are_what_their_sources_give(page):
    assert pages.problems(page, _text(page)) == []


def test_every_block_is_on_a_page_and_every_results_file_names_its_provenance():
    used = {m.group(2) for page in pages.pages() for m in pages.BLOCK.finditer(_text(page))}
    assert used == set(pages.BLOCKS)
    for sources, _ in pages.BLOCKS.values():
        for path in sources:
            prov = pages.provenance(path)
            assert {"command", "commit", "toy_build", "machine"} <= set(prov), path


@pytest.mark.parametrize("page,block,typed,retyped", [
    ("README.md", "demo", "92.6%", "93.6%"),
    ("docs/chat.md", "demo-chat", "26.6%", "28.6%"),  # the chat demo's fresh results file
])
def test_a_typed_figure_in_a_copy_of_a_page_fails_the_check(page, block, typed, retyped):
    text = _text(page)
    rest = text[text.index(f"<!-- figures: {block} -->"):]
    edited = text.replace(rest, rest.replace(typed, retyped, 1), 1)
    assert edited != text
    assert pages.problems(page, edited) == [
        f"{page}: block {block!r} differs from its source: regenerate with `make docs`"]
    assert pages.render(page, edited) == text  # make docs puts the figure back


def test_a_plan_figure_typed_otherwise_fails_the_check():
    text = _text("docs/memory-plan.md")
    edited = text.replace("46.26 GiB", "46.17 GiB", 1)
    assert any("'plan-shipped' differs" in line for line in pages.problems("docs/memory-plan.md",
                                                                            edited))


def test_an_older_toy_build_must_be_named_where_its_figures_are_quoted(tmp_path, monkeypatch):
    """A results file of another build than the current one: its block must name that build;
    the same file at the current build needs no such words."""
    folder = tmp_path / "benchmarks" / "results" / "run"
    folder.mkdir(parents=True)
    (folder / "summary.txt").write_text("table\n")
    monkeypatch.setattr(pages, "REPO", str(tmp_path))
    monkeypatch.setitem(pages.BLOCKS, "t", (["benchmarks/results/run/summary.txt"],
                                            lambda page: "figures\n"))
    page = "<!-- figures: t -->\nfigures\n<!-- /figures -->\n"
    for build, named in ((f"{TOY_VERSION} sha256:ab", True), ("toy-model-v0 sha256:cd", False)):
        (folder / "meta.json").write_text(json.dumps(dict(
            command="c", commit="unrecorded", toy_build=build, machine="m")))
        found = pages.problems("docs/x.md", page)
        assert found == ([] if named else [
            "docs/x.md: block 't' quotes benchmarks/results/run/summary.txt of toy build "
            f"toy-model-v0 sha256:cd without naming it (the current build is {TOY_VERSION})"])
    assert "toy-model-v0" in pages.caption("docs/x.md", "benchmarks/results/run/summary.txt")


def test_family_table_states_each_arms_updates_and_gamma_from_the_results():
    block = pages.BLOCKS["family-pairs"][1]("README.md")
    rows = [row.split("|") for row in block.splitlines()
            if row.startswith("| ") and " -> F-" in row]
    # FAMILY_MINI_BATCH=8 of 32, one epoch: 4 updates every arm, as its runs recorded; the
    # focal arms at the presets' gammas
    assert [r[-2].strip() for r in rows] == ["4", "4", "4"]
    assert [r[-3].strip() for r in rows] == ["0.5", "0.5", "1"]


def test_family_pairs_read_pass_at_k_where_the_start_has_headroom():
    """The pairs table's k is the largest at which the SFT start's mean pass@k is below 90%
    (at 16 and 32 the start is above it: no room left for the focal weight to show)."""
    record = json.loads(pages.read(f"{pages.FAMILY}/summary.json"))["family"]
    start = {k: 100 * np.mean(v) for k, v in record["start"]["pass_at_k"].items()}
    assert pages.family_k(record) == 8 and start["8"] < 90 < start["16"]
    record["start"]["pass_at_k"]["16"] = [0.89] * len(record["start"]["seeds"])
    assert pages.family_k(record) == 16
    block = pages.BLOCKS["family-pairs"][1]("README.md")
    assert "toy: pass@8 over the SFT start" in block and "toy: focal - plain, pass@8" in block


@pytest.mark.parametrize("page,block,typed,retyped", [
    ("docs/chat.md", "demo-chat", "37.5%", "39.5%"),
    ("docs/chat.md", "demo-chat-prose", "gained", "lost"),
    ("docs/scaling.md", "scaling-sharded-prose", "0.34x", "0.39x"),
    ("docs/scaling.md", "scaling-quantize", "1.06x", "1.07x"),
    ("docs/benchmarks.md", "gpu-check", "**0.82**", "**0.83**"),
    ("docs/memory-plan.md", "tracker", "| 73.3 |", "| 73.2 |"),
    ("docs/memory-plan.md", "tracker-32b", "70.0 GiB", "69.9 GiB"),
    ("docs/memory-plan.md", "tracker-jobs", "48.49 / 48.71", "48.49 / 48.70"),
    ("docs/memory-plan.md", "tracker-handovers", "(1.25x)", "(1.26x)"),
    ("docs/benchmarks.md", "bench-memory", "706 / 708", "706 / 707"),
    ("docs/benchmarks.md", "gpu-host-bound", "= 0.739", "= 0.740"),
    ("docs/engine.md", "quantization", "0.919", "0.918"),
    ("docs/training-memory.md", "training-memory", "8.34", "8.35"),
    ("docs/reproduce.md", "pilot-findings", "0.65x", "0.66x"),
    ("docs/reproduce.md", "pilot-findings", "p = 0.007", "p = 0.07"),
    ("docs/essa.md", "essa-sigma0", "61.3%", "61.8%"),
    ("docs/toy.md", "demo-kernels", "63.7%", "62.7%"),
])
def test_a_typed_figure_in_a_measured_block_fails_the_check(page, block, typed, retyped):
    """A figure of a block generated from a results file or hpc-scaling, typed otherwise in a
    copy of the block: the check names that block, and ``make docs`` puts the figure back."""
    text = _text(page)
    start = text.index(f"<!-- figures: {block} -->")
    end = text.index("<!-- /figures -->", start) + len("<!-- /figures -->")
    original = text[start:end]
    assert typed in original
    edited = original.replace(typed, retyped, 1)
    assert pages.problems(page, edited) == [
        f"{page}: block {block!r} differs from its source: regenerate with `make docs`"]
    assert pages.render(page, edited) == original


def test_reproduce_words_are_checked_against_its_summary():
    """The reproduction's findings are written from summary.txt only while their words hold:
    a summary where gamma 2 loses plain GRPO's pass@1 is refused, naming the claim."""
    text = _text(pages.REPRODUCE)
    row = next(line for line in text.splitlines() if line.split()[:1] == ["2"])
    changed = text.replace(row, row.replace("66.4 ± 2.4", "60.1 ± 2.4", 1), 1)
    assert changed != text
    with pytest.raises(ValueError, match="gamma 2 keeps plain GRPO's pass@1"):
        pages.tables.pilot_findings(changed, "essa.md")
