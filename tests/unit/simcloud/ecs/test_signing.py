"""Signature verification of simcloud's ECS endpoint, against what the SDKs themselves sign.

The fixed vectors were computed with the SDKs' own signing code
(`alibabacloud_tea_openapi.utils.Utils.get_authorization` / `get_rpcsignature`,
`aliyunsdkcore.auth.composer.rpc_signature_composer`); the round-trip tests
call that code again on awkward values, so a change on either side shows up.
"""
from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qsl

import pytest
from alibabacloud_tea_openapi.utils import Utils
from aliyunsdkcore.auth.composer import rpc_signature_composer
from darabonba.request import DaraRequest

from simcloud.ecs import signing
from simcloud.ecs.signing import SignatureError

AK, SECRET = "LTAI5tExample", "secret/+=example"
CREDS = {AK: SECRET}
NOW = datetime(2026, 11, 30, 1, 5, tzinfo=UTC)
EMPTY_SHA = hashlib.sha256(b"").hexdigest()
QUERY = {"RegionId": "cn-hangzhou", "InstanceId.1": "i-bp1", "InstanceId.2": "i-bp2", "Tag.1.Value": "a b*c~/ü"}
HEADERS = {"host": "127.0.0.1:8080", "x-acs-action": "StartInstances", "x-acs-version": "2014-05-26",
           "x-acs-date": "2026-11-30T01:02:03Z", "x-acs-signature-nonce": "3b9c4f0e9d2a4c7b",
           "accept": "application/json", "user-agent": "AlibabaCloud (Linux) Python/3.11 TeaDSL/2",
           "x-acs-content-sha256": EMPTY_SHA}
ACS3_VECTOR = ("ACS3-HMAC-SHA256 Credential=LTAI5tExample,SignedHeaders=accept;host;user-agent;x-acs-action;"
               "x-acs-content-sha256;x-acs-date;x-acs-signature-nonce;x-acs-version,"
               "Signature=c801ea64e70f6392b9033c737cb3f3f3f55c5821e2ebc57c9432369fa9d4c53a")
FORM_BODY = b"Name=x%20y&Tag.1.Key=k"
ACS3_FORM_SIGNATURE = "7cb806652d1e5b04010a88b93e93d6a9e908580fbd7205cea572e7cccb1fa1ac"
V1_PARAMS = {"Action": "DescribeInstances", "Format": "json", "Version": "2014-05-26",
             "Timestamp": "2026-11-30T01:02:03Z", "SignatureNonce": "n-1", "SignatureMethod": "HMAC-SHA1",
             "SignatureVersion": "1.0", "AccessKeyId": AK, "RegionId": "cn-hangzhou",
             "InstanceIds": '["i-1","i-2"]', "InstanceName": "a b*c~/ü"}
V1_OFFICIAL_SIGNATURE = "40pLbCmdtZJewzsWuRQ9tukUgsg="
V1_LEGACY_STRING_TO_SIGN = (
    "GET&%2F&AccessKeyId%3DLTAI5tExample%26Action%3DDescribeInstances%26Format%3DJSON%26InstanceIds%3D"
    "%255B%2522i-1%2522%252C%2522i-2%2522%255D%26InstanceName%3Da%2520b%252Ac~%252F%25C3%25BC%26RegionId"
    "%3Dcn-hangzhou%26SignatureMethod%3DHMAC-SHA1%26SignatureNonce%3Dn-1%26SignatureType%3D%26"
    "SignatureVersion%3D1.0%26Timestamp%3D2026-11-30T01%253A02%253A03Z%26Version%3D2014-05-26")
V1_LEGACY_SIGNATURE = "/mq4KaHrIEtnFPuBHaPtmSXvB+w="


def getter(headers: dict[str, str]):
    lowered = {k.lower(): v for k, v in headers.items()}
    return lambda name: [lowered[name]] if name in lowered else []


def acs3(headers=HEADERS, query=QUERY, body=b"", creds=CREDS, method="POST", now=NOW):
    return signing.verify_acs3(method, "/", list(query.items()), getter(headers), body, creds, now=now)


# ------------------------------------------------------------------ ACS3-HMAC-SHA256

def test_acs3_fixed_vector():
    verified = acs3({**HEADERS, "Authorization": ACS3_VECTOR})
    assert (verified.access_key_id, verified.scheme, verified.nonce) == (AK, "ACS3-HMAC-SHA256", "3b9c4f0e9d2a4c7b")


