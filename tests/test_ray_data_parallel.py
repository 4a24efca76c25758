"""Data parallelism on the Ray backend: the replicas as Ray actors, on a local Ray cluster of two nodes
(ray.cluster_utils.Cluster: a head and a worker node of one CPU each, both on this machine).

Two replica actors, one on each node, decode what one engine decodes (their own tensor-parallel ranks
as Ray actors too); a replica actor killed fails its requests at once with EngineDeadError, never a hang;
`tokenmill serve -dp 2 --distributed-executor-backend ray` answers as one engine does; nothing of Ray is
left behind, whether the front end is shut down or dropped; without Ray the backend says how to get it."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import EngineDeadError
from tokenmill.executor.ray_executor import RayBackendError, RayNotInstalledError

from conftest import smollm2_gguf_path
from server_utils import RemoteServer
from test_tensor_parallel import GREEDY, engine, token_ids, token_prompts

TINY = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def ray_cluster(request):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})

    def tear_down() -> None:
        ray.shutdown()
        cluster.shutdown()

    request.addfinalizer(tear_down)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return cluster


@pytest.fixture
def spread(monkeypatch):
    """One replica per node: the driver's (the head) and the other."""
    monkeypatch.setenv("TOKENMILL_RAY_PLACEMENT_STRATEGY", "STRICT_SPREAD")


