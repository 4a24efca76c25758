"""RayReplicaPool: the data-parallel replicas as Ray actors (distributed_executor_backend="ray"), on the nodes
of a Ray cluster. It has ReplicaPool's interface, so both front ends use it as they use the process pool.

Each replica is a ReplicaActor in its own bundle of one placement group (strategy and extra bundle
resources: TOKENMILL_RAY_PLACEMENT_STRATEGY / TOKENMILL_RAY_BUNDLE_RESOURCES, as for the tensor-parallel
ranks), running run_replica: the same engine and loop as a spawned replica, over two actor methods
instead of two pipes. Commands go by `put`, numbered, since a threaded actor may run two calls out of
order; results come back by `take`, a long poll that returns whatever the loop sent since the last one.
The pool keeps one `take` outstanding per live replica and poll() is ray.wait over them, so an update is
handed on as soon as it is made, and an actor that dies (killed, its node gone) fails its `take` at once:
ReplicaDied with Ray's reason. A replica's own tensor-parallel ranks (tensor_parallel_size > 1) are Ray
actors of the same cluster, started by its engine's RayExecutor inside the replica's actor.

A replica on the driver's node runs on its own share of the driver's cores (pinned, as the process pool
does); elsewhere it runs as many threads as its bundle has CPUs and the OS places them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenmill.config import EngineConfig, resolve_device
from tokenmill.engine.dp.messages import ReplicaDied, ReplicaFatal, ReplicaReady, Shutdown
from tokenmill.engine.dp.pool import replica_config
from tokenmill.engine.dp.replica import ReplicaSpec, run_replica
from tokenmill.errors import EngineDeadError
from tokenmill.executor.ray_executor import (
    PLACEMENT_TIMEOUT_S,
    STOP_GRACE_S,
    RayBackendError,
    RayPlacement,
    connect_ray,
    describe_ray_error,
    import_ray,
)

logger = logging.getLogger(__name__)

# Seconds a replica's `take` waits for a message before it returns none (the pool then asks again): short
# enough that an idle actor's thread is not held long after the pool stops asking.
TAKE_WAIT_S = 1.0

# The driver's settings that describe the cluster, handed to the replicas' actors (whose environment is their
# node's): a replica's own tensor-parallel ranks are placed by them too. Settings that describe a machine
# (TOKENMILL_SIMD, TOKENMILL_CPU_MARCH, ...) stay each node's own.
CLUSTER_SETTINGS = ("TOKENMILL_RAY_PLACEMENT_STRATEGY", "TOKENMILL_RAY_BUNDLE_RESOURCES", "TOKENMILL_TP_PORT")


class ReplicaActor:
    """One replica in a Ray actor (made an actor class with ray.remote where Ray is installed). Threaded:
    run() holds one thread for the replica's life, take() waits on another, put() and where() use the rest."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)  # this actor's process is its own: its RayExecutor reads them
        # Ctrl-C reaches a local Ray's workers with the driver: the front end decides what it means (as a
        # spawned replica, which ignores it). Only the main thread may set a handler: elsewhere, leave it.
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._numbered: dict[int, object] = {}  # commands that arrived before an earlier one
        self._next = 0  # the number of the command the loop takes next
        self._commands_lock = threading.Lock()
        self._outbox: list = []
        self._sent = threading.Condition()

    def where(self) -> tuple[str, int]:
        """This actor's node address and process id (for logs and for tests that kill it)."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def run(self, spec: ReplicaSpec, num_threads: int) -> bool:
        """Build the engine and run its loop until Shutdown (False: it failed, and said so by ReplicaFatal)."""
        logging.basicConfig(level=spec.log_level, format=f"%(levelname)s replica{spec.index} %(name)s: %(message)s")
        logging.getLogger("tokenmill").setLevel(spec.log_level)  # Ray's worker may have configured the root already
        from tokenmill.executor.tensor_parallel import pin_process

        if spec.cores is not None:
            pin_process(spec.cores)  # the driver's node: this replica's share of its cores
        elif spec.config.device != "cuda":
            torch.set_num_threads(num_threads)  # the bundle's CPUs; which cores is the OS's choice
        return run_replica(spec.index, spec.config, self._inbox, self._send)

    def put(self, number: int, command: object) -> None:
        """Command `number` (0, 1, 2, ... from the pool) to the loop, after every command numbered before it."""
        with self._commands_lock:
            self._numbered[number] = command
            while self._next in self._numbered:
                self._inbox.put(self._numbered.pop(self._next))
                self._next += 1

    def take(self, timeout: float) -> list:
        """The messages the loop sent since the last take, waiting up to `timeout` seconds for the first."""
        with self._sent:
            self._sent.wait_for(lambda: self._outbox, timeout)
            messages, self._outbox = self._outbox, []
        return messages

    def _send(self, message: object) -> None:
        with self._sent:
            self._outbox.append(message)
            self._sent.notify_all()


@dataclass
class RayReplicaHandle:
    index: int
    actor: Any
    node_id: str
    cores: list[int] | None  # pinned to these of the driver's cores (on the driver's node only)
    run_ref: Any = None  # the actor's run(): ends at Shutdown, or with its failure
    where_ref: Any = None
    take_ref: Any = None  # the outstanding take(), while it lives
    num_sent: int = 0  # commands numbered so far
    address: str = "?"
    pid: int | None = None
    death: str | None = None  # why it is gone, once it is


class RayReplicaPool:
    def __init__(self, config: EngineConfig) -> None:
        self.size = config.parallel.data_parallel_size
        self.ray = ray = import_ray()
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placement = RayPlacement.from_env()
        device = resolve_device(config.device)
        cores = sorted(os.sched_getaffinity(0))
        # A replica's bundle: its rank 0's GPU (a replica's other ranks get theirs from its RayExecutor), or on
        # a CPU the share of cores a spawned replica would have here; TOKENMILL_RAY_BUNDLE_RESOURCES may say
        # otherwise (e.g. {"CPU": 8} for bigger machines than the driver's).
        base = {"GPU": 1.0} if device.type == "cuda" else {"CPU": float(max(1, len(cores) // self.size))}
        bundle = {**base, **placement.resources}
        bundles = [dict(bundle) for _ in range(self.size)]
        num_cpus, num_gpus = bundle.get("CPU", 0.0), int(bundle.get("GPU", 0.0))
        self._lock = threading.Lock()  # send() may run on the event loop while poll() runs on the collector
        self.replicas: list[RayReplicaHandle] = []
        self._actors: list[Any] = []  # what the finalizer kills (the handles' actors)
        self._groups: list[Any] = []  # the placement group, once made (what the finalizer removes)
        self._closed = False
        self.owns_ray = connect_ray(ray)
        # A front end dropped without shutdown() must not leave its actors, their reservation or its Ray behind.
        self._release = weakref.finalize(self, _release, ray, remove_placement_group, self._actors, self._groups, self.owns_ray)
        try:
            _check_feasible(ray, bundles, placement.strategy)
            group = placement_group(bundles, strategy=placement.strategy, name=f"tokenmill-dp-{os.getpid()}-{id(self):x}")
            self._groups.append(group)
            ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RayBackendError(f"the Ray cluster found no room for {self.size} data-parallel replica(s) of {bundle} "
                                      f"each (strategy {placement.strategy}) within {PLACEMENT_TIMEOUT_S:.0f} s; "
                                      f"available now: {ray.available_resources()}")
            node_of_bundle = placement_group_table(group)["bundles_to_node_id"]
            nodes = [node_of_bundle[i] for i in range(self.size)]
            driver_node = ray.get_runtime_context().get_node_id()
            addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            logger.info("Ray backend: %s", ", ".join(
                f"data-parallel replica {i} on node {node[:8]} ({addresses.get(node, '?')}{', the driver' if node == driver_node else ''})"
                for i, node in enumerate(nodes)))

            env = {name: os.environ[name] for name in CLUSTER_SETTINGS if name in os.environ}
            log_level = logging.getLogger("tokenmill").getEffectiveLevel()
            actor_class = ray.remote(ReplicaActor)
            on_driver = 0
            for index, node in enumerate(nodes):
                share = None
                if device.type == "cpu" and node == driver_node:
                    share = _driver_share(cores, on_driver, int(num_cpus))
                    on_driver += 1
                spec = ReplicaSpec(index, self._replica_config(config, index, device, nodes.count(node)), share, log_level)
                replica_env = dict(env)
                if "TOKENMILL_TP_PORT" in env:  # each replica's rank 0 its own store port: two may share a node
                    replica_env["TOKENMILL_TP_PORT"] = str(int(env["TOKENMILL_TP_PORT"]) + index)
                actor = actor_class.options(
                    num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_concurrency=4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index),
                ).remote(replica_env)
                self._actors.append(actor)
                handle = RayReplicaHandle(index, actor, node, share)
                handle.run_ref = actor.run.remote(spec, max(1, int(num_cpus)))
                handle.where_ref = actor.where.remote()
                self.replicas.append(handle)
        except BaseException:
            self.shutdown(timeout=0.0)
            raise

    @staticmethod
    def _replica_config(config: EngineConfig, index: int, device: torch.device, replicas_on_node: int) -> EngineConfig:
        """replica_config's, for a replica in a Ray actor: the RAM of its node shared by the replicas there (on a
        CPU), its rank 0 on the one GPU Ray gives its actor (on CUDA), its own ranks Ray actors when it has several."""
        replica = replica_config(config, index, shares_memory=False)
        cache = replica.cache
        if device.type == "cpu":
            cache = replace(cache, memory_share=config.cache.memory_share / replicas_on_node)
        backend = "ray" if config.parallel.tensor_parallel_size > 1 else None  # one rank: in the actor itself
        return replace(replica, cache=cache, parallel=replace(replica.parallel, distributed_executor_backend=backend),
                       device="cuda" if device.type == "cuda" else config.device)

    # -- start ----------------------------------------------------------------------------------
    def wait_ready(self) -> list[ReplicaReady]:
        """Every replica's ReplicaReady, once each has built its engine. A replica that fails to start raises
        its error (the same a one-engine LLM would raise) and every replica is stopped."""
        ready: dict[int, ReplicaReady] = {}
        try:
            while len(ready) < self.size:
                for index, message in self.poll(timeout=1.0):
                    if isinstance(message, ReplicaReady):
                        ready[index] = message
                    elif isinstance(message, ReplicaFatal):
                        raise message.error
                    elif isinstance(message, ReplicaDied):
                        raise EngineDeadError(f"data-parallel replica {index} could not start: {message.reason}")
            for replica in self.replicas:
                replica.address, replica.pid = self.ray.get(replica.where_ref, timeout=60)
        except BaseException:
            self.shutdown(timeout=0.0)
            raise
        for replica in self.replicas:
            logger.info("data-parallel replica %d (a Ray actor, pid %d on %s) ready%s", replica.index, replica.pid,
                        replica.address, f" on cores {replica.cores}" if replica.cores is not None else "")
        return [ready[i] for i in range(self.size)]

    # -- talk -----------------------------------------------------------------------------------
    def send(self, index: int, command) -> bool:
        """Send a command to a replica; False if it is gone (poll() reports why)."""
        replica = self.replicas[index]
        with self._lock:
            if replica.death is not None:
                return False
            replica.actor.put.remote(replica.num_sent, command)  # a dead actor fails the call, not this send
            replica.num_sent += 1
        return True

    def poll(self, timeout: float | None) -> list[tuple[int, object]]:
        """(replica index, message) for what the replicas sent, waiting up to `timeout` seconds for the first;
        a replica whose actor is gone gives a ReplicaDied after its last messages, once."""
        ray = self.ray
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            live = [r for r in self.replicas if r.death is None]
            if not live:
                if timeout:
                    time.sleep(timeout)
                return []
            for replica in live:
                if replica.take_ref is None:
                    replica.take_ref = replica.actor.take.remote(TAKE_WAIT_S)
            refs = [r.take_ref for r in live]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(refs, num_returns=1, timeout=remaining)
            if done:  # and whatever else has come meanwhile
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            done = set(done)
            events: list[tuple[int, object]] = []
            for replica in live:
                if replica.take_ref in done:
                    self._take(replica, events)
            # Takes that came back empty (their wait ran out) are asked again, until the caller's timeout.
            if events or (deadline is not None and time.monotonic() >= deadline):
                return events

    def _take(self, replica: RayReplicaHandle, events: list) -> None:
        ref, replica.take_ref = replica.take_ref, None
        try:
            messages = self.ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the actor died, or its message could not be read: unusable
            where = f"pid {replica.pid} on {replica.address}" if replica.pid is not None else f"on node {replica.node_id[:8]}"
            self._mark_dead(replica, f"its Ray actor ({where}) answered with {describe_ray_error(exc)}", events)
            return
        for message in messages:
            events.append((replica.index, message))
            if isinstance(message, ReplicaFatal):  # its last word: run() has returned, nothing more will come
                with self._lock:
                    replica.death = f"its engine failed: {message.error!r}"
                logger.error("data-parallel replica %d (a Ray actor) failed: %r", replica.index, message.error)
                with contextlib.suppress(Exception):
                    self.ray.kill(replica.actor, no_restart=True)

    def _mark_dead(self, replica: RayReplicaHandle, reason: str, events: list) -> None:
        with self._lock:
            replica.death = reason
        logger.error("data-parallel replica %d is gone: %s", replica.index, reason)
        with contextlib.suppress(Exception):  # perhaps alive but unreadable: it must not hold its bundle
            self.ray.kill(replica.actor, no_restart=True)
        events.append((replica.index, ReplicaDied(reason)))

    def is_alive(self, index: int) -> bool:
        return self.replicas[index].death is None

    def pid(self, index: int) -> int | None:
        """The actor's process id (on its node, which may be another machine); None before it is ready."""
        return self.replicas[index].pid

    # -- stop -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Shutdown to every replica, up to min(timeout, STOP_GRACE_S) seconds for them to stop their engines,
        then kill the actors, give back the placement group, and stop the Ray this pool started. Safe to call again."""
        if self._closed:
            return
        self._closed = True
        ray = self.ray
        if ray.is_initialized():
            running = []
            for replica in self.replicas:
                if replica.death is None:
                    with contextlib.suppress(Exception):
                        self.send(replica.index, Shutdown())
                        running.append(replica.run_ref)
            if running and timeout > 0:
                with contextlib.suppress(Exception):
                    ray.wait(running, num_returns=len(running), timeout=min(timeout, STOP_GRACE_S))
        with self._lock:
            for replica in self.replicas:
                replica.death = replica.death or "shut down"
                replica.take_ref = None
        self._release()


def _driver_share(cores: list[int], position: int, per_replica: int) -> list[int] | None:
    """The cores of the `position`-th replica on the driver's node: the next `per_replica` of the driver's
    (None, unpinned, once they run out: a bundle asked for more CPUs than the driver has)."""
    if per_replica < 1 or (position + 1) * per_replica > len(cores):
        return None
    return cores[position * per_replica : (position + 1) * per_replica]


def _check_feasible(ray: Any, bundles: list[dict[str, float]], strategy: str) -> None:
    """Fail now, naming what is missing, when the cluster's nodes could never hold the replicas' bundles."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fitting = [n for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in bundles[0].items())]
    needed = len(bundles) if strategy == "STRICT_SPREAD" else 1
    if len(fitting) < needed:
        have = "; ".join(f"{n['NodeManagerAddress']}: {n['Resources']}" for n in nodes)
        raise RayBackendError(f"{'no' if not fitting else 'too few'} Ray node(s) can hold a data-parallel replica's bundle "
                              f"{bundles[0]} (strategy {strategy}, {len(bundles)} replica(s) to place); the nodes have: {have}")


def _release(ray: Any, remove_placement_group: Any, actors: list[Any], groups: list[Any], owns_ray: bool) -> None:
    """Kill the replica actors (their own tensor-parallel rank actors go with them), give back their placement
    group, and shut down the local Ray the pool started (at shutdown, or when the pool is collected)."""
    if not ray.is_initialized():  # Ray already shut down: its actors and groups went with it
        return
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    actors.clear()
    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
    groups.clear()
    if owns_ray:
        ray.shutdown()
        logger.info("Ray backend: the local Ray this front end started is shut down")
