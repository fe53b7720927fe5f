// FP8-KV paged decode attention for Hopper (sm_90), below Triton: compiled at run time by
// NVRTC (phaseflip/kernels/cuda_rtc.py), launched by phaseflip/kernels/attention_cuda.py.
//
// Why: Triton's FP8 decode kernel moves ~52 % of DRAM bandwidth: the P·V dot wants key pairs
// in one register and V is stored key-major, so Triton gathers V byte by byte. Here both dots
// put the *keys* where the MMA wants contiguous pairs for free:
//   S^T = K · q^T   A = K tile (keys × d), rows = keys: a thread's 32 contiguous d bytes of
//                   a key widen pairwise (cvt e4m3x2 -> f16x2) straight into A registers
//                   (the d order inside a k-step is permuted; q^T uses the same order).
//   O^T = V^T · P^T A = V^T (d × keys): a thread loads 16 contiguous d bytes of four keys
//                   and interleaves key pairs with one PRMT per two registers; the rows (d)
//                   are permuted so a thread's 16 rows are its 16 loaded bytes.
//                   B = P^T from S^T's accumulators by two movmatrix.trans per 16 keys.
// GQA group (≤ 8 query heads of one KV head) is the MMA's N = 8. One warp walks every
// fourth 16-key tile of the CTA's chunk with its own online softmax, its tiles staged STAGES
// deep in shared memory by cp.async; the CTA merges its four warps in shared memory and
// writes the output (a sequence one split holds) or the split's partial (m, l in log2 units, O
// unnormalised), the last of the sequence's splits to arrive merging them.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ u32 cvt_e4m3x2(u16 v) {
    u32 out;
    asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(v));
    return out;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 out;
    asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 out;
    asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

__device__ __forceinline__ u32 movmatrix_t(u32 v) {
    u32 out;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(v));
    return out;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 out;
    asm volatile("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(sel));
    return out;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// D += A (16×16, row) · B (16×8, col), f16 in, f32 accumulate
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// a lane's share of one 16-key tile, read from shared memory
struct Tile {
    uint4 k[4];  // keys g, g+8: 32 bytes each (d = 32t .. 32t+31)
    uint4 v[4];  // keys 2t, 2t+1, 2t+8, 2t+9: 16 bytes each (d = 16g .. 16g+15)
};

__device__ __forceinline__ u32 word(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}


struct WarpState {
    float acc[8][4];  // O^T: m-tile m, rows d = 16g + 2m (+1), heads 2t, 2t+1
    float m[2];       // running max of heads 2t, 2t+1 (log2 units)
    float l[2];       // this lane's share of the running sums
};

__device__ __forceinline__ void state_init(WarpState& st) {
#pragma unroll
    for (int m = 0; m < 8; ++m) st.acc[m][0] = st.acc[m][1] = st.acc[m][2] = st.acc[m][3] = 0.f;
    st.m[0] = st.m[1] = NEG_INF;
    st.l[0] = st.l[1] = 0.f;
}

// q^T fragments of head g (zero past the group): d = 32t .. 32t+31 as 16 f16 pairs
__device__ __forceinline__ void load_q(u32* qf, const u16* qp, bool real) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float lo_f = 0.f, hi_f = 0.f;
        if (real) {
            lo_f = __int_as_float(((u32)qp[2 * i]) << 16);
            hi_f = __int_as_float(((u32)qp[2 * i + 1]) << 16);
        }
        qf[i] = pack_f16x2(lo_f, hi_f);
    }
}

