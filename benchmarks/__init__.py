"""jaxpar's benchmarks: one module each (`python -m benchmarks.X` from the repository root), their shared model, loss
and batches (`benchmarks.common`), and `python -m benchmarks` to run them all and write one markdown results file
(see benchmarks/__main__.py)."""
