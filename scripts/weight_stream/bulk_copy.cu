// Bulk-copy (TMA) streaming rate by copy size (scripts/bench_bulk_copy.py): one CTA per SM streams
// its share of a [rows, row_bytes] matrix into a shared-memory ring of `stages` stages of
// `stage_bytes`, a stage = stage_bytes / piece rows x `piece` bytes at one column (the row pattern
// of decode_stream.cu's ROWCOPY builds), one bulk copy a row, issued by lane 0 or by one lane a
// row (`lanes`). The consumer thread frees each stage as soon as it lands: the copies alone.
#include "../../duetserve/model/csrc/stream_common.cuh"

extern "C" __global__ void __launch_bounds__(64, 1) bulk_copy(const char* base, long long rows, int row_bytes,
                                                              int piece, int lanes, int stages, int stage_bytes) {
  extern __shared__ __align__(128) char smem[];
  const uint32_t ring = smem_u32(smem), full = smem_u32(smem + stages * stage_bytes), empty = full + 8 * stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { mbar_init(full + 8 * s, 1); mbar_init(empty + 8 * s, 1); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int per_stage = stage_bytes / piece, chunks = row_bytes / piece, lane = threadIdx.x % 32;
  const long long groups = rows / per_stage;
  const long long g0 = groups * blockIdx.x / gridDim.x, g1 = groups * (blockIdx.x + 1) / gridDim.x;
  int it = 0;
  for (long long g = g0; g < g1; ++g)
    for (int c = 0; c < chunks; ++c, ++it) {
      const int slot = it % stages, parity = (it / stages) & 1;
      if (threadIdx.x < 32) {  // producer warp
        if (lane == 0) {
          mbar_wait(empty + 8 * slot, parity ^ 1);
          mbar_expect_tx(full + 8 * slot, stage_bytes);
        }
        __syncwarp();
        for (int r = lanes ? lane : 0; r < per_stage && (lanes || lane == 0); r += lanes ? 32 : 1)
          bulk_g2s(ring + slot * stage_bytes + r * piece, base + (g * per_stage + r) * (long long)row_bytes + (long long)c * piece,
                   piece, full + 8 * slot);
      } else if (threadIdx.x == 32) {  // consumer
        mbar_wait(full + 8 * slot, parity);
        mbar_arrive(empty + 8 * slot);
      }
    }
}
