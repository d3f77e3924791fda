"""Alibaba Cloud ECS access for gpuboot: the official SDK behind an Airflow hook.

Why a hook: credentials and region come from an Airflow connection (never from DAG
code), retries and error classes live in one place, and the operators stay thin.
The AccessKeySecret is only handed to the SDK; it never reaches a log line, an
XCom or an exception message.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from airflow.sdk import BaseHook

# What crosses the port to the lifecycle (gpuboot.core.ports), re-exported: this adapter makes them.
from gpuboot.core.ports import RUNNING_OR_COMING, STOPPED_OR_GOING, EcsError, InstanceOutcome, classify_code

log = logging.getLogger(__name__)
T = TypeVar("T")

DESCRIBE_BATCH = 100        # DescribeInstances: at most 100 ids in InstanceIds
TYPES_BATCH = 10            # DescribeInstanceTypes: at most 10 InstanceTypes.N


def to_ecs_error(exc: BaseException) -> EcsError:
    """Turn whatever the SDK raised into an EcsError without copying request details."""
    if isinstance(exc, EcsError):
        return exc
    inner = getattr(exc, "inner_exception", None)
    code = getattr(exc, "code", None)
    if code is None and inner is not None and not hasattr(inner, "code"):
        # Network-level failure (connection refused, reset, timeout): worth a retry.
        return EcsError("transient", "NetworkError", type(inner).__name__ + ": " + str(inner)[:200])
    if code is None:
        return EcsError("transient", "NetworkError", type(exc).__name__ + ": " + str(exc)[:200])
    data = getattr(exc, "data", None)
    body = data if isinstance(data, dict) else {}
    status = getattr(exc, "status_code", None) or getattr(exc, "statusCode", None) or body.get("statusCode")
    message = body.get("Message") or getattr(exc, "message", None) or code
    request_id = getattr(exc, "request_id", None) or body.get("RequestId")
    return EcsError(classify_code(code, status), str(code), str(message), request_id)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter (AWS architecture blog), bounded in attempts and time."""

    attempts: int = 6
    base_seconds: float = 0.5
    cap_seconds: float = 10.0
    max_total_seconds: float = 60.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_seconds, self.base_seconds * 2 ** (attempt - 1)))


