"""Batched token selection over a [B, V] logits matrix.

Two design points drive the layout of this module:

* Logprobs are reported from the raw model distribution, so they are computed from the logits
  as given, never from the biased/penalised/tempered ones used to choose the token.
* A seeded row's draw at step s depends only on (seed, s), not on which other rows share the
  batch or whether the request was preempted and recomputed: each seeded row gets its own
  generator, seeded from (seed, s), and samples by the exponential race argmax(p / q), q ~ Exp(1).

On CUDA (with Triton) greedy rows and random rows without top-k / top-p / min-p take one fused
kernel (`kernels/sampling.py`, `fused_race`) that reads each logit once and draws its Exp(1)
noise in-kernel from Philox keyed by a per-row seed (a seeded row's `step_seed(seed, s)`, else
one drawn on the device from the sampler's generator). Its draws are the same race over the
same distribution but not the same numbers as the torch path: a seeded request gets other
tokens on CUDA than on the CPU (or than before the kernel) for one seed, while still depending
on (seed, s) alone. Rows with filters and every row on the CPU keep the torch path, the
reference; the last pipeline stage (`sampling/last_stage.py`) runs the same `choose_tokens`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from phaseflip.sampling.grammar import apply_bitmask
from phaseflip.sampling.params import SamplingParams

# (rows constrained by a grammar, their int32 token bitmask [len(rows), ceil(V / 32)] on the
# host): see sampling/grammar.py
TokenMask = tuple[list[int], torch.Tensor]

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
# Exp(1) draws of exactly 0 would make -log(q) infinite; clamp to keep the race well defined.
_MIN_EXP = 1e-30
# Whether the fused Triton race (`kernels/sampling.py`, imported on first use) can run on CUDA.
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Below this temperature the fused race shifts a row by its max before scaling by 1 / T (an
# extra pass over those rows): l / T itself would lose precision (|l| / T * 2**-24 in tempered
# units, 3e-4 at |l| = 50, T = 0.01) and overflow for tiny T.
_SHIFT_BELOW = 0.01
# 1 / T in float32: past these it would be inf (inf * 0 = nan) or 0 (the greedy mark); the
# kernel multiplies it by log2(e), so the top leaves room for that (3.4e38 / 1.4427 = 2.36e38)
_INV_TEMP_MAX, _INV_TEMP_MIN = 2.0e38, 1e-37


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """Generator seed for a seeded row at generation step `step`; well mixed so nearby seeds and
    steps give unrelated streams."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) & _MASK63


@dataclass
class SamplingInput:
    """One row of the batch: its parameters and the token history the penalties need."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SampleOutput:
    """Host-side results of one sampling step, one entry per row."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 log-softmax of `logits` [B, V]: logprob of `token_ids` [B], and the `top_k`
    largest (values [B, k], ids [B, k], sorted descending; k = 0 gives empty tensors)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.to(logits.device, torch.long).view(-1, 1)).squeeze(1)
    k = min(max(top_k, 0), logits.shape[-1])
    if k == 0:
        empty = logprobs.new_empty((logits.shape[0], 0))
        return chosen, empty, empty.long()
    top_vals, top_ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return chosen, top_vals, top_ids


def to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the stream: a copy from pageable
    memory first synchronises the stream, which would stall an overlapped step until the
    forward queued before it is done; a pinned source copies asynchronously."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device, through pinned memory (no stream sync, see to_device)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _row_tensor(
    value: torch.Tensor | Sequence[float] | float,
    rows: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        t = torch.as_tensor(value, dtype=dtype, device=device)
    else:
        t = to_device(value, dtype, device)
    return t.expand(rows) if t.dim() == 0 else t


