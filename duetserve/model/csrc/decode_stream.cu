// Decode-step layers for at most 8 sequences (one token each) as persistent "weight stream"
// kernels, one launch between two decode attentions (scripts/bench_decode_stream.py).
// Compile-time dims (-D): HID, INTER, HQ, HKV, HD (128), KPART (= HID = HQ * HD, divides INTER).
// Global phase = layer * 5 + p, separated by grid barriers:
//   p 0 input RMSNorm (its weight folded into W_qkv, or with OWN_WEIGHTS applied to the input) + qkv
//   p 1 q/k RMSNorm + RoPE: rotated q to qrot, rotated k and v into the paged cache
//   (the engine's Triton decode attention runs here, between two launches, and writes attn)
//   p 2 o + residual add
//   p 3 post-attention RMSNorm (the same way) + gate_up + SiLU * up
//   p 4 down (K in parts) + residual add (the last part of a row group adds the parts in order)
// A launch runs phases [phase_begin, phase_end): o, gate_up, down of layer l, then qkv and RoPE of
// layer l + 1. One CTA per SM: warp NCW (producer) streams every weight tile the CTA owns in those
// phases into a ring of shared-memory stages with bulk copies (TMA), gated only by free stages, so
// the weight stream runs on through the grid barriers; warps 0-7 (consumers) load each phase's
// input after its barrier (into shared memory, or with OWN_WEIGHTS into registers) and run
// mma.sync over the ring.
// KC (-D, default 512): columns a tile of the tiled build.
#ifndef OWN_WEIGHTS
#define OWN_WEIGHTS 0  // 1: the engine's own weights ([N, K], per layer, through wtab), norm weights applied
                   // to the input; a stage = 8 whole rows of a K part (GR x KPART: one contiguous bulk
                   // copy, or one a row for down's parts), the weights the mma's B operand, x its A
                   // operand held in registers for the phase (16 one-row copies of 16 x 1024 stages
                   // ran 0.37-0.53 ms a step slower: docs/benchmarks.md, twentieth session);
                   // 0: stream-layout copies (16 x 512 tiles, rows XOR-swizzled), norms folded in
#endif
#include "stream_common.cuh"

#ifndef NSTAGE
#define NSTAGE 4
#endif
#if OWN_WEIGHTS
#define GR 8                         // weight rows a group (the mma's N); gate_up's: 8 gate and 8 up rows
#define STAGE_BYTES (GR * KPART * 2)
#define KW (KPART / NCW)             // a consumer warp's columns of a stage
#define XJ (KW / 32)                 // its 16-byte x chunks a lane (two mma k-steps each)
#define GROWS GR
#define XBYTES 0                     // x lives in registers
static_assert(KPART % (NCW * 32) == 0, "K parts of whole 32-column chunks a warp");
#else
#define STAGE_BYTES (ROWS * ROW_BYTES)
#define GROWS ROWS
#define XS (KPART * 2 + 16)
#define XBYTES (MR * XS)
#endif
#define WCOLS (KC / NCW)  // a consumer warp's columns of a tile
#define KS (WCOLS / 16)   // its mma k-steps
#define CHUNKS (KPART / KC)
#define QN (HQ * HD)
#define QKV_N ((HQ + 2 * HKV) * HD)
static_assert(HID == KPART && HQ * HD == KPART, "qkv, o and gate_up take K = KPART (one part, for the norms)");
static_assert(INTER % KPART == 0 && KPART % KC == 0 && HD == 128, "shapes");

#define SMEM_X (NSTAGE * STAGE_BYTES)
#define SMEM_RED (SMEM_X + XBYTES)
#define SMEM_NORM (SMEM_RED + NCW * ROWS * MR * 4)
#define SMEM_BAR (SMEM_NORM + NCW * MR * 4)
#define SMEM_TOTAL (SMEM_BAR + 2 * NSTAGE * 8)