def with_retries(action: str, call: Callable[[], T], policy: RetryPolicy,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Run `call`, retrying transient ECS errors; raise EcsError otherwise."""
    started = time.monotonic()
    for attempt in range(1, policy.attempts + 1):
        try:
            return call()
        except Exception as exc:
            err = to_ecs_error(exc)
        delay = policy.delay(attempt)
        out_of_budget = attempt == policy.attempts or time.monotonic() - started + delay > policy.max_total_seconds
        if err.kind != "transient" or out_of_budget:
            raise err from None
        log.warning("ECS %s failed with %s (attempt %d/%d, RequestId %s); retrying in %.2fs",
                    action, err.code, attempt, policy.attempts, err.request_id, delay)
        sleep(delay)
    raise AssertionError("unreachable")


def _batches(items: Sequence[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield list(items[i:i + size])


CREDENTIAL_MODES = ("static", "default_chain")
# Environment variables of the default chain whose values are secret (redacted from its errors).
_SECRET_ENV = ("ALIBABA_CLOUD_ACCESS_KEY_SECRET", "ALIBABA_CLOUD_SECURITY_TOKEN")


# gpuboot's connection type. Until 0.2 it was `alibaba_cloud`, which apache-airflow-providers-alibaba
# registers too: with both installed Airflow keeps one hook and one form for the type, and the other
# provider's connections fail there (the official hooks refuse gpuboot's login/password with "No
# access_key_id is specified"). A connection of the old type is still read, for this release, with a
# warning; its fields are the official provider's where they mean the same (extra access_key_id,
# access_key_secret, region), so an official `alibaba_cloud` connection can serve gpuboot as it is.
CONN_TYPE = "gpuboot_ecs"
OLD_CONN_TYPE = "alibaba_cloud"


def _extra_field(extra: dict, name: str) -> Any:
    """An extra field as the UI stores it: `name`, or the older `extra__<conn_type>__name` of either type."""
    value = extra.get(name)
    if value not in (None, ""):
        return value
    return next((extra[k] for k in (f"extra__{CONN_TYPE}__{name}", f"extra__{OLD_CONN_TYPE}__{name}")
                 if extra.get(k) not in (None, "")), None)


def endpoint_settings(conn_id: str, extra: dict) -> tuple[str | None, str | None]:
    """(endpoint, protocol) for the SDK from extra `endpoint` ("host:port", or a URL
    "http://host:port" whose scheme is the protocol) and `protocol`.

    Why the URL form: Airflow registers every value of a connection's extra with its secrets
    masker, which warns "Skipping masking for a secret as it's too short" at the top of every
    task log for a value under 5 characters, such as `protocol: "http"`; the local cloud's
    connection therefore carries the scheme in the endpoint instead."""
    endpoint = _extra_field(extra, "endpoint") or None
    protocol = _extra_field(extra, "protocol") or None
    if endpoint and "://" in endpoint:
        scheme, _, rest = str(endpoint).partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"connection {conn_id!r}: extra.endpoint must be host[:port] or an http(s):// URL, "
                             f"got scheme {scheme!r}")
        if protocol and str(protocol).lower() != scheme:
            raise ValueError(f"connection {conn_id!r}: extra.protocol {protocol!r} contradicts extra.endpoint's "
                             f"scheme {scheme!r}; drop extra.protocol")
        endpoint, protocol = rest.rstrip("/"), scheme
    return endpoint, protocol


# The chain's errors may quote an STS answer (alibabacloud_credentials does when one lacks a
# field): any secret-looking value in it is masked, whatever its source.
_SECRET_FIELD = re.compile(r'("?(?:AccessKeySecret|SecurityToken|access_key_secret|security_token)"?\s*[:=]\s*"?)'
                           r'[^",}\s]+', re.IGNORECASE)


# A failed STS exchange (RRSA) reports its URL, whose query holds the OIDC token.
_OIDC_TOKEN_PARAM = re.compile(r"(OIDCToken=)[^&\s'\"]+")


def _redact(text: str, secrets: Iterable[str | None]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return _OIDC_TOKEN_PARAM.sub(r"\1***", _SECRET_FIELD.sub(r"\1***", text))


def _chain_secrets() -> list[str]:
    """The secret values the default chain may be holding: its secret environment variables and
    the RRSA token (the file's content)."""
    values = [os.environ.get(name) or "" for name in _SECRET_ENV]
    token_file = os.environ.get("ALIBABA_CLOUD_OIDC_TOKEN_FILE")
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as fh:
                values.append(fh.read().strip())
        except OSError:
            pass
    return [v for v in values if v]


class _RedactingFilter(logging.Filter):
    """Masks secrets in the records of the Alibaba Cloud libraries' own loggers, which write to
    stderr (hence the task log) through handlers of their own: `credentials` logs a failed STS
    exchange with its URL, OIDC token included, and a traceback; the Tea cores log requests under
    DEBUG=sdk."""

    def filter(self, record: logging.LogRecord) -> bool:
        import traceback

        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        record.msg, record.args, record.exc_info, record.exc_text = _redact(text, _chain_secrets()), None, None, None
        return True


_SDK_LOGGERS = ("credentials", "alibabacloud-tea", "darabonba-core")


def _guard_sdk_logs() -> None:
    for name in _SDK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactingFilter) for f in logger.filters):
            logger.addFilter(_RedactingFilter())


