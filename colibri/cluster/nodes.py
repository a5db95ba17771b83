"""The Ray side: join the cluster, find the nodes that offer the resource `colibri`, start one stage actor on
each, and call them with a deadline on every wait.

Everything that crosses a process is a Ray actor call (Ray's transport: its object store and direct actor calls);
nothing here opens a socket. A failure comes back as one line naming the node: a missing node, a dead actor
(`StageLostError`: the runner ends the requests in flight), a call past its deadline, an error inside the stage.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from ..errors import ColibriError, StageLostError

log = logging.getLogger("colibri")

RESOURCE = "colibri"  # a node offers one stage: `ray start ... --resources '{"colibri": 1}'`
CALL_S = 300.0  # default deadline of a step's wait (a prefill chunk of a model streamed from disk can be slow)
LOAD_S = 3600.0  # a stage reading its layers (hundreds of GB from disk at a few GB/s)
PING_S = 30.0


def ray():
    """The ray module, or one line on how to get it."""
    try:
        import ray as r
    except ImportError:
        raise ColibriError("--cluster needs Ray: pip install 'colibri[cluster]'") from None
    return r


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto": the one this machine's `ray start` joined)."""
    r = ray()
    host, _, port = address.rpartition(":")
    if address != "auto":
        if not port.isdigit():
            raise ColibriError(f"cluster: bad address {address!r} (HOST:PORT of the Ray head, or auto)")
        try:  # Ray's own connect retries for minutes: a missing head is a one-line error at once
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=PING_S / 6).close()
        except OSError as e:
            raise ColibriError(f"cluster: no Ray cluster at {address} ({e.strerror or e}); start one with "
                               "`ray start --head --resources '{\"colibri\": 1}'` (docs/CLUSTER.md)") from None
    if r.is_initialized():
        now = r.get_runtime_context().gcs_address
        if address != "auto" and now.rpartition(":")[2] != port:
            raise ColibriError(f"cluster: this process is already connected to the Ray cluster at {now}")
        return
    try:
        r.init(address=address, log_to_driver=False, logging_level=logging.WARNING, include_dashboard=False)
    except ConnectionError as e:
        raise ColibriError(f"cluster: no Ray cluster at {address} ({_first_line(e)}); start one with "
                           "`ray start --head --resources '{\"colibri\": 1}'` (docs/CLUSTER.md)") from None


def colibri_nodes() -> list[dict]:
    """The live nodes that offer the resource `colibri`: the head's own node first, then by address."""
    me = ray().get_runtime_context().get_node_id()
    nodes = [n for n in ray().nodes() if n.get("Alive") and n.get("Resources", {}).get(RESOURCE, 0) >= 1]
    return sorted(nodes, key=lambda n: (n["NodeID"] != me, n["NodeManagerAddress"], n["NodeID"]))


def pick_nodes(want: int | None) -> list[dict]:
    """`want` nodes (None: every node that offers `colibri`), or one line saying which are missing."""
    nodes = colibri_nodes()
    have = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in nodes) or "none"
    if not nodes or (want is not None and len(nodes) < want):
        raise ColibriError(f"cluster: {want or 1} node(s) with the resource '{RESOURCE}' needed, {len(nodes)} "
                           f"found ({have}); start each with `ray start --address HEAD:PORT --resources "
                           "'{\"colibri\": 1}'`")
    return nodes[:want] if want is not None else nodes


def start_all(address: str, want: int | None, container, mem_budget: int | None, body: type | None = None):
    """Join the cluster and start `body` (a stage, or an expert worker) on each of `want` nodes offering `colibri`
    (the head's own node in this process); their facts checked against this process's container. (nodes, actors,
    facts, the nodes' budgets: given, else their free memory)."""
    from .stage import container_id

    connect(address)
    picked = pick_nodes(want)
    me = ray().get_runtime_context().get_node_id()
    actors = [start_stage(n, str(container.path), local=n["NodeID"] == me, body=body) for n in picked]
    try:
        facts = starting([a.facts.remote(mem_budget) for a in actors],
                         [f"node {n['NodeManagerAddress']}" for n in picked], PING_S * 4)
        mine = container_id(container)
        for f in facts:
            if f["id"] != mine:
                raise ColibriError(f"cluster: node {f['name']}: its container {f['path']} differs from the head's "
                                   f"{container.path} (header checksum {f['id']} vs {mine}); give every node the "
                                   "same file")
    except BaseException:
        kill(actors)
        raise
    return picked, actors, facts, [f["budget"] if f["budget"] is not None else f["available"] for f in facts]