def test_acs3_fixed_vector_with_form_body_and_tampering():
    sha = hashlib.sha256(FORM_BODY).hexdigest()
    headers = {**HEADERS, "content-type": "application/x-www-form-urlencoded", "x-acs-content-sha256": sha,
               "Authorization": f"ACS3-HMAC-SHA256 Credential={AK},SignedHeaders=accept;content-type;host;"
                                f"user-agent;x-acs-action;x-acs-content-sha256;x-acs-date;x-acs-signature-nonce;"
                                f"x-acs-version,Signature={ACS3_FORM_SIGNATURE}"}
    assert acs3(headers, body=FORM_BODY).access_key_id == AK
    with pytest.raises(SignatureError) as e:      # the server hashes the body it received, not the header
        acs3(headers, body=FORM_BODY + b"&Extra=1")
    assert e.value.code == "SignatureDoesNotMatch"
    for tampered in ({**QUERY, "InstanceId.2": "i-other"}, {**QUERY, "Extra": "1"}):
        with pytest.raises(SignatureError):
            acs3(headers, query=tampered, body=FORM_BODY)
    with pytest.raises(SignatureError):
        acs3({**headers, "x-acs-action": "StopInstances"}, body=FORM_BODY)
    with pytest.raises(SignatureError):
        acs3(headers, body=FORM_BODY, method="GET")


@pytest.mark.parametrize("value", ["plain", "a b", "a+b=c&d", "*~-_.", "ü中文", "/path?x=1", "", '["i-1","i-2"]'])
def test_acs3_round_trip_with_sdk_signing(value):
    request = DaraRequest()
    request.method, request.pathname = "POST", "/"
    request.query = {"RegionId": "cn-hangzhou", "Value": value}
    request.headers = dict(HEADERS)
    request.headers["Authorization"] = Utils.get_authorization(request, "ACS3-HMAC-SHA256", EMPTY_SHA, AK, SECRET)
    assert acs3(request.headers, query=request.query).access_key_id == AK


def test_acs3_signed_header_values_are_read_from_the_request():
    canonical = signing.acs3_canonical_request(
        "POST", "/", [("b", "2"), ("a", "x y")], lambda n: {"host": ["h"], "x-acs-k": [" v2", "v1 "]}[n],
        ["host", "x-acs-k"], EMPTY_SHA)
    assert canonical == f"POST\n/\na=x%20y&b=2\nhost:h\nx-acs-k:v1,v2\n\nhost;x-acs-k\n{EMPTY_SHA}"


def test_acs3_refusals():
    with pytest.raises(SignatureError) as e:
        acs3({**HEADERS, "Authorization": ACS3_VECTOR}, creds={"LTAIother": SECRET})
    assert (e.value.code, e.value.status, e.value.message) == \
        ("InvalidAccessKeyId.NotFound", 404, "Specified access key is not found.")
    with pytest.raises(SignatureError) as e:
        acs3({**HEADERS, "Authorization": ACS3_VECTOR}, creds={AK: "wrong"})
    assert (e.value.code, e.value.status) == ("SignatureDoesNotMatch", 400)
    assert "wrong" not in e.value.message and SECRET not in e.value.message
    assert e.value.message.startswith("Specified signature is not matched with our calculation. "
                                      "server string to sign is:ACS3-HMAC-SHA256\n")
    with pytest.raises(SignatureError) as e:
        acs3({**HEADERS, "Authorization": ACS3_VECTOR.replace("ACS3-HMAC-SHA256 ", "ACS3-HMAC-SM3 ")})
    assert e.value.code == "InvalidSignatureMethod"
    with pytest.raises(SignatureError) as e:
        acs3({**HEADERS, "Authorization": ACS3_VECTOR.replace("accept;host;", "accept;")})
    assert e.value.code == "IncompleteSignature" and "host" in e.value.message
    with pytest.raises(SignatureError) as e:
        acs3({**HEADERS, "Authorization": "ACS3-HMAC-SHA256 Credential=x"})
    assert e.value.code == "IncompleteSignature" and "SignedHeaders" in e.value.message
    with pytest.raises(SignatureError) as e:
        acs3({**HEADERS, "Authorization": ACS3_VECTOR}, now=NOW + timedelta(minutes=20))
    assert e.value.code == "InvalidTimeStamp.Expired"


