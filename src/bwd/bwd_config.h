// flash3: the one table of backward tile shapes, per head dim, and the workspace layout built
// from it. Plain C++ (no CuTe) so that the host-side workspace sizing can include it.
//
// NOTES: a block owns kBlockN keys of one (head, batch) and keeps dK, dV for them in registers
// (FP32) for its whole life, while kBlockM query rows stream past. Two consumer warpgroups
// share every GEMM; the accumulators per consumer thread are
//   dK + dV: 2 x kBlockN x d / 256,  S + dP: 2 x kBlockM x kBlockN / 256,  dQ: kBlockM x d / 256
// and S, dP are dead before dQ is live. kSdPSwapAB (FlashAttention-3's SdP_swapAB, bwd_traits.h):
// S^T, dP^T are computed, so that P^T, dS^T are the register A operands of the dV, dK GEMMs and
// only dS^T goes to shared memory (two buffers); otherwise P and dS both go through shared
// memory. (Head dim 64 with kBlockM = 128, swapped: ptxas serialized the WGMMAs, C7512, at 240
// registers; with dS computed from the 16-bit P it fit but measured 1-5% slower than 64 x 128
// with the overlapped schedule of then (docs/perf-log.md B13), and 7-10% slower than 64 x 128
// with the in-order loop of now (B27); not swapped it spilled.) Shared memory
// (bf16): K, V (kBlockN x d each), kStages x (Q, dO) (kBlockM x d each), P and dS or 2 x dS^T
// (kBlockM x kBlockN each), kDQStages x dQ in FP32 (kBlockM x d). Registers (setmaxnreg)
// producer / consumers: see bwd_traits.h. The swapped loop issues the gradient GEMMs as dV, dQ,
// dK (FlashAttention-3's order: dQ goes to shared memory while dK still runs); at head dim 256
// (not swapped, one Q/dO stage) dK, dV, dQ, so that Q and dO are released as early as possible
// (dK, dQ, dV measured 25-40% slower there: docs/perf-log.md B26).
//
// kDQAlternate (head dim 64): each query block's dQ is computed whole by one consumer warpgroup,
// the two taking turns (bwd_mainloop_swapped.h), instead of split along the head dim (docs/perf-log.md B38).
// kSpreadVisits (head dim 256): where the dQ adds need no order, the key blocks of a head visit
// the query blocks from different starting points instead of in step (bwd_scheduler.h, B39).
// kPersistentCausal, kPersistentNonCausal (head dim 64): the kernel is persistent, one block per
// SM taking the blocks of work from a counter (bwd_scheduler.h, docs/perf-log.md B53, B56,
// B58); with the next block's K, V loaded early (a second K buffer) and dK, dV staged in a buffer
// of their own, +2-12% over one block per item at causal 512-4k, +2-5% non-causal. At head dim
// 128 the causal one measured 1-3% slower from 2k (its main loop ran 2-7% longer, B54; why is
// not known yet; no room there for the second K buffer); at 256 (not swapped) it does not exist.
// kSoftcapOwnLoop (swapped loop; general kernel): the consumers' loop in two copies, one with
// softcap and one without, chosen once per item, instead of softcap tested inside the loop.
// The test's branches between the exponentials and dS^T kept ptxas from interleaving the
// exponentials with dS^T's loads and stmatrix addresses: at head dim 64 the general kernel
// without softcap ran 10% more instructions per visit than the default kernel at a lower issue
// rate; with the two copies the window backward gained 8% and varlen 4-7% (docs/perf-log.md
// W10). At head dim 128 the two copies spilled 480 bytes and ran 22% slower, so off there.
// kSoftcapOwnKernel (swapped loop; general kernel): softcap in a kernel of its own (BwdTraits'
// kSoftcap), the general kernel's loop without it. At head dim 128, where the loop's two copies
// spill, the loop with softcap tested at each use ran 2-3% slower than without it (varlen 8 x 2k
// +2.2-2.4%, window 4096 of 16k +3.2%, docs/perf-log.md W12); the cost is two more kernels per
// dtype to build.
// kTmaEpilogueCausal, kTmaEpilogueNonCausal: dK, dV (MHA) leave through two TMA stores from
// shared memory instead of row-by-row stores (bwd_store_dkdv_tma, docs/perf-log.md B56, B57): head
// dim 64 +1-4%, 128 non-causal +0-4%, causal even; at 256 2-3% slower at non-causal 512-4k, so
// off there, but +2.0 / +1.1 / +0.5% at causal 512 / 1k / 2k (B106), where most blocks are short.
//
//   head dim | kBlockM | kBlockN | stages | dQ stages | swapped | regs (dK+dV, S+dP, dQ) | smem
//   ---------+---------+---------+--------+-----------+---------+------------------------+-------
//        64  |    64   |   128   |   3    |     4     |   yes   |   64,  64, 32 (alt.)   | 226 KB *
//       128  |    64   |   128   |   2    |     2     |   yes   |  128,  64, 32          | 225 KB
//       256  |    64   |    64   |   1    |     1     |   no    |  128,  32, 64          | 208 KB
//   * 178 KB, plus the persistent kernel's second K buffer (16 KB) and dK, dV staging (32 KB).
// Head dim 64 has three Q/dO stages (the room was there): +1-3% at 1k-4k, even from 8k
// (docs/perf-log.md B82; two stages before; four with two dQ stages measured even, B84). At head
// dim 128 a third stage in the room of one of the two dQ stages measured 0.99x (B86).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device.h"
#include "runtime/varlen_tiles.h"