def kill(actors: list) -> None:
    """End the actors (a LocalActor has no process of its own)."""
    for a in actors:
        if not isinstance(a, LocalActor):
            ray().kill(a, no_restart=True)


def until_up(call, deadline_s: float = PING_S * 4):
    """`call()` until the actors it asks answer: Ray restarts a lost one in a new process, "unavailable" meanwhile."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return call()
        except StageLostError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


class LocalActor:
    """A stage in the head's own process (its node offers `colibri`): the actor's calls, run when made, so a step
    crosses one process boundary less. `wait` takes their results as they are."""

    def __init__(self, stage):
        self.stage = stage

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self.stage, name))


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kw):
        try:
            return self.fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - raised by `wait`, named, as an actor's error would be
            return _Failed(e)


class _Failed:
    def __init__(self, error: Exception):
        self.error = error


def start_stage(node: dict, path: str, local: bool = False, body: type | None = None) -> Any:
    """A stage actor (cluster/stage.py) pinned to `node`. Ray restarts it if its process dies; the head then
    loads it again (cluster/head.py)."""
    from .stage import Stage

    body = body or Stage  # (or an expert worker: cluster/experts.py)
    if local:
        return LocalActor(body(path))
    r = ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = r.remote(body).options(
        num_cpus=0, resources={RESOURCE: 1}, max_restarts=-1, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
    return actor.remote(path)


def wait(refs: list, what: list[str], deadline_s: float) -> list:
    """ray.get of `refs` with one deadline for all; `what[i]` names the stage and node of refs[i] for errors."""
    r = ray()
    end = time.monotonic() + deadline_s
    out = []
    for ref, name in zip(refs, what):
        if isinstance(ref, _Failed):
            _task_error(name, ref.error)
        if not isinstance(ref, r.ObjectRef):  # a LocalActor's result
            out.append(ref)
            continue
        try:
            out.append(r.get(ref, timeout=max(end - time.monotonic(), 0.001)))
        except r.exceptions.GetTimeoutError:
            raise ColibriError(f"cluster: {name} did not answer within {deadline_s:.0f} s") from None
        except (r.exceptions.RayActorError, r.exceptions.ActorUnavailableError) as e:
            raise StageLostError(f"cluster: {name} was lost ({_first_line(e)})") from None
        except r.exceptions.RayTaskError as e:
            _task_error(name, e.cause if isinstance(getattr(e, "cause", None), BaseException) else e)
        except r.exceptions.OutOfMemoryError as e:
            raise ColibriError(f"cluster: {name} ran out of memory ({_first_line(e)})") from None
    return out


def starting(refs: list, what: list[str], deadline_s: float) -> list:
    """`wait` for actors' first calls: an actor that never starts is most often one whose node's `colibri` unit
    another engine holds (Ray keeps the actor pending): the error says so."""
    try:
        return wait(refs, what, deadline_s)
    except ColibriError as e:
        if "did not answer" not in str(e):
            raise
        raise ColibriError(f"{e}: is another colibri engine using that node's 'colibri' resource (one stage or "
                           "expert worker a node)? `ray status` shows what is in use") from None


def _task_error(name: str, cause: BaseException):
    """An error raised inside a stage's call, as one line naming the stage and its node."""
    if isinstance(cause, ColibriError):
        raise ColibriError(f"cluster: {name}: {cause}") from None
    if isinstance(cause, MemoryError) or "OutOfMemory" in type(cause).__name__:
        raise ColibriError(f"cluster: {name} ran out of memory ({_first_line(cause)})") from None
    raise ColibriError(f"cluster: {name} failed: {type(cause).__name__}: {_first_line(cause)}") from None


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(e).__name__
