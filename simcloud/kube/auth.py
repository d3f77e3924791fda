"""Authentication and RBAC authorization of the local Kubernetes API, as kube-apiserver does them.

Every request carries a bearer token: the admin token the workdir's kubeconfig holds
(user `simcloud-admin` in group `system:masters`, which the real server never
authorizes further), or a ServiceAccount token issued by `issue_token` (TokenRequest,
`kubectl create token`, or the admin route), bound to the account's uid so deleting the
account revokes it. A missing token is `system:anonymous`, allowed only on the public
health and version paths (the 1.32 structured-authentication `anonymous.conditions`
pattern); an unknown token is 401. Everything else is decided by the Roles,
ClusterRoles and bindings stored through the API (rbac.authorization.k8s.io/v1), with
the real authorizer's rule matching and its Forbidden message, plus the bootstrap
ClusterRoles every real cluster starts with (cluster-admin, system:discovery,
system:basic-user, system:public-info-viewer).
"""
from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from simcloud.kube.errors import ApiError, invalid
from simcloud.kube.store import Store

ADMIN_USER = "simcloud-admin"
MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
ANONYMOUS = "system:anonymous"
SA_PREFIX = "system:serviceaccount:"
PUBLIC_PATHS = ("/healthz", "/livez", "/readyz", "/version", "/version/")
API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"   # the issuer: --api-audiences' default
_RBAC = "rbac.authorization.k8s.io"


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()
    uid: str = ""


@dataclass(frozen=True)
class Attributes:
    """What one request asks to do, as the apiserver's RequestInfo resolves it."""
    user: User
    verb: str
    resource_request: bool
    path: str = ""
    namespace: str = ""
    api_group: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""

    @property
    def qualified_resource(self) -> str:
        return f"{self.resource}.{self.api_group}" if self.api_group else self.resource


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def forbidden_message(attrs: Attributes) -> str:
    """responsewriters.forbiddenMessage, wrapped as errors.NewForbidden does."""
    user = attrs.user.name
    if not attrs.resource_request:
        return f'forbidden: User "{user}" cannot {attrs.verb} path "{attrs.path}"'
    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    scope = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    detail = f'User "{user}" cannot {attrs.verb} resource "{resource}" in API group "{attrs.api_group}" {scope}'
    subject = f'{attrs.qualified_resource} "{attrs.name}"' if attrs.name else attrs.qualified_resource
    return f"{subject} is forbidden: {detail}"


def forbidden(attrs: Attributes, reason: str = "") -> ApiError:
    message = forbidden_message(attrs) + (f": {reason}" if reason else "")
    details = {"name": attrs.name, "kind": attrs.resource} if attrs.resource_request else {}
    if attrs.resource_request and attrs.api_group:
        details["group"] = attrs.api_group
    return ApiError(403, "Forbidden", message, {k: v for k, v in details.items() if v})


# --------------------------------------------------------------------------- request attributes
def request_attributes(user: User, method: str, path: str, query) -> Attributes:
    """RequestInfoFactory: the verb, namespace, resource, subresource and name a request names."""
    parts = [p for p in path.strip("/").split("/") if p]
    verb_of = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    prefix = {"api": 2, "apis": 3}.get(parts[0] if parts else "")    # /api/v1, /apis/GROUP/VERSION
    if prefix is None or len(parts) <= prefix:      # discovery, /version, /healthz, ...: non-resource
        return Attributes(user, method.lower(), False, path=path)
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[prefix:]
    verb = verb_of.get(method, method.lower())
    if rest and rest[0] == "watch":
        verb, rest = "watch", rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in ("status", "finalize"):
            rest = rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if (query.get("watch") or "").lower() in ("true", "1") else "list"
    elif verb == "get" and (query.get("watch") or "").lower() in ("true", "1"):
        verb = "watch"
    if not name and verb in ("list", "watch"):
        name = _exact_name(query.get("fieldSelector") or "")
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(user, verb, True, path=path, namespace=namespace, api_group=group, resource=resource,
                      subresource=subresource, name=name)