namespace flash3 {

template <int kHeadDim>
struct BwdTileConfig;
template <> struct BwdTileConfig<64> {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 3, kDQStages = 4;
  static constexpr bool kSdPSwapAB = true, kKVInRegs = true, kDQAlternate = true, kSpreadVisits = false;
  static constexpr bool kPersistentCausal = true, kPersistentNonCausal = true;
  static constexpr bool kTmaEpilogueCausal = true, kTmaEpilogueNonCausal = true;
  static constexpr bool kSoftcapOwnLoop = true, kSoftcapOwnKernel = false;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
};
template <> struct BwdTileConfig<128> {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2, kDQStages = 2;
  static constexpr bool kSdPSwapAB = true, kKVInRegs = false, kDQAlternate = false, kSpreadVisits = false;
  static constexpr bool kPersistentCausal = false, kPersistentNonCausal = false;
  static constexpr bool kTmaEpilogueCausal = true, kTmaEpilogueNonCausal = true;
  static constexpr bool kSoftcapOwnLoop = false, kSoftcapOwnKernel = true;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
};
template <> struct BwdTileConfig<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kStages = 1, kDQStages = 1;
  static constexpr bool kSdPSwapAB = false, kKVInRegs = false, kDQAlternate = false, kSpreadVisits = true;
  static constexpr bool kPersistentCausal = false, kPersistentNonCausal = false;
  static constexpr bool kTmaEpilogueCausal = true, kTmaEpilogueNonCausal = false;
  static constexpr bool kSoftcapOwnLoop = false, kSoftcapOwnKernel = false;  // not swapped (bwd_mainloop_ss.h)
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
};

inline int bwd_block_m(int head_dim) {
  return head_dim == 64 ? BwdTileConfig<64>::kBlockM
                        : head_dim == 128 ? BwdTileConfig<128>::kBlockM : BwdTileConfig<256>::kBlockM;
}
inline int bwd_block_n(int head_dim) {
  return head_dim == 64 ? BwdTileConfig<64>::kBlockN
                        : head_dim == 128 ? BwdTileConfig<128>::kBlockN : BwdTileConfig<256>::kBlockN;
}

