"""The engine loop's third verb: logits become tokens (and prompt logprobs).

`SamplingStep` picks each sampling item's logits row and samples it, either waiting for the
tokens on the host (`sample`) or leaving them on the device for an overlapped next step
(`sample_ahead`, an `InFlight`). It also computes the prompt logprobs a step's logits hold.
Per-request state it writes: `prompt_logprobs` (by position), and `pending`/`future_row` of
requests whose token is still on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from phaseflip.sampling.grammar import GrammarBook
from phaseflip.sampling.last_stage import SampledTokens, SampleSpec, SpecBuilder
from phaseflip.sampling.params import SamplingParams
from phaseflip.sampling.sampler import Sampler, SamplingInput, compute_logprobs, to_device
from phaseflip.scheduler.scheduler import Scheduled, ScheduledBatch


@dataclass
class InFlight:
    """A step whose sampled tokens are still on the device (overlap scheduling)."""

    items: list[Scheduled]  # the sampling items, row i sampled token i
    tokens: torch.Tensor  # device [len(items)]: what the next step's placeholders name
    host: torch.Tensor  # the same, being copied to host memory
    done: torch.cuda.Event | None  # recorded after the copy (None on the CPU)

    def host_tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def overlappable(params: SamplingParams) -> bool:
    """Whether sampling with `params` needs nothing of the previous token on the host: no
    logprobs (read at sampling), no penalties or min_new_tokens (they read the output so
    far), no stop strings (checked on the text at once), no seed (its stream is keyed by the
    output length). A grammar is fine: an overlapped step's tokens reach the host (and the
    matchers) before the next step's are chosen, while the device runs that next step."""
    return (params.logprobs is None and params.prompt_logprobs is None and not params.stop
            and not params.has_penalties and params.min_new_tokens == 0 and params.seed is None)


def _inputs(items: list[Scheduled]) -> list[SamplingInput]:
    out = []
    for it in items:
        req = it.req
        inp = req.sampling_input
        if inp is None:
            inp = req.sampling_input = SamplingInput(req.params, req.prompt_ids,
                                                     req.output_ids, req.eos_ids)
        out.append(inp)
    return out


def _others(n: int, local: list[int]) -> list[int]:
    """The positions in range(n) not in `local` (ascending)."""
    if not local:
        return list(range(n))
    mine = set(local)
    return [i for i in range(n) if i not in mine]


def _local_mask(mask, local: list[int]):
    """A grammar mask of a step's items, for its `local` items only (a constrained row is
    always one of them: `SpecBuilder`)."""
    if mask is None:
        return None
    at = {p: j for j, p in enumerate(local)}
    return [at[r] for r in mask[0]], mask[1]


def logit_rows(items: list[Scheduled], logits: torch.Tensor) -> torch.Tensor:
    """The sampling rows of `logits`, in item order."""
    rows = [it.logit_row + it.num_logit_rows - 1 for it in items]
    if rows == list(range(len(rows))):  # every decode step: a view, not a gather copy
        return logits[: len(rows)]
    return logits[to_device(rows, torch.long, logits.device)]


