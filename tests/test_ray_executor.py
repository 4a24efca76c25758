"""Tensor parallelism's Ray backend: rank 0 here, rank 1 a Ray actor, on a local Ray cluster of two nodes
(ray.cluster_utils.Cluster: a head and a worker node of one CPU each, both on this machine). Two ranks
decode what one rank decodes, with rank 1 on the driver's node (shared-memory collectives) or on
another node (gloo over TCP, as across machines); a rank that fails or is killed fails the engine at
once with a clear error; nothing of Ray is left behind; without Ray the backend says how to get it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tokenmill import LLM
from tokenmill.errors import TokenmillError
from tokenmill.executor import ExecutorDiedError
from tokenmill.executor import ray_executor
from tokenmill.executor.ray_executor import RayBackendError, RayNotInstalledError, RayPlacement

from conftest import smollm2_gguf_path
from server_utils import RemoteServer
from test_tensor_parallel import GREEDY, engine, token_ids, token_prompts

# Resources that put rank 1's bundle on the head node (where this process's driver is) or on the worker node.
REMOTE = "tokenmill_test_remote"
ON_HEAD = {"node:__internal_head__": 0.001}
ON_WORKER = {REMOTE: 1}


@pytest.fixture(scope="module")
def ray_cluster(request):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})

    def tear_down() -> None:
        ray.shutdown()
        cluster.shutdown()

    request.addfinalizer(tear_down)
    cluster.add_node(num_cpus=1, resources={REMOTE: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return cluster


def place_rank1(monkeypatch, resources: dict[str, float]) -> None:
    monkeypatch.setenv("TOKENMILL_RAY_BUNDLE_RESOURCES", json.dumps(resources))


def rank_actor_processes() -> list[psutil.Process]:
    """This machine's processes running a rank actor (Ray titles them ray::RankActor...)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "RankActor" in " ".join(process.info["cmdline"] or []):
                found.append(process)
    return found


def assert_nothing_left(ray) -> None:
    """No placement group still holds resources, and no rank actor process is alive (killing one takes a moment)."""
    from ray.util.placement_group import placement_group_table

    assert all(group["state"] == "REMOVED" for group in placement_group_table().values())
    deadline = time.monotonic() + 15
    while rank_actor_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_actor_processes() == []


def tp_llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32", device="cpu",
               skip_tokenizer_init=True, kv_cache_memory=8 << 20, **kwargs)


# -- settings, without a cluster ------------------------------------------------------------------


