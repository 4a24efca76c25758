"""worker/cpu_memory.py's KV cache prefault: it faults pages in without changing what blocks hold,
stops when the cache is freed, and an engine with it on computes what one without it does; the
weights' move into huge pages (at once, or deferred to a background copy and a repointing between two
passes) keeps every value, tie and view, and an engine computes the same."""

from __future__ import annotations

import functools
import gc
import mmap
import sys
import time
import weakref

import pytest
import torch

from conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.worker import cpu_memory
from tokenmill.worker.cpu_memory import (HUGE_PAGE_WEIGHTS_ENV, KV_PREFAULT_ENV, KVPrefault, WeightMove, move_weights_to_huge_pages,
                                        weight_tensors, zeros_huge_page_aligned)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")


def _populate_write_works() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (Linux 5.14); older ones refuse it and the prefault does nothing."""
    libc = cpu_memory._libc()
    region = mmap.mmap(-1, 1 << 16)
    address = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    return libc is not None and cpu_memory._madvise(libc, address, 1 << 16, cpu_memory._MADV_POPULATE_WRITE)


needs_populate = pytest.mark.skipif(sys.platform.startswith("linux") and not _populate_write_works(),
                                    reason="this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")


@pytest.fixture(autouse=True)
def _prefault_on(monkeypatch):
    monkeypatch.setenv(KV_PREFAULT_ENV, "1")  # conftest.py turns it off for the rest of the suite


def kv_tensor(heads: int, blocks: int, dtype=torch.bfloat16) -> torch.Tensor:
    shape = (heads, blocks, 16, 64)
    return torch.from_numpy(zeros_huge_page_aligned(shape, dtype)).view(dtype)


def fresh_kv_tensor(heads: int, blocks: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A cache in a fresh anonymous mapping: never touched, whatever the allocator holds warm."""
    nbytes = heads * blocks * 16 * 64 * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(heads, blocks, 16, 64)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@needs_populate
def test_pages_fault_in_and_blocks_keep_their_contents():
    caches = [fresh_kv_tensor(3, 4096), fresh_kv_tensor(3, 4096, torch.float32)]  # 24 MB and 48 MB
    caches[0][1, 7] = 1.5  # blocks in use before the prefault starts
    caches[1][2, 4000] = -2.0
    before = resident_bytes()
    assert KVPrefault(caches).wait(60)
    assert resident_bytes() - before >= 0.9 * sum(c.nbytes for c in caches)
    assert (caches[0][1, 7] == 1.5).all() and (caches[1][2, 4000] == -2.0).all()
    assert caches[0].sum() == 1.5 * 16 * 64 and caches[1].sum() == -2.0 * 16 * 64  # nothing else written


@needs_populate
def test_it_waits_for_an_idle_engine_unless_waited_on():
    """While steps run (and IDLE_AFTER after) nothing is faulted in; idle, it goes on by itself; wait() makes it go on regardless."""
    cache = fresh_kv_tensor(4, 4096)  # 32 MB
    prefault = KVPrefault([cache])
    before = resident_bytes()
    with prefault.busy():
        time.sleep(0.3)
        assert not prefault.done() and resident_bytes() - before < cache.nbytes / 2
    deadline = time.monotonic() + 30
    while not prefault.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefault.done() and resident_bytes() - before >= 0.9 * cache.nbytes

    busy_engine = KVPrefault([fresh_kv_tensor(4, 4096)])
    with busy_engine.busy():
        assert busy_engine.wait(30)


def test_it_stops_short_of_the_machines_memory(monkeypatch):
    """A cache larger than what the machine has to spare is left to fault in by use, not committed whole."""
    import psutil

    monkeypatch.setattr(cpu_memory, "_PREFAULT_RESERVE", psutil.virtual_memory().total)  # nothing to spare
    cache = fresh_kv_tensor(4, 4096)
    before = resident_bytes()
    assert KVPrefault([cache]).wait(30)
    assert resident_bytes() - before < cache.nbytes / 2


def test_a_freed_cache_is_not_kept_alive():
    """The thread holds the cache weakly: freed, its memory goes at once (not after the 2 GB are faulted in), and the thread ends."""
    cache = kv_tensor(8, 1 << 17)
    ref = weakref.ref(cache)
    prefault = KVPrefault([cache])
    del cache
    for _ in range(100):  # the thread holds it strongly only while it faults one range in (4 MB)
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.01)
    assert ref() is None
    assert prefault.wait(30)


def test_stop_ends_the_thread_within_a_call():
    """stop() (which the interpreter's exit calls) ends the thread after its current call, far from done: a daemon
    thread still faulting in while Python finalizes aborted processes (SIGABRT, seen at a benchmark's exit)."""
    cache = fresh_kv_tensor(8, 1 << 16)  # 1 GB, never touched
    prefault = KVPrefault([cache])
    prefault.wait(0)  # go on regardless of the engine
    time.sleep(0.05)
    before = resident_bytes()
    start = time.monotonic()
    prefault.stop()
    assert time.monotonic() - start < 5
    assert prefault.done() and not prefault._thread.is_alive()
    time.sleep(0.05)
    assert resident_bytes() - before < 16 << 20  # nothing more faulted in after it returned


