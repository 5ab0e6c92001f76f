"""`python run.py`: the run configuration and its flags, building a run from it, the run itself and resuming."""
