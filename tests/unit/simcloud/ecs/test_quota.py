"""The per-API ECS quota on a fake clock, and its fault syntax."""
import pytest

from simcloud.admin import parse_assignments
from simcloud.config import Faults
from simcloud.ecs.model import EcsError
from simcloud.ecs.quota import ApiQuota


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_a_quota_refuses_until_its_window_ends_and_counts_each_api_alone():
    faults, clock = Faults(ecs_api_quota={"StartInstances": 2, "*": 1}), Clock()
    quota = ApiQuota(faults, clock)
    quota.claim("StartInstances")
    quota.claim("StartInstances")
    quota.claim("DescribeInstances")        # the "*" quota, counted per action
    for at in (1.0, 30.0, 59.9):
        clock.now = at
        with pytest.raises(EcsError) as err:
            quota.claim("StartInstances")
        assert (err.value.code, err.value.status) == ("Throttling.User", 400)
    quota.claim("DescribeInstanceStatus")
    clock.now = 60.0
    quota.claim("StartInstances")            # a new window
    quota.claim("StartInstances")
    with pytest.raises(EcsError):
        quota.claim("StartInstances")


def test_no_quota_is_no_limit_and_the_cli_syntax_sets_one():
    quota = ApiQuota(Faults(), Clock())
    for _ in range(1000):
        quota.claim("DescribeInstances")
    faults = Faults()
    faults.update(parse_assignments(["ecs_api_quota=StartInstances:5,*:100", "ecs_api_quota_window_seconds=10"]))
    assert faults.ecs_api_quota == {"StartInstances": 5.0, "*": 100.0}
    assert faults.ecs_api_quota_window_seconds == 10.0
    with pytest.raises(ValueError):
        faults.update({"ecs_api_quota": {"StartInstances": -1}})
