// flash3: compile-time description of one backward kernel: tiles, warp roles, shared-memory
// layouts, the three WGMMA tilings, TMA types, parameters and shared storage.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "bwd/bwd_config.h"
#include "common/mask.h"
#include "common/seqlen.h"

namespace flash3::detail {

using namespace cute;

// Named barriers of the backward kernel (id 0 is __syncthreads).
// dQ buffer b uses kBwdBarDQFull + b and kBwdBarDQEmpty + b (and, with kDQEmptyPerWG, the second
// warpgroup's kBwdBarDQEmpty + kDQStages + b; at most 4 empty barriers in all).
enum : int { kBwdBarPReady = 1, kBwdBarPFree = 2, kBwdBarDQFull = 3, kBwdBarDQEmpty = 7,  // up to 4 dQ buffers
             kBwdBarEpilogue = 11 };

// The persistent kernel's second K buffer and dK, dV staging tiles (kEarlyKV), as a base of
// SharedStorage: empty, and so no bytes, where they are not used.
template <class Element, int kElems>
struct BwdSecondK {
  alignas(1024) cute::array_aligned<Element, kElems, 1024> smem_k_alt;
  alignas(1024) cute::array_aligned<Element, 2 * kElems, 1024> smem_dkv_stage;  // dK, dV for the TMA stores
};
template <class Element>
struct BwdSecondK<Element, 0> {};

// kGeneral: the general kernel of variable lengths, sliding windows and softcap (common/mask.h
// says why it is a kernel of its own). kSoftcap: its softcap kernel, where the config gives
// softcap a kernel of its own (kSoftcapOwnKernel, bwd_config.h).
template <class Element_, int kHeadDim_, bool kCausal_, bool kGeneral_ = false, bool kSoftcap_ = false>
struct BwdTraits {
  using Element = Element_;
  using Config = BwdTileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kGeneral = kGeneral_;
  static constexpr bool kSoftcap = kSoftcap_;
  static_assert(!kSoftcap || (kGeneral && Config::kSoftcapOwnKernel), "softcap's own kernel: a general one");
  using MaskT = Mask<kCausal, kGeneral>;
  static constexpr bool kSpreadVisits = Config::kSpreadVisits;  // bwd_scheduler.h
  // Persistent (bwd_scheduler.h, where bwd_config.h says): one block per SM takes blocks of
  // work (key block, head, batch) from a counter, so that the next one's K,
  // V and first Q, dO load while this one's dK, dV leave.
  static constexpr bool kPersistent = kCausal_ ? Config::kPersistentCausal : Config::kPersistentNonCausal;
  // Persistent with K, V in registers (head dim 64): the next item's K, V load early, K into the
  // second of two buffers (the dQ GEMM reads K from shared memory to the end of the loop), V as
  // soon as the consumers have copied theirs into registers (bwd_load.h).
  static constexpr bool kEarlyKV = kPersistent && Config::kKVInRegs;
  // dK, dV of MHA problems out by TMA stores (bwd_store_dkdv_tma), where bwd_config.h says so.
  static constexpr bool kTmaEpilogue = kCausal ? Config::kTmaEpilogueCausal : Config::kTmaEpilogueNonCausal;

  // Warpgroup 0: warp 0 is the producer (TMA), warps 1.. the dQ writers; warpgroups 1 and 2 are the
  // consumers, which split every GEMM between them.
  static constexpr int kNumConsumerThreads = 256;
  static constexpr int kNumThreads = 128 + kNumConsumerThreads;
  // NOTES: setmaxnreg moves registers within the pool the block got at launch, 168 x 384 =
  // 64512 (ptxas's per-thread cap for 384 threads); an increase past what the decreases freed
  // waits forever. 40 x 128 + 232 x 256 = 24 x 128 + 240 x 256 = 64512. Per head dim
  // (bwd_config.h): at 128 the swapped loop needs 240 (ptxas serialized its WGMMAs at 232,
  // C7512) and the producer spills a few bytes at 24; at 256 the producer spilled 224 bytes at
  // 24 and ran 12-20% slower (one stage: every load waits for the producer).
  static constexpr int kProducerRegs = Config::kProducerRegs, kConsumerRegs = Config::kConsumerRegs;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kNumConsumerThreads <= 168 * kNumThreads);

