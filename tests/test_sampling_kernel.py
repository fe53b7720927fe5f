"""The fused sampling kernel (`kernels/sampling.py`) and the sampler's route to it.

Greedy rows must be `greedy`'s first maximal index bit for bit; a random row's draw must depend
on its seed and logits alone (not the batch, its position or the launch's chunking), never pick
a -inf token, and follow softmax(l / T). Runs on CUDA when present, else on the CPU through
Triton's interpreter; the sampler-level tests force the CUDA route on CPU tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.kernels.sampling import RNG_GROUP, exponential_race  # noqa: E402
from phaseflip.sampling import last_stage, sampler  # noqa: E402
from phaseflip.sampling.params import SamplingParams  # noqa: E402
from phaseflip.sampling.sampler import (  # noqa: E402
    Sampler,
    SamplingInput,
    filters,
    fused_plan,
    fused_race,
    greedy,
    step_seed,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEG = float("-inf")


def _race(x: torch.Tensor, temps: list[float], seeds: list[int], **kw) -> list[int]:
    inv = torch.tensor([1.0 / t if t > 0 else 0.0 for t in temps], device=DEVICE)
    s = torch.tensor(seeds, dtype=torch.int64, device=DEVICE)
    return exponential_race(x.to(DEVICE), inv, s, **kw).tolist()


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_are_the_first_maximal_index(dtype):
    x = _logits(7, 3000)
    x[1, 2500] = x[1, 17] = x[1, 273] = x[1, 1041] = 50.0  # ties in a slot, across chunks
    x[2, 5:9] = 50.0  # ties inside one slot run
    x[3] = NEG  # all -inf: 0, as argmax
    x[4] = NEG
    x[4, 2999] = -6e4  # the only finite logit (fp16 too), the last column
    x[5] = 0.0  # all equal
    x = x.to(dtype)
    wide = torch.full((7, 3100), 7.0, dtype=dtype)  # a row stride past the vocabulary
    wide[:, :3000] = x
    want = greedy(x.float()).tolist()
    assert want[1] == 17 and want[2] == 5 and want[3] == 0 and want[4] == 2999
    for chunk in (RNG_GROUP, 2 * RNG_GROUP, None):
        assert _race(x, [0.0] * 7, list(range(7)), chunk=chunk) == want
        assert _race(wide[:, :3000], [0.0] * 7, list(range(7)), chunk=chunk) == want


def test_seeded_row_ignores_batch_position_and_chunking():
    vocab = 5000  # not a multiple of the chunk: a ragged last chunk
    x = _logits(4, vocab, seed=1)
    seeds = [11, 2**62 + 5, 7, 123456789]
    alone = [_race(x[i : i + 1], [0.8], [seeds[i]])[0] for i in range(4)]
    others = _logits(4, vocab, seed=2)
    mixed = torch.stack([others[0], x[2], others[1], x[0], x[3], others[2], x[1]])
    got = _race(mixed, [1.3, 0.8, 0.0, 0.8, 0.8, 0.5, 0.8],
                [99, seeds[2], 5, seeds[0], seeds[3], 98, seeds[1]])
    assert [got[3], got[6], got[1], got[4]] == alone
    for chunk in (RNG_GROUP, 2 * RNG_GROUP, 4 * RNG_GROUP, 8 * RNG_GROUP):
        assert _race(x, [0.8] * 4, seeds, chunk=chunk) == alone
    assert len(set(_race(x[:1].expand(8, vocab), [0.8] * 8, list(range(8))))) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neg_inf_is_never_drawn(dtype):
    rows, vocab = 8, 2100
    x = torch.full((rows, vocab), NEG)
    allowed = [3, 1024, 1500, 2099]
    x[:, allowed] = torch.tensor([0.0, -20.0, 5.0, -3.0])
    x[1] = NEG
    x[1, 777] = -1e30  # all -inf but one: that one, whatever the noise
    x = x.to(dtype)
    for temp in (0.5, 1.0, 1e4):  # a huge temperature: nearly uniform over the finite ones
        got = _race(x, [temp] * rows, list(range(100, 100 + rows)))
        assert got[1] == 777
        assert all(t in allowed for i, t in enumerate(got) if i != 1)
    assert _race(torch.full((2, vocab), NEG), [1.0, 0.0], [1, 2]) == [0, 0]


def test_low_precision_inputs_draw_as_their_float32_values():
    x = _logits(6, 2000, seed=3).to(torch.bfloat16)
    temps, seeds = [0.7, 1.0, 0.0, 2.0, 0.3, 1.0], [1, 2, 3, 4, 5, 6]
    assert _race(x, temps, seeds) == _race(x.float(), temps, seeds)
    h = x.to(torch.float16)
    assert _race(h, temps, seeds) == _race(h.float(), temps, seeds)


_M32 = np.uint64(0xFFFFFFFF)


def _philox(seeds: list[int], counters: np.ndarray) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 as `tl.randint4x` computes it (key = the 64-bit seed, counter (c, 0,
    0, 0)): the four uint32 lanes, [len(seeds), len(counters)] each, in uint64 arrays."""
    key = np.asarray([s & (2**64 - 1) for s in seeds], dtype=np.uint64)[:, None]
    c0 = np.broadcast_to(counters.astype(np.uint64)[None, :], (len(seeds), len(counters)))
    c1 = c2 = c3 = np.zeros_like(c0)
    k0, k1 = key & _M32, key >> np.uint64(32)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = a * c0, b * c2  # 32 x 32 bits: exact in uint64
        c0, c1, c2, c3 = ((p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & _M32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
    return c0, c1, c2, c3


def _reference(logits: np.ndarray, temp: float, seeds: list[int]) -> np.ndarray:
    """The race of the kernel's documented stream in float64: argmax(l / T - log E)."""
    cols = np.arange(logits.shape[-1])
    bits = np.choose((cols // 256) % 4, _philox(seeds, (cols // 1024) * 256 + cols % 256))
    u = ((bits >> np.uint64(9)).astype(np.float64) + 0.5) * 2.0**-23
    gumbel = -np.log(np.maximum(-np.log(u), 1e-30))
    return np.argmax(np.asarray(logits, dtype=np.float64) / temp + gumbel, axis=-1)


def _fused(logits: list[float], temp: float, seeds: list[int]) -> list[int]:
    x = torch.tensor(logits).expand(len(seeds), len(logits)).to(DEVICE)
    return fused_race(x, [temp] * len(seeds),
                      torch.tensor(seeds, dtype=torch.int64, device=DEVICE)).tolist()


def test_kernel_draws_its_documented_stream():
    x = _logits(6, 3000, seed=6)
    seeds = [0, 1, 2**63 - 1, step_seed(3, 4), 2**40 + 7, 99]
    for temp in (0.6, 1.0, 3.0):
        want = _reference(x.numpy(), temp, seeds).tolist()
        assert _race(x, [temp] * 6, seeds) == want


def test_draws_follow_softmax_of_tempered_logits():
    """The stream's race follows softmax(l / T) (20 000 draws in numpy: standard errors
    <= 0.0036, fixed seeds), and the kernel draws that stream (its first 256 draws)."""
    logits, temp = [1.0, 0.5, -0.3, 2.0, NEG], 0.7
    seeds = [step_seed(7, i) for i in range(20000)]
    drawn = _reference(np.array(logits), temp, seeds)
    freq = np.bincount(drawn, minlength=len(logits)) / len(seeds)
    want = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temp, 0).numpy()
    assert freq[4] == 0
    assert np.abs(freq - want).max() < 0.015, (freq, want)
    assert _fused(logits, temp, seeds[:256]) == drawn[:256].tolist()


def test_tiny_temperature_keeps_small_logit_gaps():
    """At T = 1e-4 a logit gap of 2**-14 at 1000 is 0.61 tempered units; l / T in float32
    would round it to 1.0 and flip ~8 % of the draws: `fused_race` shifts by the row max."""
    logits, seeds = [1000.0, 1000.0 + 2.0**-14, 990.0], list(range(64))
    want = _reference(np.array(logits), 1e-4, seeds).tolist()
    assert 10 < sum(want) < 54  # both near-equal tokens are drawn
    assert _fused(logits, 1e-4, seeds) == want
    assert _fused([-50.0, -50.0 + 2.0**-14, -80.0], 1e-30, seeds[:8]) == [1] * 8  # 1/T 1e30
    for t in (4e-39, 1e-40):  # 1/T past float32 (inf): clipped so that 1/T * log2(e) is finite
        assert _fused([-50.0, -50.0 + 2.0**-14, -80.0], t, seeds[:8]) == [1] * 8


def test_filters_and_route():
    vocab = 100
    assert not filters(-1, 1.0, 0.0, vocab) and not filters(0, 1.0, 0.0, vocab)
    assert not filters(vocab, 1.0, 0.0, vocab) and not filters(500, 1.0, 0.0, vocab)
    assert filters(5, 1.0, 0.0, vocab) and filters(-1, 0.9, 0.0, vocab)
    assert filters(-1, 1.0, 0.05, vocab)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not sampler.fused_device(cpu) and sampler.fused_device(cuda)  # triton imports here
    assert fused_plan(cpu, 3, [False, True]) == (False, [0, 1])  # the CPU: the torch path
    assert fused_plan(cuda, 3, [False, True]) == (True, [1])
    assert fused_plan(cuda, 2, []) == (True, [])  # greedy rows only
    assert fused_plan(cuda, 2, [True, True]) == (False, [0, 1])  # every row raced
    assert fused_plan(cuda, 3, [True, True]) == (True, [0, 1])  # and one greedy row


def _as_cuda(monkeypatch) -> None:
    """The sampler's CUDA route on CPU tensors (the kernel through the interpreter)."""
    monkeypatch.setattr(sampler, "fused_device", lambda device: True)


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=42),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, seed=5, top_k=20),  # filtered: the torch race
    SamplingParams(temperature=1.2, top_k=1),  # greedy
    SamplingParams(temperature=0.005, seed=9),  # shifted by its max
]


