"""What ships besides the code: licence, changelog, container image definition, extras."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_apache_2():
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert pyproject()["project"]["license"] == "Apache-2.0"


def test_changelog_names_this_version():
    version = pyproject()["project"]["version"]
    assert re.search(rf"^## \[?{re.escape(version)}\]?", (ROOT / "CHANGELOG.md").read_text(),
                     re.M)


def test_extras_keep_a_cpu_torch():
    """Nothing in an extra may depend on torch: a resolve would pull the CUDA build."""
    extras = pyproject()["project"]["optional-dependencies"]
    assert any(d.startswith("triton") and "x86_64" in d for d in extras["test"])
    assert not any(re.match(r"torch\b", d) for deps in extras.values() for d in deps)
    assert "aiohttp" in " ".join(extras["bench"])


def test_dockerfile_serves_and_lints():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["phaseflip", "serve"', text, re.M)
    assert "pip install \"torch==${TORCH_VERSION}\"" in text
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(
        Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (the test extra installs it on Linux x86_64)")
    r = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