  // ---- WGMMA tilings (two warpgroups each; a warpgroup's atom is 64 rows) -------------------
  // NOTES: a 128-row GEMM is split along M (one 64-row atom per warpgroup); a 64-row GEMM is
  // split along N (each warpgroup takes half the columns).
  template <int M, int N>
  using Split = Layout<Shape<Int<M == 128 ? 2 : 1>, Int<M == 128 ? 1 : 2>, _1>>;
  template <int M, int N, int K>
  using AtomTile = Shape<_64, Int<M == 128 ? N : N / 2>, Int<K>>;
  // NOTES: two consumer layouts (bwd_config.h, kSdPSwapAB).
  // Not swapped: S = Q K^T and dP = dO V^T as (kBlockM, kBlockN); P and dS go to shared memory
  // and all five GEMMs read both operands from there.
  // Swapped (FlashAttention-3's SdP_swapAB): S^T = K Q^T and dP^T = V dO^T as (kBlockN = 128,
  // kBlockM), split along the keys, so that warpgroup w holds P^T and dS^T of its 64 keys in
  // registers in exactly the layout of the A operand of dV += P^T dO and dK += dS^T Q for the
  // same 64 keys: those two GEMMs take A from registers (RS), P never goes to shared memory, and
  // only dS^T is stored (for dQ = dS K, which needs all keys).
  static constexpr bool kSdPSwapAB = Config::kSdPSwapAB;
  static_assert(!kSdPSwapAB || kBlockN == 128, "the swapped layout splits kBlockN = 128 keys over 2 warpgroups");
  // kKVInRegs (swapped only): each warpgroup's 64 keys of K and V are loaded once into
  // registers as the A operands of S^T = K Q^T and dP^T = V dO^T (RS): per query block only
  // Q^T, dO^T are then read from shared memory by those two GEMMs.
  static constexpr bool kKVInRegs = Config::kKVInRegs;
  static_assert(!kKVInRegs || kSdPSwapAB, "K, V in registers needs the swapped layout");
  using AtomSdPSwapped = Shape<_64, Int<kBlockM>, Int<kHeadDim>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      conditional_t<kKVInRegs,
                    decltype(GMMA::rs_op_selector<Element, Element, float, AtomSdPSwapped>()),
                    decltype(GMMA::ss_op_selector<Element, Element, float,
                                                  conditional_t<kSdPSwapAB, AtomSdPSwapped,
                                                                AtomTile<kBlockM, kBlockN, kHeadDim>>>())>{},
      conditional_t<kSdPSwapAB, Split<128, kBlockM>, Split<kBlockM, kBlockN>>{}));
  // dV += P^T dO and dK += dS^T Q: (kBlockN, d, kBlockM); B (dO^T, Q^T) MN-major; A from
  // registers (swapped) or the transposed P, dS tiles in shared memory (MN-major).
  using AtomdKV = AtomTile<kBlockN, kHeadDim, kBlockM>;
  using TiledMmadKV = decltype(make_tiled_mma(
      conditional_t<kSdPSwapAB,
                    decltype(GMMA::rs_op_selector<Element, Element, float, AtomdKV, GMMA::Major::K,
                                                  GMMA::Major::MN>()),
                    decltype(GMMA::ss_op_selector<Element, Element, float, AtomdKV, GMMA::Major::MN,
                                                  GMMA::Major::MN>())>{},
      Split<kBlockN, kHeadDim>{}));
  // dQ = dS K: (kBlockM, d, kBlockN), K^T MN-major; dS K-major (stored as dS) or MN-major
  // (stored as dS^T, swapped).
  // kDQAlternate (swapped, kBlockM = 64): dQ_m computed whole by one warpgroup, 0 for even
  // visits and 1 for odd ones (m64n64 atoms), the other warpgroup going on without waiting for
  // it; otherwise both warpgroups split it along the head dim (m64n(d/2) atoms).
  static constexpr bool kDQAlternate = Config::kDQAlternate;
  static_assert(!kDQAlternate || (kSdPSwapAB && kBlockM == 64));
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           conditional_t<kDQAlternate, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                                         AtomTile<kBlockM, kHeadDim, kBlockN>>,
                           kSdPSwapAB ? GMMA::Major::MN : GMMA::Major::K, GMMA::Major::MN>(),
      conditional_t<kDQAlternate, Layout<Shape<_1, _1, _1>>, Split<kBlockM, kHeadDim>>{}));
  // Threads holding one dQ tile's accumulators (the dQ GEMM's), and the dQ hand-off barriers'
  // thread count (they and one writer warp).
  static constexpr int kDQFragThreads = kDQAlternate ? 128 : kNumConsumerThreads;
  static constexpr int kDQBarThreads = kDQFragThreads + 32;
  // Where both warpgroups hold a dQ tile, each waits for a buffer's release on a barrier of its
  // own (its 128 threads and the writer warp), so that neither waits there for the other:
  // buffer b's are kBwdBarDQEmpty + b and kBwdBarDQEmpty + kDQStages + b. +1-5% at head dim 128
  // (docs/perf-log.md B108, B111), +4-8% with softcap and a causal mask (B113).
  static constexpr bool kDQEmptyPerWG = !kDQAlternate;
  static constexpr int kDQEmptyThreads = kDQEmptyPerWG ? 128 + 32 : kDQBarThreads;

  // ---- shared memory: row-major tiles with the 128-byte swizzle -----------------------------
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutP = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutdS = SmemLayoutP;
  // Transposed views (the same bytes): Q^T, dO^T as (d, kBlockM, stage), K^T as (d, kBlockN),
  // P^T, dS^T as (kBlockN, kBlockM).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = SmemLayoutQt;
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutPt = decltype(composition(
      SmemLayoutP{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Step<_2, _1>{})));
  using SmemLayoutdSt = SmemLayoutPt;
  // Swapped: dS^T stored row-major as (kBlockN, kBlockM, stage), two stages (so that a
  // warpgroup may store block m+1's dS^T while the other's dQ GEMM of block m still reads it),
  // and viewed as dS (kBlockM, kBlockN, stage) by the dQ GEMM.
  static constexpr int kDSStages = 2;
  using SmemLayoutdStStore =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kBlockM>, Int<kDSStages>>{}));
  using SmemLayoutdSView = decltype(composition(
      SmemLayoutdStStore{},
      make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>, Int<kDSStages>>{}, Step<_2, _1, _3>{})));

  // ---- global tensors: (seqlen, head_dim, heads, batch), head dim contiguous ---------------
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using LayoutQKV = Layout<ShapeQKV, StrideQKV>;

  static auto make_tma_q(Element const* ptr, LayoutQKV layout) {  // also dO
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout),
                         take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
  }
  static auto make_tma_kv(Element const* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout), SmemLayoutK{},
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  }
  // kTmaEpilogue: dK, dV (MHA) out by TMA stores from SmemLayoutK-shaped staging tiles.
  static auto make_tma_dkv_store(Element* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(ptr), layout), SmemLayoutK{},
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  }
  // kTmaAddKV (GQA, default mode): dK, dV added into the kv head's FP32 buffers (rows, d) by TMA
  // reduce-adds from FP32 staging tiles with the 128-byte swizzle (bwd_add_dkdv_tma); dK's staged
  // in the Q and dO buffers, dV's in the K and V buffers, each kBlockN x d x 4 bytes. Not in the
  // persistent kernels, whose Q, dO and K, V buffers already hold the next item's tiles.
  using SmemLayoutAccKV =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using LayoutAccKV = Layout<Shape<int32_t, Int<kHeadDim>>, Stride<int64_t, _1>>;
  static auto make_tma_dkv_add(float* ptr, int32_t rows) {
    return make_tma_copy(SM90_TMA_REDUCE_ADD{},
                         make_tensor(make_gmem_ptr(ptr), LayoutAccKV{make_shape(rows, Int<kHeadDim>{}),
                                                                      make_stride(int64_t(kHeadDim), _1{})}),
                         SmemLayoutAccKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  }
  // (The Q and dO buffers, and the K and V buffers, are adjacent: their sizes are multiples of
  // their 1024-byte alignment.)
  static constexpr bool kTmaAddKV =
      !kPersistent && cosize_v<SmemLayoutQ> * sizeof(Element) % 1024 == 0 &&
      cosize_v<SmemLayoutK> * sizeof(Element) % 1024 == 0 &&
      cosize_v<SmemLayoutAccKV> * sizeof(float) <= 2 * cosize_v<SmemLayoutQ> * sizeof(Element) &&
      cosize_v<SmemLayoutAccKV> * sizeof(float) <= 2 * cosize_v<SmemLayoutK> * sizeof(Element);
  using TmaQ = decltype(make_tma_q(nullptr, LayoutQKV{}));
  using TmaKV = decltype(make_tma_kv(nullptr, LayoutQKV{}));
  using TmaStoreKV = decltype(make_tma_dkv_store(nullptr, LayoutQKV{}));
  using TmaAddKV = decltype(make_tma_dkv_add(nullptr, 0));

  // One stage: a Q (or dO) tile plus its kBlockM log-sum-exps (or D values).
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element) + kBlockM * sizeof(float);
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kDQElems = kBlockM * kHeadDim;  // one FP32 dQ tile
  // dQ tiles in shared memory: two where they fit, so the consumers rarely wait for the writer
  // (in deterministic mode the writer waits for the previous key block's adds).
  static constexpr int kDQStages = Config::kDQStages;
  // dQ writer warps (warps 1.. of warpgroup 0): warp 1 + w takes the tiles i with i % kDQWriters = w.
  // Tile i's "full" barrier is kBwdBarDQFull + i % kDQFullBars: with one buffer and two writers
  // the two writers' phases must not mix, so odd and even tiles use their own barrier.
  static constexpr int kDQWriters = 2;
  static constexpr int kDQFullBars = kDQStages > kDQWriters ? kDQStages : kDQWriters;
  static_assert(kDQStages >= 1 && kDQStages <= 4 && (kDQStages == 1 || kDQStages % kDQWriters == 0));
  static_assert(!kDQEmptyPerWG || kDQStages <= 2, "two empty barriers per dQ buffer: ids 7-10");

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;

  struct Params {
    TmaQ tma_q, tma_do;
    TmaKV tma_k, tma_v;
    LayoutQKV layout_q, layout_k;  // logical shapes (TMA bounds)
    const float* lse_log2;         // workspace (bwd_config.h)
    const float* dpsum;
    float* dq_accum;
    int* dq_sem;                   // the first add into a tile is a store (bwd_dq_store_first), else null
    int dq_groups;                 // copies of each dQ tile (bwd_dq_groups); 1 without dq_sem
    int dq_ordered;                // deterministic: the adds into a tile in key-block order
    float* dk_accum;               // GQA/MQA: FP32 dK, dV (bwd_config.h); else null
    float* dv_accum;
    bool dkv_add;                  // dk_accum, dv_accum per kv head: atomic adds (else per query head)
    Element* dk;                   // MHA: written directly
    Element* dv;
    int64_t dk_row_stride, dk_head_stride, dk_batch_stride;
    int64_t dv_row_stride, dv_head_stride, dv_batch_stride;
    int batch;
    SeqLens seqlens;               // read per batch entry: seqlens.template of<false>(batch)
    MaskOffsets mask;              // the sliding window (common/mask.h)
    int nheads, nheads_per_kv;
    int m_blocks, n_blocks;
    int l2_section, l2_big;  // causal block order: sections of (head, batch) pairs (bwd_sections)
    int64_t seqlen_q_pad, seqlen_k_pad;
    // P = exp2(S * scale_log2 - lse_log2); dQ, dK are scaled by softmax_scale at the end.
    // Softcap (common/softmax.h): S is t = tanh(softcap_coef S), softcap_coef = softmax_scale /
    // softcap (0: no softcap), and scale_log2 = softcap * log2(e).
    float softmax_scale, scale_log2, softcap_coef;
    int* tile_counter = nullptr;  // kPersistent: two zeroed ints (TileStream), or null (static order)
    int num_items = 0;            // kPersistent: key blocks x heads x batch
    TmaStoreKV tma_dk{}, tma_dv{};  // kTmaEpilogue, MHA: dK, dV out by TMA (bwd_store_dkdv_tma) ...
    int dkv_tma = 0;                // ... where set
    TmaAddKV tma_dk_add{}, tma_dv_add{};  // kTmaAddKV, GQA default mode: dK, dV added by TMA ...
    int dkv_add_tma = 0;                  // ... where set, into buffers of dkv_rows rows
    int32_t dkv_rows = 0;
    int late_request = 0;           // kEarlyKV: the next item asked for after the last load (bwd_launch.h)
    int* dq_done = nullptr;         // per pair: writers done (bwd_config.h), for the postprocess; or null
    // Variable lengths (general kernels): packed sides' workspace rows per head (bwd_ws_row), and
    // item t = varlen_items[t] = (n_block, head, batch, -) of min(num_items, *varlen_count) items
    // (runtime/varlen_tiles.h); null: the fixed-length order.
    int64_t q_head_rows = 0, k_head_rows = 0;
    const int4* varlen_items = nullptr;
    const int* varlen_count = nullptr;
  };

  struct SharedStorage : BwdSecondK<Element, kEarlyKV ? int(cosize_v<SmemLayoutK>) : 0> {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> smem_do;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    // Not swapped: P, then dS (kBlockM x kBlockN each); swapped: kDSStages x dS^T.
    alignas(1024) cute::array_aligned<
        Element, kSdPSwapAB ? cosize_v<SmemLayoutdStStore> : 2 * cosize_v<SmemLayoutP>, 1024> smem_pds;
    alignas(128) float smem_dq[kDQStages * kDQElems];
    alignas(16) float smem_lse[kStages * kBlockM];
    alignas(16) float smem_dpsum[kStages * kBlockM];
    cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename Pipeline::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_do;
    cutlass::arch::ClusterBarrier barrier_kv_free;  // kPersistent: the consumers are done with K, V
    cutlass::arch::ClusterBarrier barrier_v_free, barrier_k_free[2];  // kEarlyKV: V copied, K buffer done
    cutlass::arch::ClusterBarrier tile_full[2], tile_empty[2], tile_request;  // kPersistent (TileStream)
    int tile_ring[2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "backward tile config exceeds 227 KB of shared memory");
};