def test_sampler_route_draws_per_row(monkeypatch):
    if DEVICE.type == "cpu":
        _as_cuda(monkeypatch)
    x = _logits(len(PARAMS), 3000, seed=4).to(DEVICE)
    outs = [[3] * i for i in range(len(PARAMS))]
    inputs = [SamplingInput(p, [1, 2], o) for p, o in zip(PARAMS, outs)]
    got = Sampler(seed=1).sample_on_device(x, inputs).tolist()
    want = greedy(x).tolist()
    assert [got[0], got[4]] == [want[0], want[4]]
    for i in (1, 5):  # a seeded row alone, keyed by step_seed(seed, output length)
        p = PARAMS[i]
        alone = fused_race(x[i : i + 1], [p.temperature], torch.tensor(
            [step_seed(p.seed, len(outs[i]))], device=DEVICE))
        assert got[i] == alone.item()
    torch_path = Sampler(seed=1).sample_on_device(x[3:4].cpu(), inputs[3:4]).item()
    assert got[3] == torch_path  # a filtered seeded row: the torch race's draw, as before
    assert 0 <= got[2] < 3000


def test_last_stage_draws_the_drivers_ids(monkeypatch):
    if DEVICE.type == "cpu":
        _as_cuda(monkeypatch)
    x = _logits(4, 2500, seed=5).to(DEVICE)
    params = [PARAMS[0], PARAMS[1], PARAMS[3], PARAMS[5]]
    steps = [0, 3, 2, 7]
    inputs = [SamplingInput(p, [1], [4] * s) for p, s in zip(params, steps)]
    driver = Sampler(seed=3).sample_on_device(x, inputs).tolist()
    random = [i for i, p in enumerate(params) if not p.is_greedy]
    spec = last_stage.SampleSpec(
        np.arange(4, dtype=np.int64),
        np.array([(i, params[i].top_k, params[i].seed, steps[i]) for i in random]),
        np.array([(params[i].temperature, params[i].top_p, params[i].min_p) for i in random]))
    assert last_stage.sample_rows(x, spec).tolist() == driver