// Deterministic mode: how many copies of the FP32 dQ accumulator the key blocks add into.
// NOTES: the adds into one dQ tile must come in a fixed order, so key block n waits for key
// block n - 1's add (poll, add, completion, release: about 0.65 / 0.85 / 1.6 us for the 16 / 32
// / 64 KB tiles of head dims 64 / 128 / 256, docs/perf-log.md B19). The key blocks of one head
// run side by side and visit the query tiles in the same order, so the last of k such blocks
// lags the first by k links: at head dim 256 the mode ran at 0.66-0.84x the default. With G
// copies, key block n adds into copy n % G after block n - G, so the chain is G times shorter;
// the postprocess sums the copies in order 0, 1, ..., G - 1 (the result stays bitwise
// reproducible; it differs from the default mode's, whose add order is whatever ran first). The
// first add into each copy is a plain store, so no copy needs clearing; the postprocess reads
// the copies that were written (their counter is > 0). Cost: G x the accumulator's memory
// (seqlen_q x nheads x d x 4 bytes per batch) and the postprocess reads G tiles per tile, which
// at short sequences costs more than the chain (docs/perf-log.md B24, measured G = 1, 2, 4 at
// every sweep point: two copies gained from 8 key blocks on without a mask, and causal from 64
// on, where the chain is long enough; four were never better than two). Head dim 256 causal,
// whose 64 KB tiles make each link the longest (on an H200, B80: det / default with
// 1 / 2 / 4 copies 0.82 / 0.88 / 0.77 at 2k (32 key blocks), 0.79 / 0.88 / 0.85 at 4k, 0.76 / 0.87 /
// 0.91 at 8k, 0.76 / 0.90 / 0.95 at 16k): two copies from 32 key blocks, four from 128 while the
// four take at most 1 GiB together (copy_bytes: one copy, bwd_dq_copy_bytes), two beyond.
inline int bwd_dq_groups(bool deterministic, bool causal, int n_blocks, int head_dim, int64_t copy_bytes) {
  if (!deterministic) return 1;
  if (causal && head_dim == 256) {
    if (n_blocks >= 128 && 4 * copy_bytes <= (int64_t(1) << 30)) return 4;
    return n_blocks >= 32 ? 2 : 1;
  }
  return n_blocks >= (causal ? 64 : 8) ? 2 : 1;
}
// One copy of the FP32 dQ accumulator: batch x nheads x seqlen_q_pad x d floats.
inline int64_t bwd_dq_copy_bytes(int64_t bh, int64_t seqlen_q_pad, int head_dim) {
  return int64_t(sizeof(float)) * bh * seqlen_q_pad * head_dim;
}

// Whether the first add into each dQ tile (copy) is a store, so that the accumulator needs no
// clear: always in the deterministic mode; in the default mode key block 0 of a head, the first
// of its blocks to be dispatched, also visits every tile no later than the others (non-causal
// first to last, causal last to first: bwd_scheduler.h), so its writer stores and releases each
// tile and the other key blocks' writers add once it has. The preprocess then writes 4 bytes
// per tile instead of the tile (at 16k tokens x hidden 2048, 134 MB: about 35 us). But every key
// block of a head then moves at key block 0's pace: measured (docs/perf-log.md B25), +1-4% at
// non-causal head dims 64 and 128 up to 32 key blocks and +2-9% at causal head dim 256 up to 32,
// 1-6% slower at 128 key blocks and more. So in the default mode only up to 32 key blocks. (B66:
// 64 and 128 key blocks measured even (8k, 16k at head dims 64, 128); non-causal head
// dim 256, 1-2% slower in B25 with its single dQ buffer, now +7 / +3 / +1% at 512 / 1k / 2k.)
inline bool bwd_dq_store_first(bool deterministic, int n_blocks) {
  return deterministic || n_blocks <= 32;
}