// Every field 8 bytes: the host fills it as an int64 tensor.
struct Params {
  const bf16* wqkv;   // [L] stream-layout weights (input norm folded in)
  const bf16* wo;
  const bf16* wgu;    // gate/up interleaved by 8 rows, post-attention norm folded in
  const bf16* wdown;
  const bf16* qnorm;  // [L][HD], null without q/k norms
  const bf16* knorm;
  const float* cos;   // [P][HD / 2]
  const float* sin;
  bf16* kv;           // layer 0's K cache; V at +kv_stride, layer l at +l * layer_stride (elements)
  long long kv_stride;
  long long layer_stride;
  long long block_size;
  const long long* positions;  // [m]
  const long long* slots;      // [m]
  const int* block_tables;     // [m][bt_stride]
  long long bt_stride;
  const int* ctx_lens;         // [m], the new token included
  bf16* stream;   // [MR][HID]: embeddings in, the last layer's residual stream out
  bf16* qkv;      // [MR][QKV_N]
  bf16* attn;     // [MR][QN]
  bf16* h;        // [MR][INTER]
  float* down;    // [INTER / KPART][MR][HID]
  bf16* qrot;     // [MR][HQ][HD] rotated queries (phase 1 out, the attention kernel's q)
  unsigned int* counter;  // grid barrier: zero at a step's first launch, counts every phase's end
  unsigned int* gcount;   // [HID / GROWS] down parts done per row group (self-resetting)
  const long long* wtab;  // OWN_WEIGHTS: [L][8] pointers: qkv, o, gate_up ([gate; up]), down, input norm,
                          // post-attention norm, q norm, k norm (the weight fields above unused)
  long long m;
  long long mode;         // bit 0: no grid waits, 1: stream and multiply only, 2 (with 1): stream only (each
                          // stage freed as it lands), 3: no norms (wrong values)
  float eps;
  float unused;
};

__constant__ Params c_params;  // the host copies a step's parameters here (a graph node before the launch)

__device__ __forceinline__ float bfr(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- weight phases -------------------------------------------------------------------------

// phase 0 qkv, 2 o, 3 gate_up, 4 down
__device__ __forceinline__ const bf16* wtab(const Params& P, int layer, int i) {
  return reinterpret_cast<const bf16*>(P.wtab[layer * 8 + i]);
}

// Layer `layer`'s RMSNorm weight i (4 input, 5 post-attention, 6 q, 7 k): OWN_WEIGHTS reads it from
// wtab (a global load: callers issue it before the grid barrier it does not depend on); the tiled
// build has the input and post-attention norms folded into its weights (null) and q/k norms stacked.
__device__ __forceinline__ const bf16* norm_weight(const Params& P, int layer, int i) {
#if OWN_WEIGHTS
  return wtab(P, layer, i);
#else
  const bf16* stacked = i == 6 ? P.qnorm : i == 7 ? P.knorm : nullptr;
  return stacked ? stacked + (size_t)layer * HD : nullptr;
#endif
}

__device__ __forceinline__ PhaseShape phase_shape(const Params& P, int layer, int p) {
  PhaseShape s;
#if OWN_WEIGHTS
  s.w = wtab(P, layer, p == 0 ? 0 : p - 1);
  s.n = p == 0 ? QKV_N : p == 3 ? 2 * INTER : HID;
  s.k = p == 2 ? QN : p == 4 ? INTER : HID;
  s.ksplit = s.k / KPART;
  s.grp = p == 3 ? ROWS : GROWS;  // gate_up: 8 gate and 8 up rows a group
  return s;
#endif
  if (p == 0) { s.w = P.wqkv + (size_t)layer * QKV_N * HID; s.n = QKV_N; s.k = HID; }
  else if (p == 2) { s.w = P.wo + (size_t)layer * HID * QN; s.n = HID; s.k = QN; }
  else if (p == 3) { s.w = P.wgu + (size_t)layer * 2 * INTER * HID; s.n = 2 * INTER; s.k = HID; }
  else { s.w = P.wdown + (size_t)layer * HID * INTER; s.n = HID; s.k = INTER; }
  s.ksplit = s.k / KPART;
  return s;
}

#if !OWN_WEIGHTS
// The phase input x[:m] (bf16, row stride `stride`) into shared memory, rows >= m zero; warp w
// takes row w (MR = NCW), all its loads in flight at once. With `with_norm`, also each row's sum
// of squares into norm[row] (the norms' weights are folded into the tiled weights).
__device__ __noinline__ void load_x(char* smem, const bf16* src, int stride, int m, bool with_norm, int warp, int lane) {
  static_assert(MR == NCW && KPART % 512 == 0, "a warp a row, 8 columns a lane, in halves");
  constexpr int PER = KPART / 256 / 2;  // 16-byte loads a lane, per half of the row
  uint32_t* row = reinterpret_cast<uint32_t*>(smem + SMEM_X + warp * XS);
  const bf16* x = src + (size_t)warp * stride;
  float ss = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = (half * PER + i) * 256 + lane * 8;
      v[i] = warp < m ? __ldcg(reinterpret_cast<const uint4*>(x + c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = (half * PER + i) * 256 + lane * 8;
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&v[i]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
        ss += f.x * f.x + f.y * f.y;
      }
      *reinterpret_cast<uint4*>(row + c / 2) = v[i];
    }
  }
  if (with_norm) {
    ss = warp_sum(ss);
    if (lane == 0) reinterpret_cast<float*>(smem + SMEM_NORM)[warp] = ss;
  }
  consumer_sync();
}

