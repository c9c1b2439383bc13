// flash3: the FP8 forward's V path (§3.3, layout conformance): V arrives by TMA like K, head dim
// contiguous, but the FP8 WGMMA of O += P V reads its B operand k-major (keys contiguous), so
// warps of the producer warpgroup transpose each V tile in shared memory into a second ring
// (Vt) that the consumers read. The keys of each 32-key group are stored in the order that
// matches P's registers (the register permutation: fwd_fp8_mainloop.h, fp8_key_of_k).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/host_device.h"

namespace flash3::detail {

using namespace cute;

// The key (within a 32-key group) whose V row WGMMA k index kk reads. P's accumulator gives a
// thread of quad lane q the columns 8g + 2q + {0, 1}, g = 0..3; the FP8 A operand wants from it
// k = 4q + {0..3} and 16 + 4q + {0..3}. Packing its columns in order makes k = 4q + j (+16 h)
// the column 8 (j / 2 + 2 h) + 2q + j % 2: no data moves between threads.
FLASH3_HD constexpr int fp8_key_of_k(int kk) {
  const int h = kk / 16, q = (kk % 16) / 4, j = kk % 4;
  return 16 * h + 8 * (j / 2) + 2 * q + (j % 2);
}

// The V ring and the Vt ring, one index sequence: the TMA thread fills V stage s (v_full), the
// transposer warps read it (then v_empty) and write Vt stage s (after vt_empty; then vt_full),
// the consumers read Vt stage s (then vt_empty). For the TMA thread and the consumers it has
// the interface of CUTLASS's PipelineTmaAsync that fwd_load.h and the mainloop use: the producer
// side is V's, the consumer side Vt's. After its last tile the TMA thread completes one more V
// stage without data and with `stop` set (producer_stop): the transposers leave on it, so they
// need no scheduler of their own.
template <int kStages_, int kTransposeWarps, int kConsumerThreads>
struct Fp8VPipeline {
  static constexpr uint32_t Stages = kStages_;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using Barrier = cutlass::arch::ClusterBarrier;
  enum class ThreadCategory { NonParticipant, Producer, Consumer, ProducerConsumer };
  struct Params {
    uint32_t transaction_bytes = 0;
    ThreadCategory role = ThreadCategory::NonParticipant;
    uint32_t is_leader = 0;
    uint32_t num_consumers = 0;
  };
  struct SharedStorage {
    FullBarrier v_full[Stages];
    Barrier v_empty[Stages], vt_full[Stages], vt_empty[Stages];
    int stop[Stages];
  };
  using State = cutlass::PipelineState<Stages>;

  SharedStorage& s;
  uint32_t bytes;

  template <class ClusterShape>
  __device__ Fp8VPipeline(SharedStorage& storage, const Params& p, ClusterShape) : s(storage), bytes(p.transaction_bytes) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < int(Stages); ++i) {
        s.stop[i] = 0;
        s.v_full[i].init(1);
        s.v_empty[i].init(kTransposeWarps);
        s.vt_full[i].init(kTransposeWarps);
        s.vt_empty[i].init(kConsumerThreads);
      }
    }
    cutlass::arch::fence_barrier_init();
  }

  // The TMA thread (fwd_load.h).
  __device__ __forceinline__ void producer_acquire(const State& st) {
    s.v_empty[st.index()].wait(st.phase());
    s.v_full[st.index()].arrive_and_expect_tx(bytes);
  }
  __device__ __forceinline__ uint64_t* producer_get_barrier(const State& st) {
    return reinterpret_cast<uint64_t*>(&s.v_full[st.index()]);
  }
  // The TMA thread, after its last load: the end, through the next V stage. NOTES: a flag per
  // stage: the transposers may still be on the other stage's last tile when it is set.
  __device__ __forceinline__ void producer_stop(const State& st) {
    s.v_empty[st.index()].wait(st.phase());
    *reinterpret_cast<volatile int*>(&s.stop[st.index()]) = 1;
    s.v_full[st.index()].arrive();  // release: the flag is visible to whoever sees the phase
  }
  // The consumers (the PV GEMM's B operand is Vt).
  __device__ __forceinline__ void consumer_wait(const State& st) { s.vt_full[st.index()].wait(st.phase()); }
  __device__ __forceinline__ void consumer_release(const State& st) { s.vt_empty[st.index()].arrive(); }
  // The transposer warps: V stage landed (false: the TMA thread's stop instead) and Vt stage
  // free; then both handed on (lane 0 of each warp, after the warp's shared-memory writes are
  // fenced for the async proxy).
  __device__ __forceinline__ bool transpose_wait(const State& st) {
    s.v_full[st.index()].wait(st.phase());
    if (*reinterpret_cast<volatile int*>(&s.stop[st.index()])) return false;
    s.vt_empty[st.index()].wait(st.phase() ^ 1);
    return true;
  }
  __device__ __forceinline__ void transpose_done(const State& st, bool lane0) {
    if (lane0) {
      s.v_empty[st.index()].arrive();
      s.vt_full[st.index()].arrive();
    }
  }
};

