// flash3: the one table of forward tile shapes, per head dim.
//
// NOTES: a consumer warpgroup owns 64 query rows (one m64nNk16 WGMMA tile), so kBlockM = 64 x
// the number of consumer warpgroups. Shared memory holds Q (kBlockM x d) plus kStages stages of
// K and V (kBlockN x d each); 227 KB per block is the limit. Registers: each consumer thread
// keeps O (64 x d / 128 floats) and S (64 x kBlockN / 128 floats), within the 240 registers
// that setmaxnreg gives it.
//
// O leaves either straight from registers (the next tile's Q then loads as soon as the last
// S = Q K^T is done) or, with kStageOInQ, through the Q buffer and one TMA store (the next Q
// waits for the store); measured: staging wins at head dim 256 (128 accumulator registers of
// O per thread), direct stores win at 64 and 128 (docs/perf-log.md, step 7). From registers,
// kOStageWarp passes O through a 2 KB buffer per consumer warp so that the global stores
// write whole row segments: +2-7% at head dim 128 for seqlen <= 2k, but 1-4% slower at head
// dim 64 with three consumer warpgroups at 160 registers, measured side by side (step 14).
// Written with stmatrix (step 18): +1-3% more at head dim 128 for seqlen <= 1k, and +2-3% for
// the 128-row (two warpgroup) causal head dim 64 kernel; the 192-row kernels still lose 2-13%
// with it, so they store from registers.
//
// NOTES: pingpong (two or more consumer warpgroups taking turns at the tensor cores, §3.1) and
// the intra-warpgroup GEMM-softmax overlap (Algorithm 2, §3.2) are on wherever registers allow.
//
//   head dim | kBlockM (WGs) | kBlockN            | stages | pingpong | overlap | smem (bf16)
//   ---------+---------------+--------------------+--------+----------+---------+-------------
//        64  |   192 (3)     | 128                |   2    |   yes    |   yes   | 24 + 2x32 = 88 KB
//            | (causal, seqlen_q <= 1024: 128 (2), FwdBlockM128, O staged per warp)
//       128  |   128 (2)     | 176 (causal: 128)  |   2    |   yes    |   yes   | 32 + 2x88 + 16 = 224 KB
//            | (causal: K 2 stages, V 3 stages: 32 + 2x32 + 3x32 + 16 = 208 KB;
//            |  long causal key ranges: 176, FwdBlockN176)
//       256  |   128 (2)     |  80                |   2    |   yes    |   yes   | 64 + 2x80 = 224 KB
//
// NOTES: pingpong at head dim 256 measured +2-17% against none on the
// non-causal sweep and +2-6% causal in flash3_bench (docs/perf-log.md, step 12).
// NOTES: head dim 128 non-causal at kBlockN 128 (the causal tile), measured against 176 in one
// device call with bench/bench_torch.py (docs/perf-log.md, step 16): +4% at seqlen 512, even at
// 1k-4k, 2-3.5% slower at 8k-16k; so 176 stays. (flash3_bench, which has no spin kernel ahead
// of each timed call, had shown 128 ahead by 3-10% at 512-4k.) 144 and 160 were slower than 128
// at 512-2k; causal 144 and 160 slower than 128 at 512-1k, even from 4k.
#pragma once

