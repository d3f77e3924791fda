"""Per-node faults of the local cloud: validated on the way in, looked up by node, instance id or "*"."""
import pytest

from simcloud.admin import parse_assignments
from simcloud.config import Faults


def test_per_node_delays_and_boot_order_are_validated_and_looked_up():
    faults = Faults()
    faults.update({"gpu_reset_delay_seconds": {"gpu-1": "10", "*": 1}, "boot_order": {"i-abc": "kubelet"}})
    assert faults.for_node("gpu_reset_delay_seconds", 0.0, "gpu-1", "i-1") == 10.0
    assert faults.for_node("gpu_reset_delay_seconds", 0.0, "gpu-2", "i-2") == 1.0
    assert faults.for_node("boot_order", "stale-first", "gpu-9", "i-abc") == "kubelet"
    assert faults.for_node("boot_order", "stale-first", "gpu-9", "i-9") == "stale-first"
    with pytest.raises(ValueError, match=r"boot_order.*not one of stale-first, kubelet"):
        faults.update({"boot_order": {"*": "fast"}})
    with pytest.raises(ValueError, match="gpu_register_delay_seconds: seconds must be >= 0"):
        faults.update({"gpu_register_delay_seconds": {"gpu-1": -1}})
    with pytest.raises(ValueError, match="must be an object"):
        faults.update({"gpu_reset_delay_seconds": [1]})


def test_the_cli_reads_node_value_pairs():
    assert parse_assignments(["gpu_reset_delay_seconds=gpu-1:10,gpu-2:2.5", "boot_order=*:kubelet"]) == {
        "gpu_reset_delay_seconds": {"gpu-1": "10", "gpu-2": "2.5"}, "boot_order": {"*": "kubelet"}}
    with pytest.raises(ValueError, match="node:value pairs"):
        parse_assignments(["gpu_reset_delay_seconds=10"])