#endif

// RMSNorm's 1 / rms of input row m from the sums of squares load_x (one a row) or load_xfrag (a
// part a warp, added in warp order) left in norm.
__device__ __forceinline__ float row_rsqrt(const float* norm, int m, float eps) {
#if OWN_WEIGHTS
  float ss = 0.f;
  for (int w = 0; w < NCW; ++w) ss += norm[w * MR + m];
  return rsqrtf(ss / HID + eps);
#else
  return rsqrtf(norm[m] / HID + eps);
#endif
}

__device__ void epilogue(char* smem, const Params& P, int p, int part, int g) {
  const float* red = reinterpret_cast<const float*>(smem + SMEM_RED);
  const float* norm = reinterpret_cast<const float*>(smem + SMEM_NORM);
  const int t = threadIdx.x;
  if (p == 3) {
    if (t < 64) {
      int r = t / MR, mm = t % MR;
      if (mm >= P.m) return;
      float gs = 0.f, us = 0.f;
      for (int w = 0; w < NCW; ++w) { gs += red[(w * ROWS + r) * MR + mm]; us += red[(w * ROWS + r + 8) * MR + mm]; }
      float rs = row_rsqrt(norm, mm, P.eps);
      gs = bfr(gs * rs); us = bfr(us * rs);
      P.h[(size_t)mm * INTER + g * 8 + r] = __float2bfloat16_rn(gs / (1.f + __expf(-gs)) * us);
    }
    return;
  }
  if (t >= GROWS * MR) return;
  int r = t / MR, mm = t % MR, n = g * GROWS + r;
  if (mm >= P.m) return;
  float s = 0.f;
  for (int w = 0; w < NCW; ++w) s += red[(w * ROWS + r) * MR + mm];
  if (p == 0) {
    P.qkv[(size_t)mm * QKV_N + n] = __float2bfloat16_rn(s * row_rsqrt(norm, mm, P.eps));
  } else if (p == 2) {
    bf16* st = P.stream + (size_t)mm * HID + n;
    *st = __float2bfloat16_rn(__bfloat162float(*st) + bfr(s));
  } else {
    P.down[((size_t)part * MR + mm) * HID + n] = s;
  }
}

// End of a down phase: the sum of the K parts added to the residual stream.
__device__ void finish_down(const Params& P, int g0, int g1) {
  finish_parts<GROWS>(P.gcount, P.down, HID, INTER / KPART, g0, g1 - g0, (int)P.m, [&](int row, int col, float v) {
    bf16* st = P.stream + (size_t)row * HID + col;
    *st = __float2bfloat16_rn(__bfloat162float(*st) + bfr(v));
  });
}

// ---- attention -------------------------------------------------------------------------------
// Lane l holds dims 4l .. 4l+3 of a head. Per-head RMSNorm (weight w) then rotate-half RoPE,
// rounded to bf16 where the engine's fused kernel rounds.
__device__ __forceinline__ void norm_rope(float (&x)[4], const bf16* w, const float* cs, const float* sn, float eps,
                                          int lane) {
  if (w) {
    float s = warp_sum(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]);
    float inv = rsqrtf(s / HD + eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = bfr(__bfloat162float(w[4 * lane + i]) * bfr(x[i] * inv));
  }
  float other[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) other[i] = __shfl_xor_sync(0xffffffffu, x[i], 16);
  const int d0 = (4 * lane) % (HD / 2);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float c = cs[d0 + i], s = sn[d0 + i];
    x[i] = bfr(lane < 16 ? x[i] * c - other[i] * s : x[i] * c + other[i] * s);
  }
}

__device__ __forceinline__ void load4(float (&x)[4], const bf16* p) {
  uint2 v = *reinterpret_cast<const uint2*>(p);
  float2 a = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v.x));
  float2 b = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v.y));
  x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
}

