"""Engine configuration: one frozen dataclass of frozen sections; CLI flags are generated from
their fields' docstrings."""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from phaseflip.errors import InvalidRequestError

EMBEDDED_MODEL = Path(__file__).parent / "assets" / "tiny-llama"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_LAYOUT = re.compile(r"(?:tp(?P<tp>\d+))?(?:[x×*]?pp(?P<pp>\d+))?")


def parse_layout(text: str) -> tuple[int, int]:
    """`tp2` → (2, 1), `pp4` → (1, 4), `tp2xpp2` → (2, 2); ValueError otherwise."""
    m = _LAYOUT.fullmatch(text.strip().lower())
    if m is None or not (m["tp"] or m["pp"]):
        raise ValueError(f"{text!r} is not a layout: expected tpN, ppN or tpAxppB")
    return int(m["tp"] or 1), int(m["pp"] or 1)


# enumerated fields and their values, in the order the error lists them (the CLI's choices)
CHOICES: dict[str, tuple] = {
    "attention_backend": ("torch", "triton", "auto"),
    "load_format": ("auto", "dummy"),
    "dtype": ("float32", "float16", "bfloat16", "auto"),
    "quantization": ("fp8", None),
    "kv_cache_dtype": ("auto", "fp8_e4m3"),
    "schedule_policy": ("fcfs", "lpm", "lof"),
    "dist_backend": ("gloo", "nccl", "auto"),
    "all_reduce": ("nccl", "symm-mem", "auto"),
    "hicache_write_policy": ("write_through", "write_back"),
    "flip_weights": ("auto", "resident", "peer", "host-image", "reload"),
    "flip_policy": ("manual", "auto"),
    "log_level": LOG_LEVELS,
}
# counts that must be at least 1 (None: unset, where the field allows it)
_AT_LEAST_ONE = ("page_size", "max_running_requests", "max_total_tokens", "cuda_graph_max_bs",
                 "max_prefill_tokens", "pp_min_micro_batch_tokens", "hicache_disk_queue_pages",
                 "cpu_threads", "all_reduce_max_kib", "max_model_len", "stream_interval")
# counts where 0 means none (or off), and what the error adds
_AT_LEAST_ZERO = {"piecewise_graph_max_tokens": " (0 turns them off)", "max_logprobs": "",
                  "flip_min_dwell_steps": ""}
# set in the environment, --max-model-len may exceed the model's positions (as vLLM's
# VLLM_ALLOW_LONG_MAX_MODEL_LEN): positions it was never trained on, at the user's risk
ALLOW_LONG_MAX_MODEL_LEN_ENV = "PHASEFLIP_ALLOW_LONG_MAX_MODEL_LEN"


