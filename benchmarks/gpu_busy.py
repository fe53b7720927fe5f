"""Per-GPU busy fraction over a benchmark's timed region, sampled from NVML outside the ranks.

A multi-GPU engine runs its ranks in other processes, so a profiler in the benchmark's process
sees only rank 0. NVML sees every GPU: its "utilization.gpu" is the percent of the last sample
period in which *any* kernel was running on the device (not SM occupancy: one small kernel
counts as busy). The driver's period is 1/6 s to 1 s depending on the product, so a region must
be a few periods long to say anything; samples within `SETTLE_S` of a region's start are
dropped (their period began before it).

`GpuBusySampler` polls every `period_s` in a background thread, through `pynvml` when it is
importable, else through one long-lived `nvidia-smi --query-gpu=... -lms N` process, and only
keeps the GPUs the engine's ranks run on. With the benchmark's step time,
`host_bubble_ms_per_step = (1 - busy) * step_ms` estimates the idle time per step (labelled
an estimate: NVML's busy is coarse, see above). Unmeasured stays None (design law 5): on the CPU,
without NVML, on a failure or with too few samples every figure is None and `note` says why.
The sampler never raises into the benchmark.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_PERIOD_S = 0.1  # how often we ask; NVML's own averaging period is 1/6 s to 1 s
SETTLE_S = 1 / 6  # a sample this soon after a region starts averages time before it
MIN_SAMPLES = 3  # fewer in a region: unmeasured
STOP_TIMEOUT_S = 2.0  # terminate, then kill, then give up waiting (never hang a benchmark)
SMI_QUERY = "timestamp,index,uuid,utilization.gpu"


@dataclass(frozen=True)
class Sample:
    """One NVML reading: wall-clock time (time.time()), the device id asked for, percent."""

    t_s: float
    device: str
    util_pct: float


def visible_ids(logical: Sequence[int], visible: str | None) -> list[str]:
    """NVML ids (indices or UUIDs) of CUDA ordinals, mapped through CUDA_VISIBLE_DEVICES."""
    if visible is None:
        return [str(i) for i in logical]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if any(i >= len(entries) for i in logical):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} has no device {max(logical)}")
    return [entries[i] for i in logical]


def _nvml_id(ordinal: int) -> str:
    """A CUDA ordinal's NVML id: its UUID from torch (exact whatever CUDA_DEVICE_ORDER says),
    else the CUDA_VISIBLE_DEVICES entry or the ordinal itself."""
    import torch

    try:
        uuid = str(torch.cuda.get_device_properties(ordinal).uuid)
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    except Exception:  # noqa: BLE001 - an older torch: the environment's mapping
        return visible_ids([ordinal], os.environ.get("CUDA_VISIBLE_DEVICES"))[0]


def engine_gpus(engine: Any) -> dict[str, list[int]] | None:
    """{NVML id: ranks on it} for this node's ranks (placed as `rank_device` places them:
    local rank % GPU count); None when the engine is not on a GPU."""
    import torch

    device = engine.core.runner.device
    if device.type != "cuda":
        return None
    cfg = engine.config
    per_node = cfg.world_size // getattr(cfg, "nnodes", 1)
    if per_node == 1:
        ordinals = {device.index if device.index is not None else torch.cuda.current_device(): [0]}
    else:
        ordinals: dict[int, list[int]] = {}
        for r in range(per_node):
            ordinals.setdefault(r % torch.cuda.device_count(), []).append(r)
    return {_nvml_id(i): ranks for i, ranks in ordinals.items()}


def parse_smi_line(line: str, received_s: float) -> tuple[float, str, str, float] | None:
    """(time, index, uuid, percent) of one `nvidia-smi --query-gpu=SMI_QUERY` line; None for
    anything else ([N/A], an error message). The line's own timestamp (local time, ms) dates it
    when it parses, else the time it was read."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    stamp, index, uuid, util = parts
    try:
        pct = float(util)
    except ValueError:
        return None
    try:
        t = time.mktime(time.strptime(stamp[:19], "%Y/%m/%d %H:%M:%S")) + float("0" + stamp[19:])
    except ValueError:
        t = received_s
    return t, index, uuid, pct


def _matches(device: str, index: str, uuid: str) -> bool:
    if device.upper().startswith(("GPU-", "MIG-")):
        return uuid.lower().startswith(device.lower())
    return device == index