def credential_settings(conn_id: str, login: str | None, password: str | None, extra: dict) -> dict[str, Any]:
    """The SDK Config arguments for the connection's credential mode (extra `credential_mode`):

    * "static" (default): the AccessKey pair from login/password or, as the form of the
      `apache-airflow-providers-alibaba` connection stores it, from extra `access_key_id` /
      `access_key_secret`;
    * "default_chain": Alibaba Cloud's default credentials chain (`alibabacloud_credentials`):
      environment variables, the RRSA OIDC token file with role and provider ARNs, the CLI and
      credentials-file profiles, the ECS instance RAM role. It is asked once here, so a setup
      that yields nothing fails at once (a permanent EcsError) instead of after the retries.

    Errors name the missing fields, never a value."""
    _guard_sdk_logs()
    mode = str(_extra_field(extra, "credential_mode") or "static").strip().lower()
    if mode not in CREDENTIAL_MODES:
        raise ValueError(f"connection {conn_id!r}: extra.credential_mode must be one of "
                         f"{', '.join(CREDENTIAL_MODES)}, got {mode!r}")
    key_id = login or _extra_field(extra, "access_key_id")
    secret = password or _extra_field(extra, "access_key_secret")
    if mode == "static":
        missing = [name for name, value in (("login (AccessKey ID) or extra.access_key_id", key_id),
                                            ("password (AccessKey secret) or extra.access_key_secret", secret))
                   if not value]
        if missing:
            raise ValueError(f"connection {conn_id!r}: missing {', '.join(missing)} (credential_mode "
                             'static); or set extra {"credential_mode": "default_chain"} to use the '
                             "environment, RRSA or the instance RAM role")
        return {"access_key_id": key_id, "access_key_secret": secret}
    if key_id or secret:
        raise ValueError(f"connection {conn_id!r}: credential_mode default_chain takes its keys from the "
                         "chain; leave login/password and extra access_key_id/access_key_secret empty")
    from alibabacloud_credentials.client import Client as CredentialClient

    credential = CredentialClient()
    try:
        credential.get_credential()
    except Exception as exc:
        detail = _redact(f"{type(exc).__name__}: {exc}", _chain_secrets())[:800]
        raise EcsError("permanent", "InvalidCredentials",
                       f"connection {conn_id!r}: the default credentials chain found no credentials ({detail})"
                       ) from None
    return {"credential": credential}