namespace flash3 {

// Technique switches, for the ablation of the paper's Table 2.
struct FwdDefaultVariant {
  static constexpr int kPingpong = -1;        // -1: as the tile config says; 0: off; 1: on
  static constexpr int kIntraWGOverlap = -1;  // likewise
  static constexpr bool kThreeStage = false;  // Appendix B.3's 3-stage pipeline instead
  static constexpr int kBlockN = 0;           // > 0: overrides the tile config's
  static constexpr int kBlockM = 0;           // likewise
  static constexpr bool kTailPieces = false;  // the tail kernel of the split (tail_split.h)
  static constexpr bool kGeneral = false;  // variable lengths, sliding windows, softcap (common/mask.h)
};
struct FwdNoPingpong : FwdDefaultVariant { static constexpr int kPingpong = 0; };
struct FwdNoOverlap : FwdDefaultVariant { static constexpr int kIntraWGOverlap = 0; };
// NOTES: the 3-stage pipeline keeps two score tiles in FP32 registers (S_j under softmax,
// S_{j-1} in flight) besides P_{j+1} and O. At head dim 128, ptxas 13.0 keeps its WGMMAs
// asynchronous with kBlockN = 96 (2 x 48 + 24 + 64 accumulator registers per thread); at 112
// it serialized them (C7512, insufficient registers), at 176 there is no room at all.
struct FwdThreeStage : FwdDefaultVariant {
  static constexpr bool kThreeStage = true;
  static constexpr int kBlockN = 96;
};
// The default 2-stage pipeline at the 3-stage variant's tile, to tell the two effects apart.
struct FwdTwoStageBlockN96 : FwdDefaultVariant { static constexpr int kBlockN = 96; };

// Causal head dim 64 at short sequences: 128-row tiles (two consumer warpgroups) instead of 192.
// NOTES: with 192-row tiles the causal diagonal and the ragged last tile waste work: at seqlen 1k
// the tiles compute 786k scores for the 524k that the mask keeps (1024 = 5 x 192 + 64, and the
// last, 64-row tile is the longest), at 2k 2.48M for 2.1M; 128-row tiles compute 590k and 2.23M.
// Measured side by side (docs/perf-log.md, step 15): 128-row tiles +5% at 512 and +9% at 1k,
// 192-row tiles ahead from 2k (by 5% at 2k, 10% at 8k: at long sequences the third warpgroup's
// share of the softmax hiding matters more than the diagonal). The launcher (fwd_launch.h)
// picks the 128-row kernel for seqlen_q <= kFwdCausal64ShortMax.
struct FwdBlockM128 : FwdDefaultVariant { static constexpr int kBlockM = 128; };
constexpr int kFwdCausal64ShortMax = 1024;

// Causal head dim 128 over long key ranges: the non-causal tile (176 keys, V in two stages)
// instead of 128 keys, where a query row sees kFwdCausal128LongMin keys or more on average
// (seqlen_k - seqlen_q / 2).
// NOTES: measured side by side on an H200 (docs/perf-log.md, step 35), 176 against 128 keys at
// equal lengths: +1.8-2.6% at 8k, +3.6% at 16k, +4.6-5.8% at 32k, but 0.9% slower at 4k, 4-5% at
// 2k and 11% at 1k, where the diagonal's masked work weighs more (step 13).
struct FwdBlockN176 : FwdDefaultVariant { static constexpr int kBlockN = 176; };
constexpr int kFwdCausal128LongMin = 4096;

// Non-causal: the last partial wave of tiles cut along the keys over all SMs, by a kernel of its
// own launched behind the main one (tail_split.h; docs/perf-log.md step 25). Head dims 128 and
// 256 only: with 192-row tiles, hdim 64's sweep shapes leave last waves of 112 of 132 tiles,
// where a split gains little (measured +-1%, step 22).
struct FwdTailPieces : FwdDefaultVariant { static constexpr bool kTailPieces = true; };

// The general kernels: variable lengths, sliding windows and softcap (kernels of their own:
// common/mask.h says why).
struct FwdGeneral : FwdDefaultVariant { static constexpr bool kGeneral = true; };

template <int kHeadDim, bool kCausal>
struct FwdTileConfig;

// The FP8 forward (fwd_fp8_traits.h): K, V and the transposed V in two stages each; a key tile
// lies in one k/v scale block (fp8_block_kv in flash3.h), so that its scale is one number.
//   head dim | kBlockM (WGs) | kBlockN | k/v scale block | smem: Q + (K, V, Vt) x 2 stages
//        64  |   192 (3)     |   128   |       128       | 12 + 3 x 16 = 60 KB
//       128  |   128 (2)     |   192   |       192       | 16 + 3 x 48 = 160 KB (+ 16 O staging)
//       256  |   128 (2)     |   128   |       128       | 32 + 3 x 64 = 224 KB
// NOTES: measured against FlashAttention-3's FP8 forward in one process (docs/perf-log.md F10-F13):
// three consumer warpgroups at head dim 64 (+9-29%, but 7% slower causal at 1k), and 192-key tiles
// at head dim 128 (+1-14% non-causal) over 128; 224 keys (FA3's tile) was within 2% of 192, and
// 3-4% slower non-causal at 4k-16k. At head dim 256, O alone is 128 registers: with S (64) and P
// (16) live together 128-key tiles serialize the WGMMAs (C7512) or spill, so each warpgroup there
// finishes P V before it issues Q K^T (kSerialPvQk): +17-25% over 64-key tiles with the overlap.
template <int kHeadDim>
struct FwdFp8TileConfig {
  static constexpr int kBlockM = kHeadDim == 64 ? 192 : 128;
  static constexpr int kBlockN = kHeadDim == 128 ? 192 : 128, kStages = 2;
  static constexpr bool kOStageWarp = kHeadDim == 128;
  // P V, then Q K^T once P V is done: S and P are never live together.
  static constexpr bool kSerialPvQk = kHeadDim == 256;
};

template <bool kCausal> struct FwdTileConfig<64, kCausal> {
  // NOTES: three consumer warpgroups (160 registers each): more warps to hide the softmax,
  // which at head dim 64 takes as long as the GEMMs. (With O staged through shared memory this
  // spilled a few values; with O stored from registers it does not.)
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 2, kStagesV = kStages;
  static constexpr bool kPingpong = true, kIntraWGOverlap = true;
  // kOStageWarp applies to the 128-row causal kernel (FwdBlockM128) only (fwd_traits.h).
  static constexpr bool kStageOInQ = false, kOStageWarp = true;
  static constexpr bool kSoftcapOwnStep = false, kSoftcapBounded = false;
  static constexpr bool kGeneralUniformDescriptors = false;
  static constexpr int kSoftmaxChains = 1;
};
template <bool kCausal> struct FwdTileConfig<128, kCausal> {
  // NOTES: causal, V has a third stage (the 128-wide tiles leave room: 208 KB): the consumers had
  // spent 1.3% of their samples waiting for V and 1.2% for K (ncu, docs/perf-log.md step 30);
  // measured +0.5-1% at 512-8k.
  static constexpr int kBlockM = 128, kBlockN = kCausal ? 128 : 176, kStages = 2;
  static constexpr int kStagesV = kCausal ? 3 : 2;
  static constexpr bool kPingpong = true, kIntraWGOverlap = true;
  static constexpr bool kStageOInQ = false, kOStageWarp = true;
  // The general kernels (fwd_mainloop.h): the softcap path with its own mask and softmax step,
  // not one step after an optional softcap; that step takes each row's max of t in the tanh's
  // pass (OnlineSoftmax::softcap_with_max), where it fills the gaps between the MUFU operations.
  // NOTES: causal, the own step made the window forward 6% faster (window 4096 of 16k: 0.92 ->
  // 0.98x FlashAttention-3, perf log W6) with softcap's cost as before, and the max in the tanh's
  // pass made softcap 2-3% faster (W18); non-causal the own step spilled 256 bytes and softcap
  // cost 1.66x instead of 1.39x; at head dims 64 and 256 the window forward lost 1.5% or nothing.
  static constexpr bool kSoftcapOwnStep = kCausal;
  // kSoftcapBounded: see head dim 256's; 0-2% slower here (docs/perf-log.md W15).
  static constexpr bool kSoftcapBounded = false;
  // The general kernels' WGMMA descriptors partitioned with a warp-uniform warpgroup index
  // (warpgroup_first_thread, common/wgmma.h) instead of the thread's: ptxas then keeps them in
  // uniform registers (R2UR 758 -> 559 at head dim 128, spills 60 -> 20 bytes non-causal).
  // NOTES: measured side by side (docs/perf-log.md V8): varlen non-causal +5-7%, causal and the
  // window within 1%; at head dims 64 (-1 to -4%) and 256 (-2 to +2%) it is off. In the default
  // kernels it cost 1.5-4% non-causal at every head dim.
  static constexpr bool kGeneralUniformDescriptors = !kCausal;
  // The softmax's row max and row sum each in kSoftmaxChains interleaved chains per row
  // (OnlineSoftmax, common/softmax.h), in the default kernels. NOTES: measured side by side
  // (docs/perf-log.md steps 39-40): two chains, causal: +1.0-2.3% on the paper's sweep, +1.2-4.4%
  // on the GQA shapes; in the general kernels 2-3% slower (window, varlen); non-causal, at head
  // dim 256 and with four chains within 1%.
  static constexpr int kSoftmaxChains = kCausal ? 2 : 1;
};
template <bool kCausal> struct FwdTileConfig<256, kCausal> {
  static constexpr int kBlockM = 128, kBlockN = 80, kStages = 2, kStagesV = kStages;
  static constexpr bool kPingpong = true, kIntraWGOverlap = true;
  static constexpr bool kStageOInQ = true, kOStageWarp = false;
  static constexpr bool kSoftcapOwnStep = false;
  // The general kernels with softcap in BF16: the softmax's reference max fixed at 0
  // (OnlineSoftmax::step_bounded). NOTES: measured side by side (docs/perf-log.md W13, W14):
  // softcap +9-14% here; at head dims 64 and 128 softcap -3% to +5%, and the general kernels
  // without softcap 2% slower (the branch's second softmax step).
  static constexpr bool kSoftcapBounded = true;
  static constexpr bool kGeneralUniformDescriptors = false;
  static constexpr int kSoftmaxChains = 1;
};

}  // namespace flash3