// one 16-key tile starting at key n0 (keys >= hi masked) into the warp's online softmax
__device__ __forceinline__ void step_tile(WarpState& st, const Tile& cur, const u32* qf,
                                          float scale, int n0, int hi, int g) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 w0 = word(cur.k[j >> 2], j & 3);        // key g, d 32t+4j..+3
        const u32 w1 = word(cur.k[2 + (j >> 2)], j & 3);  // key g+8
        mma16816(s, cvt_e4m3x2((u16)(w0 & 0xffff)), cvt_e4m3x2((u16)(w1 & 0xffff)),
                 cvt_e4m3x2((u16)(w0 >> 16)), cvt_e4m3x2((u16)(w1 >> 16)), qf[2 * j],
                 qf[2 * j + 1]);
    }
    const bool ok0 = n0 + g < hi, ok1 = n0 + g + 8 < hi;
    s[0] = ok0 ? s[0] * scale : NEG_INF;
    s[1] = ok0 ? s[1] * scale : NEG_INF;
    s[2] = ok1 ? s[2] * scale : NEG_INF;
    s[3] = ok1 ? s[3] * scale : NEG_INF;
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float mn0 = fmaxf(st.m[0], mx0), mn1 = fmaxf(st.m[1], mx1);
    const float a0 = ex2(st.m[0] - mn0), a1 = ex2(st.m[1] - mn1);
    st.m[0] = mn0;
    st.m[1] = mn1;
    const float p0 = ex2(s[0] - mn0), p1 = ex2(s[1] - mn1);
    const float p2 = ex2(s[2] - mn0), p3 = ex2(s[3] - mn1);
    st.l[0] = st.l[0] * a0 + p0 + p2;
    st.l[1] = st.l[1] * a1 + p1 + p3;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        st.acc[m][0] *= a0;
        st.acc[m][1] *= a1;
        st.acc[m][2] *= a0;
        st.acc[m][3] *= a1;
    }
    const u32 b0 = movmatrix_t(pack_f16x2(p0, p1));
    const u32 b1 = movmatrix_t(pack_f16x2(p2, p3));
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int w = m >> 1;
        const u32 sel = (m & 1) ? 0x7362u : 0x5140u;
        const u32 x01 = prmt(word(cur.v[0], w), word(cur.v[1], w), sel);
        const u32 x89 = prmt(word(cur.v[2], w), word(cur.v[3], w), sel);
        mma16816(st.acc[m], cvt_e4m3x2((u16)(x01 & 0xffff)), cvt_e4m3x2((u16)(x01 >> 16)),
                 cvt_e4m3x2((u16)(x89 & 0xffff)), cvt_e4m3x2((u16)(x89 >> 16)), b0, b1);
    }
}

__device__ __forceinline__ void reduce_l(WarpState& st) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        st.l[0] += __shfl_xor_sync(0xffffffffu, st.l[0], o);
        st.l[1] += __shfl_xor_sync(0xffffffffu, st.l[1], o);
    }
}

// ---------------------------------------------------------------------------------------------
// Each warp's tiles staged through shared memory by cp.async, STAGES deep: a register
// prefetch keeps one tile (4 KB a warp) in flight and waits on DRAM (2.43 TB/s against
// 2.99 at 1 000 sequences, H200).

#ifndef STAGES  // a build option (-DSTAGES=n): shared memory 16 KB a stage a CTA
#define STAGES 4
#endif
#ifndef MIN_BLOCKS  // a build option: CTAs an SM the register allocation must allow
#define MIN_BLOCKS 1
#endif
#define TILE_BYTES 4096  // 16 keys × (128 K bytes + 128 V bytes)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// 16-byte chunk c of key row r sits at chunk c ^ (r & 7): the fragment reads are conflict-free
__device__ __forceinline__ u32 chunk_off(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// issue one tile's copies: lane copies keys lane/8 + 4i, chunk lane%8, of K and V
__device__ __forceinline__ void issue_tile(u32 stage, const unsigned char* Kh,
                                           const unsigned char* Vh, const i64* slots,
                                           int n0, int hi, int lane, i64 stride_kn,
                                           i64 stride_vn) {
    const int c = lane & 7;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = (lane >> 3) + 4 * i;
        const bool ok = n0 + r < hi;
        const i64 s = ok ? slots[i] : 0;
        cp_async16(stage + chunk_off(r, c), Kh + s * stride_kn + 16 * c, ok);
        cp_async16(stage + 2048 + chunk_off(r, c), Vh + s * stride_vn + 16 * c, ok);
    }
}

__device__ __forceinline__ void load_slots(i64* slots, const i64* idx, int n0, int hi,
                                           int lane) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int key = n0 + (lane >> 3) + 4 * i;
        slots[i] = key < hi ? idx[key] : 0;
    }
}

__device__ __forceinline__ void read_tile(Tile& tl, u32 stage, int g, int t) {
    tl.k[0] = lds128(stage + chunk_off(g, 2 * t));
    tl.k[1] = lds128(stage + chunk_off(g, 2 * t + 1));
    tl.k[2] = lds128(stage + chunk_off(g + 8, 2 * t));
    tl.k[3] = lds128(stage + chunk_off(g + 8, 2 * t + 1));
    tl.v[0] = lds128(stage + 2048 + chunk_off(2 * t, g));
    tl.v[1] = lds128(stage + 2048 + chunk_off(2 * t + 1, g));
    tl.v[2] = lds128(stage + 2048 + chunk_off(2 * t + 8, g));
    tl.v[3] = lds128(stage + 2048 + chunk_off(2 * t + 9, g));
}

