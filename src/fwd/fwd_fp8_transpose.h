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
// side is V's, the consumer side Vt's.
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
  };
  using State = cutlass::PipelineState<Stages>;

  SharedStorage& s;
  uint32_t bytes;

  template <class ClusterShape>
  __device__ Fp8VPipeline(SharedStorage& storage, const Params& p, ClusterShape) : s(storage), bytes(p.transaction_bytes) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < int(Stages); ++i) {
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
  // The consumers (the PV GEMM's B operand is Vt).
  __device__ __forceinline__ void consumer_wait(const State& st) { s.vt_full[st.index()].wait(st.phase()); }
  __device__ __forceinline__ void consumer_release(const State& st) { s.vt_empty[st.index()].arrive(); }
  // The transposer warps: V stage landed and Vt stage free; then both handed on (lane 0 of each
  // warp, after the warp's shared-memory writes are fenced for the async proxy).
  __device__ __forceinline__ void transpose_wait(const State& st) {
    s.v_full[st.index()].wait(st.phase());
    s.vt_empty[st.index()].wait(st.phase() ^ 1);
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
  static constexpr int kThreads = 32 * Traits::kTransposeWarps;
  // A work unit: 4 keys (one quad of Vt's k order) x 4 head-dim columns, 4 words in and out.
  static constexpr int kQuadsD = kHeadDim / 4, kUnits = (kBlockN / 4) * kQuadsD;
  static_assert(kBlockN % 32 == 0 && kUnits % kThreads == 0);

  // Transposes V stage `stage` into Vt stage `stage`. t: the thread's index among the transposers.
  template <class TensorV, class TensorVt>
  __device__ __forceinline__ static void tile(TensorV& sV, TensorVt& sVt, int stage, int t) {
#pragma unroll 4
    for (int u = t; u < kUnits; u += kThreads) {
      const int dq = u % kQuadsD, kq = u / kQuadsD;  // head-dim quad, k quad
      const int kk = 4 * kq;
      const int d = 4 * dq;
      const int key0 = (kk / 32) * 32 + fp8_key_of_k(kk % 32);  // keys key0, +1, +8, +9
      const uint32_t a0 = *reinterpret_cast<const uint32_t*>(&sV(key0, d, stage));
      const uint32_t a1 = *reinterpret_cast<const uint32_t*>(&sV(key0 + 1, d, stage));
      const uint32_t a2 = *reinterpret_cast<const uint32_t*>(&sV(key0 + 8, d, stage));
      const uint32_t a3 = *reinterpret_cast<const uint32_t*>(&sV(key0 + 9, d, stage));
      // 4 x 4 byte transpose: word c of the result holds byte c of a0, a1, a2, a3.
      const uint32_t t01lo = __byte_perm(a0, a1, 0x5140), t23lo = __byte_perm(a2, a3, 0x5140);
      const uint32_t t01hi = __byte_perm(a0, a1, 0x7362), t23hi = __byte_perm(a2, a3, 0x7362);
      *reinterpret_cast<uint32_t*>(&sVt(d + 0, kk, stage)) = __byte_perm(t01lo, t23lo, 0x5410);
      *reinterpret_cast<uint32_t*>(&sVt(d + 1, kk, stage)) = __byte_perm(t01lo, t23lo, 0x7632);
      *reinterpret_cast<uint32_t*>(&sVt(d + 2, kk, stage)) = __byte_perm(t01hi, t23hi, 0x5410);
      *reinterpret_cast<uint32_t*>(&sVt(d + 3, kk, stage)) = __byte_perm(t01hi, t23hi, 0x7632);
    }
  }

  // The transposer warps' loop: as many V tiles, in the same order, as the TMA thread loads
  // (the same pieces of work from the scheduler).
  template <class Scheduler>
  __device__ static void run(typename Traits::SharedStorage& shared, typename Traits::PipelineV& pipeline_v,
                             const Scheduler& scheduler, const typename Scheduler::Params& sched_params, int t) {
    Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.smem_vt.data()), typename Traits::SmemLayoutVt{});
    typename Traits::PipelineStateV st;
    const bool lane0 = t % 32 == 0;
    for (int tiles_done = 0;; ++tiles_done) {
      auto work = scheduler.work(sched_params, tiles_done, shared);
      if (scheduler.done(work)) break;
      scheduler.locate(work);
      for (int n = work.n_lo; n < work.n_hi; ++n) {
        pipeline_v.transpose_wait(st);
        tile(sV, sVt, st.index(), t);
        cutlass::arch::fence_view_async_shared();  // st.shared -> WGMMA (async proxy)
        __syncwarp();
        pipeline_v.transpose_done(st, lane0);
        ++st;
      }
    }
  }
};

}  // namespace flash3::detail
