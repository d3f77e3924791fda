"""How the adapter names the API server's refusals of a write: the lifecycle code catches these, never the
client library's ApiException."""
from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from gpuboot.exceptions import Conflict, InvalidRequest, Overloaded
from gpuboot.hooks.kube import KubeClient


def answering(status: int, reason: str):
    def write(*args, **kwargs):
        raise ApiException(status=status, reason=reason)
    return write


@pytest.mark.parametrize(("status", "raised"), [(409, Conflict), (422, InvalidRequest), (429, Overloaded),
                                                (500, Overloaded), (503, Overloaded), (504, Overloaded)])
def test_a_refused_write_is_raised_as_the_projects_exception(status, raised):
    with pytest.raises(raised, match=str(status)):
        KubeClient._write(answering(status, "Gateway Timeout"), "name", "ns", {})


@pytest.mark.parametrize("status", [401, 403, 404])
def test_other_refusals_stay_the_client_librarys(status):
    with pytest.raises(ApiException):
        KubeClient._write(answering(status, "no"), "name", "ns", {})
