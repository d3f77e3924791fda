"""The ECS OpenAPI emulator: the RPC endpoint (api), instances and their power lifecycle (model),
prices and stock (catalog), tags, per-API quotas, parameter parsing, and the verification of request
signatures (signing).
"""
