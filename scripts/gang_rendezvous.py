"""A gang's workload for the demo and the tests: the ranks rendezvous using only the environment
gpuboot sets (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) and exchange a message.

Rank 0 listens on MASTER_ADDR:MASTER_PORT (its own pod IP) and greets every other rank; each
other rank connects there, says hello and prints the answer. Run as the container's
`python -c <this file's text>`. RENDEZVOUS_TAG prefixes the lines; RENDEZVOUS_FAIL_RANK=N makes
rank N exit 1 before it connects (only while the file RENDEZVOUS_FAIL_ONCE does not exist, if
set: the first attempt fails, its retry succeeds).
"""
import os
import socket
import sys
import time

tag = os.environ.get("RENDEZVOUS_TAG", "gang")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
print(f"{tag} rank {rank} of {world}: master {addr}:{port}", flush=True)

once = os.environ.get("RENDEZVOUS_FAIL_ONCE")
if os.environ.get("RENDEZVOUS_FAIL_RANK") == str(rank) and not (once and os.path.exists(once)):
    if once:
        open(once, "w").close()
    print(f"{tag} rank {rank} gives up: failing on purpose", flush=True)
    sys.exit(1)

if rank == 0:
    with socket.create_server((addr, port)) as server:
        server.settimeout(300)
        for _ in range(world - 1):
            conn, _peer = server.accept()
            with conn:
                print(f"{tag} rank 0 got: {conn.recv(1024).decode()}", flush=True)
                conn.sendall(f"welcome from rank 0 of {world}".encode())
else:
    deadline = time.monotonic() + 300
    while True:     # rank 0 may not listen yet
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # sleep-ok: the workload's own connect retry
    with conn:
        conn.sendall(f"hello from rank {rank}".encode())
        print(f"{tag} rank {rank} got: {conn.recv(1024).decode()}", flush=True)
print(f"{tag} rank {rank} done", flush=True)
