"""The kubelets' HTTPS endpoint: `GET /containerLogs/<namespace>/<pod>/<container>`.

A real API server answers `pods/log` (kubectl logs, the pod operator's log reads) by calling the
kubelet of the pod's node at the node's InternalIP and `status.daemonEndpoints.kubeletEndpoint.Port`.
One aiohttp application serves every emulated node: one listening socket per node address,
all on the same port; the address a request arrived on says which node's kubelet answers, and
a pod bound elsewhere is not found there. Only clients with a certificate of the cluster CA
are served (the API server's --kubelet-client-certificate), as a kubelet with
--client-ca-file does.
"""
from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Callable

from aiohttp import web

from simcloud.kube.errors import ApiError
from simcloud.machines.containers import ContainerRunner


class KubeletEndpoint:
    """Serve container logs for the nodes at `addresses` (node name -> IP) on one port.

    find_pod(namespace, name) -> the pod as the kubelets know it (or None)."""

    def __init__(self, runner: ContainerRunner, find_pod: Callable[[str, str], dict | None],
                 addresses: dict[str, str], cert: tuple[str, str], ca_file: str) -> None:
        self.runner, self.find_pod = runner, find_pod
        self.node_of = {ip: name for name, ip in addresses.items()}
        self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca_file)
        self.tls.load_cert_chain(*cert)
        self.tls.verify_mode = ssl.CERT_REQUIRED
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        app.router.add_get("/healthz", lambda _r: web.Response(text="ok"))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        for _attempt in range(20):
            sockets = self._bind_all()
            if sockets:
                break
        else:
            raise OSError("no port free on every kubelet address")
        for sock in sockets:
            await web.SockSite(self._runner, sock, ssl_context=self.tls).start()
        return self.port

    def _bind_all(self) -> list[socket.socket]:
        """One socket per node address, all on the port the first one got (or none, to try again)."""
        sockets: list[socket.socket] = []
        port = 0
        try:
            for ip in self.node_of:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sockets.append(sock)
                sock.bind((ip, port))
                port = sock.getsockname()[1]
        except OSError:
            for sock in sockets:
                sock.close()
            return []
        self.port = port
        return sockets

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        node = self.node_of.get(sockname[0] if sockname else "")
        namespace, name = request.match_info["namespace"], request.match_info["pod"]
        pod = self.find_pod(namespace, name)
        if pod is None or node is None or (pod.get("spec") or {}).get("nodeName") != node:
            return web.Response(status=404, text=f'pod "{name}" in namespace "{namespace}" not found on this node')
        query = request.query

        def number(key: str) -> int | None:
            return int(query[key]) if query.get(key) not in (None, "") else None
        try:
            lines = self.runner.stream(namespace, pod, request.match_info["container"],
                                       follow=query.get("follow") in ("true", "1"),
                                       timestamps=query.get("timestamps") in ("true", "1"),
                                       since_seconds=number("sinceSeconds"), since_time=query.get("sinceTime"),
                                       tail_lines=number("tailLines"), limit_bytes=number("limitBytes"))
        except ApiError as exc:
            return web.Response(status=exc.code, text=exc.message)
        except ValueError as exc:
            return web.Response(status=400, text=str(exc))
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            async for chunk in lines:
                await response.write(chunk)
            await response.write_eof()
        return response
