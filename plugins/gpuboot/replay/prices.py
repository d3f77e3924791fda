"""What a node of the openb trace costs per hour: the replay's price table (USD, pay-as-you-go).

The trace names GPU models and node shapes, not ECS instance types, so a node's price is
built the way Alibaba Cloud prices its GPU families: a price per GPU of the model plus a
price per vCPU and per GiB of memory,

    price = gpus * PER_GPU[model] + vcpus * PER_VCPU + GiB * PER_GIB

Source and date (looked up 2026-12-01): no authoritative list price was found (ECS prices
vary by region and change; `DescribePrice` is the authority, which is why the product asks
it). The coefficients are fitted to the local cloud's indicative per-type figures
(simcloud/harness.py INSTANCE_TYPES, same date): ecs.g7.xlarge 0.2 (4 vCPU, 16 GiB) gives
PER_VCPU and PER_GIB; gn6i (T4) 1.2, gn7i (A10) 2.1 and gn6v (V100) 2.6 for their 1-GPU
types give the per-GPU figures, which also reproduce their multi-GPU types within 10 %.
The per-vCPU and per-GiB figures are of the order of ECI's published unit prices
(0.1764 CNY per vCPU-hour, 0.0221 CNY per GiB-hour, about 0.025 and 0.003 USD).
Assumptions, not fits: V100 32 GB at 2.6 (its 16 GB twin + ~20 %), P100 at 1.5 (an older
generation, between T4 and V100), and the anonymised G2 and G3 priced like T4 and A10.
Change `PER_GPU` to replay other prices; every figure in summary.json follows.
"""
from __future__ import annotations

from collections.abc import Mapping

PER_VCPU = 0.035     # USD per vCPU-hour
PER_GIB = 0.004      # USD per GiB-hour
PER_GPU: Mapping[str, float] = {   # USD per GPU-hour, by the trace's model column
    "T4": 1.0,
    "A10": 1.7,
    "V100M16": 2.2,
    "V100M32": 2.6,
    "P100": 1.5,
    "G2": 1.0,
    "G3": 1.7,
}
SOURCE = ("indicative USD/h, fitted 2026-12-01 to simcloud/harness.py's ECS figures "
          "(see gpuboot/replay/prices.py)")


def node_price(model: str, gpus: int, cpu_milli: int, memory_mib: int) -> float:
    """USD per hour of one node of the trace; an unknown model is refused, never guessed."""
    if model not in PER_GPU:
        raise ValueError(f"price: no per-GPU price for model {model!r}; add it to "
                         f"gpuboot.replay.prices.PER_GPU (known: {', '.join(sorted(PER_GPU))})")
    return round(gpus * PER_GPU[model] + cpu_milli / 1000 * PER_VCPU + memory_mib / 1024 * PER_GIB, 4)
