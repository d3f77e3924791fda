"""simcloud.machines.containers: what a container does, and its log as the kubelet serves it (no servers)."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from simcloud.harness import process_alive
from simcloud.kube.errors import ApiError
from simcloud.machines.containers import CannotRun, ContainerRunner


def pod(*containers: dict, name: str = "p", annotations: dict | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                         "annotations": annotations or {}},
            "spec": {"nodeName": "n1", "containers": list(containers)},
            "status": {"podIP": "10.16.0.2", "hostIP": "172.16.0.2"}}


async def collect(stream) -> bytes:
    return b"".join([chunk async for chunk in stream])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_command_runs_with_env_and_logs_lines(tmp_path):
    async def main():
        runner = ContainerRunner(tmp_path, k8s_host="10.0.0.7", k8s_port=6443)
        script = ("import os; print('hello', os.environ['GREETING'], os.environ['HOSTNAME']); "
                  "import sys; print('oops', file=sys.stderr); print(os.environ['NVIDIA_VISIBLE_DEVICES'], "
                  "os.environ['POD_IP'], os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT'], "
                  "os.environ['KUBERNETES_PORT']); print(os.getcwd())")
        c = {"name": "main", "image": "python:3.11", "command": ["python", "-c", script],
             "env": [{"name": "GREETING", "value": "world"},
                     {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}
        p = pod(c)
        ctr = await runner.start(p, c, {"NVIDIA_VISIBLE_DEVICES": "0,1"})
        assert await ctr.wait() == 0
        text = (await collect(runner.stream("default", p, None))).decode()
        lines = text.splitlines()
        assert lines[:3] == ["hello world p", "oops", "0,1 10.16.0.2 10.0.0.7 6443 tcp://10.0.0.7:6443"]
        assert lines[3].startswith(str(tmp_path))
        stamped = (await collect(runner.stream("default", p, "main", timestamps=True))).decode().splitlines()
        assert stamped[0].endswith("Z hello world p") and len(stamped[0].split(" ")[0]) == 30
        assert await collect(runner.stream("default", p, None, tail_lines=1)) == lines[3].encode() + b"\n"
        assert await collect(runner.stream("default", p, None, limit_bytes=5)) == b"hello"
        assert await collect(runner.stream("default", p, None, since_seconds=3600)) == text.encode()
        await runner.shutdown()
    run(main())


def test_exit_code_args_expansion_and_sh(tmp_path):
    async def main():
        runner = ContainerRunner(tmp_path)
        c = {"name": "c", "command": ["sh", "-c"], "args": ["echo $(WHO) '$$(KEEP)'; exit 3"],
             "env": [{"name": "WHO", "value": "me"}]}
        p = pod(c)
        ctr = await runner.start(p, c)
        assert await ctr.wait() == 3
        assert await collect(runner.stream("default", p, "c")) == b"me $(KEEP)\n"
    run(main())


def test_follow_streams_lines_as_they_come_and_ends_at_exit(tmp_path):
    async def main():
        runner = ContainerRunner(tmp_path)
        c = {"name": "c", "command": ["python", "-c",
                                      "import time\nfor i in range(3):\n print('step', i); time.sleep(0.2)"]}  # sleep-ok: the pod's own workload, not a wait
        p = pod(c)
        await runner.start(p, c)
        arrivals = []
        async for chunk in runner.stream("default", p, "c", follow=True):
            arrivals.append((time.monotonic(), chunk))
        assert [a[1] for a in arrivals] == [b"step 0\n", b"step 1\n", b"step 2\n"]
        assert arrivals[-1][0] - arrivals[0][0] > 0.3      # they came while it ran, not all at the end
    run(main())


def test_command_not_found_and_log_errors(tmp_path):
    async def main():
        runner = ContainerRunner(tmp_path)
        c = {"name": "c", "command": ["no-such-binary-xyz"]}
        with pytest.raises(CannotRun, match='exec: "no-such-binary-xyz": executable file not found in \\$PATH'):
            await runner.start(pod(c), c)
        two = pod({"name": "a"}, {"name": "b"}, name="two")
        with pytest.raises(ApiError) as caught:
            runner.stream("default", two, None)
        assert caught.value.code == 400 and "choose one of: [a b]" in str(caught.value.message)
        with pytest.raises(ApiError) as caught:
            runner.stream("default", two, "a")
        assert caught.value.message == 'container "a" in pod "two" is waiting to start: ContainerCreating'
        with pytest.raises(ApiError):
            runner.stream("default", two, "zzz")
    run(main())


def test_commandless_container_sleeps_for_annotation_seconds(tmp_path):
    async def main():
        runner = ContainerRunner(tmp_path)
        c = {"name": "c", "image": "busybox"}
        p = pod(c, annotations={"simcloud.io/run-seconds": "0.2"})
        started = time.monotonic()
        ctr = await runner.start(p, c)
        assert await ctr.wait() == 0
        assert 0.15 < time.monotonic() - started < 2
        assert b"has no command" in await collect(runner.stream("default", p, "c"))
    run(main())


def test_stop_terminates_then_kills_the_whole_process_group(tmp_path):
    async def main():
        runner = ContainerRunner(tmp_path)
        # a shell that ignores SIGTERM and has a child: both must be gone after stop()
        c = {"name": "c", "command": ["sh", "-c", "trap '' TERM; sleep 30 & echo $!; wait"]}
        p = pod(c)
        ctr = await runner.start(p, c)
        stream = runner.stream("default", p, "c", follow=True)
        child = int((await stream.__anext__()).decode())
        code = await ctr.stop(0.3)
        assert code == 128 + signal.SIGKILL
        for _ in range(100):
            if not process_alive(child):
                break
            await asyncio.sleep(0.02)
        assert not process_alive(child)
        c2 = {"name": "c", "command": ["sleep", "30"]}
        p2 = pod(c2, name="q")
        ctr2 = await runner.start(p2, c2)
        await runner.shutdown(grace_seconds=2)
        assert ctr2.exit_code == 128 + signal.SIGTERM
        assert not list(tmp_path.iterdir())       # working dirs removed
    run(main())