def _either(choices: list) -> str:
    return ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}" if len(choices) > 1 else (
        str(choices[0]))


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights and the tokenizer come from."""

    revision: str | None = None
    """With --model ORG/NAME: the branch, tag or commit in the local cache (default: main)."""
    tokenizer: str | None = None
    """Tokenizer directory or ORG/NAME, if not the model's own."""
    chat_template: str | None = None
    """Chat template (a Jinja file, or the template itself) in place of the tokenizer's."""
    trust_remote_code: bool = False
    """Accepted for compatibility: phaseflip runs its own implementation of each supported
    architecture, never a checkpoint's code; a model that needs its own code is refused."""
    load_format: str = "auto"
    """auto (the checkpoint's safetensors) or dummy (random weights made on the device)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """What runs in each step: batch limits, chunking and the queue order."""

    max_running_requests: int = 256
    """Most requests decoding at once."""
    max_model_len: int | None = None
    """Context limit (prompt + output); default the model's max_position_embeddings."""
    chunked_prefill_size: int = 8192
    """Most prompt tokens prefilled per step (a longer prompt is cut into chunks; the step's
    budget is the smaller of this and --max-prefill-tokens); 0 or -1 turns chunking off."""
    max_prefill_tokens: int = 16384
    """Most prefill tokens in one step across requests (a request alone may exceed it)."""
    schedule_policy: str = "fcfs"
    """fcfs; lpm (longest cached prefix first); or lof (longest remaining output first: a
    batch's longest requests start first, so its last step comes sooner; under steady load a
    short request may wait behind longer ones)."""


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its size on the device, the prefix cache and the HiCache host/disk tiers."""

    max_total_tokens: int | None = None
    """KV pool size in tokens. Default: 16384 on CPU, from --mem-fraction on GPU."""
    mem_fraction: float = 0.85
    """Fraction of the GPU's memory that weights plus KV pool may take."""
    page_size: int = 1
    """Tokens per KV page; prefix-cache matches are page aligned."""
    enable_prefix_cache: bool = True
    """Reuse KV of cached prompt prefixes (radix tree)."""
    enable_hicache: bool = False
    """Keep KV pages in a host-memory tier (and a disk tier with --hicache-dir) so prefixes
    outlive device eviction, cache flushes and restarts."""
    hicache_host_gb: float = 1.0
    """Host-memory tier size in GiB."""
    hicache_dir: str | None = None
    """Directory of the disk tier (none: host tier only)."""
    hicache_disk_gb: float = 16.0
    """Disk tier size in GiB."""
    hicache_page_size: int = 64
    """Tokens per HiCache page (a multiple of --page-size)."""
    hicache_write_policy: str = "write_through"
    """write_through (store pages as soon as they are computed) or write_back (store them
    when the device cache evicts them)."""
    hicache_disk_queue_pages: int = 64
    """Most pages waiting for the disk writer thread; a page stored while the queue is full
    skips the disk tier (counted as disk_writes_dropped) instead of stalling the engine."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks are laid out and reach each other: the part a phase flip replaces."""

    tp_size: int = 1
    """Tensor-parallel ranks (each holds a slice of every layer)."""
    pp_size: int = 1
    """Pipeline-parallel stages (each holds a contiguous range of layers)."""
    pp_min_micro_batch_tokens: int = 1024
    """With --pp-size > 1, a step with prompt tokens is cut into about T / this many
    micro-batches (at least pp_size, at most 4 * pp_size; one long prompt is cut too), so the
    pipeline bubble (p-1)/(m+p-1) shrinks while each micro-batch stays large enough for
    efficient matmuls; once rank 0 has timed its own parts, into the count its measured
    stage time says is fastest. Decode-only steps always use pp_size micro-batches."""
    pp_async_decode: bool = False
    """With --pp-size > 1 and overlap scheduling (on NCCL unmeasured on GPUs): the running
    requests decode in pp_size groups, each its own step, kept in flight across steps so
    every stage works on another group's step (no bubble at the end of a step); a group's
    next step starts as soon as its tokens are sampled. Decode steps run whole, not cut."""
    dist_backend: str = "auto"
    """torch.distributed backend: gloo, nccl, or auto (nccl when every rank has its own GPU)."""
    all_reduce: str = "nccl"
    """The TP all-reduce: nccl (the process group: NCCL, or gloo staged through the host),
    symm-mem (PyTorch's one-shot/two-shot kernels over symmetric memory for messages up to
    --all-reduce-max-kib, captured in the decode graphs; also when ranks share a GPU, for
    correctness runs) or auto (symm-mem when every rank has its own GPU on one node). Set up
    at launch for every layout; where it cannot be, the launch log says why and uses nccl.
    The default stays nccl until symm-mem has run one rank per GPU (it has run only on ranks
    sharing one GPU)."""
    all_reduce_max_kib: int = 2048
    """Largest all-reduce (KiB) that --all-reduce symm-mem takes (its buffer per layout);
    larger ones go to the process group. 2048: a decode step of 256 rows of 4096 bf16."""
    dist_init_addr: str | None = None
    """host:port of rank 0 for the process group (default: a free loopback port)."""
    nnodes: int = 1
    """Hosts the ranks are spread over (ranks split evenly, node 0 holds rank 0)."""
    node_rank: int = 0
    """This host's index among --nnodes."""
    dist_timeout_s: float = 120.0
    """A rank blocked this long on a peer inside a step stops the group with a named stall
    error. Idle ranks wait for work without a deadline."""
    watchdog_timeout_s: float = 300.0
    """An engine that has work but finishes no step for this long is reported (every rank's
    position and stack in the log), /health answers 503, and the server exits non-zero."""
    grammar_compile_timeout_s: float = 30.0
    """Longest a new grammar (JSON schema, regex, EBNF) may take to build and compile, tried
    in a child process that is then killed; its request gets a 400 ("grammar too complex to
    compile within N s")."""

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