def _maybe_active(value: torch.Tensor | Sequence[float] | float, active) -> bool:
    """Whether a filter parameter may be on for some row, decided on the host: per-row values
    given as numbers are checked here; a tensor counts as on (its filter then runs and leaves
    the off rows unchanged). Why: a device-side `.any()` here was a host sync in every
    temperature > 0 step, which serialised the overlapped scheduler with the GPU."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Sequence):
        return any(active(v) for v in value)
    return bool(active(value))


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor | Sequence[int] | int = -1,
    top_p: torch.Tensor | Sequence[float] | float = 1.0,
    min_p: torch.Tensor | Sequence[float] | float = 0.0,
) -> torch.Tensor:
    """Return a copy of `logits` [B, V] with tokens outside the top-k / top-p / min-p sets of
    each row set to -inf. Parameters are scalars or per-row sequences; top_k <= 0 is off.

    Top-p keeps the smallest prefix of the sorted distribution (after top-k) whose mass reaches
    top_p, and always the top token; min-p drops tokens with prob < min_p * max prob, which is a
    logit comparison and hence independent of the other two filters' renormalisation.
    """
    rows, vocab = logits.shape
    device = logits.device
    k = _row_tensor(top_k, rows, torch.long, device)
    p = _row_tensor(top_p, rows, logits.dtype, device)
    m = _row_tensor(min_p, rows, logits.dtype, device)
    out = logits.clone()
    k_active = (k > 0) & (k < vocab)
    p_active = p < 1.0
    if _maybe_active(top_k, lambda v: 0 < v < vocab) or _maybe_active(top_p, lambda v: v < 1.0):
        sorted_logits, sorted_idx = out.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).expand(rows, vocab)
        kk = torch.where(k_active, k, torch.full_like(k, vocab))
        sorted_logits = sorted_logits.masked_fill(ranks >= kk.unsqueeze(1), float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_p = (mass_before >= p.unsqueeze(1)) & p_active.unsqueeze(1)
        drop_p[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop_p, float("-inf"))
        out = torch.empty_like(out).scatter_(1, sorted_idx, sorted_logits)
    m_active = m > 0.0
    if _maybe_active(min_p, lambda v: v > 0.0):
        row_max = out.max(dim=-1, keepdim=True).values
        # prob_i / prob_max = exp(l_i - l_max); compare in log space to avoid underflow.
        threshold = row_max + torch.log(m.clamp_min(1e-38)).unsqueeze(1)
        drop_m = (out < threshold) & m_active.unsqueeze(1)
        out = out.masked_fill(drop_m, float("-inf"))
    return out


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> None:
    """In place on one row [V]: logit_bias, then HF repetition penalty over prompt+output, then
    OpenAI frequency/presence penalties over output tokens only."""
    device = logits.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long, device=device)
        vals = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=device)
        logits.index_add_(0, ids, vals)
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(prompt_ids + output_ids, dtype=torch.long, device=device).unique()
        vals = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output_ids:
        ids, counts = torch.tensor(output_ids, dtype=torch.long, device=device).unique(
            return_counts=True
        )
        delta = params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        logits.index_add_(0, ids, -delta)


def _history_keys(rows: list[int], histories: list[tuple[Sequence[int], ...]], vocab: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of every history as flat indices into a [B, vocab] matrix: `row * vocab +
    token` with row = `rows[j]` (global) and with row = j (local to the group); repeated tokens
    repeat. Built in numpy on the host and sent as two tensors, whatever the number of rows."""
    lengths = [sum(map(len, h)) for h in histories]
    total = sum(lengths)
    ids = np.fromiter(chain.from_iterable(chain.from_iterable(histories)), dtype=np.int64,
                      count=total)
    if total and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise IndexError(f"a penalty history holds a token id outside the {vocab} logits")
    global_keys = np.repeat(np.asarray(rows, dtype=np.int64) * vocab, lengths) + ids
    local_keys = np.repeat(np.arange(len(rows), dtype=np.int64) * vocab, lengths) + ids
    return torch.from_numpy(global_keys).to(device), torch.from_numpy(local_keys).to(device)


