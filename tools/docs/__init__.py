"""``make docs``: the generated figures of README.md and docs/*.md (:mod:`tools.docs.pages`),
run from the repository root as ``python -m tools.docs.pages``."""
