"""Trace replay: a real GPU-cluster pod trace against boot policies, side by side.

A discrete-event simulation (no sleeping) of a fleet of ECS GPU nodes that are
powered on and off by a policy. The `gpuboot` policy calls the very same
`gpuboot.core.placement.place` the DAGs use, so the figures measure the product.

    python -m gpuboot.replay --help        (PYTHONPATH=plugins)

Modules: `trace` (CSV -> fleet and jobs), `clock` (the event queue), `sim`
(nodes, boots, idle stops), `policies` (who goes where, what gets booted),
`metrics` (what a run cost), `plot` (the PNG), `report` (tables), `cli`.
"""
