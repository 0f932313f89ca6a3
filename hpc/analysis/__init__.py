"""Offline analysis of run files: reports, plots and the scaling model (never imported at
run time)."""
