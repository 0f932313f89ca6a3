"""The repository's own tools, run from a checkout (never installed: setup.py's packages list
names hpc, sft, essa, fgrpo and compare only)."""
