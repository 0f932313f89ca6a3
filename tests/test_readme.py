"""The README and every page of docs/ say what the code does: the commands they show exist and
answer ``--help`` with the flags shown, the files, tests, config keys and make targets they name
exist, relative links resolve (anchors included), every page is reachable from the README, and
no page speaks of how or by whom the software was made.

``docs/config.md`` itself is checked against the config classes in ``tests/test_docs.py``;
``docs/_incoming/`` (drafts waiting to be merged into the pages) is not a page.
"""
import dataclasses
import functools
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from essa.config import ESSAJobConfig
from fgrpo.config import FGRPOJobConfig
from sft.config import SFTJobConfig

PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO)
                               for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
README_MAX_LINES = 260

# Phrases that speak of how or by whom the software was made, not of the software.
MAKING_OF = [r"\bsessions?\b", r"\bmerged?\b", r"\bthis round\b", r"\bbranch(es)?\b",
             r"\bour (machine|code|format|build)s?\b", r"\bthe authors?\b", r"\bwe\b",
             r"\bprototype\b", r"\bwas lent\b", r"\bno GPU (was|has been) lent\b",
             r"\b(suite|jobs?) (ran|running) beside\b", r"\bwhile tuning\b",
             r"\bhelpers?\b", r"\bother engineers\b"]

SECTIONS = ("model", "lora", "task", "eval", "run", "plan", "sft", "essa", "fgrpo")
KEY = re.compile(r"(?<![\w./-])(%s)\.([A-Za-z_][\w]*)" % "|".join(SECTIONS))
FILE_SUFFIXES = {"h5", "yaml", "py", "json", "txt", "sbatch", "png", "csv", "md", "sh", "tmp"}
PATH = re.compile(r"(?<![\w./<-])((?:hpc|essa|fgrpo|benchmarks|jobscripts|configs|tests|docs|"
                  r"\.ci)/[\w./*{},-]*[\w*}]/?)")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+\*?)")
