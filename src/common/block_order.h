// flash3: the order of the causal forward tiles and backward blocks, in plain C++ (no CuTe) so
// that the CPU tests can check it: the kernels' schedulers and the launchers use these functions.
//
// Longest-processing-time first (the last query blocks, which see the most keys, come first, so
// the short tiles fill the tail), within sections of (head, batch) pairs whose K and V fit in
// kCausalL2Budget: all pairs at once would stream every K and V from DRAM (ncu: 73% of DRAM
// bandwidth at hdim 128, causal, seqlen 2k, batch 8, 16 heads). Within a section, the tiles of
// one query block index are adjacent across its pairs.
//
// NOTES: LPT holds within a section only, so the last section's longest tiles start last; when
// that section is too small to fill the GPU once (e.g. 16 pairs in sections of 3 leave one
// pair, 64 tiles at seqlen 8k), its longest tiles ran with most SMs idle: the sections before
// it now join it until it holds at least one tile per SM (it may then exceed the budget).
// Measured side by side (docs/perf-log.md, step 20): +2-10% at head dims 128 and 256 for seqlen
// 2k-16k; and a 32 MB budget (FlashAttention-3's figure) ahead of half the L2 (25 MB) by 1-3%
// at head dim 256 and at head dim 64 8k.
#pragma once

#include "common/host_device.h"

namespace flash3 {

constexpr long long kCausalL2Budget = 32ll << 20;

// Rows of a pair of (head_dim wide, elem_bytes) tensors of one head (K and V; Q and dO) that fit
// `budget` bytes: the variable-length lists size each sequence's sections by it (varlen_tiles.h).
inline long long causal_section_rows(int head_dim, int elem_bytes, long long budget) {
  return budget / (2ll * head_dim * elem_bytes);
}

// (head, batch) pairs per section: as many as have their K and V (seqlen_k x head_dim x 2
// tensors x elem_bytes) within `budget` bytes, at least 1; with GQA/MQA the heads_per_kv query
// heads of one kv head (adjacent pairs) read one K and V, so a section holds whole groups of them.
inline int causal_section(int seqlen_k, int head_dim, int elem_bytes, long long budget, int heads_per_kv = 1) {
  long long n = seqlen_k > 0 ? causal_section_rows(head_dim, elem_bytes, budget) / seqlen_k : 1;
  n = (n < 1 ? 1 : n) * (heads_per_kv < 1 ? 1 : heads_per_kv);
  return n > (1 << 30) ? (1 << 30) : int(n);
}

// The backward's causal section size in (head, batch) pairs: as many as have their Q and dO
// within half the L2, or, at head dims up to 128 where that is more than 32 pairs, within a
// quarter.
// NOTES: each pair's FP32 dQ accumulator (twice Q's bytes) is also read and written through the L2
// while the section's key blocks add into it; the half-L2 budget counts only Q and dO. Measured
// at causal head dims 64 and 128 (docs/perf-log.md B60, one process): a quarter was +15% at 512,
// +13% / +7% at 1k and +3% / -1% at 2k (head dim 64 / 128: 50 / 25 pairs at half the L2), but
// 2-3% slower at 4k (25 / 12 pairs); at 8k-16k within the noise. Head dim 256 was not measured.
inline int bwd_section_pairs(int seqlen_q, int head_dim, int elem_bytes, long long l2_bytes) {
  const int half = causal_section(seqlen_q, head_dim, elem_bytes, l2_bytes / 2);
  if (head_dim > 128 || half <= 32) return half;
  return causal_section(seqlen_q, head_dim, elem_bytes, l2_bytes / 4);
}

// The backward's sections (bwd_scheduler.h, BwdScheduler): as many as `section` pairs per
// section need, the pairs spread evenly over them. BwdSections{size, big}: the first `big`
// sections hold size + 1 pairs, the others size, the last one what is left (bwd_causal_block).
// Where ceil(pairs / sections) per section leaves at least half a section for the last one, that
// (big = 0); where it leaves less, the sections as even as they go (size = pairs / sections,
// big = pairs % sections). No section is larger than `section`.
// NOTES: with sections of `section` pairs the last one held what was left, e.g. 3 pairs of 25 at
// head dim 128, causal 2k (48 blocks): its longest blocks, dispatched last, ran with most SMs
// idle (65 us of a 700 us kernel, docs/perf-log.md B50). B50's ceil(pairs / sections) still left
// a small last section where few pairs are cut into many sections: 6 x 5 + 2 at head dim 256
// causal 4k, 128 causal 8k and 64 causal 16k (32 pairs, 6 per section), 3 x 5 + 1 at 256 causal
// 8k and 128 causal 16k. As even as they go (6, 6, 5, 5, 5, 5 and 3, 3, 3, 3, 2, 2) measured
// +1.5 / +4.6 / +7.6 / +2.5 / +3.1% there (B63, one process), but 0.3-1.4% slower at 512-4k
// (hdim 64, 128), where B50's last section is 9 of 11 pairs, 16 of 24, 18 of 22.
struct BwdSections {
  int size = 1, big = 0;
};
inline BwdSections bwd_sections(int pairs, int section) {
  section = section < 1 ? 1 : section;
  pairs = pairs < 1 ? 1 : pairs;
  const int n = (pairs + section - 1) / section;
  const int even = (pairs + n - 1) / n, last = pairs - (n - 1) * even;
  if (2 * last >= even) return {even, 0};
  return {pairs / n, pairs % n};
}

// The backward's causal block order: block `bid` -> (key block, (head, batch) pair), longest
// first (key block 0 visits every query block) within sections of consecutive pairs (the first
// `big` of size + 1 pairs, then of `size`, the last one holding what is left: BwdSections), key
// block slowest inside a section. Key block n - 1 of a pair comes before key block n, which the
// deterministic mode relies on (bwd_kernel.h).
FLASH3_HD void bwd_causal_block(int bid, int n_blocks, int pairs, int size, int big, int& n_block,
                                         int& pair) {
  const int big_blocks = (size + 1) * n_blocks;  // blocks of each of the first `big` sections
  int first, count, r;
  if (bid < big * big_blocks) {
    const int index = bid / big_blocks;
    first = index * (size + 1);
    count = size + 1;
    r = bid - index * big_blocks;
  } else {
    const int rest = bid - big * big_blocks, per_section = size * n_blocks;
    const int index = rest / per_section;
    first = big * (size + 1) + index * size;
    count = size < pairs - first ? size : pairs - first;
    r = rest - index * per_section;
  }
  n_block = r / count;
  pair = first + r % count;
}

// The first pair of the last section, which takes every pair from there on (see NOTES).
inline int causal_tail_first(int pairs, int section, int num_m_blocks, int num_sms) {
  section = section < 1 ? 1 : section;
  int tail = (pairs - 1) / section * section;
  while (tail > 0 && (long long)(pairs - tail) * num_m_blocks < num_sms) tail -= section;
  return tail < 0 ? 0 : tail;
}

// Tile t (0 <= t < num_m_blocks x pairs) -> its query block and (head, batch) pair.
FLASH3_HD void causal_tile(int t, int num_m_blocks, int pairs, int section, int tail_first,
                                    int& m_block, int& pair) {
  int first, count;
  if (t < tail_first * num_m_blocks) {
    first = t / (section * num_m_blocks) * section;
    count = section;
  } else {
    first = tail_first;
    count = pairs - tail_first;
  }
  const int rest = t - first * num_m_blocks;
  pair = first + rest % count;
  m_block = num_m_blocks - 1 - rest / count;
}

}  // namespace flash3
