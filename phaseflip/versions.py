"""Which phaseflip this is, and what it runs on: `phaseflip --version` and `GET /version`."""

from __future__ import annotations

import sys

__version__ = "0.1.0"  # the package's version (pyproject.toml says the same)


def version_info() -> dict[str, str | None]:
    """Versions of phaseflip and what it runs on (None: not installed); what `GET /version`
    answers. Read from package metadata: nothing is imported."""
    from importlib.metadata import PackageNotFoundError, version

    info: dict[str, str | None] = {"version": __version__}
    for dist in ("torch", "transformers", "triton"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    info["python"] = sys.version.split()[0]
    return info
