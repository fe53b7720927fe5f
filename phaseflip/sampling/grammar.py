"""Grammar-constrained decoding: what a request may generate, as a token mask per step.

A `GrammarSpec` is the picklable description a request carries (in `SamplingParams`, across
the front end's ZeroMQ link); the engine process compiles it against its tokenizer with
xgrammar (compiled grammars cached by spec) and keeps one matcher per constrained sequence in a
`GrammarBook`. A grammar the book has not compiled yet compiles off the engine loop, on a
small thread pool (xgrammar releases the GIL while it compiles), after a trial run in a child
process that is killed past a budget or once no request waits (`grammar_worker`): its request
waits in the scheduler's queue, not admitted, until `GrammarBook.poll` finds the grammar ready
(or ends the request with the 400 the client would have got). Before a step's tokens are
chosen the book brings each matcher up to its request's `output_ids` (every accepted token,
whatever path appended it: n > 1 samples, a retracted request that re-prefills keeps its
output, so its matcher stays where it was) and fills the rows of an int32 bitmask
[rows, ceil(V / 32)];
`apply_bitmask` sets the logits of disallowed tokens to -inf in the sampler.

xgrammar is imported on first use only: requests without a grammar never load it (law 11);
torch too, as `GrammarSpec` travels through the front end, which does not load torch.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.grammar_worker import COMPILE_BUDGET_S, CompileCancelled, GrammarProbes
from phaseflip.sampling.surrogates import without_surrogates

if TYPE_CHECKING:
    import torch

GrammarKind = Literal["json_object", "json_schema", "regex", "ebnf"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "ebnf")
_COMPILED_CACHE = 256  # compiled grammars kept per engine (LRU)
MAX_GRAMMAR_CHARS = 65536
"""Longest grammar text (regex, EBNF, JSON schema as JSON) a request may give: xgrammar's
compile time grows faster than the text (on one CPU core, a 64 KiB regex of literals 1.9 s,
100 000 characters 9 s, a million minutes) and cannot be interrupted, so a few huge grammars
held every compile thread and stalled every other constrained request."""
COMPILE_THREADS = 2  # background compile threads per engine: a big schema delays no small one
_TRIAL_CACHE_BYTES = 256 * 2**20  # a trial child's xgrammar cache (the engine's is unbounded)
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `value`: the JSON schema as JSON text (json_schema), the
    regex, the EBNF grammar (root rule `root`), or "" (json_object: any JSON object).
    JSON is generated compactly (", " and ": " separators, no free whitespace): a model
    allowed free whitespace can fill its whole budget with it."""

    kind: GrammarKind
    value: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=False)
        return cls("json_schema", text)

    def check_shape(self, param: str = "response_format") -> None:
        """The checks that build nothing (a known kind, text): what the engine loop runs
        itself; building and compiling happen on the book's compile threads."""
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}", param)
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"the {self.kind} grammar must be given as text", param)
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"the {self.kind} is {len(self.value)} characters; this server compiles "
                f"grammars of at most {MAX_GRAMMAR_CHARS}", param)

    def check(self, param: str = "response_format", probes: GrammarProbes | None = None
              ) -> None:
        """Raises `InvalidRequestError` naming the problem if the grammar cannot be built
        (no tokenizer needed; cached, so a repeated spec costs a dict lookup). With `probes`
        (build-only ones), a grammar a client can make slow is built in a child first,
        within its budget (`GrammarTooComplexError` past it), and only then here."""
        self.check_shape(param)
        if probes is not None and self.kind != "json_object":
            problem = probes.problem(self, param=param)
            if problem is not None:
                raise InvalidRequestError(f"invalid {self.kind}: {problem}", param)
        problem = _grammar_problem(self)  # (fills the cache `SamplingParams.validate` reads)
        if problem is not None:
            raise InvalidRequestError(f"invalid {self.kind}: {problem}", param)


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(
            "structured output (response_format, tool_choice required/named, regex/ebnf/"
            "json_schema) needs xgrammar on the server: pip install 'phaseflip[structured]'",
            "response_format") from None
    return xgrammar


def _clean(e: Exception) -> str:
    text = str(e).strip()
    return _XGR_PREFIX.sub("", text).strip() or type(e).__name__


# xgrammar writes the characters of a length-limited JSON string (maxLength/minLength) as the
# class below, which lets control characters through: strict JSON parsers (json.loads,
# pydantic) refuse them, and a random-weight 8B model put them in half of all answers to a
# nested schema on the H200. They are swapped for a class without them.
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'  # no control characters (nor escapes, as before)


def _valid_utf8(grammar, text: str | None = None):
    """`grammar` matching no UTF-8 surrogate (xgrammar lets them through, `surrogates.py`),
    rebuilt from its printed form (or `text`, that form edited) when that changes it."""
    printed = str(grammar)
    fixed = without_surrogates(printed if text is None else text)
    return grammar if fixed == printed else _xgr().Grammar.from_ebnf(fixed, root_rule_name="root")