@dataclass(frozen=True)
class FlipConfig:
    """Phase flips: whether they are on, how the weights move, and the automatic policy."""

    enable_flip: bool = False
    """Allow phase flips (`POST /admin/flip`, `Engine.flip`): re-lay the ranks out as another
    tp × pp at runtime. Needs --enable-hicache: a flip carries no KV, so without a host tier
    every flip would re-prefill every cached prefix."""
    flip_weights: str = "auto"
    """How a phase flip's new ranks get their weights: resident (every layout's shards stay on
    the device from launch: a flip moves no weights; the memory comes out of the KV cache), peer
    (each rank keeps the slices it holds and receives the rest from the other ranks),
    host-image (copy their shards from an image of the checkpoint in shared host memory, built
    once at launch: the whole checkpoint in host RAM, one copy per node), reload (read the
    checkpoint from disk again; dummy weights are made on the device again), or auto (resident
    when the other layouts' shards take at most 25 % of a rank's memory budget, else peer when
    the ranks run on NCCL, else host-image for a real checkpoint, else reload; reload with a
    warning also when /dev/shm cannot hold the image). host-image with --load-format dummy is
    refused."""
    flip_policy: str = "manual"
    """manual (flips only through POST /admin/flip or Engine.flip) or auto (the engine also
    flips between the two --flip-layouts by itself when the cost model says a flip pays, and
    back). auto needs --enable-flip. Why it did or did not flip: /server_info, flip_policy."""
    flip_layouts: str | None = None
    """The two layouts auto flips between, comma separated, each tpN, ppN or tpAxppB (e.g.
    tp2,pp2). The one with more tensor-parallel ranks is the decode layout, the other the
    prefill layout; one of them must be the launch layout. Default: tpW,ppW for W ranks."""
    flip_min_dwell_s: float = 10.0
    """Auto flips: least seconds in a layout before the policy may flip again (and
    --flip-min-dwell-steps steps), so it cannot thrash."""
    flip_min_dwell_steps: int = 4
    """Auto flips: least steps in a layout before the policy may flip again (and
    --flip-min-dwell-s seconds)."""
    flip_backlog_served_fraction: float = 0.25
    """Auto flips: the prefill backlog counts as served, and the prefill layout flips back,
    once the uncached pending prefill tokens are at most this fraction of the break-even N
    (the band between the two is the hysteresis)."""
    flip_decode_slo_ms: float | None = None
    """Auto flips: the prefill layout flips back when the mean wall time of its last 8 steps
    that carried decode rows exceeds this (decoding requests wait that long per token).
    Default: no SLO."""
    flip_seed_pp_speedup: float | None = None
    """Auto flips: prior for the prefill throughput of the prefill layout over the decode
    layout's; scales the one measured layout ('half-measured') until both are measured.
    Default: none; the policy waits for both measurements."""
    flip_seed_to_pp_s: float | None = None
    """Auto flips: prior seconds of a seam from the decode to the prefill layout, until one
    is measured. Default: none; unmeasured, so the policy cannot price a flip."""
    flip_seed_to_tp_s: float | None = None
    """Auto flips: prior seconds of a seam from the prefill back to the decode layout, until
    one is measured (law 7: each direction has its own estimate). Default: none."""


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Everything an engine is built from: the model and numerics at the top, the rest in
    sections (`load`, `scheduler`, `cache`, `parallel`, `flip`), each frozen, so a phase flip
    replaces the `parallel` section alone (`with_layout`). A section's fields also read and
    construct flat (`cfg.tp_size`, `EngineConfig(tp_size=2)`, `replace(cfg, tp_size=2)`):
    the CLI flags, the Python API and /server_info keep one flat namespace."""

    model: str = str(EMBEDDED_MODEL)
    """Hugging Face model directory, ORG/NAME from the local Hugging Face cache (never
    downloaded), or a bundled shape name (llama-3.1-8b, llama-3.1-70b, qwen3-8b, llama-3.2-1b,
    qwen3-0.6b) with --load-format dummy (default: the tiny shipped model)."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    cpu_threads: int | None = None
    """torch CPU threads of each engine process and rank. Default: the cores this process may
    use, less one for the front end, shared by this host's ranks (OMP_NUM_THREADS, if set)."""
    dtype: str = "auto"
    """float32, float16, bfloat16 or auto (float32 on CPU; on a GPU the checkpoint's dtype,
    bfloat16 for a float32 checkpoint)."""
    quantization: str | None = None
    """fp8: the decoder's projections in FP8 (a scale per output channel, activations scaled
    per token at run time); a float checkpoint is quantized at load. Default: the checkpoint's
    own (FP8 checkpoints, compressed-tensors or block-wise, run FP8), else none."""
    kv_cache_dtype: str = "auto"
    """auto (the model dtype) or fp8_e4m3: the KV cache in FP8 with a scale per layer and KV
    head, about twice the tokens in the same memory."""
    fp8_lm_head: bool = False
    """With FP8 weights: the LM head in FP8 too (a scale per vocabulary row, made at load
    beside the 16-bit weight, which embeddings and phase flips keep using): half the head's
    bytes and GEMM time, at more change to the logits than the decoder's projections make
    (docs/quantization.md). Other servers leave the head in 16 bits, as this does unless
    asked."""
    attention_backend: str = "auto"
    """torch (the reference), triton, or auto (triton on CUDA when installed, else torch)."""
    disable_cuda_graph: bool = False
    """Run every step eagerly instead of replaying captured CUDA graphs (the decode graphs and
    the piecewise prefill/mixed graphs; CUDA only)."""
    overlap_schedule: bool = True
    """Schedule and launch step k+1 before step k's sampled tokens reach the host (they are
    fed to the GPU as device-side placeholders), so the host's scheduling and output work
    overlaps the GPU. Every layout (stage 0's TP ranks get the tokens from rank 0), HiCache
    on or off; only for steps whose requests need nothing of the sampled ids on the host: no
    logprobs, penalties, stop strings, min_new_tokens or seeds (other steps run
    synchronously). On the H200: batch-1 decode 95 percent GPU-busy
    (88 without), offline 1000 requests +11 percent."""
    skip_warmup: bool = False
    """Serve without the launch warm-up. By default a server runs one short internal request
    through the engine before it reports ready (CUDA only), so the first client does not pay
    for compiling the prefill kernels: the FP8 extend kernel's compile made the first request
    of an 8B FP8 server wait 2.1 s on the H200 (then 0.2 s)."""
    cuda_graph_max_bs: int = 1024
    """Largest decode batch captured in a CUDA graph (capped by max_running_requests); larger
    batches run eagerly. Eager decode at ~770 rows cost 46 ms a step on the H200, 22 ms of it
    host launches, against 31 ms of GPU work."""
    piecewise_graph_max_tokens: int = 1024
    """Largest prefill or mixed step (prompt tokens plus decodes) run as piecewise CUDA graphs:
    every layer's kernels but attention replayed from graphs, attention launched between them
    (every layout captured at launch; a phase flip's new layout runs these steps eagerly). 0
    turns them off. Launched from Python, a 32-token prompt beside 6 decodes took 45 ms on the
    H200 (8B, FP8), 44 ms of it host time, for 5.4 ms of kernels; from the pieces 7.2 ms."""
    stream_interval: int = 1
    """Tokens a stream's chunk waits for (SGLang's `--stream-interval`): each request's first
    token goes out at once, then a chunk every this many tokens, and its last when it ends.
    1 sends every step's token; more cuts the engine's messages and the front end's chunks
    (and its CPU) by about as much, at coarser streaming (docs/benchmarks.md)."""
    seed: int = 0
    """Seed for requests that do not set their own."""
    log_level: str = "info"
    """Log level of every process: debug, info, warning, error or critical."""
    max_logprobs: int = 20
    """Largest top-logprobs count a request may ask for."""
    check_accounting: bool = False
    """Check KV pool accounting whenever the engine goes idle (debug)."""
    load: LoadConfig = field(default_factory=LoadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    flip: FlipConfig = field(default_factory=FlipConfig)

    def __init__(self, **kwargs: Any) -> None:
        """Top-level fields, sections (objects or dicts, as `asdict` writes them) and any
        section's fields by their flat names (applied on top of a section given too)."""
        sections = {}
        for name, cls in SECTIONS.items():
            given = kwargs.pop(name, None)
            sections[name] = cls(**given) if isinstance(given, dict) else given or cls()
        flat: dict[str, dict[str, Any]] = {}
        for key in [k for k in kwargs if k in _SECTION_OF]:
            flat.setdefault(_SECTION_OF[key], {})[key] = kwargs.pop(key)
        for name, changes in flat.items():
            sections[name] = replace(sections[name], **changes)
        top = {f.name: f for f in fields(self) if f.name not in SECTIONS}
        unknown = sorted(set(kwargs) - set(top))
        if unknown:
            raise TypeError(f"EngineConfig got unexpected keyword argument(s) {unknown}")
        for name, f in top.items():
            object.__setattr__(self, name, kwargs.get(name, f.default))
        for name, section in sections.items():
            object.__setattr__(self, name, section)
        self.__post_init__()

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid engine config {name}={getattr(self, name)!r}: "
                                       f"{why}", param=name)

        self._check_types(bad)  # first: the checks below compare numbers
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise bad("device", "expected cpu, cuda or auto")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                unset = " (or leave it unset)" if None in choices else ""
                raise bad(name, f"expected {_either([c for c in choices if c])}{unset}")
        self._check_counts(bad)
        if not 0.0 < self.mem_fraction <= 1.0:
            raise bad("mem_fraction", "expected a fraction in (0, 1]")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be in [0, nnodes={self.nnodes})")
        if self.world_size % self.nnodes:
            raise bad("nnodes", f"tp_size*pp_size={self.world_size} ranks do not split evenly")
        if self.hicache_page_size < 1 or self.hicache_page_size % self.page_size:
            raise bad("hicache_page_size", f"must be a multiple of page_size={self.page_size}")
        if self.enable_hicache and self.hicache_host_gb <= 0:
            raise bad("hicache_host_gb", "must be > 0 with --enable-hicache")
        if self.enable_hicache and self.hicache_dir and self.hicache_disk_gb <= 0:
            raise bad("hicache_disk_gb", "must be > 0 with --hicache-dir")
        if self.enable_hicache and not self.enable_prefix_cache:
            raise bad("enable_hicache", "needs the prefix cache (drop --no-enable-prefix-cache)")
        if self.enable_flip and not self.enable_hicache:
            raise bad("enable_flip", "needs a host cache tier: without one every flip "
                      "re-prefills every cached prefix; add --enable-hicache, or drop "
                      "--enable-flip")
        if self.flip_weights in ("resident", "peer") and (
                not self.enable_flip or self.world_size < 2):
            raise bad("flip_weights", f"{self.flip_weights} serves phase flips only: add "
                      "--enable-flip with at least 2 ranks, or use --flip-weights auto")
        if self.flip_weights == "host-image" and self.load_format == "dummy":
            raise bad("flip_weights", "host-image copies the checkpoint, and --load-format "
                      "dummy has none; use --flip-weights auto or reload, or a real checkpoint")
        if self.flip_weights == "host-image" and (not self.enable_flip or self.world_size < 2):
            raise bad("flip_weights", "host-image serves phase flips only: add --enable-flip "
                      "with at least 2 ranks, or use --flip-weights auto")
        if self.enable_hicache and self.nnodes > 1:
            raise bad("enable_hicache", "needs every rank on one host (the host tier is shared "
                      "memory of the node); use --nnodes 1 or turn HiCache off")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise bad("dist_init_addr", "is required with --nnodes > 1 (host:port of node 0; "
                      "or MASTER_ADDR and MASTER_PORT in the environment)")
        self._check_flip_policy(bad)

    def _check_types(self, bad: Callable[[str, str], InvalidRequestError]) -> None:
        """Every numeric field an int (a float field: any finite real): a string or a float
        count would otherwise fail deep inside the engine, and NaN passes every comparison."""
        for name, (kind, optional) in _NUMERIC.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            exact = Integral if kind is int else Real
            if isinstance(value, bool) or not isinstance(value, exact):
                what = "an integer" if kind is int else "a number"
                raise bad(name, f"expected {what}, got {type(value).__name__}")
            if kind is float and not math.isfinite(value):
                raise bad(name, "must be a finite number")

    def _check_counts(self, bad: Callable[[str, str], InvalidRequestError]) -> None:
        for name in _AT_LEAST_ONE:
            value = getattr(self, name)
            if value is not None and value < 1:
                unset = (" (leave it unset for the model's max_position_embeddings)"
                         if name == "max_model_len" else "")
                raise bad(name, f"must be >= 1{unset}")
        for name, hint in _AT_LEAST_ZERO.items():
            if getattr(self, name) < 0:
                raise bad(name, f"must be >= 0{hint}")
        if self.tp_size < 1 or self.pp_size < 1:
            raise bad("tp_size" if self.tp_size < 1 else "pp_size", "must be >= 1")
        if self.chunked_prefill_size < -1:
            raise bad("chunked_prefill_size", "must be >= 1, or 0 or -1 to turn chunking off")
        for name in ("dist_timeout_s", "watchdog_timeout_s", "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be > 0")

    def _check_flip_policy(self, bad) -> None:
        auto = self.flip_policy == "auto"
        if auto and not self.enable_flip:
            raise bad("flip_policy", "needs phase flips: add --enable-flip (with "
                      "--enable-hicache), or use --flip-policy manual")
        if auto and self.world_size < 2:
            raise bad("flip_policy", "needs at least 2 ranks to flip between layouts "
                      "(--tp-size 2 or --pp-size 2)")
        if self.flip_layouts is not None or auto:
            try:
                pair = self.flip_layout_pair
            except ValueError as e:
                raise bad("flip_layouts", str(e)) from None
            if (self.tp_size, self.pp_size) not in pair:
                raise bad("flip_layouts", f"the launch layout tp{self.tp_size}×pp{self.pp_size} "
                          "must be one of the two; pass --flip-layouts with it")
        for name in ("flip_min_dwell_s", "flip_seed_to_pp_s", "flip_seed_to_tp_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise bad(name, "must be >= 0")
        for name in ("flip_decode_slo_ms", "flip_seed_pp_speedup"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise bad(name, "must be > 0")
        if not 0.0 <= self.flip_backlog_served_fraction < 1.0:
            raise bad("flip_backlog_served_fraction", "expected a fraction in [0, 1)")

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def with_layout(self, tp_size: int, pp_size: int) -> EngineConfig:
        """This config in another TP x PP layout: a phase flip's new `parallel` section, every
        other section the same objects."""
        return replace(self, parallel=replace(self.parallel, tp_size=tp_size, pp_size=pp_size))

    def flat_dict(self) -> dict[str, Any]:
        """Every field by its flat name (what the CLI flags and /server_info show)."""
        return {name: getattr(self, name) for name in self.field_names()}

    @property
    def flip_layout_pair(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(decode layout, prefill layout) as (tp_size, pp_size) pairs: --flip-layouts, or
        tpW and ppW for W ranks. ValueError names what is wrong with --flip-layouts."""
        w = self.world_size
        spec = self.flip_layouts or f"tp{w},pp{w}"
        items = [s.strip() for s in spec.split(",")]
        if len(items) != 2:
            raise ValueError("expected two layouts, comma separated (e.g. tp2,pp2)")
        pair = []
        for item in items:
            tp, pp = parse_layout(item)
            if tp < 1 or pp < 1 or tp * pp != w:
                raise ValueError(f"{item!r} has {tp * pp} ranks; the engine has {w} "
                                 "(tp_size x pp_size)")
            pair.append((tp, pp))
        if pair[0] == pair[1]:
            raise ValueError("the two layouts are the same")
        decode, prefill = sorted(pair, reverse=True)  # more tensor-parallel ranks: decode
        return decode, prefill

    def context_len(self, model_positions: int) -> int:
        """The context limit served: max_model_len, else the model's max_position_embeddings
        (`model_positions`). Whether the model can take max_model_len: `engine.core`."""
        return model_positions if self.max_model_len is None else self.max_model_len

    @property
    def chunk_size(self) -> int | None:
        """Prefill chunk in tokens, or None when chunking is off."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

    @classmethod
    def field_names(cls) -> list[str]:
        """Every field by its flat name: the top-level ones, then each section's."""
        top = [f.name for f in fields(cls) if f.name not in SECTIONS]
        return top + [f.name for s in SECTIONS.values() for f in fields(s)]


SECTIONS: dict[str, type] = {"load": LoadConfig, "scheduler": SchedulerConfig,
                             "cache": CacheConfig, "parallel": ParallelConfig,
                             "flip": FlipConfig}
_SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}


def _numeric_fields() -> dict[str, tuple[type, bool]]:
    """Flat name → (int or float, whether None is allowed) of every numeric field."""
    out = {}
    for cls in (EngineConfig, *SECTIONS.values()):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            args = typing.get_args(hints[f.name]) or (hints[f.name],)
            kind = next((a for a in args if a is not type(None)), None)
            if kind in (int, float):
                out[f.name] = (kind, type(None) in args)
    return out


_NUMERIC = _numeric_fields()


def _flat_alias(section: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, section), name),
                    doc=f"`{section}.{name}`, read flat")


for _name, _section in _SECTION_OF.items():
    setattr(EngineConfig, _name, _flat_alias(_section, _name))