class EcsHook(BaseHook):
    """ECS through `alibabacloud_ecs20140526`, configured by a `gpuboot_ecs` connection (CONN_TYPE; one of
    the old type `alibaba_cloud`, an official provider's included, is read too, with a warning):
    extra `region_id` (required; `region` is read too), for a private or local endpoint
    `endpoint` ("host:port", or "http://host:port") and `protocol` ("http"/"https"), and `credential_mode` ("static":
    login = AccessKey ID, password = AccessKey secret, or extra access_key_id/access_key_secret;
    "default_chain": environment, RRSA, instance RAM role; see credential_settings).
    Its form is declared in gpuboot.get_provider_info (`conn-fields` and `ui-field-behaviour` of the
    provider info): Airflow 3.3 reads it from there without importing the hook, and deprecates
    (since 3.2) the hook methods get_connection_form_widgets / get_ui_field_behaviour."""

    conn_name_attr = "ecs_conn_id"
    default_conn_name = "alibaba_ecs_default"
    conn_type = CONN_TYPE
    hook_name = "Alibaba Cloud ECS (gpuboot)"

    def __init__(self, ecs_conn_id: str = default_conn_name, retry: RetryPolicy | None = None,
                 read_timeout_ms: int = 10_000) -> None:
        super().__init__()
        self.ecs_conn_id = ecs_conn_id
        self.retry = retry or RetryPolicy()
        self.read_timeout_ms = read_timeout_ms
        self._client = None
        self._region: str | None = None

    # -- connection ---------------------------------------------------------------
    @property
    def region_id(self) -> str:
        if self._region is None:
            self.get_conn()
        return self._region  # type: ignore[return-value]

    def get_conn(self):
        """Build (once) the SDK client from the connection."""
        if self._client is not None:
            return self._client
        from alibabacloud_ecs20140526.client import Client
        from alibabacloud_tea_openapi.utils_models import Config

        conn = self.get_connection(self.ecs_conn_id)
        extra = conn.extra_dejson
        if conn.conn_type == OLD_CONN_TYPE:
            self.log.warning("connection %r has type %s, which apache-airflow-providers-alibaba registers too; "
                             "gpuboot reads it for this release: change its type to %s%s", self.ecs_conn_id,
                             OLD_CONN_TYPE, CONN_TYPE,
                             " (the official provider's hooks cannot read its login/password: they read extra "
                             "access_key_id / access_key_secret)" if conn.login or conn.password else "")
        region = _extra_field(extra, "region_id") or _extra_field(extra, "region")
        if not region:
            raise ValueError(f"connection {self.ecs_conn_id!r}: missing extra.region_id; "
                             'set it, e.g. extra {"region_id": "cn-hangzhou"}')
        credentials = credential_settings(self.ecs_conn_id, conn.login, conn.password, extra)
        endpoint, protocol = endpoint_settings(self.ecs_conn_id, extra)
        config = Config(region_id=region, endpoint=endpoint, protocol=protocol,
                        read_timeout=self.read_timeout_ms, connect_timeout=5_000, **credentials)
        self._client, self._region = Client(config), region
        return self._client

    def _call(self, action: str, call: Callable[[], T]) -> T:
        self.get_conn()  # a configuration error surfaces at once, never retried
        return with_retries(action, call, self.retry)

    # -- reads ----------------------------------------------------------------------
    def describe_instances(self, instance_ids: Sequence[str] | None = None, **filters: Any) -> list[dict]:
        """Instances in DescribeInstances form (PascalCase), all pages, ids in batches of 100.
        Extra keyword filters go to DescribeInstancesRequest (e.g. status="Running")."""
        from alibabacloud_ecs20140526 import models

        if instance_ids is not None and not instance_ids:
            return []
        batches = [None] if instance_ids is None else list(_batches(list(instance_ids), DESCRIBE_BATCH))
        result: list[dict] = []
        for batch in batches:
            token = None
            while True:
                request = models.DescribeInstancesRequest(
                    region_id=self.region_id, max_results=100, next_token=token,
                    instance_ids=json.dumps(batch) if batch is not None else None, **filters)
                body = self._call("DescribeInstances",
                                  lambda r=request: self.get_conn().describe_instances(r)).body.to_map()
                result.extend((body.get("Instances") or {}).get("Instance") or [])
                token = body.get("NextToken")
                if not token:
                    break
        return result

    def describe_instance_types(self, type_ids: Iterable[str]) -> dict[str, dict]:
        """Instance types in DescribeInstanceTypes form, keyed by InstanceTypeId."""
        from alibabacloud_ecs20140526 import models

        wanted = sorted(set(type_ids))
        found: dict[str, dict] = {}
        for batch in _batches(wanted, TYPES_BATCH):
            token = None
            while True:
                request = models.DescribeInstanceTypesRequest(instance_types=batch, next_token=token,
                                                              max_results=100)
                body = self._call("DescribeInstanceTypes",
                                  lambda r=request: self.get_conn().describe_instance_types(r)).body.to_map()
                for item in (body.get("InstanceTypes") or {}).get("InstanceType") or []:
                    found[item["InstanceTypeId"]] = item
                token = body.get("NextToken")
                if not token:
                    break
        return found

    def describe_price(self, instance_type: str, zone: str | None) -> float:
        """DescribePrice (ResourceType instance, PriceUnit Hour, pay-as-you-go): TradePrice, the
        price after discounts, per hour. Raises EcsError (e.g. permanent when ECS prices no such type)."""
        from alibabacloud_ecs20140526 import models

        request = models.DescribePriceRequest(region_id=self.region_id, resource_type="instance",
                                              instance_type=instance_type, zone_id=zone or None, price_unit="Hour")
        body = self._call("DescribePrice", lambda: self.get_conn().describe_price(request)).body.to_map()
        price = ((body.get("PriceInfo") or {}).get("Price") or {}).get("TradePrice")
        if price is None:
            raise EcsError("permanent", "PriceNotFound", f"DescribePrice answered no TradePrice for {instance_type}",
                           body.get("RequestId"))
        return float(price)

    def statuses(self, instance_ids: Sequence[str]) -> dict[str, str]:
        return {i["InstanceId"]: i.get("Status", "") for i in self.describe_instances(instance_ids)}

    def wait_for_status(self, instance_ids: Sequence[str], wanted: set[str] | frozenset[str],
                        timeout: float, poll: float = 2.0) -> dict[str, str]:
        """Poll DescribeInstances until every instance is in `wanted` or `timeout` passes;
        returns the last statuses seen (the caller decides what a timeout means)."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = self.statuses(instance_ids)
            if all(statuses.get(i) in wanted for i in instance_ids) or time.monotonic() >= deadline:
                return statuses
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    # -- power ------------------------------------------------------------------------
    def start_instances(self, instance_ids: Sequence[str]) -> dict[str, InstanceOutcome]:
        """StartInstances for those that are Stopped; Pending/Starting/Running is "already",
        Stopping is reported as "stopping" (start it once Stopped), per-instance errors classified."""
        return self._power("StartInstances", instance_ids, skip=RUNNING_OR_COMING, defer={"Stopping"},
                           build=lambda m, ids: m.StartInstancesRequest(
                               region_id=self.region_id, instance_id=ids, batch_optimization="SuccessFirst"),
                           send=lambda c, r: c.start_instances(r))

    def stop_instances(self, instance_ids: Sequence[str], stopped_mode: str = "StopCharging",
                       force: bool = False) -> dict[str, InstanceOutcome]:
        """StopInstances (economical mode by default); Stopping/Stopped is "already"."""
        if stopped_mode not in ("StopCharging", "KeepCharging"):
            raise ValueError(f"stopped_mode must be StopCharging or KeepCharging, got {stopped_mode!r}")
        return self._power("StopInstances", instance_ids, skip=STOPPED_OR_GOING, defer=set(),
                           build=lambda m, ids: m.StopInstancesRequest(
                               region_id=self.region_id, instance_id=ids, stopped_mode=stopped_mode,
                               force_stop=force, batch_optimization="SuccessFirst"),
                           send=lambda c, r: c.stop_instances(r))

    def _power(self, action, instance_ids, *, skip, defer, build, send) -> dict[str, InstanceOutcome]:
        from alibabacloud_ecs20140526 import models

        ids = list(dict.fromkeys(instance_ids))
        statuses = self.statuses(ids) if ids else {}
        outcomes: dict[str, InstanceOutcome] = {}
        todo = []
        for iid in ids:
            status = statuses.get(iid)
            if status is None:
                outcomes[iid] = InstanceOutcome(iid, "failed", None, EcsError(
                    "permanent", "InvalidInstanceId.NotFound", f"instance {iid} not found in {self.region_id}"))
            elif status in skip:
                outcomes[iid] = InstanceOutcome(iid, "already", status)
            elif status in defer:
                outcomes[iid] = InstanceOutcome(iid, "stopping", status)
            else:
                todo.append(iid)

        def request(batch: list[str]) -> dict[str, InstanceOutcome]:
            body = self._call(action, lambda: send(self.get_conn(), build(models, batch))).body.to_map()
            got = {}
            for item in (body.get("InstanceResponses") or {}).get("InstanceResponse") or []:
                iid, code = item.get("InstanceId"), str(item.get("Code") or "200")
                if code == "200":
                    got[iid] = InstanceOutcome(iid, "done", item.get("PreviousStatus"))
                elif item.get("CurrentStatus") in skip:
                    got[iid] = InstanceOutcome(iid, "already", item.get("CurrentStatus"))
                else:
                    got[iid] = InstanceOutcome(iid, "failed", item.get("PreviousStatus"), EcsError(
                        classify_code(code), code, str(item.get("Message") or code), body.get("RequestId")))
            # Accepted without a per-instance list (AllTogether-style answer): all done.
            return {iid: got.get(iid, InstanceOutcome(iid, "done", statuses.get(iid))) for iid in batch}

        for batch in _batches(todo, DESCRIBE_BATCH):
            try:
                outcomes.update(request(batch))
            except EcsError as err:
                if len(batch) == 1:
                    outcomes[batch[0]] = self._settle_failure(action, batch[0], err, skip)
                    continue
                for iid in batch:  # one bad instance failed the batch: find out which
                    try:
                        outcomes.update(request([iid]))
                    except EcsError as single:
                        outcomes[iid] = self._settle_failure(action, iid, single, skip)
        for iid, outcome in outcomes.items():
            log.info("%s %s: %s (was %s)%s", action, iid, outcome.outcome, outcome.previous_status,
                     f" {outcome.error}" if outcome.error else "")
        return {iid: outcomes[iid] for iid in ids}

    def _settle_failure(self, action: str, iid: str, err: EcsError, skip) -> InstanceOutcome:
        """IncorrectInstanceStatus after a race (someone else started/stopped it) is not an error."""
        if err.code.startswith("IncorrectInstanceStatus"):
            status = self.statuses([iid]).get(iid)
            if status in skip:
                return InstanceOutcome(iid, "already", status)
        return InstanceOutcome(iid, "failed", None, err)