def test_without_ray_the_backend_says_how_to_get_it(tiny_model_factory, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    with pytest.raises(RayNotInstalledError, match=r"the Ray backend needs Ray: pip install 'tokenmill\[ray\]'") as info:
        tp_llm(tiny_model_factory("llama_gqa"))
    assert isinstance(info.value, ImportError) and isinstance(info.value, TokenmillError)  # the CLI prints it as one line


def test_one_rank_with_the_ray_backend_runs_in_process(tiny_model_factory):
    """tensor_parallel_size 1 has no ranks to place: the engine runs as with "uni", touching no Ray."""
    llm = LLM(tiny_model_factory("llama_gqa"), distributed_executor_backend="ray", dtype="float32", device="cpu",
              skip_tokenizer_init=True, kv_cache_memory=8 << 20)
    assert type(llm.llm_engine.executor).__name__ == "Executor"
    assert llm.generate(token_prompts(1, seed=1), GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_placement_settings_are_read_and_checked():
    assert RayPlacement.from_env({}) == RayPlacement("PACK", {}, None)
    env = {"TOKENMILL_RAY_PLACEMENT_STRATEGY": "strict_spread", "TOKENMILL_RAY_BUNDLE_RESOURCES": '{"gpu_box": 1}',
           "TOKENMILL_TP_PORT": "29500"}
    assert RayPlacement.from_env(env) == RayPlacement("STRICT_SPREAD", {"gpu_box": 1.0}, 29500)
    with pytest.raises(RayBackendError, match="TOKENMILL_RAY_PLACEMENT_STRATEGY must be one of PACK, SPREAD"):
        RayPlacement.from_env({"TOKENMILL_RAY_PLACEMENT_STRATEGY": "ANYWHERE"})
    with pytest.raises(RayBackendError, match="TOKENMILL_RAY_BUNDLE_RESOURCES is not valid JSON"):
        RayPlacement.from_env({"TOKENMILL_RAY_BUNDLE_RESOURCES": "{gpu_box: 1}"})
    with pytest.raises(RayBackendError, match="must map resource names to positive numbers"):
        RayPlacement.from_env({"TOKENMILL_RAY_BUNDLE_RESOURCES": '{"gpu_box": -1}'})
    with pytest.raises(RayBackendError, match=r"TOKENMILL_TP_PORT must be a port number \(1-65535\), got '70000'"):
        RayPlacement.from_env({"TOKENMILL_TP_PORT": "70000"})


# -- on the cluster -------------------------------------------------------------------------------


@pytest.mark.parametrize("model, where", [("llama_gqa", "driver's node"), ("qwen2", "other node")])
def test_a_ray_rank_decodes_what_one_rank_decodes(ray_cluster, tiny_model_factory, monkeypatch, model, where):
    import ray

    folder = tiny_model_factory(model)
    prompts = token_prompts(5, seed=3)
    with engine(folder, skip_tokenizer_init=True, kv_cache_memory=8 << 20) as one:
        reference = one.generate(prompts, GREEDY, use_tqdm=False)
    place_rank1(monkeypatch, ON_HEAD if where == "driver's node" else ON_WORKER)
    llm = tp_llm(folder)
    try:
        executor = llm.llm_engine.executor
        driver_node = ray.get_runtime_context().get_node_id()
        assert (executor.follower_nodes == [driver_node]) == (where == "driver's node")
        assert executor.same_machine == (where == "driver's node")  # shared memory only on one node
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert token_ids(outputs) == token_ids(reference)
    finally:
        llm.llm_engine.shutdown()
    assert_nothing_left(ray)


@pytest.mark.parametrize("where", ["driver's node", "other node"])
def test_a_killed_rank_actor_fails_the_engine_at_once(ray_cluster, tiny_model_factory, monkeypatch, where):
    import ray

    place_rank1(monkeypatch, ON_HEAD if where == "driver's node" else ON_WORKER)
    llm = tp_llm(tiny_model_factory("llama_gqa"))
    [actor] = llm.llm_engine.executor.actors
    ray.kill(actor)
    start = time.monotonic()
    with pytest.raises(ExecutorDiedError, match=r"rank 1 \(a Ray actor\) failed: .*(Actor|actor)"):
        llm.generate(token_prompts(2, seed=1), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.llm_engine.shutdown()
    assert_nothing_left(ray)


def test_a_rank_that_fails_before_joining_fails_the_start_at_once(ray_cluster, tiny_model_factory, monkeypatch):
    import ray

    class BrokenRank:  # a local class: Ray ships it to the actor by value
        def run(self, rank, *args):
            raise RuntimeError(f"rank {rank} found no model at this path")

    monkeypatch.setattr(ray_executor, "RankActor", BrokenRank)
    place_rank1(monkeypatch, ON_WORKER)
    start = time.monotonic()
    with pytest.raises(ExecutorDiedError, match="could not start: tensor-parallel rank 1 .* RuntimeError: rank 1 found no model"):
        tp_llm(tiny_model_factory("llama_gqa"))
    assert time.monotonic() - start < 60  # not the rendezvous timeout (300 s)
    assert_nothing_left(ray)


def test_resources_no_node_has_are_a_clear_error(ray_cluster, tiny_model_factory, monkeypatch):
    place_rank1(monkeypatch, {"tokenmill_no_such_node": 1})
    with pytest.raises(RayBackendError, match=r"no Ray node\(s\) can hold a rank's bundle .*tokenmill_no_such_node"):
        tp_llm(tiny_model_factory("llama_gqa"))


def test_a_local_ray_the_engine_started_is_shut_down_with_it(ray_cluster, tiny_model_factory):
    # In a process of its own (this one is connected to the test cluster); RAY_ADDRESS=local: a Ray of its own.
    script = textwrap.dedent(f"""
        import time
        import psutil, ray
        from tokenmill import LLM, SamplingParams
        llm = LLM({tiny_model_factory("llama_gqa")!r}, tensor_parallel_size=2, distributed_executor_backend="ray",
                  dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory=8 << 20)
        assert llm.llm_engine.executor.owns_ray
        [out] = llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
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


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs the embedded SmolLM2 model")
def test_serve_with_a_ray_rank_on_another_node(ray_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)  # the server joins the cluster, as `ray start` machines would
    place_rank1(monkeypatch, ON_WORKER)
    server = RemoteServer(["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--dtype", "float32"])
    try:
        client = server.client(timeout=60)
        done = client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                         max_tokens=8, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 8
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_text()[-3000:]
    import ray

    assert_nothing_left(ray)
