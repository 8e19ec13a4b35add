"""Sweeps declared in config files (sweep.py) and their reports and plots (report.py)."""
