// A persistent decode "weight stream" kernel (scripts/bench_weight_stream.py) for the 4 GEMMs of each layer
// (qkv, o, gate_up + SiLU*mul, down), M = 8 rows, bf16 weights, fp32 accumulation.
// One CTA per SM. Warp 8 (producer) streams every weight tile this CTA owns, phase after phase,
// layer after layer, into a ring of shared-memory stages with 1-D bulk copies (TMA), gated only
// by free stages. Warps 0-7 (consumers) wait at a grid barrier for each phase's input, load it
// into registers, and run mma.sync over the ring. The weight stream never waits for a barrier.
#include "../../duetserve/model/csrc/stream_common.cuh"

#ifndef NSTAGE
#define NSTAGE 13
#endif
#ifndef ROWCOPY
#define ROWCOPY 0  // 1: weights in their own [N, K] layout, a stage = 16 one-row bulk copies from 16 lanes
#endif
#if ROWCOPY
#define ROW_STRIDE (ROW_BYTES + 16)  // padded: ldmatrix without bank conflicts
#else
#define ROW_STRIDE ROW_BYTES
#endif
#define STAGE_BYTES (ROWS * ROW_STRIDE)
#define KPART 4096
#define CHUNKS (KPART / KC)
#define HID 4096
#define QKV_N 6144
#define INTER 12288
#define GU_N (2 * INTER)

#define SMEM_RING 0
#define SMEM_RED (SMEM_RING + NSTAGE * STAGE_BYTES)
#define SMEM_BAR (SMEM_RED + NCW * ROWS * MR * 4)
#define SMEM_TOTAL (SMEM_BAR + 2 * NSTAGE * 8)

struct Weights {
  const __nv_bfloat16* qkv;  // [L][6144][4096]
  const __nv_bfloat16* o;    // [L][4096][4096]
  const __nv_bfloat16* gu;   // [L][24576][4096], groups of 16 rows: 8 gate rows, then the 8 matching up rows
  const __nv_bfloat16* down; // [L][4096][12288]
};

struct Acts {
  const __nv_bfloat16* x0;  // [8][4096] input of layer 0
  __nv_bfloat16* qkv;       // [8][6144]
  __nv_bfloat16* o;         // [8][4096]
  __nv_bfloat16* x;         // [8][4096] a layer's output (sum of the down partials)
  __nv_bfloat16* h;         // [8][12288]
  float* down;              // [3][8][4096] partial sums over 4096-column parts of K
  unsigned int* counter;    // grid barrier, zero at launch
  unsigned int* gcount;     // [256] per down row group: K parts done (the last resets it to 0)
  unsigned long long* clock;  // per CTA end time (globaltimer), or null
};

// Phase p of a layer: 0 qkv, 1 o, 2 gate_up, 3 down.
__device__ __forceinline__ PhaseShape phase_shape(const Weights& W, int layer, int p) {
  PhaseShape s;
  if (p == 0) { s.w = W.qkv + (size_t)layer * QKV_N * HID; s.n = QKV_N; s.k = HID; s.ksplit = 1; }
  else if (p == 1) { s.w = W.o + (size_t)layer * HID * HID; s.n = HID; s.k = HID; s.ksplit = 1; }
  else if (p == 2) { s.w = W.gu + (size_t)layer * GU_N * HID; s.n = GU_N; s.k = HID; s.ksplit = 1; }
  else { s.w = W.down + (size_t)layer * HID * INTER; s.n = HID; s.k = INTER; s.ksplit = INTER / KPART; }
  return s;
}

// This warp's B fragments of the phase input. The weight tiles permute the columns of each warp's
// 64-column slice (mma k-step ks, index kappa <- column 16 q + 4 ks + j, q = (kappa % 8) / 2,
// j = kappa % 2 + 2 (kappa / 8)), so lane (m = lane / 4, q = lane % 4) needs x[m][slice + 16 q .. + 16]:
// two 16-byte loads a chunk.
__device__ __forceinline__ void load_xb(uint32_t (&xb)[CHUNKS][4][2], const Acts& A, int layer, int p, int part,
                                        int warp, int lane) {
  const __nv_bfloat16* src; int stride;
  if (p == 0) { src = layer == 0 ? A.x0 : A.x; stride = HID; }
  else if (p == 1) { src = A.qkv; stride = QKV_N; }
  else if (p == 2) { src = A.o; stride = HID; }
  else { src = A.h + part * KPART; stride = INTER; }
#if ROWCOPY  // natural column order: b0 = x[m][k + 2q, +1], b1 = x[m][k + 8 + 2q, +1]
  const __nv_bfloat16* row = src + (size_t)(lane / 4) * stride + warp * 64 + 2 * (lane % 4);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      xb[c][ks][0] = __ldcg(reinterpret_cast<const unsigned int*>(row + c * KC + ks * 16));
      xb[c][ks][1] = __ldcg(reinterpret_cast<const unsigned int*>(row + c * KC + ks * 16 + 8));
    }
#else
  const __nv_bfloat16* row = src + (size_t)(lane / 4) * stride + warp * 64 + 16 * (lane % 4);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint4 v = __ldcg(reinterpret_cast<const uint4*>(row + c * KC + 8 * h));
      xb[c][2 * h][0] = v.x; xb[c][2 * h][1] = v.y; xb[c][2 * h + 1][0] = v.z; xb[c][2 * h + 1][1] = v.w;
    }
#endif
}

