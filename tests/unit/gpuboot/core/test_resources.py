"""Quantities and resource vectors: exact, in the scheduler's units."""
from fractions import Fraction

import pytest

from gpuboot.core.resources import GPU, QuantityError, Resources, parse_quantity


@pytest.mark.parametrize("text, expected", [
    ("500m", Fraction(1, 2)),
    ("16Gi", 16 * 2**30),
    ("1e3", 1000),
    ("1E3", 1000),
    ("2k", 2000),
    ("0.1", Fraction(1, 10)),
    ("1.5", Fraction(3, 2)),
    ("1.5Gi", 3 * 2**29),
    ("100Ki", 102400),
    ("1E", 10**18),
    ("1Ei", 2**60),
    ("12e-3", Fraction(12, 1000)),
    (".5", Fraction(1, 2)),
    ("5.", 5),
    ("+2", 2),
    ("-1", -1),
    ("  3  ", 3),
    ("128974848", 128974848),
    ("129M", 129_000_000),
    ("123Mi", 123 * 2**20),
    (2, 2),
    (0.1, Fraction(1, 10)),
])
def test_parse_quantity_is_exact(text, expected):
    assert parse_quantity(text, "f") == expected


@pytest.mark.parametrize("bad", ["", "abc", "1KB", "1ki", "1e", "Gi", "1.2.3", "1 Gi", "--1", "0x10", "1e999",
                                 True, None, float("nan"), float("inf"), [1]])
def test_bad_quantity_names_the_field_and_an_example(bad):
    with pytest.raises(QuantityError) as err:
        parse_quantity(bad, "spec.memory")
    assert "spec.memory" in str(err.value)
    assert "e.g." in str(err.value)


def test_parse_resources_canonical_units_round_up_like_kubernetes():
    r = Resources.parse({"cpu": "0.0001", "memory": "1.5", GPU: "2", "ephemeral-storage": "1Gi", "pods": 0})
    assert r == {"cpu": 1, "memory": 2, GPU: 2, "ephemeral-storage": 2**30}
    assert "pods" not in r  # zero entries dropped
    assert r.gpus == 2


def test_fractional_extended_resource_is_an_error():
    with pytest.raises(QuantityError, match=r"limits\.nvidia\.com/gpu.*whole number"):
        Resources.parse({GPU: "500m"}, field="limits")


def test_negative_amount_is_an_error_naming_the_field():
    with pytest.raises(QuantityError, match=r"requests\.cpu.*negative"):
        Resources.parse({"cpu": "-1"}, field="requests")


def test_parse_rejects_non_mapping():
    with pytest.raises(QuantityError, match="requests: expected a mapping"):
        Resources.parse(["cpu"], field="requests")


def test_arithmetic_is_exact_and_may_go_negative():
    a = Resources.parse({"cpu": "1", "memory": "4Gi", GPU: 1})
    b = Resources.parse({"cpu": "1500m", GPU: 1})
    assert a + b == {"cpu": 2500, "memory": 4 * 2**30, GPU: 2}
    diff = a - b
    assert diff == {"cpu": -500, "memory": 4 * 2**30}
    assert GPU not in diff
    assert (a - a) == Resources() and len(a - a) == 0


def test_fits_in_and_shortfall_per_resource():
    need = Resources.parse({"cpu": "4", "memory": "16Gi", GPU: 2})
    node = Resources.parse({"cpu": "8", "memory": "32Gi", GPU: 1})
    assert not need.fits_in(node)
    assert need.shortfall(node) == {GPU: 1}
    assert need.fits_in(node + {GPU: 1})
    assert need.shortfall(node + {GPU: 1}) == {}
    # a resource missing from capacity counts as 0
    assert not Resources.parse({"example.com/fpga": 1}).fits_in(node)
    assert Resources().fits_in(Resources())
    assert need.fits_in({"cpu": 4000, "memory": 16 * 2**30, GPU: 2})        # any mapping


def test_copies_in_counts_whole_copies_per_resource():
    need = Resources.parse({"cpu": "4", "memory": "16Gi", GPU: 2})
    assert need.copies_in(Resources.parse({"cpu": "32", "memory": "40Gi", GPU: 8}), 100) == 2   # memory-bound
    assert need.copies_in(Resources.parse({"cpu": "32", "memory": "40Gi", GPU: 8}), 1) == 1     # the limit
    assert need.copies_in(Resources.parse({"cpu": "32", "memory": "40Gi"}), 100) == 0            # no GPU
    assert need.copies_in(Resources({"cpu": -1000}), 100) == 0 and Resources().copies_in(Resources(), 7) == 7


def test_immutable_hashable_and_equal_to_plain_mappings():
    a = Resources.parse({"cpu": "1", GPU: 1})
    b = Resources({GPU: 1, "cpu": 1000})
    assert a == b and hash(a) == hash(b)
    assert {a: "x"}[b] == "x"
    assert a == {"cpu": 1000, GPU: 1, "memory": 0}
    with pytest.raises(TypeError):
        a["cpu"] = 1  # type: ignore[index]
    assert a.get("memory") == 0


def test_to_k8s_and_str_are_shortest_exact_forms():
    r = Resources.parse({"memory": "16Gi", GPU: 1, "cpu": "500m", "ephemeral-storage": "1000"})
    assert r.to_k8s() == {"cpu": "500m", "memory": "16Gi", "ephemeral-storage": "1k", GPU: "1"}
    assert str(Resources.parse({"cpu": "500m", "memory": "16Gi", GPU: 1})) == "cpu=500m memory=16Gi nvidia.com/gpu=1"
    assert Resources.parse({"cpu": "2", "memory": "1536Mi"}).to_k8s() == {"cpu": "2", "memory": "1536Mi"}
    assert Resources.parse({"memory": "1G"}).to_k8s() == {"memory": "1G"}
    assert Resources.parse({"memory": "1001"}).to_k8s() == {"memory": "1001"}
    assert str(Resources()) == "none"
    # round trip through the API form
    assert Resources.parse(r.to_k8s()) == r


def test_json_round_trip():
    r = Resources.parse({"cpu": "250m", "memory": "1Gi", GPU: 4})
    assert Resources.from_json(r.to_json()) == r
    assert all(isinstance(v, int) for v in r.to_json().values())


def test_constructor_rejects_non_integer_amounts():
    with pytest.raises(QuantityError, match=r"resources\.cpu"):
        Resources({"cpu": 0.5})
    with pytest.raises(QuantityError):
        Resources({"cpu": True})