def _exact_name(field_selector: str) -> str:
    """A list/watch pinned to one object by `metadata.name=` counts as a request for that name."""
    for term in field_selector.split(","):
        key, sep, value = term.partition("=")
        if sep and key.strip() == "metadata.name" and not key.endswith("!"):
            value = value.lstrip("=").strip()
            return value if value and "/" not in value and value not in (".", "..") else ""
    return ""


# --------------------------------------------------------------------------- rule matching
def _matches(values: Iterable[str] | None, wanted: str) -> bool:
    values = values or ()
    return "*" in values or wanted in values


def _resource_matches(rule: dict, attrs: Attributes) -> bool:
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    for resource in rule.get("resources") or ():
        if resource in ("*", combined):
            return True
        if attrs.subresource and resource == f"*/{attrs.subresource}":
            return True
    return False


def rule_allows(rule: dict, attrs: Attributes) -> bool:
    """rbac/v1 RuleAllows: verbs, apiGroups, resources (incl. `pods/log`, `*/status`), resourceNames,
    or nonResourceURLs (exact or `prefix*`)."""
    if not _matches(rule.get("verbs"), attrs.verb):
        return False
    if not attrs.resource_request:
        return any(url in ("*", attrs.path) or (url.endswith("*") and attrs.path.startswith(url[:-1]))
                   for url in rule.get("nonResourceURLs") or ())
    names = rule.get("resourceNames") or ()
    return (_matches(rule.get("apiGroups"), attrs.api_group) and _resource_matches(rule, attrs)
            and (not names or attrs.name in names))


