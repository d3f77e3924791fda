"""Command line: `python -m simcloud serve|fault|state|token|apply ...`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simcloud", description="The local ECS + Kubernetes cloud.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the local cloud until SIGTERM/SIGINT")
    serve.add_argument("--fleet", required=True, type=Path, help="fleet YAML (see simcloud/fleets/demo.yaml)")
    serve.add_argument("--workdir", required=True, type=Path, help="where kubeconfig, ecs.json, ... are written")
    serve.add_argument("--k8s-port", type=int, default=0, help="Kubernetes API port (0 = free port)")
    serve.add_argument("--ecs-port", type=int, default=0, help="ECS API port (0 = free port)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind and to write into kubeconfig/ecs.json/connections.json "
                            "(default 127.0.0.1; a container name such as `simcloud` under docker compose)")
    serve.add_argument("--seed", type=int, default=None, help="seed for boot ids and injected API faults")
    serve.add_argument("--kube", choices=("simcloud", "real"), default="simcloud",
                       help="the Kubernetes control plane: simcloud's own API server, scheduler and node-lifecycle "
                            "controller (default), or the real one (etcd, kube-apiserver, kube-scheduler, "
                            "kube-controller-manager from `make controlplane`) with the same ECS and kubelets")
    fault = sub.add_parser("fault", help="show or change the faults of a running local cloud")
    fault.add_argument("--workdir", required=True, type=Path)
    group = fault.add_mutually_exclusive_group(required=True)
    group.add_argument("--set", nargs="+", metavar="KEY=VALUE",
                       help="e.g. ecs_throttle_rate=0.3 never_ready=gpu-a,gpu-b no_stock= (empty clears a list)")
    group.add_argument("--show", action="store_true")
    state = sub.add_parser("state", help="print the instances/nodes summary of a running local cloud")
    state.add_argument("--workdir", required=True, type=Path)
    token = sub.add_parser("token", help="a bearer token (or kubeconfig / Airflow connections) acting as a "
                                         "ServiceAccount of a running local cloud")
    token.add_argument("--workdir", required=True, type=Path)
    token.add_argument("--serviceaccount", required=True, metavar="NAMESPACE/NAME")
    token.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for the ServiceAccount here")
    token.add_argument("--connections", type=Path,
                       help="also write an Airflow connections.json whose kubernetes_default uses that kubeconfig")
    token.add_argument("--namespace", default="default", help="the kubeconfig context's namespace")
    apply = sub.add_parser("apply", help="create the objects of YAML manifests in a running local cloud, as its "
                                         "admin (what exists already is left as it is)")
    apply.add_argument("--workdir", required=True, type=Path)
    apply.add_argument("manifests", nargs="+", type=Path, metavar="FILE")
    args = parser.parse_args(argv)

    if args.command == "serve":
        from simcloud.fleet import FleetError, load_fleet
        from simcloud.server import main_serve
        try:
            fleet = load_fleet(args.fleet)
        except (FleetError, OSError) as exc:
            parser.error(f"--fleet {args.fleet}: {exc}")
        return main_serve(fleet, args.workdir, args.k8s_port, args.ecs_port, args.seed, args.host, args.kube)

    from simcloud import admin
    if args.command == "apply":
        try:
            print("\n".join(admin.apply_manifests(args.workdir, *args.manifests)))
        except Exception as exc:   # the client's ApiException, a YAML error, a missing file: one line, exit 2
            print(f"simcloud apply: {type(exc).__name__}: {str(exc)[:500]}", file=sys.stderr)
            return 2
        return 0
    if args.command == "token":
        namespace, sep, name = args.serviceaccount.partition("/")
        if not sep or not namespace or not name:
            parser.error("--serviceaccount: expected NAMESPACE/NAME")
        if args.connections and not args.kubeconfig:
            parser.error("--connections needs --kubeconfig")
        try:
            if args.kubeconfig:
                admin.write_serviceaccount_files(args.workdir, namespace, name, args.kubeconfig, args.connections,
                                                 args.namespace)
                print(args.kubeconfig)
            else:
                print(admin.serviceaccount_token(args.workdir, namespace, name))
        except (admin.AdminError, OSError) as exc:
            print(f"simcloud token: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        if args.command == "state":
            result = admin.get_state(args.workdir)
        elif args.show:
            result = admin.get_faults(args.workdir)
        else:
            result = admin.set_faults(args.workdir, **admin.parse_assignments(args.set))
    except (admin.AdminError, ValueError, OSError) as exc:
        print(f"simcloud {args.command}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