// The first FP32 workspace row (bwd_config.h, bwd_ws_row) of (batch b, query head h), bh = b x
// nheads + h: of its query rows (kQ: lse_log2, dpsum; dQ tiles and their semaphores: / kBlockM)
// or of its key rows (GQA: dk_accum, dv_accum).
template <class Traits, bool kQ>
__device__ __forceinline__ int64_t bwd_row0(typename Traits::Params const& p, int b, int h, int64_t bh) {
  const int64_t pad = kQ ? p.seqlen_q_pad : p.seqlen_k_pad;
  if constexpr (Traits::kGeneral) {
    return bwd_ws_row(kQ ? p.seqlens.cu_q : p.seqlens.cu_k, kQ ? p.seqlens.total_q : p.seqlens.total_k, b, h,
                      p.nheads, pad, kQ ? p.q_head_rows : p.k_head_rows, kQ ? Traits::kBlockM : Traits::kBlockN);
  }
  return bh * pad;
}

// The rows of batch entry b, head `head`, of a (seqlen, d, heads, batch) TMA tensor of the query
// side (kQ) or the key side: its batch entry, or (packed: variable lengths) entry 0 from the
// sequence's first row.
template <class Traits, bool kQ, class MTensor>
__device__ __forceinline__ auto bwd_seq_rows(MTensor const& m, typename Traits::Params const& params, int b, int head) {
  if constexpr (Traits::kGeneral) {
    const SeqLen len = params.seqlens.template of<true>(b);
    const int row0 = kQ ? len.q_start : len.k_start;
    return domain_offset(make_coord(row0, _0{}),
                         m(_, _, head, kQ ? params.seqlens.q_batch(b) : params.seqlens.k_batch(b)));
  } else {
    return m(_, _, head, b);
  }
}

// The first workspace row of kv head head_kv of batch entry b in dk_accum, dv_accum laid out per
// kv head (dkv_add).
template <class Traits>
__device__ __forceinline__ int64_t bwd_kv_row0(typename Traits::Params const& p, int b, int head_kv) {
  const int nheads_kv = p.nheads / p.nheads_per_kv;
  if constexpr (Traits::kGeneral) {
    return bwd_ws_row(p.seqlens.cu_k, p.seqlens.total_k, b, head_kv, nheads_kv, p.seqlen_k_pad, p.k_head_rows,
                      Traits::kBlockN);
  }
  return (int64_t(b) * nheads_kv + head_kv) * p.seqlen_k_pad;
}

}  // namespace flash3::detail
