from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from unittest import mock

# NOTE: before torch loads OpenMP: busy-waiting threads make a shared 2-core machine ~3x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

pytest.register_assert_rewrite("realtime_helpers")  # a plugin whose helpers the tests also import

# NOTE: before Triton loads: without a GPU, @triton.jit kernels run in Triton's interpreter on CPU tensors, so
# the fused kernels are checked here too (tests take `KERNEL_DEVICE`; they skip when Triton is missing).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from omnistage.models.qwen3_omni.presets import preset_config
from omnistage.models.qwen3_omni.weights import init_reference_weights

torch.set_num_threads(1)  # tiny ops: threads cost more than they give


@functools.cache
def hf_reference(preset: str = "tiny", seed: int = 0):
    """transformers' Qwen3-Omni model on a preset, every tensor seeded like make-tiny (fp32, CPU, eval)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config = Qwen3OmniMoeConfig(**preset_config(preset))
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    init_reference_weights(model, seed)
    return model


def hf_stage_state(model, stage: str) -> dict[str, torch.Tensor]:
    """The HF model's tensors of one stage under our module names (stage prefix stripped)."""
    prefix = stage + "."
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith(prefix):
            key = name[len(prefix):].replace("model.language_model.", "model.")
            out[key.replace("model.audio_tower.", "audio_tower.").replace("model.visual.", "visual.")] = t
    return out


@pytest.fixture(params=["tiny", "tiny-wide"])
def preset(request) -> str:
    return request.param


@pytest.fixture(scope="module", autouse=True)
def engines_freed(request):
    """After each test file, the engines it made and left running are shut down and the test files' caches in its
    namespace (`functools.cache`: engines, models) emptied: an xdist worker would otherwise keep every engine its
    files made (two workers: 22 of the 24 GB of a 2-core CI machine)."""
    from omnistage.pipeline.orchestrator import Orchestrator

    running, init, shutdown = set(), Orchestrator.__init__, Orchestrator.shutdown

    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        running.add(self)

    def tracked_shutdown(self):
        running.discard(self)
        shutdown(self)

    # NOTE: every shutdown inside the patch: atexit holds the (patched) bound method that shutdown unregisters
    with mock.patch.object(Orchestrator, "__init__", tracked_init), \
            mock.patch.object(Orchestrator, "shutdown", tracked_shutdown):
        yield
        for engine in list(running):
            engine.shutdown()
    for f in vars(request.module).values():
        if isinstance(f, functools._lru_cache_wrapper) and f.__module__.startswith("test_"):
            f.cache_clear()


@pytest.fixture(scope="session")
def tiny_dir(request):
    """A `make-tiny` folder (seed 0), written once into omnistage's cache. Preset "tiny" unless parametrised:
    `@pytest.mark.parametrize("tiny_dir", ["tiny-wide"], indirect=True)`."""
    from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

    return tiny_checkpoint(getattr(request, "param", "tiny"), 0)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (pytest-xdist): each test file to one worker, so its module-scoped engines are made once, and the
    files of one server plugin (`pytest_plugins`) to one worker, so it alone starts those session servers. In
    collection order: sorted by test count, the long one-test files (the soak) would come last and run alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndServer(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(config.rootpath / nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False
    return ByFileAndServer(config, log)


@functools.cache
def scope_of(path: Path) -> str:
    plugins = re.search(r"^pytest_plugins = (.+)$", path.read_text(), re.MULTILINE)
    return plugins[1] if plugins else str(path)
