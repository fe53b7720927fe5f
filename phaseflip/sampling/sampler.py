"""Batched token selection over a [B, V] logits matrix.

Two design points drive the layout of this module:

* Logprobs are reported from the raw model distribution, so they are computed from the logits
  as given, never from the biased/penalised/tempered ones used to choose the token.
* A seeded row's draw at step s depends only on (seed, s), not on which other rows share the
  batch or whether the request was preempted and recomputed: each seeded row gets its own
  generator, seeded from (seed, s), and samples by the exponential race argmax(p / q), q ~ Exp(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phaseflip.sampling.params import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
# Exp(1) draws of exactly 0 would make -log(q) infinite; clamp to keep the race well defined.
_MIN_EXP = 1e-30


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


def _row_tensor(
    value: torch.Tensor | Sequence[float] | float,
    rows: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    return t.expand(rows) if t.dim() == 0 else t


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
    if bool((k_active | p_active).any()):
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
    if bool(m_active.any()):
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

    def sample(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> SampleOutput:
        """Pick a token for every row of `logits` [B, V] and report raw-distribution logprobs."""
        if logits.dim() != 2 or logits.shape[0] != len(inputs):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match {len(inputs)} sampling inputs"
            )
        rows, vocab = logits.shape
        if rows == 0:
            return SampleOutput(token_ids=[], logprobs=None, top_logprobs=None)
        device = logits.device
        raw = logits.float()

        work = raw
        edited = False
        for i, inp in enumerate(inputs):
            params = inp.params
            must_mask = len(inp.output_ids) < params.min_new_tokens
            if not (params.has_penalties or must_mask):
                continue
            if not edited:
                work = raw.clone()
                edited = True
            row = work[i]
            apply_penalties(row, params, inp.prompt_ids, inp.output_ids)
            if must_mask:
                banned = [t for t in (*inp.eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab]
                if banned:
                    row[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")

        # argmax returns the first maximal index: ties resolve to the lowest id, deterministically.
        tokens = work.argmax(dim=-1)

        random_rows = [i for i, inp in enumerate(inputs) if not inp.params.is_greedy]
        if random_rows:
            idx = torch.tensor(random_rows, dtype=torch.long, device=device)
            sub = work.index_select(0, idx)
            params_list = [inputs[i].params for i in random_rows]
            temps = torch.tensor([p.temperature for p in params_list], device=device)
            # Shift by the row max before dividing so tiny temperatures cannot overflow to inf.
            sub = (sub - sub.max(dim=-1, keepdim=True).values) / temps.unsqueeze(1)
            sub = filter_logits(
                sub,
                top_k=[p.top_k for p in params_list],
                top_p=[p.top_p for p in params_list],
                min_p=[p.min_p for p in params_list],
            )
            noise = self._exponential_noise(
                [inputs[i] for i in random_rows], vocab, device, sub.dtype
            )
            # argmax(p / q) == argmax(logit - log q): the exponential race samples from softmax.
            chosen = (sub - noise.clamp_min(_MIN_EXP).log()).argmax(dim=-1)
            tokens = tokens.index_copy(0, idx, chosen)

        want = [inp.params.logprobs for inp in inputs]
        if all(w is None for w in want):
            return SampleOutput(token_ids=tokens.tolist(), logprobs=None, top_logprobs=None)
        max_k = max(w or 0 for w in want)
        chosen_lp, top_vals, top_ids = compute_logprobs(raw, tokens, max_k)
        # One host transfer for everything: float64 holds ids (< 2**53) and float32 values exactly.
        packed = torch.cat(
            [tokens.unsqueeze(1), chosen_lp.unsqueeze(1), top_vals, top_ids], dim=1
        ).to(dtype=torch.float64)
        host = packed.cpu().tolist()
        token_list = [int(r[0]) for r in host]
        lp_list = [r[1] for r in host]
        tops: list[list[tuple[int, float]]] = []
        for r, w in zip(host, want, strict=True):
            k = w or 0
            tops.append([(int(r[2 + max_k + j]), r[2 + j]) for j in range(k)])
        return SampleOutput(token_ids=token_list, logprobs=lp_list, top_logprobs=tops)

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
            if seed is None:
                continue
            gen = torch.Generator(device=device)
            gen.manual_seed(step_seed(seed, len(inp.output_ids)))
            # A fresh [V] tensor (not a row view) so the stream cannot depend on the row's offset.
            noise[j] = torch.empty(vocab, device=device, dtype=dtype).exponential_(generator=gen)
        return noise
