"""Server-side verification of Alibaba Cloud OpenAPI request signatures.

Two schemes reach the ECS endpoint:

* ACS3-HMAC-SHA256 (the official `alibabacloud-ecs20140526` SDK): an
  `Authorization` header over a canonical request built from the method, path,
  query, the signed headers and the SHA-256 of the body.
* V1 (the legacy `aliyun-python-sdk-core`, and the official SDK in "v2" mode):
  `Signature` in the parameters, HMAC-SHA1 (or HMAC-SHA256) over
  `METHOD&%2F&percentEncode(sorted, percent-encoded parameters)` with key
  `secret + "&"`.

Everything here is pure: the caller passes what came over the wire and the
known credentials, and gets back the verified AccessKeyId or a `SignatureError`
carrying the code, message and HTTP status the real service answers with.
Messages never contain a secret; like the real service, a signature mismatch
reports the string the server signed, so a client can compare it with its own.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

ACS3_ALGORITHM = "ACS3-HMAC-SHA256"
V1_METHODS: dict[str, Callable] = {"HMAC-SHA1": hashlib.sha1, "HMAC-SHA256": hashlib.sha256}
MAX_CLOCK_SKEW = timedelta(minutes=15)

# Reads header values for a lower-case name: all values, in arrival order.
HeaderGetter = Callable[[str], list[str]]


class SignatureError(Exception):
    """A request refused by authentication; `code`/`message`/`status` are what the service answers."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class Verified:
    """What authentication established about a request."""

    access_key_id: str
    scheme: str          # "ACS3-HMAC-SHA256" or "V1"
    nonce: str | None    # SignatureNonce / x-acs-signature-nonce, for replay protection


def percent_encode(value: str) -> str:
    """RFC 3986 percent-encoding, as both signature schemes define it (only A-Za-z0-9-_.~ stay)."""
    return quote(value, safe="~", encoding="utf-8")


# ---------------------------------------------------------------- V1 (query)

def v1_string_to_sign(method: str, params: Mapping[str, str]) -> str:
    """`METHOD&%2F&` + the percent-encoded canonicalized query of every parameter but `Signature`."""
    canonical = "&".join(
        f"{percent_encode(k)}={percent_encode(v)}" for k, v in sorted(params.items()) if k != "Signature"
    )
    return f"{method.upper()}&{percent_encode('/')}&{percent_encode(canonical)}"


def v1_signature(string_to_sign: str, secret: str, method: str = "HMAC-SHA1") -> str:
    digest = hmac.new(f"{secret}&".encode(), string_to_sign.encode(), V1_METHODS[method]).digest()
    return base64.b64encode(digest).decode()


def verify_v1(method: str, params: Mapping[str, str], credentials: Mapping[str, str], *,
              now: datetime | None = None) -> Verified:
    """Verify a V1 request; `params` are the query and form-body parameters together, decoded."""
    key_id = _required(params.get("AccessKeyId"), "AccessKeyId")
    signature = _required(params.get("Signature"), "Signature")
    sig_method = params.get("SignatureMethod") or "HMAC-SHA1"
    if sig_method not in V1_METHODS:
        raise SignatureError("InvalidSignatureMethod",
                             f"Specified signature method {sig_method!r} is not supported; use HMAC-SHA1.")
    version = params.get("SignatureVersion") or "1.0"
    if version != "1.0":
        raise SignatureError("InvalidSignatureVersion", f"Specified signature version {version!r} is not valid; use 1.0.")
    check_timestamp(_required(params.get("Timestamp"), "Timestamp"), now)
    secret = _secret_for(key_id, credentials)
    string_to_sign = v1_string_to_sign(method, params)
    if not hmac.compare_digest(v1_signature(string_to_sign, secret, sig_method), signature):
        raise _mismatch(string_to_sign)
    return Verified(key_id, "V1", params.get("SignatureNonce"))


# ---------------------------------------------------------------- ACS3 (headers)

@dataclass(frozen=True)
class Acs3Authorization:
    algorithm: str
    access_key_id: str
    signed_headers: tuple[str, ...]
    signature: str


_AUTH_RE = re.compile(r"^(?P<alg>\S+)\s+(?P<fields>.+)$")


def parse_authorization(header: str) -> Acs3Authorization:
    """Split `ACS3-HMAC-SHA256 Credential=AK,SignedHeaders=a;b,Signature=hex`."""
    match = _AUTH_RE.match(header.strip())
    if not match:
        raise _incomplete("the Authorization header has no algorithm and fields")
    fields = {}
    for part in match["fields"].split(","):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name] = value
    missing = [n for n in ("Credential", "SignedHeaders", "Signature") if not fields.get(n)]
    if missing:
        raise _incomplete(f"the Authorization header lacks {', '.join(missing)}")
    return Acs3Authorization(match["alg"], fields["Credential"],
                             tuple(fields["SignedHeaders"].split(";")), fields["Signature"])