def actor_processes(name: str) -> list[psutil.Process]:
    """This machine's processes running an actor of this class (Ray titles them ray::<class>...)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if name in " ".join(process.info["cmdline"] or []):
                found.append(process)
    return found


def assert_nothing_left(ray) -> None:
    """No placement group still holds resources, and no replica or rank actor process is alive (killing one
    takes a moment)."""
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
            any(g["state"] != "REMOVED" for g in placement_group_table().values())
            or actor_processes("ReplicaActor") or actor_processes("RankActor")):
        time.sleep(0.2)
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())
    assert actor_processes("ReplicaActor") == [] and actor_processes("RankActor") == []


def dp_llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, data_parallel_size=2, distributed_executor_backend="ray", **TINY, **kwargs)


# -- without a cluster ----------------------------------------------------------------------------


def test_without_ray_the_backend_says_how_to_get_it(tiny_model_factory, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    with pytest.raises(RayNotInstalledError, match=r"the Ray backend needs Ray: pip install 'tokenmill\[ray\]'"):
        dp_llm(tiny_model_factory("llama_gqa"))


# -- on the cluster -------------------------------------------------------------------------------


def test_two_replica_actors_on_two_nodes_decode_what_one_engine_decodes(ray_cluster, tiny_model_factory, spread):
    import ray

    from tokenmill.engine.dp.ray_pool import RayReplicaPool

    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(6, seed=3)
    with engine(folder, skip_tokenizer_init=True, kv_cache_memory=8 << 20) as one:
        reference = one.generate(prompts, GREEDY, use_tqdm=False)
    llm = dp_llm(folder)
    try:
        pool = llm.llm_engine.pool
        assert isinstance(pool, RayReplicaPool)
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = [r.node_id for r in pool.replicas]
        assert len(set(nodes)) == 2 and driver_node in nodes  # STRICT_SPREAD: one on each node
        # The replica on the driver's node is pinned to its share of the cores; the other's are the OS's choice.
        assert [r.cores is not None for r in pool.replicas] == [node == driver_node for node in nodes]
        assert all(psutil.pid_exists(pool.pid(i)) for i in range(2))
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert token_ids(outputs) == token_ids(reference)
        assert all(s.prefix_cache_queries > 0 for s in llm.llm_engine.replica_stats())  # both replicas worked
    finally:
        llm.llm_engine.shutdown()
    assert_nothing_left(ray)


def test_replica_actors_with_their_own_ray_ranks_decode_what_one_engine_decodes(ray_cluster, tiny_model_factory, spread,
                                                                              monkeypatch):
    """dp 2 x tp 2: each replica's rank 1 is a Ray actor that its replica's actor starts (half a CPU per bundle:
    four bundles on two one-CPU nodes)."""
    import ray

    monkeypatch.setenv("TOKENMILL_RAY_BUNDLE_RESOURCES", json.dumps({"CPU": 0.5}))
    folder = tiny_model_factory("llama_gqa")
    prompts = token_prompts(4, seed=7)
    with engine(folder, skip_tokenizer_init=True, kv_cache_memory=8 << 20) as one:
        reference = one.generate(prompts, GREEDY, use_tqdm=False)
    llm = dp_llm(folder, tensor_parallel_size=2)
    try:
        assert len(actor_processes("RankActor")) == 2
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(reference)
    finally:
        llm.llm_engine.shutdown()
    assert_nothing_left(ray)


def test_a_replica_that_fails_to_start_raises_its_error(ray_cluster, tiny_model_factory):
    import ray

    with pytest.raises(ValueError, match="exceeds the model's context length"):
        dp_llm(tiny_model_factory("llama_gqa"), max_model_len=10**6)
    assert_nothing_left(ray)


def test_resources_no_node_has_are_a_clear_error(ray_cluster, tiny_model_factory, monkeypatch):
    monkeypatch.setenv("TOKENMILL_RAY_BUNDLE_RESOURCES", json.dumps({"tokenmill_no_such_node": 1}))
    with pytest.raises(RayBackendError, match=r"no Ray node\(s\) can hold a data-parallel replica's bundle .*tokenmill_no_such_node"):
        dp_llm(tiny_model_factory("llama_gqa"))


def test_a_killed_replica_actor_fails_its_requests_at_once(ray_cluster, tiny_model_factory, spread):
    import ray

    llm = dp_llm(tiny_model_factory("llama_gqa"))
    engine_ = llm.llm_engine
    prompts = token_prompts(6, seed=5)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = engine_.add_requests(prompts, [long] * len(prompts))
    engine_.step()  # the replicas are running
    ray.kill(engine_.pool.replicas[1].actor)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"replica 1 died: its Ray actor \(pid \d+ on .*\) answered with .*(Actor|actor)"):
        while engine_.has_unfinished_requests():
            engine_.step()
    assert time.monotonic() - start < 10
    with pytest.raises(EngineDeadError, match="not running"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    for request_id in ids:
        engine_.abort_request(request_id)  # the living replica's requests: no error, no hang
    # Dropped without shutdown(): the finalizer kills the living replica and gives back the placement group.
    del llm, engine_
    gc.collect()
    assert_nothing_left(ray)


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs the embedded SmolLM2 model")
def test_serve_with_replica_actors_answers_as_one_engine(ray_cluster, spread, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)  # the server joins the cluster, as `ray start` machines would
    args = ["--max-model-len", "256", "--kv-cache-memory", str(16 << 20), "--dtype", "float32"]
    server = RemoteServer([*args, "-dp", "2", "--distributed-executor-backend", "ray"])
    try:
        client = server.client(timeout=60)
        done = client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                         max_tokens=8, temperature=0)
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_text()[-3000:]
    assert "data-parallel replica 1 (a Ray actor" in server.log_text()
    import ray

    assert_nothing_left(ray)
    with engine(None, max_model_len=256, kv_cache_memory=16 << 20) as one:
        [want] = one.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert done.choices[0].text == want.outputs[0].text and done.usage.completion_tokens == 8


def test_a_local_ray_the_front_end_started_is_shut_down_with_it(ray_cluster, tiny_model_factory):
    # In a process of its own (this one is connected to the test cluster); RAY_ADDRESS=local: a Ray of its own.
    script = textwrap.dedent(f"""
        import time
        import psutil, ray
        from tokenmill import LLM, SamplingParams
        llm = LLM({tiny_model_factory("llama_gqa")!r}, data_parallel_size=2, distributed_executor_backend="ray",
                  dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory=8 << 20)
        assert llm.llm_engine.pool.owns_ray
        outs = llm.generate([{{"prompt_token_ids": [1, 2, 3]}}] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
        llm.llm_engine.shutdown()
        assert not ray.is_initialized()
        def ray_processes():
            return [p.name() for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]
        deadline = time.monotonic() + 10
        while ray_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ray_processes(), ray_processes()
        print("ok")
    """)
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
