"""Where tensor-parallel ranks meet, and what torchrun says about it (no torch here: the CLI reads
it before it knows whether this process will run an engine at all)."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

from tokenmill.errors import EngineDeadError

TOKEN_ENV = "TOKENMILL_TP_TOKEN"  # the secret under which every rank finds its keys


@dataclass
class Rendezvous:
    """Where the ranks meet: rank 0 hosts a TCPStore at host:port (port 0: any free one)."""

    host: str
    port: int
    world_size: int
    spawn_workers: bool = True  # False under torchrun, which starts the other ranks itself
    token: str = ""  # keys live under it; spawned workers get it in their environment
    # --distributed-executor-backend ray: the workers are Ray actors in these bundles (rank 1.. in
    # ray_bundles[1:]) of the named placement group, and host is this node's address
    ray_placement_group: str | None = None
    ray_bundles: list[int] | None = None


def torchrun_rendezvous() -> tuple[int, Rendezvous] | None:
    """(rank, rendezvous) when this process was started by torchrun with more than one rank. The
    ranks use torchrun's store at MASTER_ADDR:MASTER_PORT; every rank needs the same
    TOKENMILL_TP_TOKEN, which is required when the ranks span machines."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return None
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    token = os.environ.get(TOKEN_ENV, "")
    if not token and not _is_loopback(host):
        raise EngineDeadError(f"a multi-node launch (MASTER_ADDR={host}) needs the same secret in {TOKEN_ENV} "
                              "on every rank")
    return int(os.environ["RANK"]), Rendezvous(host, port, world, spawn_workers=False, token=token)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
