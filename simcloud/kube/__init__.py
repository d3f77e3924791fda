"""The Kubernetes API server: the object store, admission and validation, RBAC (auth), discovery and
OpenAPI, patches, selectors, tables, protobuf; and the controllers that run in it (scheduler, node
lifecycle).
"""