__device__ __forceinline__ void store4(bf16* p, const float (&x)[4]) {
  __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&a);
  v.y = *reinterpret_cast<uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = v;
}

// Phase 1: q/k RMSNorm + RoPE; rotated q to qrot, rotated k and v into the paged cache. One warp a
// (sequence, head) of the HQ query and HKV key heads.
__device__ void rope_phase(const Params& P, int layer, const bf16* qnorm, const bf16* knorm, int warp, int lane) {
  const int items = (int)P.m * (HQ + HKV);
  for (int item = blockIdx.x * NCW + warp; item < items; item += gridDim.x * NCW) {
    const int s = item / (HQ + HKV), head = item % (HQ + HKV);
    const long long pos = P.positions[s];
    const float* cs = P.cos + pos * (HD / 2);
    const float* sn = P.sin + pos * (HD / 2);
    const bf16* row = P.qkv + (size_t)s * QKV_N;
    float x[4];
    if (head < HQ) {
      load4(x, row + head * HD + 4 * lane);
      norm_rope(x, qnorm, cs, sn, P.eps, lane);
      store4(P.qrot + ((size_t)s * HQ + head) * HD + 4 * lane, x);
    } else {
      const int kvh = head - HQ;
      bf16* kc = P.kv + (size_t)layer * P.layer_stride;
      const size_t at = ((size_t)P.slots[s] * HKV + kvh) * HD + 4 * lane;
      load4(x, row + QN + kvh * HD + 4 * lane);
      norm_rope(x, knorm, cs, sn, P.eps, lane);
      store4(kc + at, x);
      load4(x, row + QN + HKV * HD + kvh * HD + 4 * lane);
      store4(kc + P.kv_stride + at, x);
    }
  }
}

// acc += this warp's share of the weight tile at st (16 rows x KC, shared memory) times x's
// columns at xs (this lane's B fragments): KS mma.sync k-steps over the warp's WCOLS columns.
__device__ __forceinline__ void tile_mma(float (&acc)[4], uint32_t st, uint32_t xs, int warp, int lane) {
  const int arow = lane % 16;  // this lane's ldmatrix row of the tile
  uint32_t xb[KS][2];
#pragma unroll
  for (int i = 0; i < KS / 2; ++i)
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(xb[2 * i][0]), "=r"(xb[2 * i][1]),
                 "=r"(xb[2 * i + 1][0]), "=r"(xb[2 * i + 1][1]) : "r"(xs + 16 * i));
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const int chunk = warp * (WCOLS / 8) + 2 * ks + lane / 16;  // this lane's 16-byte chunk of the row
    uint32_t a0, a1, a2, a3;
    ldmatrix_x4(st + arow * ROW_BYTES + ((chunk ^ (arow & 7)) * 16), a0, a1, a2, a3);
    mma(acc, a0, a1, a2, a3, xb[ks][0], xb[ks][1]);
  }
}

#if OWN_WEIGHTS
// The phase input x[:m] (bf16, row stride `stride`, rows >= m zero) as this lane's mma A fragments:
// lane (g, t) of warp w holds row g's 16-byte chunks w * KW + 8 (4 j + t) (j < XJ), two k-steps
// each ({a0, a2} of k-step 2j, then of 2j + 1; rows 8-15 of A are zero). group_mma reads the
// weights' B fragments from the same columns, so the order of k inside a 32-column chunk does not
// matter. With `with_norm`, the warp's part of each row's sum of squares goes to norm[w][g]; with
// `gain` (the RMSNorm's weight), x * gain (rounded to bf16) is held.
__device__ __forceinline__ void load_xfrag(uint32_t (&xa)[XJ][4], float* norm, const bf16* src, int stride, int m,
                                           bool with_norm, const bf16* gain, int warp, int lane) {
  const int g = lane / 4, col = warp * KW + 8 * (lane % 4);
  const bf16* x = src + (size_t)g * stride + col;
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < XJ; ++j) {
    uint4 v = g < m ? __ldcg(reinterpret_cast<const uint4*>(x + 32 * j)) : make_uint4(0, 0, 0, 0);
    uint4 gv = gain ? __ldg(reinterpret_cast<const uint4*>(gain + col + 32 * j)) : make_uint4(0, 0, 0, 0);
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w[i]));
      ss += f.x * f.x + f.y * f.y;
      if (gain) {
        const float2 gg = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(&gv)[i]);
        const __nv_bfloat162 r = __floats2bfloat162_rn(f.x * gg.x, f.y * gg.y);
        w[i] = *reinterpret_cast<const uint32_t*>(&r);
      }
      xa[j][i] = w[i];
    }
  }
  if (with_norm) {
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    if (lane % 4 == 0) norm[warp * MR + g] = ss;
  }
}