def acs3_canonical_request(method: str, path: str, query: Iterable[tuple[str, str]], get_header: HeaderGetter,
                           signed_headers: Iterable[str], hashed_payload: str) -> str:
    """The canonical request of the ACS3 spec (query and headers already decoded as received)."""
    canonical_query = "&".join(
        f"{k}={v}" for k, v in sorted((percent_encode(k), percent_encode(v)) for k, v in query)
    )
    names = list(signed_headers)
    canonical_headers = "".join(
        f"{name}:{','.join(sorted(v.strip() for v in get_header(name)))}\n" for name in names
    )
    return "\n".join([method.upper(), path or "/", canonical_query, canonical_headers, ";".join(names), hashed_payload])


def acs3_string_to_sign(canonical_request: str) -> str:
    return f"{ACS3_ALGORITHM}\n{hashlib.sha256(canonical_request.encode()).hexdigest()}"


def acs3_signature(string_to_sign: str, secret: str) -> str:
    return hmac.new(secret.encode(), string_to_sign.encode(), hashlib.sha256).hexdigest()


def verify_acs3(method: str, path: str, query: Iterable[tuple[str, str]], get_header: HeaderGetter,
                body: bytes, credentials: Mapping[str, str], *, now: datetime | None = None) -> Verified:
    """Verify an ACS3-HMAC-SHA256 request. The payload hash is computed from the body received."""
    auth = parse_authorization(_first(get_header("authorization")))
    if auth.algorithm != ACS3_ALGORITHM:
        raise SignatureError("InvalidSignatureMethod",
                             f"Specified signature method {auth.algorithm!r} is not supported; use {ACS3_ALGORITHM}.")
    signed = [h.lower() for h in auth.signed_headers]
    if signed != sorted(set(signed)):
        raise _incomplete("SignedHeaders must be lower-case, sorted and without duplicates")
    required = {"host", "x-acs-action", "x-acs-version", "x-acs-date", "x-acs-signature-nonce", "x-acs-content-sha256"}
    unsigned = sorted(required - set(signed))
    if unsigned:
        raise _incomplete(f"SignedHeaders must include {', '.join(unsigned)}")
    check_timestamp(_required(_first(get_header("x-acs-date")), "x-acs-date"), now)
    secret = _secret_for(auth.access_key_id, credentials)
    canonical = acs3_canonical_request(method, path, query, get_header, signed, hashlib.sha256(body).hexdigest())
    string_to_sign = acs3_string_to_sign(canonical)
    if not hmac.compare_digest(acs3_signature(string_to_sign, secret), auth.signature.lower()):
        raise _mismatch(string_to_sign)
    return Verified(auth.access_key_id, ACS3_ALGORITHM, _first(get_header("x-acs-signature-nonce")) or None)


# ---------------------------------------------------------------- shared

def verify_request(method: str, path: str, query: list[tuple[str, str]], form: list[tuple[str, str]],
                   get_header: HeaderGetter, body: bytes, credentials: Mapping[str, str], *,
                   now: datetime | None = None) -> Verified:
    """Authenticate a request by whichever scheme it uses (Authorization header, else V1 `Signature`)."""
    if get_header("authorization"):
        return verify_acs3(method, path, query, get_header, body, credentials, now=now)
    params = dict(query)
    params.update(form)
    if "Signature" not in params:
        raise SignatureError("MissingSignature",
                             'The input parameter "Signature" that is mandatory for processing this request '
                             "is not supplied; sign the request (ACS3-HMAC-SHA256 Authorization header or V1 Signature).")
    return verify_v1(method, params, credentials, now=now)


def check_timestamp(value: str, now: datetime | None = None) -> datetime:
    """ISO 8601 UTC (`2026-11-30T01:02:03Z`) within 15 minutes of now, like the real gateway."""
    try:
        stamp = datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        raise SignatureError("InvalidTimeStamp.Format",
                             f"Specified time stamp or date value {value!r} is not well formatted; "
                             "use UTC ISO 8601 like 2026-01-31T12:00:00Z.") from None
    now = now or datetime.now(UTC)
    if abs(now - stamp) > MAX_CLOCK_SKEW:
        raise SignatureError("InvalidTimeStamp.Expired",
                             f"Specified time stamp or date value is expired: {value} is more than 15 minutes from "
                             "the server time; check the client clock.")
    return stamp


def _secret_for(access_key_id: str, credentials: Mapping[str, str]) -> str:
    secret = credentials.get(access_key_id)
    if secret is None:
        raise SignatureError("InvalidAccessKeyId.NotFound", "Specified access key is not found.", 404)
    return secret


def _required(value: str | None, name: str) -> str:
    if not value:
        raise SignatureError("MissingParameter",
                             f'The input parameter "{name}" that is mandatory for processing this request is not supplied.')
    return value


def _first(values: list[str]) -> str:
    return values[0] if values else ""


def _incomplete(why: str) -> SignatureError:
    return SignatureError("IncompleteSignature", f"The request signature does not conform to Aliyun standards: {why}.")


def _mismatch(string_to_sign: str) -> SignatureError:
    return SignatureError("SignatureDoesNotMatch",
                          "Specified signature is not matched with our calculation. "
                          f"server string to sign is:{string_to_sign}")
