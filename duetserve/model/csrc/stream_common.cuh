// Pieces shared by the weight-stream kernels (weight_stream.cu, decode_stream.cu): the ring's
// mbarrier and bulk-copy (TMA) primitives, the mma.sync tile, the static split of a phase's
// 16-row groups over the CTAs, and the grid barrier (one counter, arrivals count phases' ends).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define ROWS 16             // weight rows a tile (the mma's M)
#ifndef KC
#define KC 512              // weight columns a tile
#endif
#define ROW_BYTES (KC * 2)
#define MR 8                // input rows (sequences) at most
#define NCW 8               // consumer warps; warp NCW is the producer

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile("{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n"
               ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& a0, uint32_t& a1, uint32_t& a2, uint32_t& a3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(addr));
}
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Barriers of a ring of `stages` stages at full (and empty = full + 8 * stages): a stage is full
// once its bulk copy landed (one arrival with the bytes expected), empty once all NCW consumer
// warps arrived. Ends with __syncthreads.
__device__ __forceinline__ void ring_init(uint32_t full, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { mbar_init(full + 8 * s, 1); mbar_init(full + 8 * (stages + s), NCW); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// Producer: stage number `it` of the stream (slot it % stages) gets `bytes` from src once empty.
__device__ __forceinline__ void produce(uint32_t ring, uint32_t full, int stages, int stage_bytes, int it,
                                       const void* src, uint32_t bytes) {
  const int slot = it % stages;
  mbar_wait(full + 8 * (stages + slot), ((it / stages) & 1) ^ 1);
  mbar_expect_tx(full + 8 * slot, bytes);
  bulk_g2s(ring + slot * stage_bytes, src, bytes, full + 8 * slot);
}

// One weight phase: weight w ([n, k] in the stream layout), K in ksplit parts of KPART, split
// over the CTAs in groups of grp rows.
struct PhaseShape { const bf16* w; int n, k, ksplit; int grp = ROWS; };

__device__ __forceinline__ void my_work(const PhaseShape& s, int& part, int& g0, int& g1) {
  int per = gridDim.x / s.ksplit;
  part = blockIdx.x / per;
  int i = blockIdx.x % per, groups = s.n / s.grp;
  if (part >= s.ksplit) { part = 0; g0 = g1 = 0; return; }
  g0 = (int)((long)groups * i / per);
  g1 = (int)((long)groups * (i + 1) / per);
}

__device__ __forceinline__ void grid_arrive(unsigned int* counter) {
  consumer_sync();
  if (threadIdx.x == 0) { __threadfence(); atomicAdd(counter, 1u); }
}
__device__ __forceinline__ void grid_wait(unsigned int* counter, unsigned int target) {
  if (threadIdx.x == 0) {
    unsigned int v;
    do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory"); } while (v < target);
    __threadfence();
  }
  consumer_sync();
}


// End of a phase whose K is split in `parts` (partial sums in part_sums[parts][MR][n_cols], fp32):
// for each of this CTA's row groups (R rows each) g0 .. g0 + ng - 1, the CTA that finished the group's last part
// adds the parts, in order (deterministic), and hands each sum to store(row, column, value) for
// the rows below m; it also sets gcount[g] back to 0. One fence and one atomic round for all groups.
template <int R, typename Store>
__device__ __forceinline__ void finish_parts(unsigned int* gcount, const float* part_sums, int n_cols, int parts,
                                             int g0, int ng, int m, Store store) {
  __shared__ unsigned char last[128];
  consumer_sync();
  if ((int)threadIdx.x < ng) {
    __threadfence();
    last[threadIdx.x] = atomicAdd(gcount + g0 + threadIdx.x, 1u) == (unsigned)parts - 1;
    __threadfence();
  }
  consumer_sync();
  for (int e = threadIdx.x; e < ng * R * MR; e += NCW * 32) {
    const int gi = e / (R * MR);
    if (!last[gi]) continue;
    const int r = (e / MR) % R, row = e % MR, col = (g0 + gi) * R + r;
    if (r == 0 && row == 0) gcount[g0 + gi] = 0;
    if (row >= m) continue;
    float v = 0.f;
    for (int q = 0; q < parts; ++q) v += __ldcg(part_sums + ((size_t)q * MR + row) * n_cols + col);
    store(row, col, v);
  }
}

// Producer: every tile of this CTA's share of phase s, in the order the consumers take them
// (row group by row group, `chunks` tiles of ROWS x KC each); `it` counts stages across phases.
__device__ __forceinline__ void produce_phase(uint32_t ring, uint32_t full, int stages, int stage_bytes,
                                             const PhaseShape& s, int chunks, int& it) {
  int part, g0, g1;
  my_work(s, part, g0, g1);
  for (int g = g0; g < g1; ++g)
    for (int c = 0; c < chunks; ++c, ++it)
      produce(ring, full, stages, stage_bytes, it, s.w + (((size_t)part * (s.n / ROWS) + g) * chunks + c) * (ROWS * KC),
              ROWS * ROW_BYTES);
}

// Producer, weights in their own [N, K] layout (ROWCOPY builds): each tile's 16 rows are one-row
// bulk copies (KC columns: 2 KB pieces or more keep the copy rate up) issued by lanes 0-15 (every lane of the producer warp calls this). With up_rows > 0
// (gate_up as [gate; up]) a group takes 8 gate rows and the same 8 rows of the up half.
__device__ __forceinline__ void produce_phase_rows(uint32_t ring, uint32_t full, int stages, int stage_bytes,
                                                  int row_stride, const PhaseShape& s, int chunks, int up_rows,
                                                  int& it) {
  const int lane = threadIdx.x % 32, kpart = s.k / s.ksplit;
  int part, g0, g1;
  my_work(s, part, g0, g1);
  for (int g = g0; g < g1; ++g)
    for (int c = 0; c < chunks; ++c, ++it) {
      const int slot = it % stages;
      if (lane == 0) {
        mbar_wait(full + 8 * (stages + slot), ((it / stages) & 1) ^ 1);
        mbar_expect_tx(full + 8 * slot, ROWS * ROW_BYTES);
      }
      __syncwarp();
      if (lane < ROWS) {
        const int row = up_rows ? (lane < 8 ? 8 * g + lane : up_rows + 8 * g + lane - 8) : ROWS * g + lane;
        bulk_g2s(ring + slot * stage_bytes + lane * row_stride, s.w + (size_t)row * s.k + part * kpart + c * KC,
                 ROW_BYTES, full + 8 * slot);
      }
    }
}
