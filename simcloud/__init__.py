"""simcloud: a local ECS endpoint and Kubernetes API server for the demo and the tests.

    __main__     the CLI: python -m simcloud serve|fault|state|token|apply
    server       one process composing everything below (the two APIs, the machines, the controllers), or
                 with --kube real the ECS API and the machines on the real control plane
    harness      runs `python -m simcloud serve` as a subprocess for the tests, the demo, bench and chaos
    admin        the admin surface (/_simcloud: faults, state, compact, tokens), server and client side
    machines/    kubelets and the containers they run as local processes; the port they reach the API by
                 (in process, or over HTTPS as each node) and their container-log endpoint
    real_control_plane   the real etcd, kube-apiserver, scheduler and controller-manager (controlplane/), started
                 as processes: the second Kubernetes backend
    fleet        fleet files (fleets/*.yaml): the machines as ECS instances and Kubernetes Nodes
    kube/        the Kubernetes API server: store, admission, validation, RBAC, OpenAPI, ...; scheduler
                 and node-lifecycle controller
    ecs/         the ECS OpenAPI emulator: RPC endpoint, instance model, catalog, tags, quota, signing
    config, workdir, tls    timings and faults; the files written for clients; the serving certificate

Each line imports only the lines below it (kube and ecs know nothing of each other): the
import-linter contracts in pyproject.toml keep it so.
"""
