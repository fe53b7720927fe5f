"""Kernels do not specialize on counts that change with every batch.

Triton compiles a variant per value class of an int argument (== 1, divisible by 16, other).
A count that follows the batch (rows, tiles, splits) would then compile a new variant the first
time a batch lands in another class — mid-serving, stalling every stream (an FP8 server at
4 req/s stalled 1.76 s once on the H200; see docs/kernels.md). The decorators are read from
the source, so the check runs without a GPU (the interpreter drops them).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

KERNELS = Path(importlib.util.find_spec("phaseflip").origin).parent / "kernels"

# kernel -> the batch-dependent int arguments it must not specialize on
UNSPECIALIZED = {
    ("attention.py", "_decode_split_kernel"): {"num_splits"},
    ("attention_extend.py", "_extend_kernel"): {"num_tiles"},
    ("norm.py", "_rms_norm_kernel"): {"num_rows"},
    ("linear.py", "_skinny_kernel"): {"M", "num_splits"},
}


def _do_not_specialize(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call):
            for kw in dec.keywords:
                if kw.arg == "do_not_specialize":
                    return {ast.literal_eval(e) for e in kw.value.elts}
    return set()


@pytest.mark.parametrize(("where", "names"), UNSPECIALIZED.items(),
                         ids=[k[1] for k in UNSPECIALIZED])
def test_batch_dependent_ints_are_not_specialized(where, names):
    path = KERNELS / where[0]
    assert names <= _do_not_specialize(path, where[1])
    params = {a.arg for a in next(
        n for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == where[1]).args.args}
    assert names <= params  # (a renamed argument would silently specialize again)


def test_the_fp8_silu_build_does_not_follow_the_row_count(monkeypatch):
    """The scratch-slot FP8 SiLU·mul caps its programs at the row count; the cap is the grid,
    never a compile-time argument (the count as a constexpr compiled a build per batch size
    below the slot count). Every constexpr and launch option is the same from 3 to 600 rows."""
    import torch

    from phaseflip.kernels import activation

    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(activation, "_silu_and_mul_fp8_kernel", Recorder())
    for rows in (3, 17, 600):
        activation.silu_and_mul_fp8(torch.zeros(rows, 2 * 8192, dtype=torch.bfloat16),
                                    scratch_slots=528)
    assert len(launches) == 3 and all(k == launches[0] for k in launches)