def _subject_applies(subject: dict, user: User, binding_namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.name
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return bool(namespace) and user.name == f"{SA_PREFIX}{namespace}:{subject.get('name')}"
    return False


@dataclass
class Decision:
    allowed: bool
    reason: str = ""
    errors: list[str] = field(default_factory=list)


class Authorizer:
    """The RBAC authorizer over the store's Roles and bindings (read on every request, like the
    real one's informer cache: a binding applied with kubectl counts from the next request)."""

    def __init__(self, store: Store):
        self.store = store

    def _rules(self, role_ref: dict, namespace: str, errors: list[str]) -> list[dict]:
        kind, name = role_ref.get("kind"), role_ref.get("name") or ""
        resource = "clusterroles" if kind == "ClusterRole" else "roles"
        try:
            role = self.store.read(resource, namespace if kind == "Role" else None, name)
        except ApiError:
            errors.append(f'{kind.lower() if kind else "role"}.{_RBAC} "{name}" not found')
            return []
        return [r for r in role.get("rules") or [] if isinstance(r, dict)]

    def _bindings(self, namespace: str) -> list[tuple[dict, str]]:
        bindings = [(b, "") for b in self.store.peek("clusterrolebindings")]
        if namespace:
            bindings += [(b, namespace) for b in self.store.select("rolebindings", namespace)]
        return bindings

    def user_rules(self, user: User, namespace: str) -> list[dict]:
        """Every rule granted to `user` cluster-wide and in `namespace` (the rule resolver)."""
        rules: list[dict] = []
        for binding, ns in self._bindings(namespace):
            if any(isinstance(s, dict) and _subject_applies(s, user, ns) for s in binding.get("subjects") or []):
                rules += self._rules(binding.get("roleRef") or {}, ns, [])
        return rules

    def authorize(self, attrs: Attributes) -> Decision:
        if MASTERS in attrs.user.groups:
            return Decision(True, "")
        errors: list[str] = []
        for binding, namespace in self._bindings(attrs.namespace):
            subject = next((s for s in binding.get("subjects") or [] if isinstance(s, dict)
                            and _subject_applies(s, attrs.user, namespace)), None)
            if subject is None:
                continue
            ref = binding.get("roleRef") or {}
            if any(rule_allows(rule, attrs) for rule in self._rules(ref, namespace, errors)):
                return Decision(True, _allowed_by(binding, ref, subject, namespace))
        return Decision(False, _rbac_reason(errors), errors)


def _rbac_reason(errors: list[str]) -> str:
    """The denial's reason: the roles a matching binding named but that do not exist (an aggregate)."""
    if not errors:
        return ""
    return "RBAC: " + (errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]")


def _allowed_by(binding: dict, ref: dict, subject: dict, namespace: str) -> str:
    """The reason the real authorizer gives an allowed SelfSubjectAccessReview."""
    name = binding["metadata"]["name"] + (f"/{namespace}" if namespace else "")
    kind = "RoleBinding" if namespace else "ClusterRoleBinding"
    who = subject.get("name", "")
    if subject.get("kind") == "ServiceAccount":
        who = f"{who}/{subject.get('namespace') or namespace}"
    return f'RBAC: allowed by {kind} "{name}" of {ref.get("kind")} "{ref.get("name")}" to {subject.get("kind")} "{who}"'


# --------------------------------------------------------------------------- escalation prevention
def _simple_rules(rule: dict) -> list[tuple]:
    """A rule broken into one-verb, one-group, one-resource, one-name (or one-URL) rules."""
    verbs = rule.get("verbs") or []
    if rule.get("nonResourceURLs"):
        return [("url", verb, url) for verb in verbs for url in rule["nonResourceURLs"]]
    return [(verb, group, resource, name) for verb in verbs for group in rule.get("apiGroups") or []
            for resource in rule.get("resources") or [] for name in (rule.get("resourceNames") or [""])]


def _covers(owner: dict, simple: tuple) -> bool:
    """validation.ruleCovers: the owner's rule grants at least the simple rule."""
    if not _matches(owner.get("verbs"), simple[1] if simple[0] == "url" else simple[0]):
        return False
    if simple[0] == "url":
        url = simple[2]
        return any(o in ("*", url) or (o.endswith("*") and url.startswith(o[:-1]))
                   for o in owner.get("nonResourceURLs") or ())
    _, group, resource, name = simple
    if not _matches(owner.get("apiGroups"), group):
        return False
    if not any(o in ("*", resource) or (o.startswith("*/") and "/" in resource and resource.split("/", 1)[1] == o[2:])
               for o in owner.get("resources") or ()):
        return False
    names = owner.get("resourceNames") or ()
    return not names or name in names


def _compact(rule: dict) -> str:
    """rbacv1helpers.CompactString: how the real refusal lists a rule not held."""
    def q(values) -> str:
        return "[" + " ".join(f'"{v}"' for v in values) + "]"
    parts = [f"{label}:{q(rule[key])}" for key, label in (("apiGroups", "APIGroups"), ("resources", "Resources"),
                                                         ("resourceNames", "ResourceNames"),
                                                         ("nonResourceURLs", "NonResourceURLs"), ("verbs", "Verbs"))
             if rule.get(key)]
    return "{" + ", ".join(parts) + "}"


# --------------------------------------------------------------------------- bootstrap policy
def _cluster_role(name: str, rules: list[dict]) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                         "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "true"}}, "rules": rules}


def _binding(name: str, role: str, groups: list[str]) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                         "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "true"}},
            "roleRef": {"apiGroup": _RBAC, "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": _RBAC, "kind": "Group", "name": g} for g in groups]}