def test_turned_off_or_nothing_to_do(monkeypatch):
    monkeypatch.setenv(KV_PREFAULT_ENV, "0")
    assert KVPrefault([kv_tensor(1, 64)]).wait(0)
    monkeypatch.setenv(KV_PREFAULT_ENV, "1")
    assert KVPrefault([]).wait(0)


def greedy_outputs_on_and_off(model: str, env: str, check, **engine) -> list[list[list[int]]]:
    """A tiny model's greedy outputs with the setting `env` on ("1"), then off ("0"); check(llm, setting)
    runs on each engine before it generates."""
    prompts = random_prompts([5, 40, 70], seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = []
    for setting in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(env, setting)
            llm = LLM(model=model, dtype="float32", block_size=4, **engine)
            check(llm, setting)
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)])
    return outputs


def test_an_engine_prefaulting_computes_the_same(tiny_model_factory):
    def prefaulted(llm, setting):
        assert llm.llm_engine.executor.driver_runner.kv_prefault.wait(60)

    outputs = greedy_outputs_on_and_off(tiny_model_factory("llama_gqa"), KV_PREFAULT_ENV, prefaulted, num_kv_blocks=4096)
    assert outputs[0] == outputs[1]


def test_tune_malloc_keeps_freed_buffers_mapped():
    """A freed buffer under the mmap threshold is reused without faulting its pages in again (the trim
    threshold once reached mallopt as 0, a C int cut from 1 << 40, and every free gave the pages back).
    In a fresh process, with numpy's buffers (plain malloc): in the suite's own process the heap's state
    depends on the engines earlier tests built and freed (move_weights_to_huge_pages trims it), and
    torch's 12 MB buffers were not always placed where the last one was freed, even in a fresh one."""
    import subprocess
    import sys

    script = """
import resource, numpy as np
from tokenmill.worker.cpu_memory import tune_malloc
tune_malloc()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = np.empty(3 << 20, np.float32)
    buffer.fill(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del buffer
print(*faults)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    faults = [int(f) for f in out]
    # The first buffer faults its pages in (3,072 of 4 KB, fewer where huge pages back the heap); later ones
    # reuse them. With the heap trimmed at each free (the bug), every call faults as many as the first.
    assert max(faults[1:]) * 4 < faults[0], faults


needs_thp = pytest.mark.skipif(not cpu_memory._huge_pages_possible(), reason="transparent huge pages are off here: weights stay where they are")


class _Holder(torch.nn.Module):
    """Weights as the layers hold them: a parameter tied into a second module, a buffer, a view of the
    parameter, and tensors held only as plain attributes (a kernel call's bound arguments, a partial)."""

    def __init__(self) -> None:
        from tokenmill.layers.quantization.weight_only import KernelLinear

        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1024, 1024), requires_grad=False)  # 4 MB
        self.tied = torch.nn.Linear(1, 1, bias=False)
        self.tied.weight = self.weight
        self.register_buffer("scale", torch.rand(1024), persistent=False)
        self.register_buffer("row", self.weight.data[3], persistent=False)
        self.packed = torch.randint(-128, 127, (300, 700), dtype=torch.int8)
        self.call = KernelLinear(torch.ops.aten.mm.default, (self.packed, torch.rand(77)), None)
        self.general = functools.partial(torch.mul, torch.rand(5, dtype=torch.bfloat16))


def _deferred_move(model: torch.nn.Module) -> int:
    """WeightMove's deferred move, copied in the background and then repointed; the bytes moved."""
    move = WeightMove(model, defer=True)
    pointers = [t.data_ptr() for t in weight_tensors(model)]
    assert move.wait(60)
    assert [t.data_ptr() for t in weight_tensors(model)] == pointers  # copied: nothing repointed yet
    return move.finish()


@needs_thp
@pytest.mark.parametrize("move", [move_weights_to_huge_pages, _deferred_move], ids=["at-once", "deferred"])
def test_weights_move_into_one_huge_page_region_with_their_values_and_ties(monkeypatch, move):
    monkeypatch.setenv(HUGE_PAGE_WEIGHTS_ENV, "1")
    model = _Holder()
    tensors = weight_tensors(model)
    assert len(tensors) == 6  # weight (tied: once), scale, row, packed, the call's scale, the partial's argument
    before = [t.clone() for t in tensors]
    row_offset = model.row.data_ptr() - model.weight.data_ptr()
    moved = move(model)
    assert moved >= sum(t.numel() * t.element_size() for t in tensors) - model.row.nbytes
    start = min(t.data_ptr() for t in tensors)
    assert start % (2 << 20) == 0  # the region starts on a huge page
    assert all(start <= t.data_ptr() < start + moved for t in tensors)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert model.tied.weight is model.weight and isinstance(model.weight, torch.nn.Parameter)
    assert model.row.data_ptr() - model.weight.data_ptr() == row_offset  # the view still is one
    model.weight.data[3, 5] = 7.0
    assert model.row[5] == 7.0
    assert model.call.weights[0] is model.packed  # held objects repointed in place, not replaced