__device__ __forceinline__ void store_bf16(u16* p, float x) {
    *p = (u16)(pack_bf16x2(x, 0.f) & 0xffff);
}

// Whether this CTA is the last of the sequence's `active` splits to store its partial (the
// Triton kernel's merge does the same with an acq_rel atomic): a CTA barrier after every
// thread's stores, then thread 0 fences (release: cumulative over the barrier), counts the
// arrival, and where it came last re-arms the counter for the next launch and fences again
// (acquire) before the barrier that lets the CTA read the others' partials.
__device__ __forceinline__ bool last_arrival(int* lock, int active) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(lock, 1) == active - 1;
        if (last) {
            atomicExch(lock, 0);
            __threadfence();
        }
    }
    __syncthreads();
    return last;
}

// out[head, d] = sum_s o_s w_s / sum_s l_s w_s, w_s = exp2(m_s - max m), over a sequence's
// first `active` splits for the KV head's `group` query heads; thread d owns dimension d.
// The partials are read past L1 (`__ldcg`): other CTAs wrote them.
__device__ __forceinline__ void merge_splits(u16* out_row, const float* mid_o,
                                             const float* mid_m, const float* mid_l,
                                             i64 head0, int kvh, int group, int num_splits,
                                             int active, int d) {
    for (int h = 0; h < group; ++h) {
        const int head = kvh * group + h;
        const i64 base = (head0 + head) * num_splits;
        float mt = NEG_INF;
        for (int s = 0; s < active; ++s) mt = fmaxf(mt, __ldcg(mid_m + base + s));
        float lt = 0.f, o = 0.f;
        for (int s = 0; s < active; ++s) {
            const float f = ex2(__ldcg(mid_m + base + s) - mt);
            lt += f * __ldcg(mid_l + base + s);
            o += f * __ldcg(mid_o + (base + s) * 128 + d);
        }
        store_bf16(out_row + (i64)head * 128 + d, o / lt);
    }
}

extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)
fp8_decode_async_kernel(const u16* __restrict__ Q, const unsigned char* __restrict__ K,
                        const unsigned char* __restrict__ V, const i64* __restrict__ kv_indptr,
                        const i64* __restrict__ kv_indices, const float* __restrict__ k_scale,
                        const float* __restrict__ v_scale, u16* __restrict__ Out,
                        float* __restrict__ mid_o, float* __restrict__ mid_m,
                        float* __restrict__ mid_l, int* __restrict__ locks,
                        float qk_scale_log2, int group, int num_splits, int min_chunk,
                        i64 stride_qt, i64 stride_kn, i64 stride_vn, i64 stride_ot,
                        const i64* __restrict__ order, i64 stride_kh, i64 stride_vh) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int kvh = blockIdx.x;
    const int b = order ? (int)order[blockIdx.y] : blockIdx.y;  // longest sequences first
    const int split = blockIdx.z;
    const int kv_heads = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const i64 beg = kv_indptr[b];
    const int seq_len = (int)(kv_indptr[b + 1] - beg);
    // the split's keys, cut per sequence from its own length as `attention._split_chunks`
    // cuts them for Triton (but in 16-key steps, not BLOCK_N: the split counts may differ,
    // each launch is self-consistent): one grid serves any mix of lengths (a CUDA graph's
    // need); splits past the last key exit, and the merge counts only the `active` ones
    const int per = (seq_len + num_splits - 1) / num_splits;
    const int chunk = max(((per + 15) / 16) * 16, max(min_chunk, 16));
    const int active = max((seq_len + chunk - 1) / chunk, 1);
    if (split >= active) return;
    const int lo = split * chunk;
    const int hi = min(lo + chunk, seq_len);
    const i64* idx = kv_indices + beg;
    const unsigned char* Kh = K + (i64)kvh * stride_kh;
    const unsigned char* Vh = V + (i64)kvh * stride_vh;
    const u32 ring = smem_addr(smem) + warp * STAGES * TILE_BYTES;

    u32 qf[16];
    load_q(qf, Q + (i64)b * stride_qt + (i64)(kvh * group + (g < group ? g : 0)) * 128 + 32 * t,
           g < group);
    const float scale = qk_scale_log2 * k_scale[kvh];
    WarpState st;
    state_init(st);

    const int first = lo + warp * 16, step = 64;
    i64 slots[4];
    load_slots(slots, idx, first, hi, lane);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {  // prologue: tiles 0 .. STAGES-2
        const int n = first + s * step;
        if (n < hi) {
            issue_tile(ring + s * TILE_BYTES, Kh, Vh, slots, n, hi, lane, stride_kn, stride_vn);
            load_slots(slots, idx, n + step, hi, lane);
        }
        asm volatile("cp.async.commit_group;");
    }
    int j = 0;
    for (int n0 = first; n0 < hi; n0 += step, ++j) {
        const int n_issue = n0 + (STAGES - 1) * step;
        if (n_issue < hi) {
            issue_tile(ring + ((j + STAGES - 1) % STAGES) * TILE_BYTES, Kh, Vh, slots, n_issue,
                       hi, lane, stride_kn, stride_vn);
            load_slots(slots, idx, n_issue + step, hi, lane);
        }
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));  // may stay in flight
        __syncwarp();
        Tile cur;
        read_tile(cur, ring + (j % STAGES) * TILE_BYTES, g, t);
        __syncwarp();  // this stage is refilled next iteration