// acc += x times the warp's KW columns of the GR weight rows at st (a stage, rows KPART long):
// lane (g, t) reads row g's chunks as its B fragments (16-byte loads), 2 XJ mma k-steps. acc[0..1]
// end as out[x row g][weight rows 2t, 2t + 1]; acc[2..3] stay zero (A's rows 8-15).
__device__ __forceinline__ void group_mma(float (&acc)[4], uint32_t st, const uint32_t (&xa)[XJ][4], int warp,
                                          int lane) {
  const uint32_t base = st + (lane / 4) * (KPART * 2) + (warp * KW + 8 * (lane % 4)) * 2;
#pragma unroll
  for (int j = 0; j < XJ; ++j) {
    uint32_t b0, b1, b2, b3;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(base + 64 * j));
    mma(acc, xa[j][0], 0u, xa[j][1], 0u, b0, b1);
    mma(acc, xa[j][2], 0u, xa[j][3], 0u, b2, b3);
  }
}

// Producer: this CTA's groups of phase s, a stage each (gate_up: the group's 8 gate rows, then its 8
// up rows): one bulk copy of GR whole rows where K is one part, else one a row (lanes 0 .. GR - 1).
__device__ __forceinline__ void produce_phase_groups(uint32_t ring, uint32_t full, const PhaseShape& s, bool gate_up,
                                                     int& it) {
  const int lane = threadIdx.x % 32, kpart = s.k / s.ksplit;
  int part, g0, g1;
  my_work(s, part, g0, g1);
  for (int g = g0; g < g1; ++g)
    for (int half = 0; half <= (int)gate_up; ++half, ++it) {
      const int slot = it % NSTAGE;
      const uint32_t dst = ring + slot * STAGE_BYTES, bar = full + 8 * slot;
      const bf16* src = s.w + (size_t)(half * INTER + GR * g) * s.k + part * kpart;
      if (lane == 0) {
        mbar_wait(full + 8 * (NSTAGE + slot), ((it / NSTAGE) & 1) ^ 1);
        mbar_expect_tx(bar, STAGE_BYTES);
        if (s.ksplit == 1) bulk_g2s(dst, src, STAGE_BYTES, bar);
      }
      __syncwarp();
      if (s.ksplit > 1 && lane < GR) bulk_g2s(dst + lane * KPART * 2, src + (size_t)lane * s.k, KPART * 2, bar);
    }
}
#endif

