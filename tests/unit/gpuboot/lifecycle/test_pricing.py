"""Prices from ECS DescribePrice through the shared cache, against the in-memory fake ECS."""
import logging

import pytest

from gpuboot.core.model import LABEL_PRICE
from gpuboot.lifecycle.booking import survey
from gpuboot.lifecycle.pricing import PriceCache
from tests.builders import TYPES, instance, node
from tests.fakes import T4, T4X2, ZONE, Clock, FakeCluster, FakeEcs

OTHER_ZONE = "cn-hangzhou-i"


def price_calls(ecs):
    return ecs.price_calls


def test_each_offering_is_asked_once_per_ttl():
    clock = Clock()
    ecs = FakeEcs([], TYPES, clock)
    ecs.prices = {T4: 1.4, T4X2: 4.2}
    cache = PriceCache(ttl_seconds=600, clock=clock)
    offerings = [(T4, ZONE), (T4X2, ZONE), (T4, ZONE)]
    assert cache.prices(ecs, offerings) == {(T4, ZONE): 1.4, (T4X2, ZONE): 4.2}
    assert sorted(price_calls(ecs)) == sorted([(T4, ZONE), (T4X2, ZONE)])
    clock.advance(599)
    ecs.prices[T4] = 9.9                                  # a change inside the TTL is not seen yet
    assert cache.prices(ecs, offerings)[(T4, ZONE)] == 1.4 and len(price_calls(ecs)) == 2
    assert cache.prices(ecs, [(T4, OTHER_ZONE)]) == {(T4, OTHER_ZONE): 9.9}     # per zone
    clock.advance(1)
    assert cache.prices(ecs, [(T4, ZONE)]) == {(T4, ZONE): 9.9}                # expired: asked again
    assert len(price_calls(ecs)) == 4


def test_an_unpriced_type_is_remembered_as_unpriced_and_logged(caplog):
    clock = Clock()
    ecs = FakeEcs([], TYPES, clock)                       # no prices at all
    cache = PriceCache(ttl_seconds=600, clock=clock)
    with caplog.at_level(logging.WARNING, logger="gpuboot.lifecycle.pricing"):
        assert cache.prices(ecs, [(T4, ZONE)]) == {(T4, ZONE): None}
        assert cache.prices(ecs, [(T4, ZONE)]) == {(T4, ZONE): None}
    assert len(price_calls(ecs)) == 1
    assert [r.getMessage() for r in caplog.records if "no ECS price" in r.getMessage()] == [
        (f"no ECS price for {T4} in {ZONE} (InvalidInstanceType.ValueNotSupported: The specified InstanceType does "
        "not exist or beyond the permitted range.); placement ranks it by GPUs until 600s from now (grant "
        "ecs:DescribePrice, or label the node gpuboot.io/price-per-hour)")]


def test_a_transient_error_keeps_the_last_price_and_asks_again_next_time():
    clock = Clock()
    ecs = FakeEcs([], TYPES, clock)
    ecs.prices = {T4: 1.4}
    cache = PriceCache(ttl_seconds=60, clock=clock)
    assert cache.prices(ecs, [(T4, ZONE)]) == {(T4, ZONE): 1.4}
    clock.advance(61)
    ecs.price_errors[T4] = "ServiceUnavailable"
    assert cache.prices(ecs, [(T4, ZONE)]) == {(T4, ZONE): 1.4}          # the last answer, not remembered anew
    assert cache.prices(ecs, [(T4, ZONE)]) == {(T4, ZONE): 1.4}
    assert len(price_calls(ecs)) == 3


def test_a_negative_ttl_is_refused():
    with pytest.raises(ValueError, match="ttl_seconds"):
        PriceCache(ttl_seconds=-1)


def test_the_survey_prices_nodes_from_ecs_and_the_label_overrides():
    clock = Clock()
    nodes = [node("priced"), node("labelled", labels={LABEL_PRICE: "0.5"}), node("big", gpus=2)]
    instances = [instance("priced"), instance("labelled"), instance("big", itype=T4X2, gpus=2)]
    ecs = FakeEcs(instances, TYPES, clock)
    ecs.prices = {T4: 1.4}                                # T4X2 has no price in ECS
    cache = PriceCache(clock=clock)
    views = {v.name: v for v in survey(FakeCluster(nodes), ecs, [], clock(), prices=cache).views}
    assert (views["priced"].price_per_hour, views["labelled"].price_per_hour, views["big"].price_per_hour) == \
        (1.4, 0.5, None)
    survey(FakeCluster(nodes), ecs, [], clock(), prices=cache)
    assert sorted(price_calls(ecs)) == sorted([(T4, ZONE), (T4X2, ZONE)])       # the second survey asked nothing