def apply_penalties_batch(logits: torch.Tensor, rows: list[int],
                          inputs: list[SamplingInput]) -> None:
    """In place on the contiguous `logits` [B, V]: `apply_penalties` on row `rows[j]` with
    `inputs[j]` for every j, with the same bits as the per-row calls: each edited value goes
    through the same float operations with the same Python scalars (so the same kernels).

    Why: per row that is ~10 small ops, ~80 us of host time on a CPU and, on a GPU, a host→
    device copy and a synchronising `unique` per row. Here the rows sharing a repetition
    penalty (or a frequency/presence pair) take a few ops over all their history tokens at
    once. No `unique` is needed: a token seen twice is gathered twice and written twice with
    the same value (the new values are computed from the gathered old ones). Stages run in the
    per-row order (bias, repetition, frequency/presence); rows are independent, so finishing a
    stage for all rows before the next changes nothing."""
    vocab, device, dtype = logits.shape[1], logits.device, logits.dtype
    flat = logits.view(-1)
    bias = [(r, inp.params.logit_bias) for r, inp in zip(rows, inputs) if inp.params.logit_bias]
    if bias:
        keys = torch.tensor([r * vocab + t for r, b in bias for t in b], dtype=torch.long,
                            device=device)
        vals = torch.tensor([v for _, b in bias for v in b.values()], dtype=dtype, device=device)
        flat[keys] = flat[keys] + vals  # the keys of one row are distinct (dict keys)

    rep: dict[float, list[tuple[int, SamplingInput]]] = {}
    freq: dict[tuple[float, float], list[tuple[int, SamplingInput]]] = {}
    for r, inp in zip(rows, inputs):
        p = inp.params
        if p.repetition_penalty != 1.0 and (inp.prompt_ids or inp.output_ids):
            rep.setdefault(p.repetition_penalty, []).append((r, inp))
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and inp.output_ids:
            freq.setdefault((p.frequency_penalty, p.presence_penalty), []).append((r, inp))

    for penalty, members in rep.items():
        keys, _ = _history_keys([r for r, _ in members],
                                [(inp.prompt_ids, inp.output_ids) for _, inp in members],
                                vocab, device)
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / penalty, vals * penalty)
    for (frequency, presence), members in freq.items():
        keys, local = _history_keys([r for r, _ in members],
                                    [(inp.output_ids,) for _, inp in members], vocab, device)
        # occurrences per (row, token) in one [rows, V] int32 buffer (4 bytes a logit, like
        # the bincount vLLM keeps); converted like the per-row version's unique counts
        counts = torch.zeros(len(members) * vocab, dtype=torch.int32, device=device)
        counts.index_add_(0, local, torch.ones(local.numel(), dtype=torch.int32, device=device))
        delta = frequency * counts[local].to(dtype) + presence
        # per row this was index_add_(-delta): x + (-d), which is x - d exactly in IEEE
        flat[keys] = flat[keys] - delta


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The first maximal index of each row (argmax's and max's contract alike). On CUDA with
    Triton: the fused race's greedy rows (`fused_race` at temperature 0), which never choose
    NaN, so every greedy choice on a GPU (the driver's, the last PP stage's) is the same one.
    On the CPU `max(dim=-1).indices` is the faster reduction: 0.68 ms against 1.65 for argmax
    over 256 rows of a 128k vocabulary (one process, null forward, `bench_host_step
    --breakdown`)."""
    if fused_device(logits.device):
        n = logits.shape[0]
        return fused_race(logits, np.zeros(n), torch.zeros(n, dtype=torch.int64,
                                                            device=logits.device))
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


class Sampler:
    """Chooses one token per row. Holds only the generator for unseeded random rows."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def sample(self, logits: torch.Tensor, inputs: list[SamplingInput],
               mask: TokenMask | None = None) -> SampleOutput:
        """Pick a token for every row of `logits` [B, V] and report raw-distribution logprobs
        (of the model's distribution: a grammar's mask only restricts the choice)."""
        if logits.dim() != 2 or logits.shape[0] != len(inputs):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match {len(inputs)} sampling inputs"
            )
        if logits.shape[0] == 0:
            return SampleOutput(token_ids=[], logprobs=None, top_logprobs=None)
        tokens, raw, want_logprobs = self._choose(logits, inputs, mask)
        if not want_logprobs:
            return SampleOutput(token_ids=tokens.tolist(), logprobs=None, top_logprobs=None)
        return _with_logprobs(raw, tokens, inputs)

    def sample_on_device(self, logits: torch.Tensor, inputs: list[SamplingInput],
                         mask: TokenMask | None = None) -> torch.Tensor:
        """The chosen token ids as a device tensor, with no host sync (overlap scheduling).
        Rows must not ask for logprobs."""
        tokens, _, want_logprobs = self._choose(logits, inputs, mask)
        if want_logprobs:
            raise ValueError("sample_on_device cannot report logprobs")
        return tokens

    def _choose(self, logits: torch.Tensor, inputs: list[SamplingInput],
                mask: TokenMask | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(chosen ids on the device, the float32 logits, whether any row wants logprobs)."""
        rows, vocab = logits.shape
        device, raw = logits.device, logits.float()

        # One pass over the rows: which need logit edits, which draw, which want logprobs.
        penalised: list[int] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        random_rows: list[int] = []
        want_logprobs = False
        for i, inp in enumerate(inputs):
            params = inp.params
            if params.has_penalties:
                penalised.append(i)
            if len(inp.output_ids) < params.min_new_tokens:
                for t in (*inp.eos_token_ids, *params.stop_token_ids):
                    if 0 <= t < vocab:
                        banned_rows.append(i)
                        banned_ids.append(t)
            if not params.is_greedy:
                random_rows.append(i)
            if params.logprobs is not None:
                want_logprobs = True

        work = raw
        if penalised or banned_rows or mask is not None:
            work = raw.clone()
            if penalised:
                apply_penalties_batch(work, penalised, [inputs[i] for i in penalised])
            if banned_rows:
                work[to_device(banned_rows, torch.long, device),
                     to_device(banned_ids, torch.long, device)] = float("-inf")
            if mask is not None:  # after the bans: a grammar row keeps only allowed tokens
                apply_bitmask(work, mask[0], _on_device(mask[1], device))

        random = [inputs[i].params for i in random_rows]
        tokens = choose_tokens(
            work, random_rows, [p.temperature for p in random],
            [p.top_k for p in random], [p.top_p for p in random], [p.min_p for p in random],
            lambda plain: self._row_seeds([inputs[random_rows[j]] for j in plain],
                                          [random_rows[j] for j in plain], rows, device),
            lambda raced: self._exponential_noise([inputs[random_rows[j]] for j in raced],
                                                  vocab, device, torch.float32))
        return tokens, raw, want_logprobs

    def _row_seeds(self, plain: list[SamplingInput], rows: list[int], n: int,
                   device: torch.device) -> torch.Tensor:
        """int64 [n] Philox seeds for the fused race: `step_seed(seed, output length)` at
        `rows` (the unfiltered random rows) of seeded `plain` inputs; elsewhere seeds drawn
        on the device from the sampler's generator (no host sync; greedy rows ignore theirs)."""
        seeded = [(r, step_seed(inp.params.seed, len(inp.output_ids)))
                  for r, inp in zip(rows, plain) if inp.params.seed is not None]
        if len(seeded) == len(rows):  # no unseeded random row: nothing to draw
            host = [0] * n
            for r, v in seeded:
                host[r] = v
            return to_device(host, torch.int64, device)
        seeds = torch.randint(0, _MASK63, (n,), generator=self._generator(device),
                              device=device, dtype=torch.int64)
        if seeded:
            seeds.index_copy_(0, to_device([r for r, _ in seeded], torch.long, device),
                              to_device([v for _, v in seeded], torch.int64, device))
        return seeds

    def _exponential_noise(
        self,
        rows: list[SamplingInput],
        vocab: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Exp(1) noise [len(rows), V]: seeded rows from (seed, step) alone, others from the
        sampler's own stream."""
        noise = torch.empty((len(rows), vocab), device=device, dtype=dtype)
        unseeded = [j for j, inp in enumerate(rows) if inp.params.seed is None]
        if unseeded:
            draw = torch.empty((len(unseeded), vocab), device=device, dtype=dtype)
            draw.exponential_(generator=self._generator(device))
            if len(unseeded) == len(rows):
                return draw
            noise[torch.tensor(unseeded, dtype=torch.long, device=device)] = draw
        for j, inp in enumerate(rows):
            seed = inp.params.seed
            if seed is not None:
                noise[j] = _seeded_row(seed, len(inp.output_ids), vocab, device, dtype)
        return noise


def _seeded_row(seed: int, step: int, vocab: int, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    """A seeded row's Exp(1) noise [V] at generation step `step`: (seed, step) alone."""
    gen = torch.Generator(device=device)
    gen.manual_seed(step_seed(seed, step))
    # A fresh [V] tensor (not a row view) so the stream cannot depend on the row's offset.
    return torch.empty(vocab, device=device, dtype=dtype).exponential_(generator=gen)


def seeded_noise(seeds: list[int], steps: list[int], vocab: int, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
    """`_exponential_noise` of rows that are all seeded, from their seeds and steps (what a
    step message carries to the last pipeline stage, `sampling/last_stage.py`)."""
    noise = torch.empty((len(seeds), vocab), device=device, dtype=dtype)
    for j, (seed, step) in enumerate(zip(seeds, steps)):
        noise[j] = _seeded_row(seed, step, vocab, device, dtype)
    return noise


def filters(top_k: int | Sequence[int], top_p: float | Sequence[float],
            min_p: float | Sequence[float], vocab: int) -> np.ndarray:
    """Per row (scalars or sequences), whether top-k / top-p / min-p change a row of `vocab`
    logits (`filter_logits`'s tests of an active filter)."""
    k = np.asarray(top_k, dtype=np.int64)
    return ((k > 0) & (k < vocab)) | (np.asarray(top_p, dtype=np.float64) < 1.0) | (
        np.asarray(min_p, dtype=np.float64) > 0.0)


def fused_device(device: torch.device) -> bool:
    """Whether the fused race (`kernels/sampling.py`) runs on `device`: CUDA with Triton."""
    return device.type == "cuda" and HAS_TRITON


def fused_plan(device: torch.device, rows: int, filtered: Sequence[bool] | np.ndarray
               ) -> tuple[bool, list[int]]:
    """How `choose_tokens` draws `rows` rows whose random ones have the `filtered` flags
    (`filters`): (whether the fused kernel runs, the positions among the random rows that
    the torch race draws). The kernel runs on CUDA with Triton, for the greedy rows and the
    random rows without filters; not when every row is raced. Elsewhere: the torch path."""
    if not fused_device(device):
        return False, list(range(len(filtered)))
    raced = np.flatnonzero(np.asarray(filtered, dtype=bool)).tolist()
    return len(raced) < rows, raced


def choose_tokens(work: torch.Tensor, rows: list[int], temperatures: list[float],
                  top_k: list[int], top_p: list[float], min_p: list[float],
                  seeds: Callable[[list[int]], torch.Tensor],
                  noise: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
    """The ids of every row of `work` [B, V]: random `rows` (ascending) drawn with their
    temperature and filters, the others greedy (the first maximal index). `seeds(plain)`:
    the fused race's int64 [B] seeds, given the positions (among `rows`) of its random rows;
    `noise(raced)`: Exp(1) noise [len(raced), V] for the rows the torch race draws. One
    function for the driver's sampler and the last pipeline stage's (`fused_plan` routes)."""
    if not rows:
        return greedy(work)
    n, vocab = work.shape
    filtered = (filters(top_k, top_p, min_p, vocab) if fused_device(work.device)
                else np.ones(len(rows), dtype=bool))  # the CPU: every random row raced
    fused, raced = fused_plan(work.device, n, filtered)
    tokens = None
    if fused:  # numpy, not Python loops: ~1000 rows a decode step
        plain = np.flatnonzero(~filtered)
        temps = np.zeros(n)
        temps[np.asarray(rows, dtype=np.int64)[plain]] = np.asarray(
            temperatures, dtype=np.float64)[plain]
        tokens = fused_race(work, temps, seeds(plain.tolist()))
    if not raced:
        return greedy(work) if tokens is None else tokens
    picked = (rows, temperatures, top_k, top_p, min_p)  # every random row raced: the CPU
    if len(raced) < len(rows):  # the kernel drew the others
        picked = tuple([v[j] for j in raced] for v in picked)
    idx, chosen = race(work, *picked, noise(raced))
    if len(raced) == n:  # every row drawn (rows are distinct): no greedy pass to overwrite
        return chosen
    return (greedy(work) if tokens is None else tokens).index_copy(0, idx, chosen)


def fused_race(work: torch.Tensor, temperatures: Sequence[float] | np.ndarray,
               seeds: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the fused kernel's ids for `work` [B, V]: temperature 0 the first maximal
    index, else the exponential race at that temperature with noise from `seeds` (int64
    [B]). Rows below _SHIFT_BELOW are shifted by their max first (a row's own choice: its
    draw still depends on its seed and logits alone)."""
    from phaseflip.kernels.sampling import exponential_race

    device = work.device
    work = work if work.stride(-1) == 1 else work.contiguous()  # the kernel's layout
    t = np.asarray(temperatures, dtype=np.float64)
    with np.errstate(divide="ignore"):
        inv = np.where(t > 0, np.clip(1.0 / t, _INV_TEMP_MIN, _INV_TEMP_MAX), 0.0)
    shift = (t > 0) & (t < _SHIFT_BELOW)
    shifted = np.flatnonzero(shift).tolist()
    ref = None
    if shifted and 4 * len(shifted) >= len(t):  # many: one pass over all rows, no gather
        top = work.amax(dim=-1).float()
        keep = _on_device(torch.from_numpy(shift), device) & top.isfinite()  # all -inf: 0
        ref = torch.where(keep, top, torch.zeros_like(top))
    elif shifted:
        at = to_device(shifted, torch.long, device)
        top = work.index_select(0, at).amax(dim=-1).float()
        ref = torch.zeros(len(t), dtype=torch.float32, device=device)
        ref.index_copy_(0, at, torch.where(top.isfinite(), top, torch.zeros_like(top)))
    inv_temp = _on_device(torch.from_numpy(inv.astype(np.float32)), device)
    return exponential_race(work, inv_temp, seeds, ref)


def race(work: torch.Tensor, rows: list[int], temperatures: list[float], top_k: list[int],
         top_p: list[float], min_p: list[float], noise: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows as a device index, the ids drawn for them): `rows` of `work` [B, V] tempered,
    filtered and raced against their Exp(1) `noise` [len(rows), V], in float32. One function
    for the driver's sampler and the last pipeline stage's, so the two draw the same ids."""
    device = work.device
    idx = to_device(rows, torch.long, device)
    # every row in order (each random): the rows themselves, no gathered copy
    sub = work if rows == list(range(work.shape[0])) else work.index_select(0, idx)
    sub = sub.float()
    temps = to_device(temperatures, torch.float32, device)
    # Shift by the row max before dividing so tiny temperatures cannot overflow to inf.
    sub = (sub - sub.max(dim=-1, keepdim=True).values) / temps.unsqueeze(1)
    sub = filter_logits(sub, top_k=top_k, top_p=top_p, min_p=min_p)
    # argmax(p / q) == argmax(logit - log q): the exponential race samples from softmax.
    return idx, (sub - noise.clamp_min(_MIN_EXP).log()).argmax(dim=-1)


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, inputs: list[SamplingInput]
                   ) -> SampleOutput:
    """The chosen ids with their raw-distribution logprobs and top-k lists, in one host copy."""
    want = [inp.params.logprobs for inp in inputs]
    max_k = max(w or 0 for w in want)
    chosen_lp, top_vals, top_ids = compute_logprobs(raw, tokens, max_k)
    # One host transfer for everything: float64 holds ids (< 2**53) and float32 values exactly.
    packed = torch.cat(
        [tokens.unsqueeze(1), chosen_lp.unsqueeze(1), top_vals, top_ids], dim=1
    ).to(dtype=torch.float64)
    host = packed.cpu()
    token_list = host[:, 0].long().tolist()
    lp_list = host[:, 1].tolist()
    # column blocks to lists, then per row only a zip: no per-element Python indexing
    vals = host[:, 2 : 2 + max_k].tolist()
    ids = host[:, 2 + max_k :].long().tolist()
    tops = [list(zip(i[:w], v[:w])) if w else [] for i, v, w in zip(ids, vals, want)]
    return SampleOutput(token_ids=token_list, logprobs=lp_list, top_logprobs=tops)