// The persistent backward's grid (bwd_scheduler.h): one block per SM, but at causal
// lengths up to 8k two SMs are left to the dQ postprocess, which then converts each (head, batch)
// pair as it completes (bwd_postprocess_dq) instead of after the main kernel: all the persistent
// blocks run out of work within a few microseconds of each other, so with every SM taken the
// whole conversion (34-62 us on an H100 at head dim 64 causal 2k-8k) came after them. Measured
// (docs/perf-log.md B67): +1.1 / +0.6 / +1.0% at causal 2k / 4k / 8k, the post after the main
// kernel 5-9 us; the main kernel grows by 2 / 132, more than the conversion it hides from 16k.
// The first FP32 workspace row of (batch b, head h) (bwd_config's layout below): fixed,
// (b x nheads + h) x pad; packed (cu: the side's cu_seqlens), h x head_rows + the sequence's
// slot, (cu[b] + b x block) rounded down to a block, which leaves ceil(len / block) whole blocks
// to each sequence before the next one's slot.
FLASH3_HD int64_t bwd_ws_row(const int* cu, int total, int b, int h, int nheads, int64_t pad, int64_t head_rows,
                                    int block) {
  if (cu == nullptr) return (int64_t(b) * nheads + h) * pad;
  int start = cu[b];
  start = start < 0 ? 0 : start > total ? total : start;
  return int64_t(h) * head_rows + (int64_t(start) + int64_t(b) * block) / block * block;
}

inline int bwd_persistent_grid(int sms, int64_t items, bool causal, int seqlen_q) {
  const int spare = causal && seqlen_q <= 8192 && sms > 8 ? 2 : 0;
  return int(items < sms - spare ? items : sms - spare);
}

// The scratch memory of one backward call, carved from one buffer (each part 256-byte aligned):
//   lse_log2 float [batch][nheads][seqlen_q_pad]   lse * log2(e); +inf on padding rows
//   dpsum    float [batch][nheads][seqlen_q_pad]   D = rowsum(dO * O); 0 on padding rows
//   dq_accum float [batch][nheads][m_blocks][groups][kBlockM * d]   FP32 dQ, each tile in the
//            register order of the dQ GEMM's accumulators (see bwd_dq_writer.h); groups copies of
//            each tile in the deterministic mode (bwd_dq_groups), one otherwise
//   dq_sem   int   [batch][nheads][m_blocks][groups]  where the first add is a store
//            (bwd_dq_store_first): deterministic, the adds into each copy so far (key block n
//            adds into copy n % groups, as its (n / groups)-th); default, 1 once key block 0
//            has stored the tile
//   dq_done  int   [batch][nheads]   the key blocks' dQ writers that have finished with the pair
//            (each of the kDQWriters writers of each key block adds 1 once its adds are complete),
//            so that the postprocess converts a pair's dQ while the main kernel still runs
//   dk_accum, dv_accum float [batch][heads][seqlen_k_pad][d]   GQA/MQA only: dK, dV in FP32; the
//            default mode adds every query head's into its kv head's (heads = nheads_kv, zeroed
//            before the main kernel), the deterministic mode keeps one per query head (heads =
//            nheads) and sums them in head order (bwd_postprocess_dkv)
//   items    variable lengths: the list of key blocks (runtime/varlen_tiles.h)
// seqlen_q_pad = m_blocks * kBlockM, seqlen_k_pad = n_blocks * kBlockN. A packed side (cu_seqlens)
// replaces [batch][nheads][seqlen_pad] by [nheads][head_rows], each sequence in a slot of whole
// blocks of its own (bwd_ws_row).
// (In detail: the kernel table's launchers take it, dispatch.h.)
namespace detail {
struct BwdWorkspaceLayout {
  int block_m = 0, block_n = 0, m_blocks = 0, n_blocks = 0, dq_groups = 1;
  bool dq_store_first = false;  // dq_sem is there (bwd_dq_store_first)
  int64_t seqlen_q_pad = 0, seqlen_k_pad = 0;
  size_t lse_log2 = 0, dpsum = 0, dq_accum = 0, dq_sem = 0, dq_done = 0, dk_accum = 0, dv_accum = 0;  // offsets
  size_t bytes = 0;
  int dkv_heads = 0;       // GQA: heads of dk_accum, dv_accum (nheads_kv: atomic adds; nheads)
  int64_t dkv_rows = 0;    // GQA: rows of dk_accum (and of dv_accum), all heads
  bool dkv_add = false;    // GQA, default mode: query heads add into their kv head's (dkv_heads = nheads_kv)
  size_t dkv_bytes = 0;    // from dk_accum to the end of dv_accum (zeroed where the adds are atomic)