# ------------------------------------------------------------------ V1 (HMAC-SHA1 in the query)

def test_v1_fixed_vector_official_sdk_v2_mode():
    string_to_sign = signing.v1_string_to_sign("POST", V1_PARAMS)
    assert signing.v1_signature(string_to_sign, SECRET) == V1_OFFICIAL_SIGNATURE
    verified = signing.verify_v1("POST", {**V1_PARAMS, "Signature": V1_OFFICIAL_SIGNATURE}, CREDS, now=NOW)
    assert (verified.access_key_id, verified.scheme, verified.nonce) == (AK, "V1", "n-1")


def test_v1_fixed_vector_legacy_sdk():
    params = {**V1_PARAMS, "SignatureType": "", "Format": "JSON"}
    assert signing.v1_string_to_sign("GET", params) == V1_LEGACY_STRING_TO_SIGN
    assert signing.verify_v1("GET", {**params, "Signature": V1_LEGACY_SIGNATURE}, CREDS, now=NOW).access_key_id == AK


@pytest.mark.parametrize("value", ["plain", "a b", "a+b=c&d", "*~-_.", "ü中文", "/path?x=1", "", '["i-1"]'])
def test_v1_round_trip_with_both_sdks(value):
    params = {**V1_PARAMS, "InstanceName": value}
    official = Utils.get_rpcsignature(params, "POST", SECRET)
    assert signing.verify_v1("POST", {**params, "Signature": official}, CREDS, now=NOW)
    url, _ = rpc_signature_composer.get_signed_url({"Action": "DescribeInstances", "InstanceName": value}, AK,
                                                   SECRET, "JSON", "POST", {"Body": value})
    signed = dict(parse_qsl(url[2:], keep_blank_values=True))
    signed["Body"] = value                     # body parameters are signed too
    assert signing.verify_v1("POST", signed, CREDS).access_key_id == AK
    with pytest.raises(SignatureError):
        signing.verify_v1("POST", {**signed, "Body": value + "x"}, CREDS)


def test_v1_refusals():
    good = {**V1_PARAMS, "Signature": V1_OFFICIAL_SIGNATURE}
    with pytest.raises(SignatureError) as e:
        signing.verify_v1("GET", good, CREDS, now=NOW)       # signed for POST
    assert e.value.code == "SignatureDoesNotMatch"
    assert e.value.message.endswith(signing.v1_string_to_sign("GET", good))
    with pytest.raises(SignatureError) as e:
        signing.verify_v1("POST", {**good, "AccessKeyId": "LTAIx"}, CREDS, now=NOW)
    assert (e.value.code, e.value.status) == ("InvalidAccessKeyId.NotFound", 404)
    with pytest.raises(SignatureError) as e:
        signing.verify_v1("POST", {**good, "SignatureMethod": "MD5"}, CREDS, now=NOW)
    assert e.value.code == "InvalidSignatureMethod"
    with pytest.raises(SignatureError) as e:
        signing.verify_v1("POST", {**good, "Timestamp": "yesterday"}, CREDS, now=NOW)
    assert e.value.code == "InvalidTimeStamp.Format" and "2026-01-31T12:00:00Z" in e.value.message
    without_key = {k: v for k, v in good.items() if k != "AccessKeyId"}
    with pytest.raises(SignatureError) as e:
        signing.verify_v1("POST", without_key, CREDS, now=NOW)
    assert e.value.code == "MissingParameter" and '"AccessKeyId"' in e.value.message


def test_verify_request_dispatches_on_the_scheme():
    verified = signing.verify_request("POST", "/", list(QUERY.items()), [],
                                      getter({**HEADERS, "Authorization": ACS3_VECTOR}), b"", CREDS, now=NOW)
    assert verified.scheme == "ACS3-HMAC-SHA256"
    form = [("InstanceName", V1_PARAMS["InstanceName"])]
    query = [(k, v) for k, v in V1_PARAMS.items() if k != "InstanceName"] + [("Signature", V1_OFFICIAL_SIGNATURE)]
    assert signing.verify_request("POST", "/", query, form, getter({}), b"", CREDS, now=NOW).scheme == "V1"
    with pytest.raises(SignatureError) as e:
        signing.verify_request("POST", "/", [("Action", "DescribeInstances")], [], getter({}), b"", CREDS)
    assert e.value.code == "MissingSignature"
