"""The grammar trial child runs the installed `phaseflip`, whatever the server's working
directory holds: `python -m` puts the working directory first on the child's path, so a
server started next to another checkout (a `phaseflip/` folder of other code) ran that
checkout's grammar worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from phaseflip.sampling.grammar import GrammarSpec, _toolchain
from phaseflip.sampling.grammar_worker import GrammarProbes
from tests.fake_engine import tokenizer

SHADOW = '''import sys
sys.stderr.write("the shadowing checkout's grammar worker ran\\n")
sys.exit(7)
'''


def test_a_phaseflip_folder_in_the_working_directory_does_not_shadow_the_child(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Red before: the child ran the folder's `grammar_worker` (exit 7), every trial's child
    died and the request got 'structured output is unavailable'. Now the child starts where
    `phaseflip` was imported from and the grammar compiles."""
    for sub in ("phaseflip", "phaseflip/sampling"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "phaseflip/sampling/grammar_worker.py").write_text(SHADOW)
    monkeypatch.chdir(tmp_path)
    tok = tokenizer()
    tok_json = _toolchain(tok, len(tok)).tokenizer_json
    probes = GrammarProbes(20.0, 1, lambda: tok_json)
    try:
        assert probes.problem(GrammarSpec("regex", "[0-9]{3}")) is None
    finally:
        probes.close()