TEST_NAME = re.compile(r"(?<![\w/])(test_\w+\*?)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTPUT_FLAGS = {"--json", "--csv", "--plots", ">"}


def _read(page: str) -> str:
    with open(os.path.join(REPO, page)) as fh:
        return fh.read()


def _blocks_and_spans(text: str) -> tuple:
    """(lines of fenced code blocks, joined at trailing backslashes; inline code spans outside
    them)."""
    lines, spans, prose, inside = [], [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if inside:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line)
        else:
            prose.append(line)
    spans = re.findall(r"`([^`]+)`", "\n".join(prose).replace("\n", " "))
    return lines, spans


@functools.lru_cache(maxsize=None)
def _entry_points() -> dict:
    """{console script: 'module:function'} from setup.py."""
    with open(os.path.join(REPO, "setup.py")) as fh:
        scripts = re.search(r'"console_scripts": \[(.*?)\]', fh.read(), re.S).group(1)
    return dict(re.findall(r'"([\w-]+)=([\w.]+:\w+)"', scripts))


def _all_keys() -> set:
    keys = set()
    for job in (SFTJobConfig, ESSAJobConfig, FGRPOJobConfig):
        cfg = job()
        for section in dataclasses.fields(cfg):
            keys.update(f"{section.name}.{f.name}"
                        for f in dataclasses.fields(getattr(cfg, section.name)))
    return keys


def _commands(page: str) -> list:
    """The command lines of a page as token lists, from the first known command on: console
    scripts, ``python -m``, ``python FILE.py``, ``bash FILE``, ``sbatch``, ``make`` and the
    repository's scripts, each after an optional ``$ `` and ``mpirun``/``srun`` prefix."""
    lines, spans = _blocks_and_spans(_read(page))
    found = []
    for line in lines + spans:
        tokens = line.split(" #")[0].split()
        if tokens[:1] == ["$"]:
            tokens = tokens[1:]
        if tokens[:1] in (["mpirun"], ["srun"]):
            starts = [i for i, t in enumerate(tokens)
                      if t in _entry_points() or t in ("python", "python3")]
            tokens = tokens[starts[0]:] if starts else []
        if tokens and (tokens[0] in _entry_points() or tokens[0] in
                       ("python", "python3", "bash", "sbatch", "make")
                       or re.fullmatch(r"jobscripts/\S+\.(sh|sbatch)", tokens[0])):
            found.append(tokens)
    return found


def _flags(tokens: list) -> list:
    """The long options of a command line (``--help`` aside: every command answers it)."""
    return [t.split("=")[0] for t in tokens
            if re.fullmatch(r"--[a-z][\w-]*(=\S*)?", t) and t != "--help"]


@functools.lru_cache(maxsize=None)
def _help(script: str, sub: str = "") -> str:
    """What ``script [sub] --help`` prints (through its setup.py entry point); fails unless it
    exits 0."""
    module, function = _entry_points()[script].split(":")
    argv = [script] + ([sub] if sub else []) + ["--help"]
    code = (f"import sys; sys.argv = {argv!r}; from {module} import {function} as main; "
            f"sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr[-500:]}"
    return proc.stdout


def test_readme_is_short_and_starts_with_the_set_up_commands():
    readme = _read("README.md")
    assert readme.startswith("# ") and "make demo" in readme[:400] and "make test" in readme[:400]
    assert len(readme.splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    text = _read(page)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(REPO, os.path.dirname(page), path)) if path \
            else os.path.join(REPO, page)
        assert os.path.exists(full), f"{page}: link to {target}: no such file"
        if anchor:
            assert full.endswith(".md"), f"{page}: anchor into a non-markdown file: {target}"
            assert anchor in _anchors(full), f"{page}: link to {target}: no such heading"


def _anchors(path: str) -> set:
    """GitHub's heading anchors of a markdown file."""
    with open(path) as fh:
        headings = [line.lstrip("#").strip() for line in fh if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = {"README.md"}, ["README.md"]
    while todo:
        page = todo.pop()
        for target in LINK.findall(_read(page)):
            path = target.partition("#")[0]
            if path.endswith(".md") and not re.match(r"[a-z]+:", path):
                linked = os.path.relpath(os.path.normpath(
                    os.path.join(REPO, os.path.dirname(page), path)), REPO)
                if linked in PAGES and linked not in seen:
                    seen.add(linked)
                    todo.append(linked)
    orphans = sorted(set(PAGES) - seen)
    assert orphans == [], (f"pages no link reaches from README.md: {orphans}; link each from "
                           f"the README or from a page it links")


@pytest.mark.parametrize("page", PAGES)
def test_no_page_speaks_of_how_the_software_was_made(page):
    text = _read(page)
    found = [m.group(0) for pattern in MAKING_OF
             for m in re.finditer(pattern, text, re.IGNORECASE)]
    assert found == [], f"{page} speaks of how the software was made: {found}"


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.subprocess
def test_commands_shown_exist_and_answer_help_with_their_flags(page):
    for tokens in _commands(page):
        name, args = tokens[0], tokens[1:]
        line = " ".join(tokens)
        if not args and name in ("bash", "sbatch", "python", "python3"):
            continue  # the launcher named in prose
        if name in _entry_points():
            sub = args[0] if args and re.fullmatch(r"[a-z]+", args[0]) else ""
            text = _help(name) + (_help(name, sub) if sub else "")
            for flag in _flags(args):
                assert flag in text, f"{page}: `{line}`: {name} --help does not offer {flag}"
        elif name.startswith("python") and args[:1] == ["-m"]:
            module = args[1]
            assert importlib.util.find_spec(module) is not None, f"{page}: `{line}`: no module"
            if module in ("essa", "fgrpo"):
                for flag in _flags(args[2:]):
                    assert flag in _help(module), f"{page}: `{line}`: no {flag}"
        elif name.startswith("python") and args and args[0].endswith(".py"):
            script = os.path.join(REPO, args[0])
            assert os.path.isfile(script), f"{page}: `{line}`: no file {args[0]}"
            with open(script) as fh:  # benchmarks import torch: their flags are read, not run
                source = fh.read()
            if os.path.isfile(os.path.join(os.path.dirname(script), "common.py")):
                with open(os.path.join(os.path.dirname(script), "common.py")) as fh:
                    source += fh.read()
            for flag in _flags(args[1:]):
                assert f'"{flag}"' in source or f"'{flag}'" in source, \
                    f"{page}: `{line}`: {args[0]} has no option {flag}"
        elif name == "make":
            with open(os.path.join(REPO, "Makefile")) as fh:
                makefile = fh.read()
            targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
            variables = set(re.findall(r"^(\w+)\s*[?:]?=", makefile, re.MULTILINE))
            for target in args:
                if "=" in target:  # make VARIABLE=value: one the Makefile sets
                    assert target.split("=")[0] in variables, \
                        f"{page}: `{line}`: the Makefile has no variable {target}"
                else:
                    assert target in targets, f"{page}: `{line}`: no make target {target}"
        else:  # bash SCRIPT, sbatch ... SCRIPT, jobscripts/SCRIPT
            scripts = [t for t in tokens if t.startswith("jobscripts/")]
            assert scripts, f"{page}: `{line}`: names no script of jobscripts/"
            for script in scripts:
                assert os.path.isfile(os.path.join(REPO, script)), f"{page}: `{line}`: no {script}"


@pytest.mark.parametrize("page", PAGES)
def test_config_keys_named_exist(page):
    keys = _all_keys()
    lines, spans = _blocks_and_spans(_read(page))
    commands = [" ".join(t) for t in _commands(page)]
    for text in spans + commands:
        text = re.sub(r"error: .*?(?=\$ |$)", "", text, flags=re.S)  # a refusal the page shows
        for section, name in KEY.findall(text):
            key = f"{section}.{name}"
            if key in keys or name in FILE_SUFFIXES or _is_module(key):
                continue
            pytest.fail(f"{page}: `{text}` names {key}, which is no config key")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("page", PAGES)
def test_files_and_tests_named_exist(page):
    text = _read(page)
    lines, spans = _blocks_and_spans(text)
    pieces = spans + [" ".join(t) for t in _commands(page)]
    for piece in pieces:
        tokens = piece.split()
        for i, token in enumerate(tokens):
            if i and tokens[i - 1] in OUTPUT_FLAGS or "<" in token or "{" in token:
                continue  # an output the command writes, or a placeholder
            for path in PATH.findall(token.split("::")[0]):
                if not (path.endswith("/") or "." in os.path.basename(path)):
                    continue  # a path inside a run file (essa/fitness), not a file
                assert glob.glob(os.path.join(REPO, path)), f"{page}: names {path}: no such file"
    defined = _test_functions()
    for path, name in TEST_REF.findall(text):
        assert _defined(name, _test_functions(path)), f"{page}: {path}::{name} does not exist"
    for piece in spans:
        for name in TEST_NAME.findall(piece):
            assert _defined(name, defined), f"{page}: test {name} does not exist"


def _defined(name: str, names: frozenset) -> bool:
    """``name`` is one of ``names``; ``prefix*`` matches any name that starts with prefix."""
    return any(n.startswith(name[:-1]) for n in names) if name.endswith("*") else name in names


@functools.lru_cache(maxsize=None)
def _test_functions(path: str = "") -> frozenset:
    """Test functions and module-level names (``TABLE``) of one test file, or of all."""
    files = [os.path.join(REPO, path)] if path else \
        glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True)
    names = set()
    for file in files:
        with open(file) as fh:
            names.update(re.findall(r"^(?:def (\w+)|(\w+) =)", fh.read(), re.MULTILINE))
    return frozenset(n for pair in names for n in pair if n)
