"""`/v1/completions` and `/v1/chat/completions`: prompts in, OpenAI-shaped answers out.

Each prompt (and each of its n samples, which the engine runs as one group sharing the
prompt's KV) becomes engine deltas; this module only reshapes them — as one JSON body, or as
server-sent events ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from phaseflip.engine.outputs import StreamDelta
from phaseflip.errors import InvalidRequestError, PhaseflipError
from phaseflip.sampling.params import SamplingParams
from phaseflip.server import protocol as p
from phaseflip.server import tools
from phaseflip.server.context import ServerContext
from phaseflip.server.sse import TextFrames, arguments_only, sse
from phaseflip.server.token_text import OffsetCursor, SpecialStripper


@dataclass
class Choice:
    """Accumulated output of one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0  # from the first delta, until the usage comes

    def add(self, d: StreamDelta) -> None:
        if d.cached_tokens is not None:
            self.cached_tokens = d.cached_tokens
        text, self.text = self.text, ""  # grown in place (see `IncrementalDetokenizer._append`)
        text += d.text
        self.text = text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.top += d.top_logprobs or []
        self.finish_reason, self.stop_reason = d.finish_reason, d.matched_stop


@dataclass
class PromptRun:
    """One prompt's engine request and what came back."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    first_index: int  # choice index of sample 0
    prompt_text: str | None = None  # the prompt as sent, if as text (what `echo` repeats)
    usage: object = None
    prompt_logprobs: list | None = None
    prompt_top: list | None = None


async def run_prompts(ctx: ServerContext, runs: list[PromptRun], group: str | None = None
                      ) -> AsyncIterator[tuple[PromptRun, StreamDelta]]:
    """Runs every prompt concurrently and yields (run, delta) as deltas arrive; `group` names
    them all for `/abort_request` while they run (a request of several prompts)."""
    queue: asyncio.Queue = asyncio.Queue()
    groups, members = ctx.engine.state.groups, [r.rid for r in runs]
    if group is not None:
        groups[group] = members

    async def pump(run: PromptRun) -> None:
        try:
            async for d in ctx.run(run.rid, run.prompt_ids, run.params):
                await queue.put((run, d))
        except Exception as e:  # noqa: BLE001 — handed to the consumer, which re-raises
            await queue.put((run, e))
        finally:
            await queue.put((run, None))

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        open_runs = len(runs)
        while open_runs:
            run, item = await queue.get()
            if item is None:
                open_runs -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield run, item
    finally:
        # before any await: a stream whose client left is cancelled again at each await
        # (the anyio cancel scope Starlette streams in), so nothing after one may run
        if group is not None and groups.get(group) is members:  # (never another's)
            del groups[group]
        await stop_pumps(tasks)


async def stop_pumps(tasks: list[asyncio.Task]) -> None:
    """Cancels the prompts' pumps (client gone or error), which aborts their engine requests,
    and waits for them; shielded, so that a consumer cancelled again while it waits cannot
    cancel a pump a second time, in the middle of sending its abort."""
    for t in tasks:
        t.cancel()
    await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


async def until_disconnected(request: Request, work: asyncio.Task) -> bool:
    """Cancels `work` (and so aborts its engine requests) when the client goes away."""
    while not work.done():
        if await request.is_disconnected():
            work.cancel()
            return True
        await asyncio.sleep(0.1)
    return False


CLIENT_CLOSED = 499
"""The status logged for a request whose client left before the answer (nginx's code)."""


async def respond(request: Request, make_body) -> Response:
    """Awaits a non-streaming body, aborting the work if the client disconnects first."""
    work = asyncio.create_task(make_body())
    watcher = asyncio.create_task(until_disconnected(request, work))
    try:
        return JSONResponse(await work)
    except asyncio.CancelledError:
        if watcher.done() and watcher.result():  # nobody is left to read an answer
            return Response(status_code=CLIENT_CLOSED)
        raise
    finally:
        watcher.cancel()


def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for ev in events:
                yield ev
        except PhaseflipError as e:
            kind = "invalid_request_error" if isinstance(e, InvalidRequestError) else (
                "server_error")
            yield sse(p.error_body(str(e), kind, getattr(e, "param", None)))
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def check_grammar(ctx: ServerContext, params: SamplingParams, param: str) -> None:
    """A 400 naming the problem if the request's grammar cannot be built. In the pool: the
    first check loads xgrammar (and torch, ~seconds), which must not stall the event loop;
    the result is cached, so `SamplingParams.validate` repeats it for free. Built in a child
    first (`ctx.grammar_probes`): one that takes minutes is a 400 at the budget."""
    if params.grammar is not None:
        await ctx.in_pool(params.grammar.check, param, ctx.grammar_probes)


def usage_of(runs: list[PromptRun]) -> p.UsageInfo:
    prompt = sum(r.usage.prompt_tokens for r in runs if r.usage)
    completion = sum(r.usage.completion_tokens for r in runs if r.usage)
    cached = sum(r.usage.cached_tokens for r in runs if r.usage)
    return p.UsageInfo.from_counts(prompt, completion, cached)


# ------------------------------------------------------------------ completions
_COMPLETION_NAMES = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}
"""`SamplingParams` fields by the names a completions request gives them (the logprobs
count is `logprobs` in both)."""


