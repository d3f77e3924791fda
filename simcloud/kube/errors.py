"""How the Kubernetes API fails: `ApiError`, sent to the client as the meta/v1 Status the real
apiserver sends, and `invalid`, its 422 Invalid with field causes.

Raised by every part of the API server (store, admission, validation, auth, the API app) and
caught by the in-process controllers and the kubelets, so it depends on none of them.
"""
from __future__ import annotations


class ApiError(Exception):
    """An API failure carried as the meta/v1 Status the real apiserver sends."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details is not None:
            body["details"] = self.details
        return body


def invalid(kind: str, name: str, causes: list[tuple[str, str, str]]):
    """Build the 422 Invalid ApiError: causes are (field, reason, message). Several causes are listed in
    brackets, one is not (field.ErrorList's aggregate, as kube-apiserver words it)."""
    parts = [f"{f}: {m}" for f, _, m in causes]
    text = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {text}', {
        "name": name, "kind": kind,
        "causes": [{"reason": r, "message": m, "field": f} for f, r, m in causes]})