BOOTSTRAP_ROLES = [
    _cluster_role("cluster-admin", [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                                    {"nonResourceURLs": ["*"], "verbs": ["*"]}]),
    _cluster_role("system:discovery", [{"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/healthz",
                                                            "/livez", "/openapi", "/openapi/*", "/readyz",
                                                            "/version", "/version/"], "verbs": ["get"]}]),
    _cluster_role("system:public-info-viewer", [{"nonResourceURLs": list(PUBLIC_PATHS), "verbs": ["get"]}]),
    _cluster_role("system:basic-user", [{"apiGroups": ["authorization.k8s.io"],
                                         "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                                         "verbs": ["create"]}]),
]
BOOTSTRAP_BINDINGS = [
    _binding("cluster-admin", "cluster-admin", [MASTERS]),
    _binding("system:discovery", "system:discovery", [AUTHENTICATED]),
    _binding("system:public-info-viewer", "system:public-info-viewer", [AUTHENTICATED, UNAUTHENTICATED]),
    _binding("system:basic-user", "system:basic-user", [AUTHENTICATED]),
]


# --------------------------------------------------------------------------- authentication
class Auth:
    """Authenticator + authorizer of one API server. Installs the bootstrap policy into `store`."""

    def __init__(self, store: Store, admin_token: str | None = None):
        self.store = store
        self.admin_token = admin_token or secrets.token_hex(16)
        self.authorizer = Authorizer(store)
        self._sa_tokens: dict[str, tuple[str, str, str, tuple[str, ...]]] = {}   # token -> (ns, name, uid, audiences)
        for role in BOOTSTRAP_ROLES:
            store.create("clusterroles", role)
        for binding in BOOTSTRAP_BINDINGS:
            store.create("clusterrolebindings", binding)

    def authenticate(self, authorization: str | None, path: str) -> User:
        """The user a request's Authorization header names; 401 when unknown (or absent, off the public paths)."""
        if not authorization:
            if path in PUBLIC_PATHS:
                return User(ANONYMOUS, (UNAUTHENTICATED,))
            raise unauthorized()
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized()
        if secrets.compare_digest(token, self.admin_token):
            return User(ADMIN_USER, (MASTERS, AUTHENTICATED))
        bound = self._sa_tokens.get(token)
        if bound is None or API_AUDIENCE not in bound[3]:      # minted for another audience: not for us
            raise unauthorized()
        namespace, name, uid, _ = bound
        try:
            account = self.store.read("serviceaccounts", namespace, name)
        except ApiError:
            account = None
        if account is None or account["metadata"].get("uid") != uid:   # deleted (or re-created): revoked
            del self._sa_tokens[token]
            raise unauthorized()
        return service_account_user(namespace, name, uid)

    def issue_token(self, namespace: str, name: str, audiences: Iterable[str] | None = None) -> str:
        """A new token for an existing ServiceAccount (404 when it does not exist), valid for `audiences`
        (default: the API server's own); the API server accepts it only when it is one of them."""
        account = self.store.read("serviceaccounts", namespace, name)
        token = secrets.token_urlsafe(32)
        self._sa_tokens[token] = (namespace, name, account["metadata"]["uid"], tuple(audiences or (API_AUDIENCE,)))
        return token

    def impersonate(self, user: User, headers) -> User:
        """`kubectl --as`: the requester needs `impersonate` on the user (or service account) and groups."""
        target = headers.get("Impersonate-User")
        if not target:
            return user
        groups = tuple(headers.getall("Impersonate-Group", []))
        if target.startswith(SA_PREFIX) and target.count(":") == 3:
            namespace, name = target[len(SA_PREFIX):].split(":")
            checks = [Attributes(user, "impersonate", True, namespace=namespace, resource="serviceaccounts",
                                 name=name)]
            groups = groups or ("system:serviceaccounts", f"system:serviceaccounts:{namespace}")
        else:
            checks = [Attributes(user, "impersonate", True, resource="users", name=target)]
        checks += [Attributes(user, "impersonate", True, resource="groups", name=g) for g in groups]
        for attrs in checks:
            decision = self.authorizer.authorize(attrs)
            if not decision.allowed:
                raise forbidden(attrs, decision.reason)
        return User(target, groups + ((AUTHENTICATED,) if target != ANONYMOUS else ()))

    def check_rbac_write(self, user: User, resource: str, namespace: str | None, obj: dict) -> None:
        """The RBAC registry's escalation check: a Role may grant only what its author holds (or has
        `escalate` on it), a binding only a role its author holds or has `bind` on."""
        if MASTERS in user.groups or resource not in ("roles", "clusterroles", "rolebindings", "clusterrolebindings"):
            return
        namespace = namespace or ""
        name = (obj.get("metadata") or {}).get("name") or ""
        if resource in ("roles", "clusterroles"):
            exempt = Attributes(user, "escalate", True, namespace=namespace, api_group=_RBAC, resource=resource,
                                name=name)
            rules = [r for r in obj.get("rules") or [] if isinstance(r, dict)]
        else:
            ref = obj.get("roleRef") or {}
            role_resource = "roles" if ref.get("kind") == "Role" else "clusterroles"
            exempt = Attributes(user, "bind", True, namespace=namespace,
                                api_group=_RBAC, resource=role_resource, name=ref.get("name") or "")
            rules = self.authorizer._rules(ref, namespace, [])
        if self.authorizer.authorize(exempt).allowed:
            return
        held = self.authorizer.user_rules(user, namespace)
        missing = [r for r in rules if not all(any(_covers(o, s) for o in held) for s in _simple_rules(r))]
        if missing:
            groups = "[" + " ".join(f'"{g}"' for g in user.groups) + "]"
            raise ApiError(403, "Forbidden", f'{resource}.{_RBAC} "{name}" is forbidden: user "{user.name}" '
                                             f'(groups={groups}) is attempting to grant RBAC permissions not '
                                             f'currently held:\n' + "\n".join(_compact(r) for r in missing),
                           {"name": name, "group": _RBAC, "kind": resource})

    def check(self, attrs: Attributes) -> None:
        decision = self.authorizer.authorize(attrs)
        if not decision.allowed:
            raise forbidden(attrs, decision.reason)

    def access_review(self, user: User, review: dict) -> dict:
        """SelfSubjectAccessReview: the same decision a request with `spec`'s attributes would get."""
        spec = review.get("spec") if isinstance(review.get("spec"), dict) else {}
        res, non_res = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if isinstance(res, dict) and res:
            attrs = Attributes(user, res.get("verb") or "", True, namespace=res.get("namespace") or "",
                               api_group=res.get("group") or "", resource=res.get("resource") or "",
                               subresource=res.get("subresource") or "", name=res.get("name") or "")
        elif isinstance(non_res, dict) and non_res:
            attrs = Attributes(user, non_res.get("verb") or "", False, path=non_res.get("path") or "")
        else:
            raise invalid("SelfSubjectAccessReview", "", [
                ("spec.resourceAttributes", "FieldValueRequired",
                 "Required value: exactly one of nonResourceAttributes or resourceAttributes must be specified")])
        decision = self.authorizer.authorize(attrs)
        status = {"allowed": decision.allowed}
        if decision.reason:
            status["reason"] = decision.reason
        return {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}


    def rules_review(self, user: User, review: dict) -> dict:
        """SelfSubjectRulesReview (`kubectl auth can-i --list`): the rules `user` holds in a namespace."""
        spec = review.get("spec") if isinstance(review.get("spec"), dict) else {}
        namespace = spec.get("namespace") or ""
        rules = self.authorizer.user_rules(user, namespace) if MASTERS not in user.groups else \
            BOOTSTRAP_ROLES[0]["rules"]
        keys = ("verbs", "apiGroups", "resources", "resourceNames")
        resource_rules = [{k: list(r[k]) for k in keys if r.get(k)} for r in rules if not r.get("nonResourceURLs")]
        non_resource = [{"verbs": list(r.get("verbs") or []), "nonResourceURLs": list(r["nonResourceURLs"])}
                        for r in rules if r.get("nonResourceURLs")]
        return {"kind": "SelfSubjectRulesReview", "apiVersion": "authorization.k8s.io/v1",
                "metadata": {"creationTimestamp": None}, "spec": {"namespace": namespace},
                "status": {"resourceRules": resource_rules, "nonResourceRules": non_resource, "incomplete": False}}


def service_account_user(namespace: str, name: str, uid: str = "") -> User:
    return User(f"{SA_PREFIX}{namespace}:{name}",
                ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED), uid)


def token_request(token: str, spec: dict | None, expires: str) -> dict:
    """The authentication.k8s.io/v1 TokenRequest answer (`kubectl create token`)."""
    return {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1", "metadata": {"creationTimestamp": None},
            "spec": {"expirationSeconds": 3600, **(spec or {}), "audiences": (spec or {}).get("audiences") or [API_AUDIENCE]},
            "status": {"token": token, "expirationTimestamp": expires}}

