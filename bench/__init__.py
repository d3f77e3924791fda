"""`make bench` (python -m bench): placement cost, readiness detection lag, end-to-end overhead.

Each part is a module with `run(workdir, quick) -> dict`; `__main__` prints the
tables and writes the figures as JSON under results/bench/.
"""