__device__ void epilogue(char* smem, const Acts& A, int p, int part, int g) {
  const float* red = reinterpret_cast<const float*>(smem + SMEM_RED);
  int t = threadIdx.x;
  if (p == 2) {
    if (t < 64) {
      int r = t / MR, m = t % MR;
      float gs = 0.f, us = 0.f;
      for (int w = 0; w < NCW; ++w) { gs += red[(w * ROWS + r) * MR + m]; us += red[(w * ROWS + r + 8) * MR + m]; }
      float hv = gs / (1.f + __expf(-gs)) * us;
      A.h[(size_t)m * INTER + g * 8 + r] = __float2bfloat16_rn(hv);
    }
  } else if (t < ROWS * MR) {
    int r = t / MR, m = t % MR;
    float s = 0.f;
    for (int w = 0; w < NCW; ++w) s += red[(w * ROWS + r) * MR + m];
    int n = g * ROWS + r;
    if (p == 0) A.qkv[(size_t)m * QKV_N + n] = __float2bfloat16_rn(s);
    else if (p == 1) A.o[(size_t)m * HID + n] = __float2bfloat16_rn(s);
    else A.down[((size_t)part * MR + m) * HID + n] = s;
  }
}

// End of a down phase: the sum of the K parts into x.
__device__ void finish_down(const Acts& A, int g0, int g1) {
  finish_parts<ROWS>(A.gcount, A.down, HID, INTER / KPART, g0, g1 - g0, MR, [&](int row, int col, float v) {
    A.x[(size_t)row * HID + col] = __float2bfloat16_rn(v);
  });
}

extern "C" __global__ void __launch_bounds__((NCW + 1) * 32, 1)
mk_chain(const __nv_bfloat16* wqkv, const __nv_bfloat16* wo, const __nv_bfloat16* wgu, const __nv_bfloat16* wdown,
         const __nv_bfloat16* x0, __nv_bfloat16* aqkv, __nv_bfloat16* ao, __nv_bfloat16* ax, __nv_bfloat16* ah,
         float* adown, unsigned int* counter, unsigned int* gcount, unsigned long long* clock, int layers, int mode) {
  // mode bit 0: no grid wait (wrong values); bit 1: no input load or epilogue (stream only)
  const int no_grid_wait = mode & 1, stream_only = mode & 2;
  const Weights W{wqkv, wo, wgu, wdown};
  const Acts A{x0, aqkv, ao, ax, ah, adown, counter, gcount, clock};
  extern __shared__ __align__(128) char smem[];
  const uint32_t ring = smem_u32(smem + SMEM_RING);
  const uint32_t full = smem_u32(smem + SMEM_BAR);
  const uint32_t empty = full + NSTAGE * 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  ring_init(full, NSTAGE);

  if (warp == NCW) {  // producer
#if ROWCOPY
    int it = 0;
    for (int layer = 0; layer < layers; ++layer)
      for (int p = 0; p < 4; ++p)
        produce_phase_rows(ring, full, NSTAGE, STAGE_BYTES, ROW_STRIDE, phase_shape(W, layer, p), CHUNKS,
                           p == 2 ? INTER : 0, it);
#else
    if (lane != 0) return;
    int it = 0;
    for (int layer = 0; layer < layers; ++layer)
      for (int p = 0; p < 4; ++p) produce_phase(ring, full, NSTAGE, STAGE_BYTES, phase_shape(W, layer, p), CHUNKS, it);
#endif
    return;
  }

  // consumers
  float* red = reinterpret_cast<float*>(smem + SMEM_RED);
  uint32_t xb[CHUNKS][4][2];
  int it = 0;
  unsigned int phase_index = 0;
  for (int layer = 0; layer < layers; ++layer)
    for (int p = 0; p < 4; ++p, ++phase_index) {
      if (phase_index > 0 && !no_grid_wait) grid_wait(A.counter, phase_index * gridDim.x);
      PhaseShape s = phase_shape(W, layer, p);
      int part, g0, g1;
      my_work(s, part, g0, g1);
      if (g1 > g0 && !stream_only) load_xb(xb, A, layer, p, part, warp, lane);
      for (int g = g0; g < g1; ++g) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          int slot = (it + c) % NSTAGE;
          mbar_wait(full + 8 * slot, ((it + c) / NSTAGE) & 1);
          const uint32_t st = ring + slot * STAGE_BYTES;
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            const int kk = warp * 64 + ks * 16;
            const int arow = lane % 16, achunk = (kk + (lane / 16) * 8) / 8;
            uint32_t a0, a1, a2, a3;
#if ROWCOPY
            ldmatrix_x4(st + arow * ROW_STRIDE + achunk * 16, a0, a1, a2, a3);
#else
            ldmatrix_x4(st + arow * ROW_STRIDE + ((achunk ^ (arow & 7)) * 16), a0, a1, a2, a3);
#endif
            mma(acc, a0, a1, a2, a3, xb[c][ks][0], xb[c][ks][1]);
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(empty + 8 * slot);
        }
        it += CHUNKS;
        int r = lane / 4, m = 2 * (lane % 4);
        red[(warp * ROWS + r) * MR + m] = acc[0];
        red[(warp * ROWS + r) * MR + m + 1] = acc[1];
        red[(warp * ROWS + r + 8) * MR + m] = acc[2];
        red[(warp * ROWS + r + 8) * MR + m + 1] = acc[3];
        if (!stream_only) {
          consumer_sync();
          epilogue(smem, A, p, part, g);
          consumer_sync();
        }
      }
      if (p == 3 && !stream_only && g1 > g0) finish_down(A, g0, g1);
      grid_arrive(A.counter);
    }
  if (A.clock && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    A.clock[blockIdx.x] = t;
  }
}

extern "C" __global__ void mk_smem_size(int* out) { *out = SMEM_TOTAL; }