def hides_stop_token(params: SamplingParams, finish_reason: str | None,
                     matched_stop: int | str | None) -> bool:
    """Whether the last token is a stop token (EOS, stop_token_ids) left out of the text."""
    return (finish_reason == "stop" and isinstance(matched_stop, int)
            and not params.include_stop_str_in_output)


def reported_stop(params: SamplingParams, matched_stop: int | str | None) -> int | str | None:
    """`stop_reason` as vLLM reports it: the stop string or `stop_token_ids` entry that ended
    the choice, null for any other end (the end-of-sequence token included)."""
    if isinstance(matched_stop, int) and matched_stop not in params.stop_token_ids:
        return None
    return matched_stop


def echo_text(ctx: ServerContext, run: PromptRun) -> str:
    """The prompt as `echo` repeats it: as sent when it was text (as vLLM's; its decoded ids
    would add what the tokenizer added, a BOS token's "<s>"), else its ids decoded."""
    return run.prompt_text if run.prompt_text is not None else ctx.tokenizer.decode(
        run.prompt_ids)


def completion_logprobs(ctx: ServerContext, cursor: OffsetCursor, ids: list[int],
                        lps: list[float | None], tops: list, n_prompt: int,
                        params: SamplingParams, last_hidden: bool,
                        prompt_text: str | None = None) -> p.CompletionLogprobs:
    """Logprobs of `ids`: the first `n_prompt` of them echoed prompt tokens, whose text keeps
    special tokens (of a prompt sent as `prompt_text`, those its text spells there: not a BOS
    the tokenizer added); the rest generated, whose text skips them with
    `skip_special_tokens`, and whose last is not in the text at all when `last_hidden` (a
    stop token)."""
    tokens, offsets, tt = [], [], ctx.token_text
    special = tt.special
    for i, t in enumerate(ids):
        generated = i >= n_prompt
        if not generated:
            in_text = prompt_text is None or t not in special or prompt_text.startswith(
                tt.spell(t), cursor.chars)
        else:
            in_text = not (params.skip_special_tokens and t in special
                           or last_hidden and i == len(ids) - 1)
        token, offset = cursor.add(t, in_text)
        tokens.append(token)
        offsets.append(offset)
    spell, top = ctx.token_text.spell, []
    for t, tok, lp in zip(tops, ids, lps):
        if t is not None:  # OpenAI's: the chosen token's logprob too, so up to logprobs + 1
            t = {spell(i): v for i, v in t}
            if lp is not None:
                t.setdefault(spell(tok), lp)
        top.append(t)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=top,
                                text_offset=offsets)