def test_weights_stay_where_they_are_when_turned_off(monkeypatch):
    monkeypatch.setenv(HUGE_PAGE_WEIGHTS_ENV, "0")
    model = _Holder()
    pointers = [t.data_ptr() for t in weight_tensors(model)]
    assert move_weights_to_huge_pages(model) == 0
    move = WeightMove(model, defer=True)
    assert move.done() and move.finish() == 0
    assert [t.data_ptr() for t in weight_tensors(model)] == pointers


@needs_thp
def test_a_deferred_move_waits_for_the_first_pass_then_for_idleness(monkeypatch):
    """Before the engine's first pass (its start, a server's) the copy waits START_AFTER; after a pass it
    runs once the engine is idle; the tensors are repointed only once the copy is whole."""
    monkeypatch.setattr(WeightMove, "START_AFTER", 60.0)
    model = _Holder()
    move = WeightMove(model, defer=True)
    time.sleep(0.3)
    assert not move.done() and move.before_pass() == 0
    with move.busy():  # a pass: from its end on, an idle engine lets the copy run
        pass
    deadline = time.monotonic() + 30
    while not move.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert move.done() and move.repoint_if_copied() > 0
    start = min(t.data_ptr() for t in weight_tensors(model))
    assert start % (2 << 20) == 0


@needs_thp
def test_weights_too_large_to_copy_twice_move_at_once(monkeypatch):
    monkeypatch.setattr(WeightMove, "DEFER_MAX_SHARE", 0.0)  # no room for a second copy
    model = _Holder()
    move = WeightMove(model, defer=True)
    assert move.done() and move.moved > 0 and move.before_pass() == 0
    assert min(t.data_ptr() for t in weight_tensors(model)) % (2 << 20) == 0


@needs_thp
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_an_engine_on_huge_page_weights_computes_the_same(tiny_model_factory, quantization):
    def in_one_region(llm, setting):
        if setting == "1":  # every weight (the KV cache aside: allocated after) in one region
            runner = llm.llm_engine.executor.driver_runner
            runner.finish_weight_move()
            caches = {id(t) for layer in runner.attn_layers for t in (layer.k_cache, layer.v_cache)}
            regions = {t.untyped_storage().data_ptr() for t in weight_tensors(runner.model) if id(t) not in caches}
            assert len(regions) == 1 and regions.pop() % (2 << 20) == 0

    outputs = greedy_outputs_on_and_off(tiny_model_factory("llama_gqa"), HUGE_PAGE_WEIGHTS_ENV, in_one_region, num_kv_blocks=256,
                                        quantization=quantization)
    assert outputs[0] == outputs[1]


@needs_thp
def test_an_engine_computes_the_same_across_its_weights_move(tiny_model_factory):
    """The deferred move repoints the target's weights between two passes of a running engine (its C++ decode
    program holds them too): the outputs are those of an engine whose weights never move."""
    model = tiny_model_factory("llama_gqa")
    prompts = random_prompts([5, 40, 70], seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HUGE_PAGE_WEIGHTS_ENV, "0")
        expected = run(LLM(model=model, dtype="float32", block_size=4, num_kv_blocks=256))
    llm = LLM(model=model, dtype="float32", block_size=4, num_kv_blocks=256)
    runner = llm.llm_engine.executor.driver_runner
    before = run(llm)  # on the weights where loading put them
    pointers = [t.data_ptr() for t in weight_tensors(runner.model)]
    assert runner.weight_move.wait(60)  # copied; repointed at the next pass
    assert [t.data_ptr() for t in weight_tensors(runner.model)] == pointers
    after = run(llm)
    caches = {id(t) for layer in runner.attn_layers for t in (layer.k_cache, layer.v_cache)}
    regions = {t.untyped_storage().data_ptr() for t in weight_tensors(runner.model) if id(t) not in caches}
    assert len(regions) == 1 and regions.pop() % (2 << 20) == 0
    assert before == expected and after == expected


def _vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping holding an address (/proc/self/smaps)."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and all(c in "0123456789abcdef-" for c in first):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the address"
    return flags


@needs_thp
def test_each_heads_first_blocks_are_in_small_pages():
    """The first 2 MB of each head's blocks (where a fresh engine's first requests write) are advised out
    of huge pages, so a first prompt does not fault a 2 MB page per head, layer, K and V; the rest of
    each head's part stays advised into them."""
    heads, blocks, block_bytes = 3, 3072, 16 * 64 * 2  # 6 MB a head: its first 2 MB small, the rest huge
    cache = zeros_huge_page_aligned((heads, blocks, 16, 64), torch.bfloat16)
    cpu_memory.small_pages_where_heads_start(cache)
    head_bytes = blocks * block_bytes
    for head in range(heads):
        start = cache.ctypes.data + head * head_bytes
        assert "nh" in _vm_flags_at(start) and "nh" in _vm_flags_at(start + (2 << 20) - 1)
        assert "hg" in _vm_flags_at(start + head_bytes - 1)