class SamplingStep:
    def __init__(self, sampler: Sampler, grammars: GrammarBook | None = None) -> None:
        self.sampler, self.grammars = sampler, grammars
        self.specs = SpecBuilder()

    def last_stage_spec(self, batch: ScheduledBatch, ahead: bool) -> SampleSpec | None:
        """What the last pipeline stage may sample for this batch in the driver's stead (its
        ids then come back as `SampledTokens`), or None: the logits come to the driver."""
        return self.specs.spec(batch, ahead)

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor | SampledTokens) -> dict:
        """{sampling item: (token, logprob or None, top logprobs or None)}, on the host.
        Grammar masks are filled on the host first, while the device still runs the step.
        `SampledTokens`: the last stage chose the ids (`last_stage_spec`), nothing to do."""
        items = [it for it in batch.items if it.samples]
        if not items:
            return {}
        mask = None if self.grammars is None else self.grammars.masks([it.req for it in items])
        result: dict[Scheduled, tuple] = {}
        if isinstance(logits, SampledTokens):  # the last stage's rows, then the driver's
            local = logits.local
            there = _others(len(items), local)
            for i, t in zip(there, logits.tokens.tolist(), strict=True):
                result[items[i]] = (t, None, None)
            if not local:
                return result
            items, mask = [items[i] for i in local], _local_mask(mask, local)
            rows = logits.rows([it.logit_row + it.num_logit_rows - 1 for it in items])
        else:
            rows = logit_rows(items, logits)
        out = self.sampler.sample(rows, _inputs(items), mask)
        for i, it in enumerate(items):
            lp = out.logprobs[i] if out.logprobs is not None else None
            top = out.top_logprobs[i] if out.top_logprobs is not None else None
            result[it] = (out.token_ids[i], lp, top)
        return result

    def sample_ahead(self, batch: ScheduledBatch,
                     logits: torch.Tensor | Callable[[], torch.Tensor]) -> InFlight | None:
        """Samples on the device without waiting; the tokens start their way to the host.
        The previous step's tokens are on the host already (`OutputProcessor.take_tokens`),
        so grammar masks are filled here, on the host, while the device runs this step.
        `logits` may be a wait for them (a PP runner's last stage is another rank): called
        after the masks, as late as possible."""
        items = [it for it in batch.items if it.samples]
        if not items:
            return None
        mask = None if self.grammars is None else self.grammars.masks([it.req for it in items])
        if callable(logits):
            logits = logits()
        if isinstance(logits, SampledTokens):  # chosen on the last stage (`last_stage_spec`)
            tokens = self._merge(items, logits, mask)
        else:
            tokens = self.sampler.sample_on_device(logit_rows(items, logits), _inputs(items),
                                                   mask)
        for i, it in enumerate(items):
            it.req.pending, it.req.future_row = 1, i
        if tokens.device.type != "cuda":
            return InFlight(items, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return InFlight(items, tokens, host, done)

    def _merge(self, items: list[Scheduled], got: SampledTokens, mask) -> torch.Tensor:
        """The step's tokens in item order on the device: the last stage's ids, and the
        driver's rows (a mixed step) sampled here from the logits that came with them."""
        local = got.local
        if not local:
            return got.tokens
        mine = [items[i] for i in local]
        rows = got.rows([it.logit_row + it.num_logit_rows - 1 for it in mine])
        drawn = self.sampler.sample_on_device(rows, _inputs(mine), _local_mask(mask, local))
        device = got.tokens.device
        tokens = torch.empty(len(items), dtype=torch.int64, device=device)
        tokens[to_device(_others(len(items), local), torch.long, device)] = got.tokens
        tokens[to_device(local, torch.long, device)] = drawn
        return tokens

    @staticmethod
    def prompt_logprobs(batch: ScheduledBatch, logits: torch.Tensor | SampledTokens) -> None:
        """Records the logprobs of the prompt tokens whose logits this step computed."""
        for it in batch.items:
            req = it.req
            if not req.wants_prompt_logprobs or it.num_logit_rows == 0:
                continue
            last = len(req.prompt_ids) - 1
            n = max(0, min(it.start + it.extend_len, last) - it.start)
            if n == 0:
                continue
            rows = (logits.block(it.logit_row, n) if isinstance(logits, SampledTokens)
                    else logits[it.logit_row : it.logit_row + n])
            targets = torch.tensor(req.prompt_ids[it.start + 1 : it.start + 1 + n],
                                   device=rows.device)
            k = req.params.prompt_logprobs or 0
            chosen, top_vals, top_ids = compute_logprobs(rows, targets, k)
            chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
            for j in range(n):
                req.prompt_logprobs[it.start + 1 + j] = chosen[j]
                req.prompt_top_logprobs[it.start + 1 + j] = list(zip(top_ids[j], top_vals[j]))
            req.prompt_lp_next = max(req.prompt_lp_next, it.start + n)