template <class Traits>
struct FwdFp8Transpose {
  static constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kWarps = Traits::kTransposeWarps, kStages = Traits::kStagesV;
  // A work unit of one warp: 32 keys (group g) x 16 head-dim bytes (chunk c), one
  // ldmatrix.x4.trans and one stmatrix.x4 (512 bytes). Warp w takes the chunks c = w + kWarps j.
  static constexpr int kGroups = kBlockN / 32, kChunks = kHeadDim / 16, kChunksPerWarp = kChunks / kWarps;

  // Byte offsets in the V and Vt stages. Both are CuTe's K-major swizzle atoms (8 rows of W
  // bytes, W = 128, 64 or 32: the widest that divides the row) tiled rows first: V (key, col) at
  // (col / Wv) * kBlockN * Wv + key * Wv + col % Wv, Vt (row, k) at (k / Wt) * kHeadDim * Wt +
  // row * Wt + k % Wt, with the swizzle XOR-ing the 16-byte chunk index within the atom with
  // bits 7.. of the offset (W / 16 - 1 of them). The XOR depends only on the lane (key mod 8,
  // or Vt row mod 16), so each thread keeps one source address per chunk of an atom row and
  // one destination address per key group, and every unit is an immediate offset from one of
  // them. tests/check_fp8_transpose_layout.cu checks these addresses against SmemLayoutV and
  // SmemLayoutVt for every unit, lane, warp and stage.
  static constexpr int atom_width(int bytes) { return bytes % 128 == 0 ? 128 : bytes % 64 == 0 ? 64 : 32; }
  static constexpr int kRowV = atom_width(kHeadDim), kChunksV = kRowV / 16, kMaskV = kChunksV - 1;
  static constexpr int kRowVt = atom_width(kBlockN), kMaskVt = kRowVt / 16 - 1;
  static constexpr int kStageBytes = kBlockN * kHeadDim;
  static constexpr int kSrcBases = kChunksV / kWarps;  // a warp's chunks within one atom row
  static_assert(kBlockN % 32 == 0 && kChunks % kWarps == 0 && kChunksV % kWarps == 0);
  static_assert(cosize_v<typename Traits::SmemLayoutV> == kStages * kStageBytes &&
                cosize_v<typename Traits::SmemLayoutVt> == kStages * kStageBytes);

  struct Addresses {
    uint32_t src[kSrcBases];  // chunk warp + kWarps jj of key `lane` in the first column of atoms
    uint32_t dst[kGroups];    // Vt row 16 warp + st_row, keys 32 g + st_col
  };

  // The Vt row (within the warp's 16) and key column that lane `lane` addresses in stmatrix.x4:
  // lanes 8m..8m+7 give the rows i = 0..7 of matrix m; matrices 0 and 1 (keys 0-15, 16-31) hold
  // Vt rows 2i + (i >= 4), matrices 2 and 3 rows 2i + (i < 4). A matrix's eight rows then differ
  // mod 8 and fall in eight distinct 16-byte bank groups of the swizzled Vt atom; rows 2i alone
  // (0, 2, .., 14) took four, two wavefronts per matrix.
  FLASH3_HD static constexpr int st_row(int lane) { return 2 * (lane % 8) + ((lane / 16) ^ ((lane % 8) / 4)); }
  FLASH3_HD static constexpr int st_col(int lane) { return 16 * ((lane / 8) % 2); }

  // v, vt: the rings' shared addresses (0 on the host check).
  FLASH3_HD static Addresses addresses(uint32_t v, uint32_t vt, int warp, int lane) {
    const int st_row = FwdFp8Transpose::st_row(lane), st_col = FwdFp8Transpose::st_col(lane);
    const int x_src = (((lane * kRowV) >> 7) & kMaskV) << 4;
    const int x_dst = (((st_row * kRowVt) >> 7) & kMaskVt) << 4;
    Addresses a;
    for (int jj = 0; jj < kSrcBases; ++jj) a.src[jj] = v + lane * kRowV + ((16 * (warp + kWarps * jj)) ^ x_src);
    for (int g = 0; g < kGroups; ++g)
      a.dst[g] = vt + (16 * warp + st_row) * kRowVt + (32 * g / kRowVt) * (kHeadDim * kRowVt) +
                 (((32 * g) % kRowVt + st_col) ^ x_dst);
    return a;
  }
  // Unit (j, g) of stage `stage`: chunk c = warp + kWarps j, so c mod kChunksV = warp + kWarps
  // (j mod kSrcBases) and c / kChunksV = j / kSrcBases.
  FLASH3_HD static constexpr uint32_t src(const Addresses& a, int j, int g, int stage) {
    return a.src[j % kSrcBases] + stage * kStageBytes + (j / kSrcBases) * (kBlockN * kRowV) + g * 32 * kRowV;
  }
  FLASH3_HD static constexpr uint32_t dst(const Addresses& a, int j, int g, int stage) {
    return a.dst[g] + stage * kStageBytes + 16 * kWarps * j * kRowVt;
  }

