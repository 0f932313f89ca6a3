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
from hpc.runtime.config import config_keys
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
KEY = re.compile(r"(?<![\w./-])(%s)((?:\.[A-Za-z_]\w*)+)" % "|".join(SECTIONS))
FILE_SUFFIXES = {"h5", "yaml", "py", "json", "txt", "sbatch", "png", "csv", "md", "sh", "tmp"}
PATH = re.compile(r"(?<![\w./<-])((?:hpc|essa|fgrpo|benchmarks|jobscripts|configs|tests|docs|"
                  r"\.ci)/[\w./*{},-]*[\w*}]/?)")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+\*?)")
TEST_NAME = re.compile(r"(?<![\w/])(test_\w+\*?)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTPUT_FLAGS = {"--json", "--csv", "--plots", ">"}

# The shell lines a page may show besides the package's own commands, each checked by its own
# rule (test_commands_shown_exist_and_answer_help_with_their_flags): pip (its subcommand's
# --help offers every flag; extras and constraint files exist), python -c (what it imports is
# installed), module (a subcommand of Lmod / Environment Modules), export and NAME=value
# prefixes (a variable the package, its scripts or the library named in LIBRARY_VARIABLES
# reads), . / source, and Slurm's srun / salloc / sbatch (flags from SLURM_FLAGS).
ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
SHELL_COMMANDS = {"pip", "module", "export", ".", "source", "srun", "salloc"}
MODULE_SUBCOMMANDS = {"load", "unload", "avail", "list", "purge", "spider", "show", "swap"}
LIBRARY_VARIABLES = {"MPICC": "mpi4py's build: the MPI compiler wrapper it compiles with"}
SLURM_FLAGS = {"--mpi", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--partition",
               "--account", "--time", "--chdir", "--export", "--output", "--cpus-per-task",
               "--kill-on-bad-exit", "--signal", "--requeue", "--ntasks", "--dependency"}
SLURM_COMMANDS = {"srun", "salloc", "sbatch"}
# Pages on which every line of a shell code block (``` or ```bash) must be a command these
# rules check; what a command prints goes in ```text blocks.
STRICT_PAGES = ("docs/install.md",)
CODE_FOLDERS = ("hpc", "essa", "fgrpo", "jobscripts", "benchmarks", "tests", ".ci")


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
    """Every key of every job, dotted in full (``fgrpo.loss.clip.epsilon``), the sections
    nested in a method's section (``fgrpo.loss``), and the keys a section has moved (its
    ``RENAMED``: still accepted, with a line naming the new key)."""
    keys = set()
    for job in (SFTJobConfig, ESSAJobConfig, FGRPOJobConfig):
        cfg = job()
        for section in dataclasses.fields(cfg):
            for key, _, _ in config_keys(getattr(cfg, section.name), f"{section.name}."):
                parts = key.split(".")
                keys.update(".".join(parts[:n]) for n in range(2, len(parts) + 1))
            keys.update(f"{section.name}.{old}"
                        for old in getattr(getattr(cfg, section.name), "RENAMED", {}))
    return keys


def _command(line: str) -> list:
    """The tokens of a command line from its command on ([] if it is none the tests know):
    console scripts, ``python -m``, ``python FILE.py``, ``python -c``, ``bash FILE``,
    ``sbatch``, ``make``, the repository's scripts and SHELL_COMMANDS, each after an optional
    ``$ ``, ``NAME=value`` assignments and an ``mpirun``/``srun`` prefix (kept where no package
    command follows it)."""
    tokens = line.split(" #")[0].split()
    if tokens[:1] == ["$"]:
        tokens = tokens[1:]
    while tokens and ASSIGNMENT.fullmatch(tokens[0]):
        tokens = tokens[1:]
    if tokens[:1] in (["mpirun"], ["srun"]):
        starts = [i for i, t in enumerate(tokens)
                  if t in _entry_points() or t in ("python", "python3")]
        tokens = tokens[starts[0]:] if starts else tokens if tokens[0] == "srun" else []
    if tokens and (tokens[0] in _entry_points() or tokens[0] in
                   ("python", "python3", "bash", "sbatch", "make", *SHELL_COMMANDS)
                   or re.fullmatch(r"jobscripts/\S+\.(sh|sbatch)", tokens[0])):
        return tokens
    return []


def _commands(page: str) -> list:
    """The command lines of a page (code blocks and inline code) as token lists
    (:func:`_command`)."""
    lines, spans = _blocks_and_spans(_read(page))
    return [tokens for tokens in map(_command, lines + spans) if tokens]


def _assigned(page: str) -> list:
    """The variables a page's commands set: ``NAME=value`` before a command, ``export``."""
    lines, spans = _blocks_and_spans(_read(page))
    names = []
    for line in lines + spans:
        tokens = line.split(" #")[0].split()
        exported = tokens[:1] == ["export"]
        for token in tokens[1:] if exported else tokens:
            if not ASSIGNMENT.fullmatch(token):
                break
            names.append(token.split("=")[0])
    return names


@functools.lru_cache(maxsize=None)
def _code_text() -> str:
    """Every file of the package, its scripts, benchmarks, tests and CI, and the Makefile."""
    paths = [os.path.join(REPO, "Makefile")]
    for folder in CODE_FOLDERS:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            paths += [os.path.join(root, f) for f in files if f.endswith((".py", ".sh", ".sbatch",
                                                                          ".txt", "run"))]
    text = []
    for path in paths:
        with open(path, errors="replace") as fh:
            text.append(fh.read())
    return "\n".join(text)


def _bash_lines(page: str) -> list:
    """The lines of a page's shell code blocks (``` and ```bash), joined at backslashes,
    without comments and blank lines."""
    lines, inside, shell = [], False, False
    for line in _read(page).splitlines():
        if line.startswith("```"):
            inside, shell = not inside, line.strip() in ("```", "```bash", "```sh")
            continue
        if inside and shell:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            elif line.split("#")[0].strip():
                lines.append(line)
    return lines


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
            for flag in _flags(args[2:]):
                text = _help(module) if module in ("essa", "fgrpo") else _module_help(module)
                assert flag in text, f"{page}: `{line}`: python -m {module} has no {flag}"
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
        elif name == "pip" or (name.startswith("python") and args[:2] == ["-m", "pip"]):
            _check_pip(page, line, args[2:] if name.startswith("python") else args)
        elif name.startswith("python") and args[:1] == ["-c"]:
            for module in re.findall(r"\b(?:from|import)\s+([A-Za-z_][\w.]*)", line):
                assert _is_module(module), f"{page}: `{line}`: {module} is not installed"
        elif name == "module":
            assert args[:1] and args[0] in MODULE_SUBCOMMANDS, \
                f"{page}: `{line}`: not a subcommand of module ({sorted(MODULE_SUBCOMMANDS)})"
        elif name == "export":
            assert args and all(ASSIGNMENT.fullmatch(a) for a in args), f"{page}: `{line}`"
        elif name in (".", "source"):
            assert len(args) == 1, f"{page}: `{line}`: sources one file"
        elif name in ("srun", "salloc"):
            _check_slurm_flags(page, line, args)
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
            if name == "sbatch" and scripts:
                _check_slurm_flags(page, line, args[:args.index(scripts[0])])
            assert scripts, f"{page}: `{line}`: names no script of jobscripts/"
            for script in scripts:
                assert os.path.isfile(os.path.join(REPO, script)), f"{page}: `{line}`: no {script}"


def _check_slurm_flags(page: str, line: str, args: list) -> None:
    for flag in _flags(args):
        assert flag in SLURM_FLAGS, f"{page}: `{line}`: {flag} is not one of SLURM_FLAGS"


def _check_pip(page: str, line: str, args: list) -> None:
    """A pip line: its subcommand's --help offers every long flag; the extras (``.[a,b]``)
    are setup.py's; a constraints or requirements file (``-c``/``-r``) exists."""
    assert args, f"{page}: `{line}`: pip without a subcommand"
    text = _pip_help(args[0])
    for flag in _flags(args[1:]):
        assert flag in text, f"{page}: `{line}`: pip {args[0]} --help does not offer {flag}"
    with open(os.path.join(REPO, "setup.py")) as fh:
        extras = re.search(r"extras_require=\{(.*?)\n    \}", fh.read(), re.S).group(1)
    for group in re.findall(r"\.\[([\w,-]+)\]", line):
        for extra in group.split(","):
            assert f'"{extra}":' in extras, f"{page}: `{line}`: setup.py has no extra {extra}"
    for flag, path in zip(args, args[1:]):
        if flag in ("-c", "-r", "--constraint", "--requirement"):
            assert os.path.isfile(os.path.join(REPO, path)), f"{page}: `{line}`: no {path}"


@functools.lru_cache(maxsize=None)
def _module_help(module: str) -> str:
    """What ``python -m MODULE --help`` prints (mpi4py, venv, the package's own modules)."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"python -m {module} --help exited {proc.returncode}"
    return proc.stdout + proc.stderr


@functools.lru_cache(maxsize=None)
def _pip_help(sub: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pip", sub, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"pip {sub} --help exited {proc.returncode}: {proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("page", PAGES)
def test_variables_set_are_read_by_the_package_or_a_library_it_names(page):
    code = _code_text()
    for name in _assigned(page):
        assert name in LIBRARY_VARIABLES or re.search(rf"\b{name}\b", code), \
            f"{page}: sets {name}, which neither the package nor its scripts read"


@pytest.mark.parametrize("page", STRICT_PAGES)
def test_every_shell_line_of_a_strict_page_is_a_checked_command(page):
    unknown = [line.strip() for line in _bash_lines(page) if not _command(line)]
    assert unknown == [], (f"{page}: lines of shell blocks that no rule of this test checks "
                           f"(show output in ```text blocks): {unknown}")


@pytest.mark.parametrize("page", PAGES)
def test_config_keys_named_exist(page):
    keys = _all_keys()
    lines, spans = _blocks_and_spans(_read(page))
    commands = [" ".join(t) for t in _commands(page)]
    for text in spans + commands:
        text = re.sub(r"error: .*?(?=\$ |$)", "", text, flags=re.S)  # a refusal the page shows
        for section, rest in KEY.findall(text):
            key, name = f"{section}{rest}", rest.rsplit(".", 1)[1]
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
