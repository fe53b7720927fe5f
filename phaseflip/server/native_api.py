"""The native `POST /generate`, in SGLang's shape, so SGLang's clients (its frontend language,
RL rollout code, benchmarks) talk to phaseflip unchanged.

An answer is `{"text", "output_ids", "meta_info"}` (a list of them for several prompts or
`n` > 1, prompt by prompt), `meta_info` holding `id`, `finish_reason` as SGLang's object
(`{"type": "stop", "matched": ...}`, `{"type": "length", "length": n}`, `{"type": "abort",
"message": ...}`), the token counts and, with `return_logprob`, `input_token_logprobs` /
`output_token_logprobs` (and with `top_logprobs_num` the `*_top_logprobs`) as
`[logprob, token_id, text or null]` entries. A stream sends each choice's whole text and ids
so far in every chunk, `index` its place in the flat batch, and ends with `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.params import MAX_N, SamplingParams
from phaseflip.server import protocol as p
from phaseflip.server.context import ServerContext
from phaseflip.server.openai_api import (
    Choice,
    PromptRun,
    check_grammar,
    respond,
    run_prompts,
    stream_response,
)
from phaseflip.server.protocol.sampling import NATIVE_GRAMMARS
from phaseflip.server.sse import sse

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default when `sampling_params.max_new_tokens` is left out (less where the context
has less room)."""


async def generate(ctx: ServerContext, req: p.GenerateRequest, request: Request) -> Response:
    single = req.single
    _check_width(ctx, req)
    if req.text is not None:
        prompts = await ctx.encode_all([req.text] if single else req.text, "text")
    else:
        prompts = [list(req.input_ids)] if single else [list(x) for x in req.input_ids]
    base = req.rid if isinstance(req.rid, str) else ctx.new_id("gen")
    runs, first = [], 0
    for i, ids in enumerate(prompts):
        if req.return_logprob and req.logprob_start_len >= len(ids):
            raise InvalidRequestError(
                f"logprob_start_len {req.logprob_start_len} is past the prompt's last token "
                f"(it has {len(ids)})", "logprob_start_len")
        params = p.generate_sampling_params(
            req, min(DEFAULT_MAX_NEW_TOKENS, ctx.default_max_tokens(len(ids))), i)
        if params.grammar is not None and (i == 0 or isinstance(req.sampling_params, list)):
            # built in the pool (seconds for a large one), once per `sampling_params` entry
            await check_grammar(ctx, params, f"{_params_name(req, i)}.{params.grammar.kind}")
        _validate(ctx, req, i, ids, params)
        rid = req.rid[i] if isinstance(req.rid, list) else base if single else f"{base}-{i}"
        runs.append(PromptRun(rid, ids, params, first))
        first += params.n  # (a running count: a sum over the runs so far is quadratic)
    group = None if single or isinstance(req.rid, list) else base
    taken = [r for r in [group, *(run.rid for run in runs)] if r is not None
             and ctx.engine.in_use(r)]
    if taken:  # (before the answer starts: a stream would only get an error event)
        raise InvalidRequestError(f"request id {taken[0]!r} is already in flight", "rid")
    ctx.admit([r.params for r in runs], _prompt_field(req))
    if req.stream:
        return stream_response(_chunks(ctx, req, runs, group))
    return await respond(request, lambda: _whole(ctx, req, runs, group, single))


def _prompt_field(req: p.GenerateRequest) -> str:
    """The request's prompt field: `text` or `input_ids`."""
    return "text" if req.text is not None else "input_ids"


def _prompt_name(req: p.GenerateRequest, i: int) -> str:
    """The field holding prompt `i`, as an error's `param` names it."""
    return _prompt_field(req) if req.single else f"{_prompt_field(req)}.{i}"


def _params_name(req: p.GenerateRequest, i: int) -> str:
    """Where prompt `i`'s sampling parameters are in the request."""
    return f"sampling_params.{i}" if isinstance(req.sampling_params, list) else (
        "sampling_params")


def _check_width(ctx: ServerContext, req: p.GenerateRequest) -> None:
    """A batch wider (prompts x n) than the server ever takes is refused before any prompt
    is tokenised or checked: `ctx.admit` would refuse it anyway, but only after work that
    grows with the batch (seconds to minutes of a blocked event loop for 10^5 prompts)."""
    ctx.check_width(sum(_samples(req.params_of(i).n) for i in range(req.num_prompts)),
                    _prompt_field(req))


def _samples(n: int | None) -> int:
    """A prompt's sequences for `_check_width`; an `n` out of range counts 1, so that the
    error the client gets is that `n` is out of range (`SamplingParams.validate`'s)."""
    return n if n is not None and 1 <= n <= MAX_N else 1


_SAMPLING_FIELDS = p.native_sampling_param_names() - set(NATIVE_GRAMMARS)
"""`sampling_params` fields an engine-side check may name (grammars are checked before)."""
_ENGINE_NAMES = {"logprobs": "top_logprobs_num", "prompt_logprobs": "top_logprobs_num"}
"""`SamplingParams` fields that a native request sets outside `sampling_params`."""


