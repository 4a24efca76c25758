"""RayExecutor: tensor parallelism with the ranks > 0 as Ray actors, on the machines of a Ray cluster.

Rank 0 stays in the engine's process (the driver) and hosts the group's TCP store; each other rank is
an actor in its own bundle of one placement group, which joins the group and runs what rank 0
announces (`run_follower`, the same body as the "mp" backend's spawned ranks). Ray only places and
watches the ranks: every step's traffic goes through the group's collectives (gloo on CPU, NCCL on
CUDA; shared memory when every rank turns out to be on the driver's node, whose cores the ranks then
split and pin to as with "mp"), never through Ray.

Deployment knobs, read from the environment (they describe the cluster, not the model):
- RAY_ADDRESS: the cluster to join (else a running one is found, else a local one is started and
  shut down with the engine);
- TOKENMILL_RAY_PLACEMENT_STRATEGY: PACK (default: fill the fewest nodes), SPREAD, STRICT_PACK or
  STRICT_SPREAD (every rank > 0 on a node of its own), over the bundles of the ranks > 0;
- TOKENMILL_RAY_BUNDLE_RESOURCES: a JSON object of extra Ray resources each rank's bundle asks for,
  to put the ranks on chosen nodes (e.g. '{"tokenmill_rank": 1}' with `ray start
  --resources='{"tokenmill_rank": 1}'` on those nodes);
- TOKENMILL_TP_PORT: the port of rank 0's TCP store (default: a free port), for firewalls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import psutil
import torch

from tokenmill.distributed.communicator import TPCommunicator
from tokenmill.errors import TokenmillError
from tokenmill.executor.tensor_parallel import TensorParallelExecutor, free_port, pin_process, run_follower
from tokenmill.loader import ModelSource
from tokenmill.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Seconds the cluster has to find room for the ranks (a busy cluster may free some; an autoscaler may add nodes).
PLACEMENT_TIMEOUT_S = 120.0
# Seconds the ranks have to finish after rank 0 says stop, before their actors are killed.
STOP_GRACE_S = 5.0


class RayBackendError(TokenmillError):
    """The "ray" backend cannot start: Ray is missing, a setting is wrong, or the cluster has no room."""


class RayNotInstalledError(RayBackendError, ImportError):
    """distributed_executor_backend="ray" without Ray installed."""


def import_ray() -> Any:
    try:
        import ray
        import ray.util.placement_group  # noqa: F401 - the placement API, checked here with the rest
    except ImportError as exc:
        raise RayNotInstalledError("the Ray backend needs Ray: pip install 'tokenmill[ray]'") from exc
    return ray


@dataclass(frozen=True)
class RayPlacement:
    """Where the ranks > 0 go: a placement strategy over their bundles, and extra resources each bundle asks for."""

    strategy: str = "PACK"
    resources: dict[str, float] = field(default_factory=dict)
    port: int | None = None  # rank 0's TCP store port; None: a free one

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RayPlacement:
        env = os.environ if env is None else env
        strategy = env.get("TOKENMILL_RAY_PLACEMENT_STRATEGY", "PACK").strip().upper()
        if strategy not in PLACEMENT_STRATEGIES:
            raise RayBackendError(f"TOKENMILL_RAY_PLACEMENT_STRATEGY must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {strategy!r}")
        resources: dict[str, float] = {}
        raw = env.get("TOKENMILL_RAY_BUNDLE_RESOURCES", "").strip()
        if raw:
            try:
                resources = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise RayBackendError(f"TOKENMILL_RAY_BUNDLE_RESOURCES is not valid JSON ({exc}): give an object such as "
                                      "'{\"tokenmill_rank\": 1}'") from None
            if not isinstance(resources, dict) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for k, v in resources.items()):
                raise RayBackendError(f"TOKENMILL_RAY_BUNDLE_RESOURCES must map resource names to positive numbers, got {raw!r}")
            resources = {k: float(v) for k, v in resources.items()}
        port = None
        raw_port = env.get("TOKENMILL_TP_PORT", "").strip()
        if raw_port:
            if not raw_port.isdigit() or not 1 <= int(raw_port) <= 65535:
                raise RayBackendError(f"TOKENMILL_TP_PORT must be a port number (1-65535), got {raw_port!r}")
            port = int(raw_port)
        return cls(strategy, resources, port)


def connect_ray(ray: Any) -> bool:
    """Join the Ray cluster (RAY_ADDRESS, else the one `ray start` runs on this machine), else start a
    local Ray (Ray's own rules). True when this call started one: the engine shuts it down at its own
    shutdown; a cluster it joined is left running."""
    if ray.is_initialized():
        logger.info("Ray backend: using this process's Ray connection (%s)", ray.get_runtime_context().gcs_address)
        return False
    address = os.environ.get("RAY_ADDRESS", "").strip()
    try:
        ray.init(ignore_reinit_error=True)
    except ConnectionError as exc:
        raise RayBackendError(f"could not connect to the Ray cluster at {address or 'the address `ray start` left'}: {exc}") from None
    # A Ray started here runs its GCS server as a child of this process.
    started = any("gcs_server" in child.name() for child in psutil.Process().children(recursive=True))
    if started:
        logger.warning("Ray backend: no Ray cluster found (set RAY_ADDRESS or run `ray start`): started a local Ray on this machine")
    else:
        logger.info("Ray backend: connected to the Ray cluster at %s", ray.get_runtime_context().gcs_address)
    return started


def interface_of(ip: str) -> str | None:
    """The network interface that holds this IP address (None if none does)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            return name
    return None


@contextlib.contextmanager
def gloo_on_interface(ip: str) -> Iterator[None]:
    """Gloo groups made meanwhile listen on the interface of `ip` (the node's address as Ray knows it),
    unless GLOO_SOCKET_IFNAME says otherwise: gloo's default follows the hostname, which often resolves
    to a loopback address (127.0.1.1) that no other machine can reach."""
    interface = interface_of(ip)
    if "GLOO_SOCKET_IFNAME" in os.environ or interface is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


class RankActor:
    """A rank > 0 in a Ray actor (made a Ray actor class with ray.remote where Ray is installed)."""

    def run(self, rank: int, size: int, host: str, port: int, spec: WorkerSpec, num_threads: int, same_machine: bool,
            cores: list[int] | None = None) -> None:
        """Join the group, build this rank's shards, run what rank 0 announces until it says stop. A failure
        ends this call with its error (the run's ref carries it to rank 0); the group's connections close.
        cores: this rank's share of the driver's machine, when it runs there (see start_followers)."""
        import ray

        if spec.device.type == "cuda":
            # Ray gave this actor one GPU and made it the only one it sees.
            spec = replace(spec, device=torch.device("cuda", 0))
        elif cores is not None:
            pin_process(cores)
        else:
            torch.set_num_threads(num_threads)  # the bundle's CPUs; which cores is the OS's choice
        interface = contextlib.nullcontext() if same_machine else gloo_on_interface(ray.util.get_node_ip_address())
        try:
            with interface:
                run_follower(rank, size, host, port, spec, same_machine)
        except BaseException:
            logger.exception("tensor-parallel rank %d failed", rank)
            raise


class RayExecutor(TensorParallelExecutor):
    def __init__(self, spec: WorkerSpec, source: ModelSource) -> None:
        self.ray = import_ray()
        self.placement = RayPlacement.from_env()
        self.actors: list[Any] = []
        self.run_refs: list[Any] = []
        self.placement_group = None
        self._release = None
        self.owns_ray = connect_ray(self.ray)
        try:
            super().__init__(spec, source)
        except BaseException:
            self.stop_followers()
            self._disconnect()
            raise

    def rendezvous_address(self) -> str:
        return self.ray.util.get_node_ip_address()

    def rendezvous_port(self) -> int:
        return self.placement.port or free_port()

    def start_followers(self, spec: WorkerSpec, host: str, port: int, cores: list[list[int]] | None) -> None:
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        # A rank's share: one GPU, or on a CPU as many cores as rank 0 has here (TOKENMILL_RAY_BUNDLE_RESOURCES may
        # say otherwise, e.g. {"CPU": 4} for smaller machines); the actor asks for what its bundle holds.
        base = {"GPU": 1.0} if spec.device.type == "cuda" else {"CPU": float(len(cores[1]))}
        bundle = {**base, **self.placement.resources}
        bundles = [dict(bundle) for _ in range(self.size - 1)]
        num_cpus, num_gpus = bundle.get("CPU", 0.0), int(bundle.get("GPU", 0.0))
        num_threads = max(1, int(num_cpus))
        self._check_feasible(bundles)
        group = placement_group(bundles, strategy=self.placement.strategy, name=f"tokenmill-tp-{os.getpid()}-{port}")
        self.placement_group = group
        # An engine dropped without shutdown() must not leave its actors and their reservation behind.
        self._release = weakref.finalize(self, _release, ray, remove_placement_group, self.actors, group)
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RayBackendError(f"the Ray cluster found no room for {len(bundles)} rank(s) of {bundles[0]} each "
                                  f"(strategy {self.placement.strategy}) within {PLACEMENT_TIMEOUT_S:.0f} s; "
                                  f"available now: {ray.available_resources()}")

        node_of_bundle = placement_group_table(group)["bundles_to_node_id"]
        driver_node = ray.get_runtime_context().get_node_id()
        self.follower_nodes = [node_of_bundle[i] for i in range(len(bundles))]
        # Every rank on the driver's node: the CPU collectives can go through shared memory.
        self.same_machine = all(node == driver_node for node in self.follower_nodes)
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        logger.info("Ray backend: rank 0 on this process's node (%s); %s", host, ", ".join(
            f"rank {i + 1} on node {node[:8]} ({addresses.get(node, '?')})" for i, node in enumerate(self.follower_nodes)))

        actor_class = ray.remote(RankActor)
        for index, rank in enumerate(range(1, self.size)):
            actor = actor_class.options(
                num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index),
            ).remote()
            self.actors.append(actor)
            # On the driver's node the ranks split its cores as the "mp" backend does, each pinned to its share:
            # the shared-memory collectives spin while they wait, and a rank whose threads the OS moves onto
            # rank 0's cores makes every collective wait out the other's spinning (measured: 15x slower decode
            # under load). Elsewhere Ray's CPU count is all there is: the threads go where the OS puts them.
            share = cores[rank] if cores is not None and self.same_machine else None
            self.run_refs.append(actor.run.remote(rank, self.size, host, port, spec, num_threads, self.same_machine, share))

    def _check_feasible(self, bundles: list[dict[str, float]]) -> None:
        """Fail now, naming what is missing, when no node of the cluster could ever hold a rank's bundle."""
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        fitting = [n for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in bundles[0].items())]
        needed = len(bundles) if self.placement.strategy == "STRICT_SPREAD" else 1
        if len(fitting) < needed:
            have = "; ".join(f"{n['NodeManagerAddress']}: {n['Resources']}" for n in nodes)
            raise RayBackendError(f"{'no' if not fitting else 'too few'} Ray node(s) can hold a rank's bundle {bundles[0]} "
                                  f"(strategy {self.placement.strategy}, {len(bundles)} rank(s) to place); the nodes have: {have}")

    def join(self, host: str, port: int, device: torch.device) -> TPCommunicator:
        interface = contextlib.nullcontext() if self.same_machine else gloo_on_interface(host)
        with interface:
            return super().join(host, port, device)

    def wait_for_followers(self, timeout_s: float) -> None:
        self.ray.wait(self.run_refs, num_returns=1, timeout=timeout_s)

    def follower_failure(self) -> str | None:
        if not self.run_refs:
            return None
        ended, _ = self.ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=0)
        for ref in ended:
            rank = self.run_refs.index(ref) + 1
            try:
                self.ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - Ray's error for the actor's run: named, not raised
                return f"tensor-parallel rank {rank} (a Ray actor) failed: {describe_ray_error(exc)}"
            return f"tensor-parallel rank {rank} (a Ray actor) stopped"
        return None

    def stop_followers(self) -> None:
        if self.run_refs:
            self.ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=STOP_GRACE_S)
        if self._release is not None:
            self._release()  # once: a second stop finds nothing left to release

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._disconnect()

    def _disconnect(self) -> None:
        """Shut down the local Ray this executor started (a cluster it joined is left running)."""
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
            logger.info("Ray backend: the local Ray this engine started is shut down")
        self.owns_ray = False


def describe_ray_error(exc: BaseException) -> str:
    """Ray's error for a run in a line: the actor's own exception where it raised one, else the first line of
    Ray's (an actor that died, was killed, or whose node went away)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _release(ray: Any, remove_placement_group: Any, actors: list[Any], group: Any) -> None:
    """Kill the rank actors and give back their placement group (at shutdown, or when the executor is collected)."""
    if not ray.is_initialized():  # Ray already shut down: its actors and groups went with it
        return
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    actors.clear()
    with contextlib.suppress(Exception):
        remove_placement_group(group)