#ifdef GATHER_ONLY  // the memory traffic alone: a ceiling for this access pattern
        st.acc[0][0] += __int_as_float((cur.k[0].x ^ cur.k[3].w ^ cur.v[0].y ^ cur.v[3].z) & 0x3fffffff);
#else
        step_tile(st, cur, qf, scale, n0, hi, g);
#endif
    }
    asm volatile("cp.async.wait_group 0;");
    reduce_l(st);
    __syncthreads();  // the rings become the merge buffers

    float* sm_o = reinterpret_cast<float*>(smem);          // [4][8][128]
    float* sm_ml = sm_o + 4 * 8 * 128;                     // [4][8][2]
    if (g == 0) {
        sm_ml[(warp * 8 + 2 * t) * 2] = st.m[0];
        sm_ml[(warp * 8 + 2 * t + 1) * 2] = st.m[1];
        sm_ml[(warp * 8 + 2 * t) * 2 + 1] = st.l[0];
        sm_ml[(warp * 8 + 2 * t + 1) * 2 + 1] = st.l[1];
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int d0 = 16 * g + 2 * m;
        sm_o[(warp * 8 + 2 * t) * 128 + d0] = st.acc[m][0];
        sm_o[(warp * 8 + 2 * t + 1) * 128 + d0] = st.acc[m][1];
        sm_o[(warp * 8 + 2 * t) * 128 + d0 + 1] = st.acc[m][2];
        sm_o[(warp * 8 + 2 * t + 1) * 128 + d0 + 1] = st.acc[m][3];
    }
    __syncthreads();
    const int d = threadIdx.x;
    const float vs = v_scale[kvh];
    for (int h = 0; h < group; ++h) {
        float mt = NEG_INF;
#pragma unroll
        for (int w = 0; w < 4; ++w) mt = fmaxf(mt, sm_ml[(w * 8 + h) * 2]);
        float lt = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float mw = sm_ml[(w * 8 + h) * 2];
            const float f = (mw == NEG_INF) ? 0.f : ex2(mw - mt);
            lt += f * sm_ml[(w * 8 + h) * 2 + 1];
            o += f * sm_o[(w * 8 + h) * 128 + d];
        }
        const int head = kvh * group + h;
        if (active == 1) {  // unsplit, or a sequence one split holds: no partials
            store_bf16(Out + (i64)b * stride_ot + (i64)head * 128 + d, o * vs / lt);
        } else {
            const i64 row = ((i64)b * kv_heads * group + head) * num_splits + split;
            mid_o[row * 128 + d] = o * vs;
            if (d == 0) {
                mid_m[row] = mt;
                mid_l[row] = lt;
            }
        }
    }
    if (active > 1 && last_arrival(locks + (i64)b * kv_heads + kvh, active))
        merge_splits(Out + (i64)b * stride_ot, mid_o, mid_m, mid_l,
                     (i64)b * kv_heads * group, kvh, group, num_splits, active, d);
}