  // Packed sides (variable lengths): rows per head of the FP32 workspaces (0: not packed).
  int64_t q_head_rows = 0, k_head_rows = 0;
  size_t items = 0;  // the key blocks' list (varlen), varlen_item_capacity entries
  int varlen_item_capacity = 0;

  // packed_q / packed_k: that side has cu_seqlens, total_q / total_k rows; varlen: the key
  // blocks come from a list built on the device.
  BwdWorkspaceLayout(int batch, int nheads, int seqlen_q, int seqlen_k, int head_dim, bool causal, bool deterministic,
                     int nheads_kv, bool varlen = false, bool packed_q = false, bool packed_k = false,
                     int64_t total_q = 0, int64_t total_k = 0) {
    const bool gqa = nheads_kv != nheads;
    block_m = bwd_block_m(head_dim);
    block_n = bwd_block_n(head_dim);
    m_blocks = (seqlen_q + block_m - 1) / block_m;
    n_blocks = (seqlen_k + block_n - 1) / block_n;
    seqlen_q_pad = int64_t(m_blocks) * block_m;
    seqlen_k_pad = int64_t(n_blocks) * block_n;
    const int64_t bh = int64_t(batch) * nheads;
    if (packed_q) q_head_rows = (total_q + int64_t(batch) * block_m + block_m - 1) / block_m * block_m;
    if (packed_k) k_head_rows = (total_k + int64_t(batch) * block_n + block_n - 1) / block_n * block_n;
    const int64_t q_rows = packed_q ? nheads * q_head_rows : bh * seqlen_q_pad;
    const int64_t k_rows = packed_k ? nheads * k_head_rows : bh * seqlen_k_pad;
    dq_groups = bwd_dq_groups(deterministic, causal, n_blocks, head_dim, bwd_dq_copy_bytes(bh, seqlen_q_pad, head_dim));
    dq_store_first = bwd_dq_store_first(deterministic, n_blocks);
    size_t at = 0;
    auto take = [&at](size_t n) {
      const size_t off = at;
      at += (n + 255) / 256 * 256;
      return off;
    };
    lse_log2 = take(sizeof(float) * q_rows);
    dpsum = take(sizeof(float) * q_rows);
    dq_accum = take(sizeof(float) * q_rows * head_dim * dq_groups);
    if (dq_store_first) dq_sem = take(sizeof(int) * (q_rows / block_m) * dq_groups);
    dq_done = take(sizeof(int) * bh);
    if (gqa) {
      dkv_heads = deterministic ? nheads : nheads_kv;
      dkv_add = !deterministic;
      dkv_rows = k_rows / nheads * dkv_heads;
      dk_accum = take(sizeof(float) * dkv_rows * head_dim);
      dv_accum = take(sizeof(float) * dkv_rows * head_dim);
      dkv_bytes = at - dk_accum;
    }
    if (varlen) {
      const int64_t rows_k = packed_k ? total_k : int64_t(batch) * seqlen_k;
      varlen_item_capacity = int(detail::varlen_tile_capacity(rows_k, batch, nheads, block_n));
      items = take(detail::varlen_tiles_bytes(varlen_item_capacity, batch));
    }
    bytes = at;
  }
};
}  // namespace detail

}  // namespace flash3
