"""Kernel choices are configuration, read once (ftserve_kernels/config.py): the
kernel package needs nothing of the application; the engine builds its
KernelConfig at start-up (flags, table files), and its steps run with exactly
that one and read no FTSERVE_* variable."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ftserve.config import ConfigError, EngineConfig
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.setup import build_engine
from ftserve_kernels.config import DEFAULT_KERNELS, KernelConfig
from tests.engine_util import collect

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe")
    write_checkpoint("tiny-moe", out, config_only=True)
    return str(out)


def engine_config(model_dir: str, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                                page_size=4, num_pages=256, max_prefill_length=64, max_running_requests=4,
                                status_log_interval=0.0)
    return EngineConfig(**(base | kw))


def test_kernel_package_imports_nothing_from_ftserve() -> None:
    """Every ftserve_kernels module imports (in a fresh interpreter) without
    pulling in the application package."""
    code = ("import importlib, pkgutil, sys, ftserve_kernels\n"
            "for m in pkgutil.iter_modules(ftserve_kernels.__path__):\n"
            "    importlib.import_module('ftserve_kernels.' + m.name)\n"
            "print(sorted(n for n in sys.modules if n == 'ftserve' or n.startswith('ftserve.')))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_config_validates_its_fields() -> None:
    assert DEFAULT_KERNELS == KernelConfig(backend="auto", pdl=True, gemv_table=None, moe_table=None)
    with pytest.raises(ValueError, match="kernel backend 'cuda'"):
        KernelConfig(backend="cuda")
    with pytest.raises(ValueError, match="GEMV entry 'dense:N=8'"):
        KernelConfig(gemv_entries="dense:N=8")
    cpu = torch.zeros(1)
    assert not KernelConfig().triton(cpu) and KernelConfig(backend="triton").triton(cpu)
    assert not KernelConfig(backend="torch").triton(cpu)
    assert KernelConfig().check_tables(torch.device("cpu")) == {"gemv": 0, "moe": 0, "gemv_laid": 0}


def test_engine_builds_one_config_from_its_flags(model_dir: str) -> None:
    eng = build_engine(engine_config(model_dir, kernels="triton", pdl=False))
    try:
        kernels = eng.runner.kernels
        assert kernels == KernelConfig(backend="triton", pdl=False)
        assert eng.runner.sampler.kernels is kernels, "the sampler runs the engine's choices"
        assert eng.summary["kernels"] == kernels.summary()
    finally:
        eng.shutdown()
    with pytest.raises(ConfigError, match="--kernels must be auto, triton or torch"):
        engine_config(model_dir, kernels="cuda").validate()


def test_a_bad_table_file_fails_at_start_up(model_dir: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The table files are read once, when the engine starts: a bad one is a
    start-up error naming the file, even on a device that never reads tables."""
    bad = tmp_path / "gemv.json"
    bad.write_text("{not json")
    monkeypatch.setenv("FTSERVE_GEMV_CONFIG_FILE", str(bad))
    with pytest.raises(ConfigError, match="bad GEMV config table") as err:
        build_engine(engine_config(model_dir))
    assert str(bad) in str(err.value)
    good = tmp_path / "moe.json"
    good.write_text('{"configs": {"E=8,H=64,I=32,k=2": {}}}')
    monkeypatch.delenv("FTSERVE_GEMV_CONFIG_FILE")
    monkeypatch.setenv("FTSERVE_MOE_CONFIG_FILE", str(good))
    eng = build_engine(engine_config(model_dir))
    try:
        assert eng.runner.kernels.moe_table == str(good) and eng.runner.kernels.gemv_table is None
    finally:
        eng.shutdown()


class _ReadSpy(dict):  # type: ignore[type-arg]
    """os.environ's contents; records every FTSERVE_* name looked up."""

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self.read: list[str] = []

    def _note(self, key: object) -> None:
        if isinstance(key, str) and key.startswith("FTSERVE_"):
            self.read.append(key)

    def __getitem__(self, key: str) -> str:
        self._note(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return super().__contains__(key)


@pytest.fixture
def env_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[_ReadSpy]:
    spy = _ReadSpy(os.environ)
    monkeypatch.setattr(os, "environ", spy)
    yield spy


def test_steps_read_no_environment_and_run_the_engines_config(model_dir: str, env_reads: _ReadSpy) -> None:
    """Prefill chunks, decode steps and sampling of a started engine look up no
    FTSERVE_* variable (a captured graph and an eager step cannot disagree),
    and every forward runs the KernelConfig the engine built."""
    eng = build_engine(engine_config(model_dir, kernels="torch"))
    try:
        assert env_reads.read, "start-up reads the operational variables (table files)"
        env_reads.read.clear()
        seen: list[KernelConfig] = []
        eng.runner.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].kernels))
        rng = random.Random(2)
        reqs = [(f"r{i}", [rng.randrange(10, 32000) for _ in range(40 + 30 * i)],
                 SamplingParams(max_tokens=5, temperature=0.7 if i else 0.0, top_p=0.9, seed=i,
                                ignore_eos=True)) for i in range(3)]
        outs = collect(eng, reqs)
        assert all(outs[r][-1].finished for r, _, _ in reqs)
        assert env_reads.read == [], f"the step path read {sorted(set(env_reads.read))}"
        assert len(seen) >= 6 and all(k is eng.runner.kernels for k in seen)
    finally:
        eng.shutdown()
