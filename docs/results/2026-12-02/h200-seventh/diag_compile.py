"""After the launch warm-up, which kernels still compile on which request shape?"""
import os, time, glob, random, json
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/tcache_diag")
from phaseflip import Engine, SamplingParams
from phaseflip.engine.warmup import warm_up

def kernels_now():
    return set(glob.glob(os.environ["TRITON_CACHE_DIR"] + "/*/*.json"))

rng = random.Random(0)
toks = lambda n: [rng.randrange(10, 30000) for _ in range(n)]
e = Engine("llama-3.1-8b", load_format="dummy", quantization="fp8", kv_cache_dtype="fp8_e4m3", mem_fraction=0.5)
print(f"warm-up {warm_up(e.core):.2f} s", flush=True)
seen = kernels_now()
for name, ps in [("one 64", [toks(64)]), ("one 17", [toks(17)]), ("one 1", [toks(1)]), ("one 256", [toks(256)]),
                 ("two 100+28", [toks(100), toks(28)]), ("three 7+9+16", [toks(7), toks(9), toks(16)]),
                 ("sixteen x 16", [toks(16) for _ in range(16)]), ("one 4096", [toks(4096)]), ("forty x 37", [toks(37) for _ in range(40)])]:
    t = time.perf_counter()
    e.generate(ps, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t
    now = kernels_now(); new = now - seen; seen = now
    names = sorted({json.load(open(f)).get("name", "?") for f in new})
    print(f"{name}: {dt:.2f} s, new kernels {names}", flush=True)
