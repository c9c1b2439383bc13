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
  static constexpr int kWarps = Traits::kTransposeWarps;
  // A work unit of one warp: 32 keys x 16 head-dim bytes, one ldmatrix.x4.trans and one
  // stmatrix.x4 (512 bytes).
  static constexpr int kUnits = (kBlockN / 32) * (kHeadDim / 16);
  static_assert(kBlockN % 32 == 0 && kUnits % kWarps == 0);

  // Transposes V stage `stage` into Vt stage `stage`; warp: this warp's index among the
  // transposers, lane its lane.
  // ldmatrix.trans of 8 keys x 8 b16 columns (16 head-dim bytes) gives lane 4r + q the bytes
  // (V[2q][2r], V[2q][2r+1], V[2q+1][2r], V[2q+1][2r+1]) of its matrix; the four matrices are
  // keys 0-7, 8-15, 16-23, 24-31 of a 32-key group (lane l addresses key l). Byte permutes
  // then give Vt row 2r (and 2r + 1) at k = 4q..4q+3 the keys 2q, 2q+1, 2q+8, 2q+9, which is
  // fp8_key_of_k's order (and at k = 16 + 4q.. the keys 16 more), and one stmatrix.x4 writes
  // the four words: its matrices are Vt rows 2r at k 0-15, at k 16-31, rows 2r + 1 likewise.
  // NOTES: the addresses come from the CuTe layouts, about 25 instructions each; the
  // transposers bound the kernel (measured: 1.7-2.2x faster with the transpose skipped).
  template <class TensorV, class TensorVt>
  __device__ __forceinline__ static void tile(TensorV& sV, TensorVt& sVt, int stage, int warp, int lane) {
    const int st_row = 2 * (lane % 8) + lane / 16, st_col = 16 * ((lane / 8) % 2);
#pragma unroll 2
    for (int u = warp; u < kUnits; u += kWarps) {
      const int g = u / (kHeadDim / 16), c = u % (kHeadDim / 16);  // key group, head-dim chunk
      const uint32_t src = cute::cast_smem_ptr_to_uint(&sV(32 * g + lane, 16 * c, stage));
      const uint32_t dst = cute::cast_smem_ptr_to_uint(&sVt(16 * c + st_row, 32 * g + st_col, stage));
      uint32_t a, b, x, y;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(a), "=r"(b), "=r"(x), "=r"(y)
                   : "r"(src)
                   : "memory");
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(dst),
                   "r"(__byte_perm(a, b, 0x6420)), "r"(__byte_perm(x, y, 0x6420)), "r"(__byte_perm(a, b, 0x7531)),
                   "r"(__byte_perm(x, y, 0x7531))
                   : "memory");
    }
  }

  // The transposer warps' loop over V stages, in the order the TMA thread fills them, until its
  // stop. t: the thread's index among the transposers.
  __device__ static void run(typename Traits::SharedStorage& shared, typename Traits::PipelineV& pipeline_v, int t) {
    Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.smem_vt.data()), typename Traits::SmemLayoutVt{});
    typename Traits::PipelineStateV st;
    const int warp = t / 32, lane = t % 32;
    while (pipeline_v.transpose_wait(st)) {
      tile(sV, sVt, st.index(), warp, lane);
      cutlass::arch::fence_view_async_shared();  // st.shared -> WGMMA (async proxy)
      __syncwarp();
      pipeline_v.transpose_done(st, lane == 0);
      ++st;
    }
  }
};

}  // namespace flash3::detail