  // Transposes V stage kStage into Vt stage kStage.
  // ldmatrix.trans of 8 keys x 8 b16 columns (16 head-dim bytes) gives lane 4r + q the bytes
  // (V[2q][2r], V[2q][2r+1], V[2q+1][2r], V[2q+1][2r+1]) of its matrix; the four matrices are
  // keys 0-7, 8-15, 16-23, 24-31 of a 32-key group (lane l addresses key l). Byte permutes
  // (selectors sel_a, sel_b) then give Vt row 2r (and 2r + 1) at k = 4q..4q+3 the keys 2q,
  // 2q+1, 2q+8, 2q+9, which is fp8_key_of_k's order (and at k = 16 + 4q.. the keys 16 more),
  // and one stmatrix.x4 writes the four words: lane 4r + q supplies row r of each matrix, which
  // is Vt row 2r in matrices 0, 1 and 2r + 1 in 2, 3 for r < 4, the other way round for r >= 4
  // (st_row). kBatch units' ldmatrix go out before their stmatrix: their latencies overlap.
  static constexpr int kBatch = 2;
  template <int kStage>
  __device__ __forceinline__ static void tile(const Addresses& ad, uint32_t sel_a, uint32_t sel_b) {
#pragma unroll
    for (int j = 0; j < kChunksPerWarp; ++j) {
#pragma unroll
      for (int g0 = 0; g0 < kGroups; g0 += kBatch) {
        uint32_t r[kBatch][4];
#pragma unroll
        for (int b = 0; b < kBatch && g0 + b < kGroups; ++b)
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(r[b][0]), "=r"(r[b][1]), "=r"(r[b][2]), "=r"(r[b][3])
                       : "r"(src(ad, j, g0 + b, kStage))
                       : "memory");
#pragma unroll
        for (int b = 0; b < kBatch && g0 + b < kGroups; ++b)
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(dst(ad, j, g0 + b, kStage)),
                       "r"(__byte_perm(r[b][0], r[b][1], sel_a)), "r"(__byte_perm(r[b][2], r[b][3], sel_a)),
                       "r"(__byte_perm(r[b][0], r[b][1], sel_b)), "r"(__byte_perm(r[b][2], r[b][3], sel_b))
                       : "memory");
      }
    }
  }
  // The stage as a template argument: every unit's offset is an immediate.
  template <int kStage = 0>
  __device__ __forceinline__ static void tile_at(const Addresses& ad, uint32_t sel_a, uint32_t sel_b, int stage) {
    if constexpr (kStage + 1 < kStages) {
      if (stage != kStage) return tile_at<kStage + 1>(ad, sel_a, sel_b, stage);
    }
    tile<kStage>(ad, sel_a, sel_b);
  }

  // The transposer warps' loop over V stages, in the order the TMA thread fills them, until its
  // stop. t: the thread's index among the transposers.
  __device__ static void run(typename Traits::SharedStorage& shared, typename Traits::PipelineV& pipeline_v, int t) {
    const Addresses ad = addresses(cute::cast_smem_ptr_to_uint(shared.smem_v.data()),
                                   cute::cast_smem_ptr_to_uint(shared.smem_vt.data()), t / 32, t % 32);
    // Even Vt rows (bytes 0, 2, 4, 6 of the two words) in matrices 0, 1 for lanes 0-15, odd ones
    // for lanes 16-31 (st_row).
    const uint32_t sel_a = t % 32 < 16 ? 0x6420 : 0x7531, sel_b = sel_a ^ (0x6420 ^ 0x7531);
    typename Traits::PipelineStateV st;
    while (pipeline_v.transpose_wait(st)) {
      tile_at(ad, sel_a, sel_b, st.index());
      cutlass::arch::fence_view_async_shared();  // st.shared -> WGMMA (async proxy)
      __syncwarp();
      pipeline_v.transpose_done(st, t % 32 == 0);
      ++st;
    }
  }
};

}  // namespace flash3::detail