def _json_grammar(schema: str, strict_mode: bool):
    """The grammar of JSON matching `schema`, compact, with strings strict JSON accepts."""
    xgr = _xgr()
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                           strict_mode=strict_mode)
    return _valid_utf8(grammar, str(grammar).replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS))


def _build(spec: GrammarSpec):
    """The tokenizer-free `xgrammar.Grammar` of `spec` (raises on a bad one)."""
    xgr = _xgr()
    if spec.kind == "json_object":
        return _json_grammar('{"type": "object"}', strict_mode=False)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError("the schema must be a JSON object")
        return _json_grammar(spec.value, strict_mode=True)
    if spec.kind == "regex":
        return _valid_utf8(xgr.Grammar.from_regex(spec.value))
    return _valid_utf8(xgr.Grammar.from_ebnf(spec.value))


def problem_text(e: Exception) -> str:
    """What a failed build says to the client (no xgrammar: how to install it)."""
    return str(e) if isinstance(e, InvalidRequestError) else _clean(e)


def trial(spec: GrammarSpec, compiler) -> str | None:
    """What is wrong with `spec` (None: nothing): built, and compiled with `compiler` unless
    None (a trial child's work, `grammar_worker`; the check's, without a compiler). Raises
    `MemoryError` when an allocation failed: the memory's fault, not the text's, so not a
    problem to tell (or cache) as the grammar's; a trial child dies of it."""
    try:
        grammar = _build(spec)
        if compiler is not None:
            compiler.compile_grammar(grammar)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 — xgrammar raises RuntimeError/ValueError freely
        if isinstance(e, RuntimeError) and _clean(e) == "std::bad_alloc":  # (C++'s, as
            raise MemoryError(_clean(e)) from None  # xgrammar passes it on)
        return problem_text(e)
    return None


def trial_compiler(receive: Callable[[], str | None]):
    """A trial child's compiler: xgrammar imported first (seconds, while the parent reads
    its vocabulary), then built for the tokenizer `receive` gives (None: no compiler, the
    child only builds)."""
    xgr = _xgr()
    import torch

    torch.set_num_threads(1)
    tokenizer_json = receive()
    if tokenizer_json is None:
        return None
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
    return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_TRIAL_CACHE_BYTES)


@lru_cache(maxsize=_COMPILED_CACHE)
def _grammar_problem(spec: GrammarSpec) -> str | None:
    return trial(spec, None)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: logits[rows[j], t] = -inf wherever bit t of `bitmask[j]` is 0 (bit t is bit
    t % 32 of int32 word t // 32); `bitmask` on the logits' device, `logits` float32.

    On the CPU, xgrammar's kernel (B=64, V=128256: 37 ms against 139 ms for the unpacking
    below, one thread); elsewhere plain torch, a few device ops off any captured graph."""
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        full = bitmask  # xgrammar pairs bitmask row i with logits row i
        if rows != list(range(logits.shape[0])):
            full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
            full[rows] = bitmask
        _xgr().apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1],
                                           indices=rows)
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.long)
    if logits.device.type == "cuda":  # pinned: a pageable copy would wait for the stream
        index = index.pin_memory()
    index = index.to(logits.device, non_blocking=True)
    sub = logits.index_select(0, index)
    sub.masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, index, sub)


@dataclass(frozen=True)
class _Toolchain:
    compiler: Any  # xgrammar.GrammarCompiler
    tokenizer_json: str  # the same vocabulary, for the trial children


def _toolchain(tokenizer, vocab_size: int) -> _Toolchain:
    """xgrammar's compiler for `tokenizer` (in a compile thread: xgrammar's import and the
    vocabulary read take seconds for a large tokenizer; the tokenizer is only read, as the
    engine thread's detokenising reads it)."""
    xgr = _xgr()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return _Toolchain(xgr.GrammarCompiler(info, max_threads=1), info.serialize_json())


def _compile(toolchain: Future, probes: GrammarProbes, spec: GrammarSpec,
             cancelled: Callable[[], bool]):
    """The compiled grammar of `spec`, or `InvalidRequestError` naming the problem as
    `GrammarSpec.check` words it (runs in a compile thread). A grammar a client can make
    slow is tried in a child first, stopped there once `cancelled()` (`CompileCancelled`)
    or past the budget (`GrammarTooComplexError`), and compiled here only after it passed:
    in about the time the trial took (`grammar_worker` says why it is compiled twice)."""
    spec.check_shape()
    if spec.kind != "json_object":  # (json_object's grammar is fixed: no client makes it slow)
        try:
            problem = probes.problem(spec, cancelled)
        except (InvalidRequestError, CompileCancelled):
            raise
        except Exception as e:  # noqa: BLE001 — the toolchain's own failure, as below
            problem = problem_text(e)
        if problem is not None:
            raise InvalidRequestError(f"invalid {spec.kind}: {problem}", "response_format")
        if cancelled():
            raise CompileCancelled
    try:
        return toolchain.result().compiler.compile_grammar(_build(spec))
    except Exception as e:  # noqa: BLE001 — xgrammar raises RuntimeError/ValueError freely
        raise InvalidRequestError(f"invalid {spec.kind}: {problem_text(e)}",
                                  "response_format") from None


