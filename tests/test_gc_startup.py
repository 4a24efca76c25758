"""long_lived_import: the collector paused while a module imports for the first time, then the heap frozen;
nothing changed for a module already imported or a collector the caller turned off."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from tokenmill.gc_startup import long_lived_import


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    (tmp_path / "tm_gc_probe.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tm_gc_probe"
    sys.modules.pop("tm_gc_probe", None)
    gc.unfreeze()  # the test suite's own objects must stay collectable (engines other tests drop)


def test_first_import_pauses_the_collector_then_freezes(fresh_module):
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    with long_lived_import(fresh_module):
        assert not gc.isenabled()
        import tm_gc_probe
    assert tm_gc_probe.VALUE == 7
    assert gc.isenabled()
    assert gc.get_freeze_count() > frozen_before


def test_a_module_already_imported_changes_nothing():
    frozen_before = gc.get_freeze_count()
    with long_lived_import("gc"):
        assert gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before


def test_a_collector_the_caller_turned_off_stays_off(fresh_module):
    frozen_before = gc.get_freeze_count()
    gc.disable()
    try:
        with long_lived_import(fresh_module):
            import tm_gc_probe  # noqa: F401
        assert not gc.isenabled() and gc.get_freeze_count() == frozen_before
    finally:
        gc.enable()


def test_an_import_that_fails_turns_the_collector_back_on(fresh_module):
    with pytest.raises(ImportError):
        with long_lived_import("tm_gc_no_such_module"):
            import tm_gc_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_the_engine_import_leaves_torch_frozen_and_the_collector_on():
    # A fresh interpreter, as a user's script: `from tokenmill import LLM` freezes torch's objects.
    code = ("import gc\nfrom tokenmill import LLM\n"
            "print(gc.isenabled(), gc.get_freeze_count() > 100000, LLM.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True", "LLM"]


def test_an_engine_is_freed_after_del_whatever_its_build_imported():
    """A fresh interpreter's first LLM() (whose tokenizer thread imports transformers meanwhile): nothing of the
    engine is frozen, so `del llm` and a collection free its model's weights."""
    code = ("import gc, weakref\nfrom tokenmill import LLM\nllm = LLM(dtype='float32', max_model_len=256)\n"
            "ref = weakref.ref(next(iter(llm.llm_engine.executor.worker.runner.model.parameters())))\n"
            "del llm\ngc.collect()\nprint(ref() is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-1] == "True"