def _die_with_parent() -> Any:
    """A preexec_fn: the child gets SIGTERM when the thread that started it dies, even by
    SIGKILL (Linux prctl). libc is resolved here, in the parent: no dlopen after fork."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: stop() still ends it on a normal exit
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean_pct": None, "min_pct": None, "p10_pct": None}
    arr = np.asarray(values, dtype=float)
    return {"mean_pct": float(arr.mean()), "min_pct": float(arr.min()),
            "p10_pct": float(np.percentile(arr, 10))}


def busy_summary(samples: Sequence[Sample], gpus: dict[str, list[int]] | None,
                 windows_s: Sequence[tuple[float, float]], step_s: float | None, *,
                 source: str | None, period_s: float, notes: Sequence[str] = ()) -> dict[str, Any]:
    """Busy per GPU over the samples inside `windows_s` (wall clock; the first `SETTLE_S` of
    each window dropped) and the host bubble per step each implies. A GPU with fewer than
    `MIN_SAMPLES` samples is unmeasured (None) and the note says why. Each GPU's `series`
    ([s since the first window opened, %] per sample) says when in the run it sat idle."""
    notes = list(notes)
    region_s = sum(max(0.0, b - a) for a, b in windows_s)
    step_ok = step_s is not None and math.isfinite(step_s) and step_s > 0
    devices: list[dict[str, Any]] | None = None
    if gpus is not None:
        devices = []
        for dev, ranks in gpus.items():
            inside = [s for s in samples if s.device == dev
                      and any(a + SETTLE_S <= s.t_s <= b for a, b in windows_s)]
            vals = [s.util_pct for s in inside]
            if source is not None and len(vals) < MIN_SAMPLES:
                notes.append(f"{dev}: {len(vals)} sample(s) in a {region_s:.2f} s region (need "
                             f"{MIN_SAMPLES}; NVML averages over 1/6-1 s: lengthen the region)")
                vals = []
            t0 = min((a for a, _ in windows_s), default=0.0)
            entry: dict[str, Any] = {"device": dev, "ranks": ranks, **_stats(vals),
                                     "samples": len(vals), "host_bubble_ms_per_step": None,
                                     "series": [[round(s.t_s - t0, 3), s.util_pct]
                                                for s in inside] if vals else []}
            if vals and step_ok:
                entry["host_bubble_ms_per_step"] = (1 - entry["mean_pct"] / 100) * step_s * 1e3
            devices.append(entry)
    bubbles = [d["host_bubble_ms_per_step"] for d in devices or ()
               if d["host_bubble_ms_per_step"] is not None]
    return {
        "source": source,
        "metric": "NVML utilization.gpu: % of each sample period with any kernel running",
        "period_ms": period_s * 1e3 if source else None,
        "region_s": region_s if source else None,
        "step_ms": step_s * 1e3 if step_ok else None,
        "devices": devices,
        "host_bubble_ms_per_step": max(bubbles) if bubbles else None,  # the worst GPU's
        "host_bubble_is": "estimate from NVML: (1 - busy) x step time",
        "note": "; ".join(notes) or None,
    }


def format_busy(summary: dict[str, Any]) -> str:
    """One table cell: each GPU's mean busy % (ranks in brackets when more than one GPU)."""
    devs = summary.get("devices") or []
    if not any(d["mean_pct"] is not None for d in devs):
        return "-"
    cells = [("-" if d["mean_pct"] is None else f"{d['mean_pct']:.1f}")
             + (f" [r{','.join(map(str, d['ranks']))}]" if len(devs) > 1 else "") for d in devs]
    return " / ".join(cells)