@dataclass
class _Job:
    """One spec's compile and who waits for it: stopped (its trial child killed) once every
    request that waited has finished, unless a `compiled` caller waits too."""

    future: Future | None = None
    waiters: list[weakref.ref] = field(default_factory=list)  # requests (appended first)
    pinned: bool = False  # a caller of `GrammarBook.compiled` waits

    def unwanted(self) -> bool:
        """(Read on the compile thread: a copy of the list, and each request's flag.)"""
        return not self.pinned and all((r := w()) is None or r.finished
                                       for w in list(self.waiters))


def _stop(pool: ThreadPoolExecutor, probes: GrammarProbes) -> None:
    """A book's end (closed or collected): its queued compiles cancelled, its children killed."""
    pool.shutdown(wait=False, cancel_futures=True)
    probes.close()


@dataclass
class _Track:
    matcher: Any  # xgrammar.GrammarMatcher
    accepted: int = 0  # how many of the request's output_ids the matcher has taken


class GrammarBook:
    """Compiles grammars for one tokenizer and tracks each constrained sequence's matcher.

    A cached grammar gives its request a matcher at once (`register`); a new one compiles on
    `COMPILE_THREADS` background threads, one compile per spec however many requests wait for
    it, and `poll` (the engine loop, each step) hands out the matchers. Everything but the
    compile threads' own work runs on the engine thread. Matchers and waiting requests are
    keyed weakly by request object: a finished request's go with it. A compile's trial
    (`grammar_worker`, one child process per compile thread) is killed past `budget_s` (the
    requests get a 400) or once all its requests have finished (aborted)."""

    def __init__(self, tokenizer, vocab_size: int, threads: int = COMPILE_THREADS,
                 budget_s: float = COMPILE_BUDGET_S) -> None:
        self.tokenizer, self.vocab_size, self.threads = tokenizer, vocab_size, threads
        self.budget_s = budget_s
        self._pool: ThreadPoolExecutor | None = None  # started by the first miss (law 11)
        self._probes: GrammarProbes | None = None  # the trial children, with the pool
        self._stop_pool: weakref.finalize | None = None
        self._toolchain: Future | None = None  # the xgrammar compiler, made in the pool
        self._compiled: dict[GrammarSpec, Any] = {}  # LRU: oldest first
        self._inflight: dict[GrammarSpec, _Job] = {}  # one compile per spec
        self._waiting: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # req -> spec
        self._tracks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.compiles = 0  # grammars compiled (cache misses), for tests and /server_info

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    @property
    def compiling(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._waiting)

    @property
    def trial_pids(self) -> list[int]:
        """The trial children's process ids (none before the first compile)."""
        return [] if self._probes is None else self._probes.pids

    def _hit(self, spec: GrammarSpec):
        hit = self._compiled.pop(spec, None)
        if hit is not None:
            self._compiled[spec] = hit
        return hit

    def _store(self, spec: GrammarSpec, compiled):
        self.compiles += 1
        if len(self._compiled) >= _COMPILED_CACHE:
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[spec] = compiled
        return compiled

    def _start_pool(self) -> ThreadPoolExecutor:
        pool = self._pool = ThreadPoolExecutor(self.threads,
                                               thread_name_prefix="phaseflip-grammar")
        toolchain = self._toolchain = pool.submit(_toolchain, self.tokenizer, self.vocab_size)
        self._probes = GrammarProbes(self.budget_s, self.threads,
                                     lambda: toolchain.result().tokenizer_json)
        self._stop_pool = weakref.finalize(self, _stop, pool, self._probes)
        return pool

    def _submit(self, spec: GrammarSpec, *reqs) -> _Job:
        """The compile of `spec`, started unless one is in flight already; `reqs` wait for
        it (none: a `compiled` caller, whose wait is never stopped)."""
        job = self._inflight.get(spec)
        fresh = job is None
        if fresh:
            job = self._inflight[spec] = _Job()
        job.pinned |= not reqs
        job.waiters += map(weakref.ref, reqs)  # (before it starts: it stops once none waits)
        if fresh:
            pool = self._pool or self._start_pool()
            job.future = pool.submit(_compile, self._toolchain, self._probes, spec, job.unwanted)
        return job

    def compiled(self, spec: GrammarSpec):
        """The compiled grammar of `spec`, waited for: for callers off the engine loop
        (tests, warm-ups); the loop uses `register` and `poll`, which never wait."""
        hit = self._hit(spec)
        if hit is not None:
            return hit
        job = self._submit(spec)
        try:
            result = job.future.result()
        finally:
            if self._inflight.get(spec) is job:
                del self._inflight[spec]
        return self._store(spec, result)

    def register(self, req) -> bool:
        """Gives `req` (a scheduler `Req` whose params may carry a grammar) its matcher if its
        grammar is compiled (True; the EOS ids of the request end the grammar). Else starts
        the compile off the loop, marks `req.compiling` (the scheduler leaves it waiting) and
        returns False: `poll` gives it its matcher, or reports its error, later."""
        spec = req.params.grammar
        if spec is None:
            return True
        hit = self._hit(spec)
        if hit is not None:
            self._track(req, hit)
            return True
        self._submit(spec, req)
        self._waiting[req] = spec
        req.compiling = True
        return False

    def _track(self, req, compiled) -> None:
        matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=list(req.eos_ids) or None)
        self._tracks[req] = _Track(matcher)

    def poll(self, wait_s: float = 0.0) -> list[tuple[Any, InvalidRequestError]]:
        """Gives the requests whose grammar compiled their matchers and clears their
        `compiling` (the scheduler may admit them now); returns the waiting requests whose
        grammar failed, with the error their client gets. `wait_s`: how long to wait for a
        compile to end first (an engine with nothing else to do would spin otherwise)."""
        if not self._waiting and not self._inflight:
            return []
        if wait_s > 0 and self._inflight:
            wait([job.future for job in self._inflight.values()], wait_s, FIRST_COMPLETED)
        ready, failed = self._collect()
        out, lost = [], {}
        for req, spec in list(self._waiting.items()):
            if req.finished:  # aborted while its grammar compiled
                del self._waiting[req]
            elif spec in failed:
                del self._waiting[req]
                out.append((req, failed[spec]))
            elif (hit := ready.get(spec) or self._hit(spec)) is not None:
                del self._waiting[req]
                self._track(req, hit)
                req.compiling = False
            elif spec not in self._inflight:  # (evicted before it got it, or stopped)
                lost.setdefault(spec, []).append(req)
        for spec, reqs in lost.items():
            self._submit(spec, *reqs)
        return out

    def _collect(self) -> tuple[dict, dict[GrammarSpec, InvalidRequestError]]:
        """The compiles that ended since the last poll: (compiled by spec, errors by spec);
        a stopped one (no request waited) is dropped."""
        ready, failed = {}, {}
        for spec, job in list(self._inflight.items()):
            if not job.future.done():
                continue
            del self._inflight[spec]
            try:
                ready[spec] = self._store(spec, job.future.result())
            except InvalidRequestError as e:
                failed[spec] = e
            except CompileCancelled:
                pass
        return ready, failed

    def close(self) -> None:
        """Stops the compile threads without waiting for them and kills the trial children:
        queued compiles are cancelled, a trial ends at once; a compile already past its trial
        (xgrammar cannot be interrupted) ends on its own, unread."""
        if self._stop_pool is not None:
            self._stop_pool()
        self._inflight.clear()
        self._waiting.clear()

    def tracked(self, req) -> bool:
        return req in self._tracks

    def _sync(self, req, track: _Track) -> None:
        """Feeds the matcher the output tokens it has not seen (rolls back if the output was
        cut). A token the grammar refuses means the mask was not applied: stop loudly."""
        out = req.output_ids
        if track.accepted > len(out):
            track.matcher.rollback(track.accepted - len(out))
            track.accepted = len(out)
        for tok in out[track.accepted:]:
            if not track.matcher.accept_token(tok):
                raise RuntimeError(f"request {req.rid}: token {tok} breaks its grammar "
                                   f"(after {track.accepted} accepted tokens)")
            track.accepted += 1

    def masks(self, reqs: list) -> tuple[list[int], torch.Tensor] | None:
        """(rows of `reqs` that are constrained, their bitmask [len(rows), words] on the
        host), or None when none is. A terminated matcher allows only the stop tokens."""
        if not self._tracks:  # no constrained request in the engine: nothing to look up
            return None
        import torch

        rows = [i for i, r in enumerate(reqs) if r in self._tracks]
        if not rows:
            return None
        bitmask = torch.empty((len(rows), self.words), dtype=torch.int32)
        for j, i in enumerate(rows):
            track = self._tracks[reqs[i]]
            self._sync(reqs[i], track)
            if track.matcher.is_terminated():
                bitmask[j].zero_()
                for t in reqs[i].eos_ids:
                    bit = 1 << (t % 32)
                    bitmask[j, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
                continue
            track.matcher.fill_next_token_bitmask(bitmask, j)
        return rows, bitmask