// Runs global phases [phase_begin, phase_end) (phase = layer * 5 + p); the counter is zero at the
// step's first launch and counts every phase's end across launches.
extern "C" __global__ void __launch_bounds__((NCW + 1) * 32, 1) decode_stream(int phase_begin, int phase_end) {
  extern __shared__ __align__(128) char smem[];
  const Params& P = c_params;
  const uint32_t ring = smem_u32(smem);
  const uint32_t full = smem_u32(smem + SMEM_BAR);
  const uint32_t empty = full + NSTAGE * 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  ring_init(full, NSTAGE);

  if (warp == NCW) {  // producer
#if !OWN_WEIGHTS
    if (lane != 0) return;
#endif
    // phases with weights (p != 1); each one's shape (OWN_WEIGHTS: a pointer load) read while the
    // previous one streams
    auto weight_phase = [](int phase) { return phase + (phase % 5 == 1); };
    int it = 0, phase = weight_phase(phase_begin);
    PhaseShape next{};
    if (phase < phase_end) next = phase_shape(P, phase / 5, phase % 5);
    while (phase < phase_end) {
      const PhaseShape s = next;
      const int following = weight_phase(phase + 1);
      if (following < phase_end) next = phase_shape(P, following / 5, following % 5);
#if OWN_WEIGHTS
      produce_phase_groups(ring, full, s, phase % 5 == 3, it);
#else
      produce_phase(ring, full, NSTAGE, STAGE_BYTES, s, CHUNKS, it);
#endif
      phase = following;
    }
    return;
  }

  const int no_grid_wait = P.mode & 1, stream_only = P.mode & 2, no_mma = stream_only && (P.mode & 4);
  const int m = (int)P.m;
  float* red = reinterpret_cast<float*>(smem + SMEM_RED);
#if OWN_WEIGHTS
  uint32_t xa[XJ][4] = {};
#else
  // this lane's B fragments of chunk c: x[lane / 4][c * KC + warp * WCOLS + 4 KS (lane % 4) .. + 4 KS]
  const uint32_t xrow = smem_u32(smem + SMEM_X) + (lane / 4) * XS + (warp * WCOLS + 4 * KS * (lane % 4)) * 2;
#endif
  int it = 0;
  for (int phase = phase_begin; phase < phase_end; ++phase) {
      const int layer = phase / 5, p = phase % 5;
      // the phase's norm weights (OWN_WEIGHTS: global loads), issued before the barrier: the input's
      // (p 0, 3; null when folded into the weights), or q's and k's (p 1)
      const bf16* norm = p == 2 || p == 4 ? nullptr : norm_weight(P, layer, p == 0 ? 4 : p == 3 ? 5 : 6);
      const bf16* knorm = p == 1 ? norm_weight(P, layer, 7) : nullptr;
      if (phase > phase_begin && !no_grid_wait) grid_wait(P.counter, phase * gridDim.x);
      if (p == 1) {
        if (!stream_only) rope_phase(P, layer, norm, knorm, warp, lane);
        grid_arrive(P.counter);
        continue;
      }
      PhaseShape s = phase_shape(P, layer, p);
      int part, g0, g1;
      my_work(s, part, g0, g1);
      if (g1 > g0 && !stream_only) {
        const bf16* src; int stride;
        if (p == 0 || p == 3) { src = P.stream; stride = HID; }
        else if (p == 2) { src = P.attn; stride = QN; }
        else { src = P.h + part * KPART; stride = INTER; }
        const bool with_norm = (p == 0 || p == 3) && !(P.mode & 8);
#if OWN_WEIGHTS
        load_xfrag(xa, reinterpret_cast<float*>(smem + SMEM_NORM), src, stride, m, with_norm, norm, warp, lane);
#else
        load_x(smem, src, stride, m, with_norm, warp, lane);
#endif
      }
#if OWN_WEIGHTS
      for (int g = g0; g < g1; ++g) {
        float acc[2][4] = {};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if (half && p != 3) break;
          const int slot = it % NSTAGE;
          mbar_wait(full + 8 * slot, (it / NSTAGE) & 1);
          if (!no_mma) group_mma(acc[half], ring + slot * STAGE_BYTES, xa, warp, lane);
          __syncwarp();
          if (lane == 0) mbar_arrive(empty + 8 * slot);
          ++it;
        }
        if (!stream_only) {
          const int r = 2 * (lane % 4), mm = lane / 4;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            red[(warp * ROWS + 8 * half + r) * MR + mm] = acc[half][0];
            red[(warp * ROWS + 8 * half + r + 1) * MR + mm] = acc[half][1];
          }
          consumer_sync();
          epilogue(smem, P, p, part, g);
          consumer_sync();
        }
      }
#else
      for (int g = g0; g < g1; ++g) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          const int slot = (it + c) % NSTAGE;
          mbar_wait(full + 8 * slot, ((it + c) / NSTAGE) & 1);
          if (!no_mma) tile_mma(acc, ring + slot * STAGE_BYTES, xrow + c * KC * 2, warp, lane);
          __syncwarp();
          if (lane == 0) mbar_arrive(empty + 8 * slot);
        }
        it += CHUNKS;
        if (!stream_only) {
          const int r = lane / 4, mm = 2 * (lane % 4);
          red[(warp * ROWS + r) * MR + mm] = acc[0];
          red[(warp * ROWS + r) * MR + mm + 1] = acc[1];
          red[(warp * ROWS + r + 8) * MR + mm] = acc[2];
          red[(warp * ROWS + r + 8) * MR + mm + 1] = acc[3];
          consumer_sync();
          epilogue(smem, P, p, part, g);
          consumer_sync();
        }
      }
#endif
      if (p == 4 && !stream_only && g1 > g0) finish_down(P, g0, g1);
      grid_arrive(P.counter);
    }
}

extern "C" __global__ void decode_stream_smem(int* out) { *out = SMEM_TOTAL; }
