"""A fresh key-value store for every round of an elastic (``torchrun --max-restarts``) job.

torchrun's agents hand their workers one TCPStore for the whole job (``TORCHELASTIC_USE_AGENT_STORE``) and, as of
torch 2.14, the workers' keys in it carry no per-round prefix: a restarted round's ranks can read the dead round's
gloo addresses ("Gloo connectFullMesh failed"), so ``--max-restarts`` never resumes a job. Nor does
``TORCHELASTIC_RESTART_COUNT`` name the round: an agent restarted by a peer's failure does not count it.

Here rank 0 serves a new TCPStore each round and publishes ``port round-id`` under one key of the agent's store;
the other ranks keep only an address that answers with the same round id (a dead round's server no longer answers,
so a stale value is read again until this round's rank 0 replaced it). Joins: see :func:`join_warning`.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as tdist

from scale_ocr.errors import EXIT_PEER_LOST, RunStopped, say

KEY = "scale_ocr/round_store"  # in the agent's store: "PORT ROUND_ID" of this round's store
ROUND_KEY = "scale_ocr/round_id"  # in the round's own store: its round id, to recognise it
PROBE_S = 1.0  # seconds one connection attempt may take before the published address is read again


def uses_agent_store(env=os.environ) -> bool:
    """Whether the launcher shares one store across restart rounds (torchrun's elastic agent)."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def node_range(argv: list[str], env: Mapping[str, str]) -> tuple[int, int] | None:
    """torchrun's ``--nnodes MIN:MAX`` when MIN < MAX (an elastic job), from the agent's command line ``argv`` or,
    without the flag there, ``PET_NNODES`` (torchrun reads its flags' defaults from ``PET_*`` variables)."""
    value = env.get("PET_NNODES", "")
    for i, arg in enumerate(argv):
        if arg == "--nnodes" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
    low, sep, high = value.partition(":")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()) or int(low) >= int(high):
        return None
    return int(low), int(high)


def join_warning(argv: list[str], env: Mapping[str, str]) -> str | None:
    """A warning for an elastic torchrun job whose agents share one store across rounds.

    torch 2.14's agents then hang when a node joins a later round: the new node's agent waits for the address of
    that store under a key only the first round wrote, and the others wait for it, with nothing printed.
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every round a store of its own, and joins work.
    """
    nodes = node_range(argv, env)
    if nodes is None or not uses_agent_store(env):
        return None
    return (f"scale-ocr: warning: under torchrun --nnodes {nodes[0]}:{nodes[1]}, torch's agents hang when a node "
            "joins a running job, because they share one store across rounds; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "on every node before torchrun (examples/torchrun/elastic.sh does; docs/launchers.md)")


def warn_if_joins_would_hang() -> None:
    """Print :func:`join_warning`'s line when it applies; the agent is this worker's parent process."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")]
    except OSError:  # no procfs: PET_NNODES alone
        argv = []
    line = join_warning(argv, os.environ)
    if line:
        say(line, err=True)


def round_store(rank: int, world_size: int, timeout_s: float) -> tuple[tdist.Store, str]:
    """This round's store and its id (the same on every rank), served by rank 0's process; ``timeout_s``: how long
    to wait for rank 0 of this round (and the store's own timeout)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent = tdist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    if rank == 0:
        round_id = uuid.uuid4().hex
        own = tdist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        own.set(ROUND_KEY, round_id)
        agent.set(KEY, f"{own.port} {round_id}")
        return own, round_id
    deadline = time.monotonic() + timeout_s
    while True:
        own_port, round_id = agent.get(KEY).decode().split()  # waits for the first round's rank 0
        store = _connect(host, int(own_port), round_id, timeout)
        if store is not None:
            return store, round_id
        if time.monotonic() > deadline:
            raise RunStopped(f"rank 0 of this round did not start its store (announced at {host}:{port}) within "
                             f"{timeout_s:.0f} s (--dist-timeout); check rank 0's output and that its host accepts "
                             "connections", EXIT_PEER_LOST)
        time.sleep(0.2)


def _connect(host: str, port: int, round_id: str, timeout: datetime.timedelta) -> tdist.Store | None:
    """A client of the store at ``host:port`` if it is the round ``round_id``'s, else None."""
    try:  # a plain socket first: TCPStore's client logs a C++ stack for every address that does not answer
        socket.create_connection((host, port), timeout=PROBE_S).close()
    except OSError:
        return None
    try:
        store = tdist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=PROBE_S),
                               wait_for_workers=False)
        if not store.check([ROUND_KEY]) or store.get(ROUND_KEY).decode() != round_id:
            return None
    except (RuntimeError, OSError):  # a dead round's server: refused, reset or silent
        return None
    store.set_timeout(timeout)
    return store
