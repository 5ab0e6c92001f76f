"""jaxpar's benchmarks: standalone scripts (`python benchmarks/X.py`), and `python -m benchmarks` to run them all and
write one markdown results file (see benchmarks/__main__.py)."""
