"""Kubernetes quantities and resource vectors, exact (no floats).

Placement decides per resource whether a task fits one node, so the arithmetic
must be exact and use the same units and rounding as the Kubernetes scheduler:
cpu in millicores and memory-like resources in bytes (both rounded up, as
`Quantity.MilliValue()` / `Value()` do), other (extended) resources in whole
units, where a fraction is an error, as the API server says.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator, Mapping
from fractions import Fraction

from gpuboot.exceptions import QuantityError

GPU = "nvidia.com/gpu"
CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"

_BINARY: dict[str, int] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, Fraction | int] = {"m": Fraction(1, 1000), "": 1, "k": 10**3, "M": 10**6, "G": 10**9,
            "T": 10**12, "P": 10**15, "E": 10**18}
# <signedNumber><suffix> from k8s.io/apimachinery/pkg/api/resource/quantity.go
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_SUFFIX = r"Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E"
_QUANTITY = re.compile(rf"(?P<number>[+-]?{_NUMBER})(?:(?P<suffix>{_SUFFIX})|[eE](?P<exp>[+-]?\d+))?")
# the same grammar, non-negative, as a JSON-schema (ECMA) pattern for UI forms
QUANTITY_PATTERN = rf"^\s*\+?{_NUMBER}(?:{_SUFFIX}|[eE][+-]?\d+)?\s*$"
_MAX_EXPONENT = 64  # far beyond any real quantity; bounds the work on hostile input
_EXAMPLES = "e.g. 500m, 2, 1.5, 16Gi, 100Mi, 2k or 1e3"


def parse_quantity(value: str | int | float, field: str) -> Fraction:
    """Parse a Kubernetes quantity exactly; `field` names the value in errors."""
    if isinstance(value, bool):
        raise QuantityError(f"{field}: {value!r} is not a quantity; write a number or a string, {_EXAMPLES}")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(f"{field}: {value!r} is not a finite quantity; {_EXAMPLES}")
        return Fraction(repr(value))  # the decimal the user wrote, not the binary float
    if not isinstance(value, str):
        raise QuantityError(
            f"{field}: expected a quantity string or number, got {type(value).__name__}; {_EXAMPLES}")
    text = value.strip()
    match = _QUANTITY.fullmatch(text)
    if not match:
        raise QuantityError(f"{field}: {value!r} is not a Kubernetes quantity; {_EXAMPLES}")
    number = Fraction(match["number"])
    if match["exp"] is not None:
        exponent = int(match["exp"])
        if abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"{field}: exponent in {value!r} is out of range; {_EXAMPLES}")
        return number * Fraction(10) ** exponent
    suffix = match["suffix"] or ""
    return number * (_BINARY.get(suffix) or _DECIMAL[suffix])


def _is_bytes(name: str) -> bool:
    return name in (MEMORY, EPHEMERAL_STORAGE) or name.startswith("hugepages-")


def _canonical(name: str, quantity: Fraction, field: str) -> int:
    """Quantity -> canonical integer unit of resource `name`."""
    if name == CPU:
        return math.ceil(quantity * 1000)
    if _is_bytes(name):
        return math.ceil(quantity)
    if quantity.denominator != 1:
        raise QuantityError(
            f"{field}: {name} must be a whole number (extended resources cannot be fractional); "
            f"got {float(quantity):g}, e.g. write 1 or 2")
    return int(quantity)


@functools.lru_cache(maxsize=4096)
def _amount(name: str, value: str | int | float, field: str = "") -> int:
    """One quantity of resource `name` in canonical units (cached: clusters repeat the same few)."""
    quantity = parse_quantity(value, field)
    if quantity < 0:
        raise QuantityError(f"{field}: {value!r} is negative; resource amounts must be >= 0, e.g. 1")
    return _canonical(name, quantity, field)


@functools.lru_cache(maxsize=4096)
def _format(name: str, amount: int) -> str:
    """Canonical integer unit -> the shortest exact Kubernetes quantity string."""
    if name == CPU:
        return str(amount // 1000) if amount % 1000 == 0 else f"{amount}m"
    if _is_bytes(name) and amount:
        for suffixes in (_BINARY, _DECIMAL):
            for suffix, factor in reversed(suffixes.items()):
                if factor >= 1000 and amount % factor == 0:
                    return f"{amount // factor}{suffix}"
    return str(amount)


def _order(name: str) -> tuple:
    return ({CPU: 0, MEMORY: 1, EPHEMERAL_STORAGE: 2}.get(name, 3), name)


class Resources(Mapping[str, int]):
    """An immutable resource vector in canonical integer units; zero entries are dropped.

    `Resources({"cpu": 500, "memory": 2**30})` takes canonical units;
    `Resources.parse({"cpu": "500m", "memory": "1Gi"})` takes Kubernetes quantities.
    """

    __slots__ = ("_hash", "_items")
    _hash: int | None
    _items: dict[str, int]

    def __init__(self, amounts: Mapping[str, int] | None = None):
        items = {}
        for name, amount in (amounts or {}).items():
            if not isinstance(name, str) or not name:
                raise QuantityError(f"resources: resource names must be non-empty strings, got {name!r}")
            if isinstance(amount, bool) or not isinstance(amount, int):
                raise QuantityError(
                    f"resources.{name}: expected an integer in canonical units, got {amount!r}; "
                    "use Resources.parse() for quantity strings like 500m or 16Gi")
            if amount:
                items[name] = amount
        self._items = items
        self._hash = None

    @classmethod
    def _of(cls, items: dict[str, int]) -> Resources:
        """Fast path for amounts already checked (arithmetic on Resources)."""
        out = cls.__new__(cls)
        out._items = {name: amount for name, amount in items.items() if amount}
        out._hash = None
        return out

    @classmethod
    def parse(cls, mapping: Mapping[str, str | int | float] | None, field: str = "resources") -> Resources:
        """Parse Kubernetes quantities (`{"cpu": "500m"}`); negative amounts are an error."""
        if mapping is None:
            return cls()
        if not isinstance(mapping, Mapping):
            raise QuantityError(
                f"{field}: expected a mapping of resource name to quantity, got {type(mapping).__name__}; "
                'e.g. {"cpu": "500m", "memory": "16Gi"}')
        amounts = {}
        for name, value in mapping.items():
            try:
                amounts[name] = _amount(name, value)
            except (QuantityError, TypeError):  # TypeError: unhashable value; redo it to name the field
                amounts[name] = _amount.__wrapped__(name, value, f"{field}.{name}")
        return cls(amounts)

    # Mapping protocol -------------------------------------------------------
    def __getitem__(self, name: str) -> int:
        return self._items[name]

    def get(self, name: str, default: int = 0) -> int:  # type: ignore[override]  # missing resources are 0
        return self._items.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._items.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Resources):
            return self._items == other._items
        if isinstance(other, Mapping):
            return self._items == {k: v for k, v in other.items() if v}
        return NotImplemented

    def __repr__(self) -> str:
        return f"Resources({self.to_json()!r})"

    # Arithmetic -------------------------------------------------------------
    def _combine(self, other: Mapping[str, int], sign: int) -> Resources:
        if not isinstance(other, Resources):
            other = Resources(other)
        out = dict(self._items)
        for name, amount in other._items.items():
            out[name] = out.get(name, 0) + sign * amount
        return Resources._of(out)

    def __add__(self, other: Mapping[str, int]) -> Resources:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self._combine(other, 1)

    def __sub__(self, other: Mapping[str, int]) -> Resources:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self._combine(other, -1)

    def fits_in(self, capacity: Mapping[str, int]) -> bool:
        """True when every resource requested is <= capacity's (a missing resource is 0)."""
        have = capacity._items if isinstance(capacity, Resources) else capacity
        return all(amount <= have.get(name, 0) for name, amount in self._items.items())

    def copies_in(self, capacity: Mapping[str, int], limit: int) -> int:
        """How many copies of this vector fit in `capacity` at once (at most `limit`)."""
        have = capacity._items if isinstance(capacity, Resources) else capacity
        count = limit
        for name, amount in self._items.items():
            if amount > 0:
                fit = have.get(name, 0) // amount
                if fit < count:
                    count = fit if fit > 0 else 0
        return count

    def shortfall(self, capacity: Mapping[str, int]) -> dict[str, int]:
        """Per resource, how much more than `capacity` this asks for (only the short ones)."""
        return {name: amount - capacity.get(name, 0)
                for name, amount in self._items.items() if amount > capacity.get(name, 0)}

    @property
    def gpus(self) -> int:
        return self._items.get(GPU, 0)

    # Conversions ------------------------------------------------------------
    def to_k8s(self) -> dict[str, str]:
        """Kubernetes API form, e.g. {"cpu": "500m", "memory": "16Gi", "nvidia.com/gpu": "1"}."""
        return {name: _format(name, self._items[name]) for name in sorted(self._items, key=_order)}

    def __str__(self) -> str:
        if not self._items:
            return "none"
        return " ".join(f"{name}={text}" for name, text in self.to_k8s().items())

    def to_json(self) -> dict[str, int]:
        return {name: self._items[name] for name in sorted(self._items, key=_order)}

    @classmethod
    def from_json(cls, data: Mapping[str, int]) -> Resources:
        return cls(data)


def format_quantity(name: str, amount: int) -> str:
    """One canonical amount of resource `name` as a Kubernetes quantity string."""
    return _format(name, amount)