async def create_completion(req: p.CompletionRequest, request: Request,
                            ctx: ServerContext):
    created = int(time.time())  # the one timestamp of the answer, every chunk's
    ctx.check_model(req.model)
    feature = p.unsupported(req)
    if feature:
        raise InvalidRequestError(f"{feature} is not supported", feature)
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise InvalidRequestError("best_of > n cannot be streamed", "best_of")
    width = req.best_of if req.best_of and req.best_of > req.n else req.n
    single = isinstance(req.prompt, str) or isinstance(req.prompt[0], int)
    ctx.check_width((1 if single else len(req.prompt)) * width)  # (before tokenising them)
    prompts = await _completion_prompts(ctx, req.prompt)
    base = ctx.new_id("cmpl")
    runs = []
    texts = ([req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
             if isinstance(req.prompt[0], str) else [None] * len(prompts))  # (None: ids)
    for i, ids in enumerate(prompts):
        params = p.completion_sampling_params(req, ctx.default_max_tokens(len(ids)))
        await check_grammar(ctx, params, "response_format")
        ctx.validate(ids, params, _COMPLETION_NAMES)
        runs.append(PromptRun(f"{base}-{i}", ids, params, i * req.n, texts[i]))
    ctx.admit([r.params for r in runs])
    if req.stream:
        return stream_response(_stream_completion(ctx, req, base, created, runs))
    return await respond(request, lambda: _complete(ctx, req, base, created, runs, width))


async def _completion_prompts(ctx: ServerContext, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await ctx.encode(prompt)]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    if prompt and isinstance(prompt[0], str):
        return await ctx.encode_all(prompt, "prompt")
    return [list(x) for x in prompt]


def best_of(choices: list[Choice], n: int) -> list[Choice]:
    """The `n` choices of highest logprob per token, OpenAI's `best_of` rule (a sum would
    favour whichever choice stopped soonest)."""
    return sorted(choices, key=lambda c: -sum(c.logprobs) / max(len(c.logprobs), 1))[:n]


async def _complete(ctx, req: p.CompletionRequest, base: str, created: int,
                    runs: list[PromptRun], width: int) -> dict:
    choices = {r.rid: [Choice(j) for j in range(width)] for r in runs}
    async for run, d in run_prompts(ctx, runs, base):
        choices[run.rid][d.index].add(d)
        if d.prompt_logprobs is not None:
            run.prompt_logprobs, run.prompt_top = d.prompt_logprobs, d.prompt_top_logprobs
        if d.usage is not None:
            run.usage = d.usage
    out = []
    for run in runs:
        cs = choices[run.rid]
        if width > req.n:
            cs = best_of(cs, req.n)
        prompt_text = echo_text(ctx, run) if req.echo else ""
        for j, c in enumerate(cs):
            lp = None
            if req.logprobs is not None:
                ids, lps, tops = list(c.token_ids), list(c.logprobs), list(c.top)
                if req.echo:
                    ids = run.prompt_ids + ids
                    lps = list(run.prompt_logprobs or [None] * len(run.prompt_ids)) + lps
                    tops = list(run.prompt_top or [None] * len(run.prompt_ids)) + tops
                lp = completion_logprobs(
                    ctx, OffsetCursor(ctx.token_text), ids, lps, tops,
                    len(run.prompt_ids) if req.echo else 0, run.params,
                    hides_stop_token(run.params, c.finish_reason, c.stop_reason),
                    run.prompt_text)
            out.append(p.CompletionChoice(
                index=run.first_index + j, text=prompt_text + c.text, logprobs=lp,
                finish_reason=c.finish_reason, stop_reason=reported_stop(run.params,
                                                                         c.stop_reason)))
    return p.CompletionResponse(id=base, created=created, model=ctx.model_name, choices=out,
                                usage=usage_of(runs)).model_dump()


async def _stream_completion(ctx, req: p.CompletionRequest, base: str, created: int,
                             runs: list[PromptRun]) -> AsyncIterator[str]:
    """The chunks of a streamed completion. With `echo` and `logprobs` every choice's first
    chunk carries the prompt's tokens and logprobs, which the engine sends once, with choice
    0: a later choice's chunks that come first wait for them."""
    echoed: set[tuple[str, int]] = set()
    cursors: dict[tuple[str, int], OffsetCursor] = {}
    held: dict[str, list[StreamDelta]] = {}  # per prompt: deltas awaiting its logprobs

    text_only = TextFrames(lambda index, text: p.CompletionStreamResponse(
        id=base, created=created, model=ctx.model_name,
        choices=[p.CompletionChoice(index=index, text=text)]))

    def chunk(run: PromptRun, d: StreamDelta) -> str:
        text, lp = d.text, None
        key = (run.rid, d.index)
        first = req.echo and key not in echoed
        if first:
            echoed.add(key)
            text = echo_text(ctx, run) + text
        elif req.logprobs is None and d.finish_reason is None:
            return text_only(run.first_index + d.index, text)
        if req.logprobs is not None:
            ids, lps, tops = list(d.token_ids), list(d.logprobs or []), list(d.top_logprobs or [])
            n_prompt = 0
            if first:
                ids, n_prompt = run.prompt_ids + ids, len(run.prompt_ids)
                lps = list(run.prompt_logprobs or [None] * n_prompt) + lps
                tops = list(run.prompt_top or [None] * n_prompt) + tops
            cursor = cursors.setdefault(key, OffsetCursor(ctx.token_text))
            lp = completion_logprobs(ctx, cursor, ids, lps, tops, n_prompt, run.params,
                                     hides_stop_token(run.params, d.finish_reason,
                                                      d.matched_stop), run.prompt_text)
        choice = p.CompletionChoice(index=run.first_index + d.index, text=text, logprobs=lp,
                                    finish_reason=d.finish_reason,
                                    stop_reason=reported_stop(run.params, d.matched_stop)
                                    if d.finish_reason else None)
        return sse(p.CompletionStreamResponse(id=base, created=created, model=ctx.model_name,
                                              choices=[choice]))

    scored = req.echo and req.logprobs is not None
    async for run, d in run_prompts(ctx, runs, base):
        if d.usage is not None:
            run.usage = d.usage
        if d.prompt_logprobs is not None:
            run.prompt_logprobs, run.prompt_top = d.prompt_logprobs, d.prompt_top_logprobs
        if scored and run.prompt_logprobs is None and d.prompt_logprobs is None:
            held.setdefault(run.rid, []).append(d)
            continue
        yield chunk(run, d)
        for waiting in held.pop(run.rid, []):
            yield chunk(run, waiting)
    for run in runs:  # (not expected: choice 0's last delta brings them; nothing is dropped)
        for waiting in held.pop(run.rid, []):
            yield chunk(run, waiting)
    if req.include_usage:
        yield sse(p.CompletionStreamResponse(id=base, created=created, model=ctx.model_name,
                                             choices=[], usage=usage_of(runs)))


# ------------------------------------------------------------------ chat
def template_options(add_generation_prompt: bool, template_kwargs: dict) -> dict:
    """`apply_chat_template`'s keyword arguments. `chat_template_kwargs` may set the renderer's
    own options (`add_generation_prompt`, `continue_final_message`), as vLLM lets it: passed
    beside the request's they were a TypeError (400). `tokenize` stays False: we tokenise."""
    options = {"add_generation_prompt": add_generation_prompt, **template_kwargs,
               "tokenize": False}
    if options["add_generation_prompt"] and options.get("continue_final_message"):
        raise InvalidRequestError(
            "continue_final_message continues the last message, add_generation_prompt opens "
            "a new one: set add_generation_prompt to false", "continue_final_message")
    return options


async def chat_ids(ctx: ServerContext, messages: list[dict], add_generation_prompt: bool,
                   template_kwargs: dict) -> list[int]:
    """The chat template rendered and tokenised, in the tokenizer pool (both take seconds on
    a long conversation); refused early when the messages alone exceed the context."""
    ctx.check_text_length(sum(len(m["content"]) for m in messages), "messages")

    options = template_options(add_generation_prompt, template_kwargs)

    def render() -> str:
        return ctx.tokenizer.apply_chat_template(messages, **options)

    try:
        text = await ctx.in_pool(render)
    except Exception as e:  # noqa: BLE001 — a template error is the request's fault
        raise InvalidRequestError(f"the chat template failed: {e}", "messages") from None
    return await ctx.encode(text, "messages", add_special_tokens=False)


def chat_logprobs(ctx: ServerContext, ids: list[int], lps: list[float],
                  tops: list) -> p.ChatChoiceLogprobs:
    tt, content = ctx.token_text, []
    for t, lp, top in zip(ids, lps, tops):
        content.append(p.ChatTokenLogprob(
            token=tt.spell(t), logprob=lp, bytes=list(tt.bytes_of(t)),
            top_logprobs=[p.ChatTopLogprob(token=tt.spell(i), logprob=v,
                                           bytes=list(tt.bytes_of(i))) for i, v in top]))
    return p.ChatChoiceLogprobs(content=content)


async def create_chat_completion(req: p.ChatCompletionRequest, request: Request,
                                 ctx: ServerContext):
    created = int(time.time())  # the one timestamp of the answer, every chunk's
    ctx.check_model(req.model)
    run, plan = await prepare_chat(ctx, req, ctx.new_id("chatcmpl"), {
        "min_new_tokens": "min_tokens", "logprobs": "top_logprobs", "max_new_tokens": (
            "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens")})
    if req.stream:
        return stream_response(_stream_chat(ctx, req, run, plan, created))
    return await respond(request, lambda: _chat(ctx, req, run, plan, created))


async def chat_prompt(ctx: ServerContext, req: p.ChatCompletionRequest
                      ) -> tuple[list[int], tools.ToolPlan | None]:
    """A chat request's prompt ids and its tool plan: the tools planned, the template rendered
    (with the tools, unless tool_choice is none) and tokenised; what /tokenize counts too."""
    plan = tools.plan_tools(req)
    template = ctx.tokenizer.chat_template
    messages, tool_kwargs = tools.template_messages(
        req, plan, template if isinstance(template, str) else str(template or ""))
    effort = {} if req.reasoning_effort is None else {"reasoning_effort": req.reasoning_effort}
    ids = await chat_ids(ctx, messages, req.add_generation_prompt,
                         {**effort, **req.template_kwargs, **tool_kwargs})
    return ids, plan


async def prepare_chat(ctx: ServerContext, req: p.ChatCompletionRequest, rid: str,
                       names: dict[str, str]) -> tuple[PromptRun, tools.ToolPlan | None]:
    """A chat request made the admitted engine run `rid`: its tools planned, its template
    rendered and tokenised, its sampling checked (`names`: `ServerContext.validate`'s)."""
    feature = p.unsupported(req)
    if feature:
        raise InvalidRequestError(f"{feature} is not supported yet", feature)
    ids, plan = await chat_prompt(ctx, req)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = ctx.required_max_tokens(len(ids), "messages")
    params = p.chat_sampling_params(req, max_tokens)
    if plan is not None and plan.grammar is not None:
        params = replace(params, grammar=plan.grammar)
    if params.skip_special_tokens and tools.keep_specials(plan, ctx.token_text):
        params = replace(params, skip_special_tokens=False)  # (the plan skips them after)
        plan = replace(plan, specials=ctx.token_text)
    await check_grammar(ctx, params, "tools" if plan and plan.grammar else "response_format")
    ctx.validate(ids, params, names)
    ctx.admit([params])
    return PromptRun(rid, ids, params, 0), plan


def parser_delta(stripper: SpecialStripper | None, d: StreamDelta) -> StreamDelta:
    """`d` with the text the tool parser reads (`ToolPlan.stripper`: one per choice, since a
    special's spelling may span deltas)."""
    if stripper is None:
        return d
    text = stripper.feed(d.text, d.token_ids, d.finish_reason is not None)
    return d if text == d.text else replace(d, text=text)


def strippers(plan: tools.ToolPlan | None, n: int) -> list[SpecialStripper | None]:
    """Each choice's `ToolPlan.stripper`."""
    return [plan.stripper() if plan is not None else None for _ in range(n)]


def _chat_message(plan: tools.ToolPlan | None,
                  c: Choice) -> tuple[p.ChatResponseMessage, str | None]:
    """The assistant message of a finished choice and its finish reason
    (`ToolPlan.finish_reason`)."""
    if plan is None:
        return p.ChatResponseMessage(content=c.text), c.finish_reason
    content, calls = tools.parse_output(plan, c.text)
    if not calls:
        return p.ChatResponseMessage(content=content), c.finish_reason
    return (p.ChatResponseMessage(content=content, tool_calls=tools.tool_calls(calls)),
            plan.finish_reason(c.finish_reason, True, c.text))


async def _chat(ctx, req: p.ChatCompletionRequest, run: PromptRun,
                plan: tools.ToolPlan | None, created: int) -> dict:
    choices, parse = [Choice(j) for j in range(req.n)], strippers(plan, req.n)
    async for _, d in run_prompts(ctx, [run]):
        choices[d.index].add(parser_delta(parse[d.index], d))
        if d.usage is not None:
            run.usage = d.usage
    out = []
    for c in choices:
        message, reason = _chat_message(plan, c)
        out.append(p.ChatCompletionChoice(
            index=c.index, message=message, finish_reason=reason,
            stop_reason=reported_stop(run.params, c.stop_reason),
            logprobs=chat_logprobs(ctx, c.token_ids, c.logprobs, c.top) if req.logprobs
            else None))
    return p.ChatCompletionResponse(id=run.rid, created=created, model=ctx.model_name,
                                    choices=out, usage=usage_of([run])).model_dump()


async def _stream_chat(ctx, req: p.ChatCompletionRequest, run: PromptRun,
                       plan: tools.ToolPlan | None, created: int) -> AsyncIterator[str]:
    def chunk(choices: list, usage=None) -> str:
        return sse(p.ChatCompletionStreamResponse(id=run.rid, created=created,
                                                  model=ctx.model_name, choices=choices,
                                                  usage=usage))

    text_only = TextFrames(lambda index, text: p.ChatCompletionStreamResponse(
        id=run.rid, created=created, model=ctx.model_name,
        choices=[p.ChatCompletionStreamChoice(index=index, delta=p.DeltaMessage(content=text))]))
    fragment = TextFrames(lambda key, text: p.ChatCompletionStreamResponse(
        id=run.rid, created=created, model=ctx.model_name,
        choices=[p.ChatCompletionStreamChoice(index=key[0], delta=p.DeltaMessage(
            tool_calls=[p.DeltaToolCall(index=key[1],
                                        function=p.DeltaFunctionCall(arguments=text))]))]))

    streamers = [tools.ToolStreamer(plan) for _ in range(req.n)] if plan is not None else None
    parse = strippers(plan, req.n)

    for j in range(req.n):
        yield chunk([p.ChatCompletionStreamChoice(
            index=j, delta=p.DeltaMessage(role="assistant", content=""))])
    async for _, d in run_prompts(ctx, [run]):
        d = parser_delta(parse[d.index], d)
        if d.usage is not None:
            run.usage = d.usage
        lp = None
        if req.logprobs and d.token_ids:
            lp = chat_logprobs(ctx, d.token_ids, d.logprobs or [], d.top_logprobs or [])
        content, calls, reason = d.text or None, None, d.finish_reason
        if streamers is not None:
            streamer = streamers[d.index]
            content, calls = streamer.feed(d.text, d.finish_reason is not None)
            calls = calls or None
            reason = plan.finish_reason(reason, bool(streamer.calls), streamer.text)
        plain = lp is None and not reason
        if content and not calls and plain:
            yield text_only(d.index, content)
        elif (plain and not content and calls and len(calls) == 1
              and (args := arguments_only(calls[0])) is not None):
            yield fragment((d.index, calls[0].index), args)
        elif content or calls or lp is not None or reason:
            yield chunk([p.ChatCompletionStreamChoice(
                index=d.index, delta=p.DeltaMessage(content=content, tool_calls=calls),
                logprobs=lp, finish_reason=reason,
                stop_reason=reported_stop(run.params, d.matched_stop) if reason else None)])
    if req.include_usage:
        yield chunk([], usage_of([run]))