def _validate(ctx: ServerContext, req: p.GenerateRequest, i: int, ids: list[int],
              params: SamplingParams) -> None:
    """`ctx.validate` with errors naming the field the client sent: `sampling_params.<f>`
    (`sampling_params.<i>.<f>` for a list), and the prompt as `input_ids` or `text`, whose
    length is checked first (a prompt too long by itself is not `max_new_tokens`' fault)."""
    prompt, where = _prompt_name(req, i), _params_name(req, i)
    ctx.check_token_count(len(ids), prompt)
    names = {f: f"{where}.{f}" for f in _SAMPLING_FIELDS} | _ENGINE_NAMES
    try:
        ctx.validate(ids, params, names)
    except InvalidRequestError as e:
        if e.param == "prompt":
            raise type(e)(str(e), prompt) from None
        raise


def _take(run: PromptRun, d: Any) -> None:
    if d.prompt_logprobs is not None:
        run.prompt_logprobs, run.prompt_top = d.prompt_logprobs, d.prompt_top_logprobs
    if d.usage is not None:
        run.usage = d.usage


async def _chunks(ctx: ServerContext, req: p.GenerateRequest, runs: list[PromptRun],
                  group: str | None) -> AsyncIterator[str]:
    acc: dict[tuple[str, int], Choice] = {}
    texts: dict[int, str] = {}  # token texts decoded once for the whole stream
    async for run, d in run_prompts(ctx, runs, group):
        _take(run, d)
        c = acc.setdefault((run.rid, d.index), Choice(d.index))
        c.add(d)
        yield sse({"text": c.text, "output_ids": c.token_ids, "index": run.first_index + c.index,
                   "meta_info": _meta(ctx, req, run, c, d.finish_reason is not None, texts)})


async def _whole(ctx: ServerContext, req: p.GenerateRequest, runs: list[PromptRun],
                 group: str | None, single: bool) -> dict | list[dict]:
    acc: dict[str, dict[int, Choice]] = {run.rid: {} for run in runs}
    async for run, d in run_prompts(ctx, runs, group):
        _take(run, d)
        acc[run.rid].setdefault(d.index, Choice(d.index)).add(d)
    # (each run's own choices: sorting every choice once per run was quadratic in prompts)
    outs = [{"text": c.text, "output_ids": c.token_ids, "index": run.first_index + c.index,
             "meta_info": _meta(ctx, req, run, c, True)}
            for run in runs for _, c in sorted(acc[run.rid].items())]
    return outs[0] if single and len(outs) == 1 else outs


def _finish(c: Choice) -> dict[str, Any] | None:
    """SGLang's finish reason object (None while the choice runs)."""
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.stop_reason}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason is not None:
        return {"type": c.finish_reason, "message": f"the request was {c.finish_reason}ed"}
    return None


def _meta(ctx: ServerContext, req: p.GenerateRequest, run: PromptRun, c: Choice,
          finished: bool, texts: dict[int, str] | None = None) -> dict[str, Any]:
    out = {"id": run.rid, "finish_reason": _finish(c) if finished else None,
           "matched_stop": c.stop_reason if finished else None,
           "prompt_tokens": len(run.prompt_ids), "completion_tokens": len(c.token_ids),
           "cached_tokens": run.usage.cached_tokens if run.usage else c.cached_tokens}
    if not req.return_logprob:
        return out
    entry = _entries(ctx, req.return_text_in_logprobs, {} if texts is None else texts)
    start = max(req.logprob_start_len, 0)
    prompt_lps = run.prompt_logprobs[start:] if run.prompt_logprobs is not None else []
    out["input_token_logprobs"] = entry(prompt_lps, run.prompt_ids[start:])
    out["output_token_logprobs"] = entry(c.logprobs, c.token_ids)
    if req.top_logprobs_num:
        tops = run.prompt_top[start:] if run.prompt_top is not None else []
        out["input_top_logprobs"] = [None if t is None else entry(*_split(t)) for t in tops]
        out["output_top_logprobs"] = [entry(*_split(t)) for t in c.top]
    return out


def _split(top: list[tuple[int, float]]) -> tuple[list[float], list[int]]:
    return [lp for _, lp in top], [tid for tid, _ in top]


def _entries(ctx: ServerContext, with_text: bool, texts: dict[int, str]):
    """`[logprob, token_id, text or None]` for each pair (SGLang's layout); `texts` keeps the
    decoded tokens, so a stream decodes each once."""
    def text(tid: int) -> str:
        if tid not in texts:
            texts[tid] = ctx.tokenizer.decode([tid])
        return texts[tid]

    def entry(lps: list[float | None], ids: list[int]) -> list[list[Any]]:
        return [[lp, tid, text(tid) if with_text else None] for lp, tid in zip(lps, ids)]
    return entry
