"""gpuboot: boot stopped ECS GPU instances for Kubernetes jobs, as Airflow tasks.

The layers, bottom up (each may import only those below it; `make lint` checks it):
core (pure) < hooks (ECS, Kubernetes) < lifecycle (booking, ledger, boot) < triggers <
operators < sensors < task_groups < ui. replay runs the core on a trace.
"""
from gpuboot import _aliases

_aliases.install()