class GpuBusySampler:
    """Samples NVML busy of `gpus` ({NVML id: ranks}) while the `with` block runs.

    Start it on the thread that outlives the region (the nvidia-smi child is told to die with
    the thread that started it). `summary()` after the block; nothing here raises into the
    caller: a failure becomes `note` and the figures None."""

    def __init__(self, gpus: dict[str, list[int]] | None, *, period_s: float = DEFAULT_PERIOD_S,
                 backend: str = "auto", smi: str = "nvidia-smi", note: str | None = None) -> None:
        self.gpus, self.period_s, self.backend, self.smi = gpus, period_s, backend, smi
        self.source: str | None = None
        self.samples: list[Sample] = []
        self._notes: list[str] = [note] if note else []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._terminating = threading.Event()  # stop() ends the child: its exit is no failure
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._nvml: Any = None
        self._region = (0.0, 0.0)  # perf_counter
        self._wall_minus_perf = 0.0
        self._unparsed: list[str] = []

    @property
    def pid(self) -> int | None:
        """The nvidia-smi child's pid (None with pynvml or before start)."""
        return self._proc.pid if self._proc is not None else None

    def __enter__(self) -> GpuBusySampler:
        self._wall_minus_perf = time.time() - time.perf_counter()
        self._region = (time.perf_counter(), math.nan)
        if self.gpus:
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - never fail the benchmark
                self._fail(f"sampling did not start: {exc!r}")
        elif not self._notes:
            self._notes.append("no GPU to sample")
        return self

    def __exit__(self, *exc: object) -> None:
        self._region = (self._region[0], time.perf_counter())
        self.stop()

    def _fail(self, why: str) -> None:
        with self._lock:
            self._notes.append(why)

    def _add(self, sample: Sample) -> None:
        with self._lock:
            self.samples.append(sample)

    def _start(self) -> None:
        nvml = None
        if self.backend in ("auto", "pynvml"):
            try:
                import pynvml as nvml
            except ImportError:
                if self.backend == "pynvml":
                    raise
        if nvml is not None:
            self._start_nvml(nvml)
            return
        path = shutil.which(self.smi)
        if path is None:
            self._fail(f"neither pynvml nor {self.smi} is available")
            return
        self._start_smi(path)

    def _start_nvml(self, nvml: Any) -> None:
        nvml.nvmlInit()
        self._nvml = nvml
        handles = {d: (nvml.nvmlDeviceGetHandleByUUID(d) if d.upper().startswith(("GPU-", "MIG-"))
                       else nvml.nvmlDeviceGetHandleByIndex(int(d))) for d in self.gpus or {}}
        self.source = "pynvml"

        def poll() -> None:
            while True:
                try:
                    for dev, h in handles.items():
                        util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
                        self._add(Sample(time.time(), dev, float(util)))
                except Exception as exc:  # noqa: BLE001 - the figures go None, the run goes on
                    self._fail(f"NVML query failed: {exc!r}")
                    return
                if self._stop.wait(self.period_s):
                    return

        self._thread = threading.Thread(target=poll, name="gpu-busy", daemon=True)
        self._thread.start()

    def _start_smi(self, path: str) -> None:
        ms = max(1, round(self.period_s * 1e3))
        prctl = _die_with_parent() if os.name == "posix" else None
        self._proc = subprocess.Popen(
            [path, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits", "-lms", str(ms)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, preexec_fn=prctl)  # noqa: PLW1509
        self.source = "nvidia-smi"
        self._thread = threading.Thread(target=self._read_smi, args=(self._proc,),
                                        name="gpu-busy", daemon=True)
        self._thread.start()

    def _read_smi(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            parsed = parse_smi_line(line, time.time())
            if parsed is None:
                if line.strip():
                    self._unparsed = [*self._unparsed[-2:], line.strip()]
                continue
            t, index, uuid, pct = parsed
            for dev in self.gpus or {}:
                if _matches(dev, index, uuid):
                    self._add(Sample(t, dev, pct))
        try:
            rc = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        if not (self._terminating.is_set() and rc in (-signal.SIGTERM, -signal.SIGKILL)):
            self._fail(f"{self.smi} stopped early (exit {rc}): {' | '.join(self._unparsed)}")

    def stop(self) -> None:
        """Ends the sampling: the child terminated, then killed, each wait bounded."""
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._terminating.set()
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self._fail(f"{self.smi} (pid {proc.pid}) did not exit after SIGKILL")
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)
            if self._thread.is_alive():
                self._fail("the sampling thread did not stop")
        if proc is not None and proc.stdout is not None and not (
                self._thread is not None and self._thread.is_alive()):
            proc.stdout.close()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down a library that already failed
                pass
            self._nvml = None

    def summary(self, windows: Sequence[tuple[float, float]] | None = None,
                step_s: float | None = None) -> dict[str, Any]:
        """Busy over `windows` (perf_counter seconds, default: the whole `with` block) and the
        host bubble per step implied by `step_s`."""
        wins = windows if windows is not None else [self._region]
        off = self._wall_minus_perf
        with self._lock:
            samples, notes = list(self.samples), list(self._notes)
        try:
            return busy_summary(samples, self.gpus, [(a + off, b + off) for a, b in wins], step_s,
                                source=self.source if self.gpus else None,
                                period_s=self.period_s, notes=notes)
        except Exception as exc:  # noqa: BLE001 - never fail the benchmark
            return busy_summary([], None, [], None, source=None, period_s=self.period_s,
                                notes=[*notes, f"summary failed: {exc!r}"])


def add_gpu_busy_arg(ap: Any) -> None:
    ap.add_argument("--gpu-busy", choices=["auto", "off"], default="auto",
                    help="sample each GPU's NVML busy %% over the timed region (auto: when the "
                         "engine runs on CUDA) and estimate the host bubble per step")


def gpus_to_sample(engine: Any, mode: str) -> tuple[dict[str, list[int]] | None, str | None]:
    """({NVML id: ranks} or None, why not) for `--gpu-busy mode`; never raises."""
    if mode == "off":
        return None, "--gpu-busy off"
    try:
        gpus = engine_gpus(engine)
    except Exception as exc:  # noqa: BLE001 - unmeasured, not a failed benchmark
        return None, f"could not map the ranks to GPUs: {exc!r}"
    return gpus, None if gpus else "the engine is not on a GPU"
