"""Unit tests share one process per worker: nothing a test learns may leak into the next."""
import pytest

from gpuboot.lifecycle.pricing import PRICES


@pytest.fixture(autouse=True)
def fresh_price_cache():
    """The process-wide price cache starts empty for every unit test, so a test whose fake ECS
    has no DescribePrice fails alone as it would after any other test (order-independent)."""
    PRICES.clear()
    yield
    PRICES.clear()
