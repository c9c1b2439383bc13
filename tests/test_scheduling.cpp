// flash3: CPU tests of the causal forward tile order (src/common/block_order.h): every tile is
// handed out once, longest first within each section, sections within the L2 budget, and a last
// section that fills the GPU at least once. And the backward workspace (src/bwd/bwd_config.h):
// the deterministic mode's dQ copies and a layout whose parts hold them without overlap. And the
// decoding kernel's split count (flash3::kvcache_num_splits) and its division by a launch's
// constant (src/decode/divisor.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bwd/bwd_config.h"
#include "common/block_order.h"
#include "common/tail_split.h"
#include "decode/divisor.h"
#include "flash3/flash3.h"

namespace {

// (pair, m_block) of every tile, in hand-out order.
std::vector<std::pair<int, int>> order_of(int m_blocks, int pairs, int section, int tail_first) {
  std::vector<std::pair<int, int>> tiles;
  for (int t = 0; t < m_blocks * pairs; ++t) {
    int m = -1, p = -1;
    flash3::causal_tile(t, m_blocks, pairs, section, tail_first, m, p);
    tiles.emplace_back(p, m);
  }
  return tiles;
}

// The section of pair p: [first, last) pair range.
std::pair<int, int> section_of(int p, int pairs, int section, int tail_first) {
  if (p >= tail_first) return {tail_first, pairs};
  return {p / section * section, p / section * section + section};
}

void check_order(int m_blocks, int pairs, int section, int tail_first, int num_sms) {
  SCOPED_TRACE(testing::Message() << "m_blocks " << m_blocks << " pairs " << pairs << " section "
                                  << section << " tail_first " << tail_first);
  ASSERT_GE(tail_first, 0);
  ASSERT_LT(tail_first, pairs);
  ASSERT_EQ(tail_first % section, 0);
  const auto tiles = order_of(m_blocks, pairs, section, tail_first);
  std::set<std::pair<int, int>> seen;
  for (size_t i = 0; i < tiles.size(); ++i) {
    const auto [p, m] = tiles[i];
    ASSERT_GE(p, 0);
    ASSERT_LT(p, pairs);
    ASSERT_GE(m, 0);
    ASSERT_LT(m, m_blocks);
    ASSERT_TRUE(seen.insert(tiles[i]).second) << "tile (" << p << ", " << m << ") twice";
    if (i > 0) {
      const auto [pp, pm] = tiles[i - 1];
      const auto sec = section_of(p, pairs, section, tail_first);
      const auto prev = section_of(pp, pairs, section, tail_first);
      if (prev == sec) {
        EXPECT_LE(m, pm) << "not longest first within a section at tile " << i;
      } else {
        EXPECT_EQ(prev.second, sec.first) << "sections out of order at tile " << i;
        EXPECT_EQ(m, m_blocks - 1) << "a section starts with its longest tiles";
      }
    }
  }
  EXPECT_EQ(int(seen.size()), m_blocks * pairs);
  // The last section fills the GPU once, unless it is every pair.
  if (tail_first > 0) {
    EXPECT_GE((long long)(pairs - tail_first) * m_blocks, num_sms);
    // ... and is no larger than it needs to be: one section fewer would not fill it.
    EXPECT_LT((long long)(pairs - tail_first - section) * m_blocks, num_sms);
  }
}

TEST(CausalOrder, SectionFitsTheBudget) {
  // K and V of one pair: seqlen_k x head_dim x 2 tensors x 2 bytes.
  EXPECT_EQ(flash3::causal_section(8192, 256, 2, 32ll << 20), 4);   // 8 MB per pair
  EXPECT_EQ(flash3::causal_section(8192, 256, 2, 25ll << 20), 3);
  EXPECT_EQ(flash3::causal_section(2048, 64, 2, 32ll << 20), 64);   // 0.5 MB per pair
  EXPECT_EQ(flash3::causal_section(1 << 20, 256, 2, 32ll << 20), 1);  // 1 GB per pair: at least 1
  EXPECT_EQ(flash3::causal_section(0, 128, 2, 32ll << 20), 1);
  // GQA: the query heads of one kv head read one K and V.
  EXPECT_EQ(flash3::causal_section(8192, 128, 2, 32ll << 20, 8), 64);  // 4 MB per group of 8
  EXPECT_EQ(flash3::causal_section(1 << 20, 256, 2, 32ll << 20, 8), 8);  // at least one group
}

TEST(CausalOrder, SmallLastSectionJoinsThePreviousOnes) {
  // The case that was measured: 16 pairs in sections of 3 left one pair (64 tiles) at the end.
  EXPECT_EQ(flash3::causal_tail_first(16, 3, 64, 132), 12);  // 4 pairs, 256 tiles
  EXPECT_EQ(flash3::causal_tail_first(16, 4, 64, 132), 12);  // already full: unchanged
  EXPECT_EQ(flash3::causal_tail_first(16, 1, 64, 132), 13);  // 3 pairs of one: 192 tiles
  EXPECT_EQ(flash3::causal_tail_first(16, 3, 4, 132), 0);    // too few tiles in all: one section
  EXPECT_EQ(flash3::causal_tail_first(1, 1, 1, 132), 0);
  EXPECT_EQ(flash3::causal_tail_first(7, 100, 64, 132), 0);  // every pair fits one section
}

// The backward's section size: half the L2 of Q and dO, or a quarter at head dims up to 128 where
// half holds more than 32 pairs (50 MB of L2, bf16, the sweep's lengths).
TEST(CausalOrder, BackwardSectionPairs) {
  const long long l2 = 50ll << 20;
  EXPECT_EQ(flash3::bwd_section_pairs(512, 64, 2, l2), 100);    // half: 200
  EXPECT_EQ(flash3::bwd_section_pairs(1024, 64, 2, l2), 50);    // half: 100
  EXPECT_EQ(flash3::bwd_section_pairs(2048, 64, 2, l2), 25);    // half: 50
  EXPECT_EQ(flash3::bwd_section_pairs(4096, 64, 2, l2), 25);    // half: 25, kept
  EXPECT_EQ(flash3::bwd_section_pairs(16384, 64, 2, l2), 6);
  EXPECT_EQ(flash3::bwd_section_pairs(1024, 128, 2, l2), 25);   // half: 50
  EXPECT_EQ(flash3::bwd_section_pairs(2048, 128, 2, l2), 25);   // half: 25, kept
  EXPECT_EQ(flash3::bwd_section_pairs(512, 256, 2, l2), 50);    // head dim 256: half, as before
  EXPECT_EQ(flash3::bwd_section_pairs(1 << 20, 128, 2, l2), 1);  // at least one
}

// The sections' sizes, written out independently of bwd_causal_block: the first `big` of size + 1
// pairs, then of `size`, the last one what is left.
static std::vector<int> section_sizes(int pairs, flash3::BwdSections s) {
  std::vector<int> sizes;
  for (int left = pairs; left > 0;) {
    const int n = std::min(left, int(sizes.size()) < s.big ? s.size + 1 : s.size);
    sizes.push_back(n);
    left -= n;
  }
  return sizes;
}

// The backward's sections: no more than the budget needs, within it; B50's sizes where their last
// section holds at least half of one, else even (no remnant at the end).
TEST(CausalOrder, BackwardSections) {
  using V = std::vector<int>;
  auto sizes = [](int pairs, int section) { return section_sizes(pairs, flash3::bwd_sections(pairs, section)); };
  EXPECT_EQ(sizes(128, 25), V({22, 22, 22, 22, 22, 18}));  // hdim 128 causal 2k (B50; 25 x 5 + 3 before)
  EXPECT_EQ(sizes(32, 6), V({6, 6, 5, 5, 5, 5}));          // hdim 256 causal 4k (B50: 6 x 5 + 2)
  EXPECT_EQ(sizes(16, 3), V({3, 3, 3, 3, 2, 2}));          // hdim 256 causal 8k (B50: 3 x 5 + 1)
  EXPECT_EQ(sizes(256, 25), V({24, 24, 24, 24, 24, 24, 24, 24, 24, 24, 16}));  // hdim 64 causal 2k
  EXPECT_EQ(sizes(100, 25), V({25, 25, 25, 25}));          // divides
  EXPECT_EQ(sizes(7, 100), V({7}));                        // one section
  EXPECT_EQ(sizes(1, 3), V({1}));
  EXPECT_EQ(sizes(5, 0), V({1, 1, 1, 1, 1}));
  for (int pairs = 1; pairs <= 300; ++pairs) {
    for (int section = 1; section <= 64; ++section) {
      const std::vector<int> v = sizes(pairs, section);
      EXPECT_EQ(int(v.size()), (pairs + section - 1) / section);  // no more sections than the budget needs
      EXPECT_LE(*std::max_element(v.begin(), v.end()), section);   // within the budget
      EXPECT_GE(2 * v.back(), v.front() - 1);                      // the last one is not a remnant
    }
  }
}

// The backward's causal block order with any sections: every (key block, pair) once, key block
// n - 1 of a pair before key block n (the deterministic mode waits on it), key blocks non-decreasing
// within a section (longest first), sections in pair order.
TEST(CausalOrder, BackwardBlocksOnceInOrder) {
  for (int n_blocks : {1, 2, 3, 16, 33}) {
    for (int pairs : {1, 2, 7, 32, 128}) {
      for (flash3::BwdSections sec : {flash3::BwdSections{1, 0}, flash3::BwdSections{3, 0}, flash3::BwdSections{25, 0},
                                      flash3::BwdSections{pairs, 0}, flash3::bwd_sections(pairs, 6),
                                      flash3::bwd_sections(pairs, 25), flash3::BwdSections{pairs / 3, pairs % 3}}) {
        if (sec.size < 1) continue;
        SCOPED_TRACE(testing::Message() << "n_blocks " << n_blocks << " pairs " << pairs << " size " << sec.size
                                        << " big " << sec.big);
        std::vector<int> section_of;  // pair -> its section
        const std::vector<int> sz = section_sizes(pairs, sec);
        for (int i = 0; i < int(sz.size()); ++i) section_of.insert(section_of.end(), size_t(sz[size_t(i)]), i);
        std::vector<int> pos(size_t(n_blocks) * pairs, -1);
        int prev_n = -1, prev_section = 0;
        for (int bid = 0; bid < n_blocks * pairs; ++bid) {
          int n = -1, p = -1;
          flash3::bwd_causal_block(bid, n_blocks, pairs, sec.size, sec.big, n, p);
          ASSERT_TRUE(n >= 0 && n < n_blocks && p >= 0 && p < pairs) << "block " << bid;
          ASSERT_EQ(pos[size_t(n) * pairs + p], -1) << "(" << n << ", " << p << ") twice";
          pos[size_t(n) * pairs + p] = bid;
          const int section = section_of[size_t(p)];
          if (section == prev_section) {
            EXPECT_GE(n, prev_n) << "key blocks out of order within a section at block " << bid;
          } else {
            EXPECT_EQ(section, prev_section + 1) << "sections out of order at block " << bid;
            EXPECT_EQ(n, 0);
          }
          prev_n = n;
          prev_section = section;
        }
        for (int p = 0; p < pairs; ++p) {
          for (int n = 1; n < n_blocks; ++n) EXPECT_LT(pos[size_t(n - 1) * pairs + p], pos[size_t(n) * pairs + p]);
        }
      }
    }
  }
}

TEST(CausalOrder, EveryTileOnceLongestFirstPerSection) {
  const int sms = 132;
  for (int m_blocks : {1, 2, 5, 43, 64, 128}) {
    for (int pairs : {1, 2, 3, 7, 16, 64, 100}) {
      for (int section : {1, 2, 3, 4, 16, 200}) {
        const int tail = flash3::causal_tail_first(pairs, section, m_blocks, sms);
        check_order(m_blocks, pairs, section, tail, sms);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// The causal variable-length list's sections (runtime/varlen_tiles.h): every (block, head) of a
// sequence once; sections of whole head groups, no more groups than fit (at least one), sizes
// differing by at most one group; within a section the blocks in order, each over its heads.
TEST(VarlenOrder, SectionsCoverEveryTileOnceInOrder) {
  for (int blocks : {2, 7, 64}) {
    for (int nheads : {1, 2, 6, 16, 32}) {
      for (int group : {1, 2, 8}) {
        if (nheads % group != 0) continue;
        for (int fit : {0, 1, 2, 3, 5, 100}) {
          const std::string what = "blocks " + std::to_string(blocks) + " nheads " + std::to_string(nheads) +
                                   " group " + std::to_string(group) + " fit " + std::to_string(fit);
          std::vector<std::pair<int, int>> e(size_t(blocks) * nheads);
          for (int i = 0; i < blocks * nheads; ++i) {
            flash3::detail::varlen_section_entry(i, blocks, nheads, group, fit, e[i].first, e[i].second);
          }
          std::set<std::pair<int, int>> seen(e.begin(), e.end());
          ASSERT_EQ(seen.size(), e.size()) << what;
          ASSERT_TRUE(seen.begin()->first == 0 && seen.rbegin()->first == blocks - 1) << what;
          // Sections: a run of block-0 entries gives the section's heads, then each block in turn.
          const int per = std::max(1, std::min(fit, nheads / group)) * group;
          std::vector<int> sizes;
          int next_head = 0;
          for (size_t i0 = 0; i0 < e.size();) {
            int size = 0;
            while (i0 + size < e.size() && e[i0 + size].first == 0) ++size;
            sizes.push_back(size);
            for (int j = 0; j < size * blocks; ++j) {
              ASSERT_EQ(e[i0 + j].first, j / size) << what << " at " << i0 + j;
              ASSERT_EQ(e[i0 + j].second, next_head + j % size) << what << " at " << i0 + j;
            }
            next_head += size;
            i0 += size_t(size) * blocks;
          }
          EXPECT_EQ(next_head, nheads) << what;
          const int lo = *std::min_element(sizes.begin(), sizes.end());
          const int hi = *std::max_element(sizes.begin(), sizes.end());
          EXPECT_LE(hi, per) << what;
          EXPECT_LE(hi - lo, group) << what;
          for (int sz : sizes) EXPECT_EQ(sz % group, 0) << what;
          EXPECT_EQ(int(sizes.size()), (nheads / group + per / group - 1) / (per / group)) << what;
        }
      }
    }
  }
}

// ---- backward workspace ------------------------------------------------------------------------

// Deterministic mode: two copies of the dQ accumulator where the chain of key blocks adding into
// a tile is long (>= 8 key blocks without a mask, >= 64 causal: measured, docs/perf-log.md B24),
// one otherwise and always one in the default mode; head dim 256 causal two from 32 key blocks
// and four from 128 while the four copies fit in 1 GiB (B80).
TEST(BwdWorkspace, DeterministicCopiesWhereTheChainIsLong) {
  const int64_t mb = int64_t(1) << 20;
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE(::testing::Message() << "d " << d);
    EXPECT_EQ(flash3::bwd_dq_groups(false, false, 1000, d, mb), 1);
    EXPECT_EQ(flash3::bwd_dq_groups(false, true, 1000, d, mb), 1);
    EXPECT_EQ(flash3::bwd_dq_groups(true, false, 7, d, mb), 1);
    EXPECT_EQ(flash3::bwd_dq_groups(true, false, 8, d, mb), 2);
    EXPECT_EQ(flash3::bwd_dq_groups(true, false, 1000, d, mb), 2);
  }
  for (int d : {64, 128}) {
    EXPECT_EQ(flash3::bwd_dq_groups(true, true, 63, d, mb), 1);
    EXPECT_EQ(flash3::bwd_dq_groups(true, true, 64, d, mb), 2);
    EXPECT_EQ(flash3::bwd_dq_groups(true, true, 1000, d, mb), 2);
  }
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 31, 256, mb), 1);
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 32, 256, mb), 2);
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 127, 256, mb), 2);
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 128, 256, mb), 4);
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 128, 256, 256 * mb), 4);
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 128, 256, 256 * mb + 1), 2);
  // The paper's sweep at head dim 256, causal 16k: 8 heads x 16384 rows x 256 x 4 bytes a copy.
  EXPECT_EQ(flash3::bwd_dq_copy_bytes(8, 16384, 256), 134217728);
  const flash3::detail::BwdWorkspaceLayout ws(1, 8, 16384, 16384, 256, true, true, 8);
  EXPECT_EQ(ws.dq_groups, 4);
}

// The first add into a dQ tile is a store (no clear) always in the deterministic mode; in the
// default mode where the head has at most 32 key blocks (docs/perf-log.md B25, B28, B66).
TEST(BwdWorkspace, StoreFirstWhereKeyBlockZeroLeads) {
  for (int n : {1, 32, 33, 1000}) {
    EXPECT_TRUE(flash3::bwd_dq_store_first(true, n));
    EXPECT_EQ(flash3::bwd_dq_store_first(false, n), n <= 32) << "n_blocks " << n;
  }
}

// The persistent backward leaves two SMs to the dQ postprocess at causal lengths up to 8k
// (docs/perf-log.md B67), never more blocks than work items.
TEST(BwdWorkspace, PersistentGridLeavesTwoSMsAtShortCausal) {
  EXPECT_EQ(flash3::bwd_persistent_grid(132, 4096, true, 2048), 130);
  EXPECT_EQ(flash3::bwd_persistent_grid(132, 4096, true, 8192), 130);
  EXPECT_EQ(flash3::bwd_persistent_grid(132, 4096, true, 8193), 132);
  EXPECT_EQ(flash3::bwd_persistent_grid(132, 4096, false, 2048), 132);
  EXPECT_EQ(flash3::bwd_persistent_grid(132, 100, true, 2048), 100);
  EXPECT_EQ(flash3::bwd_persistent_grid(132, 131, true, 2048), 130);
  EXPECT_EQ(flash3::bwd_persistent_grid(8, 100, true, 2048), 8);
  EXPECT_EQ(flash3::bwd_persistent_grid(132, int64_t(1) << 40, true, 512), 130);
}

// Every part 256-byte aligned, large enough for what the kernels index, disjoint, inside bytes.
TEST(BwdWorkspace, PartsAreAlignedDisjointAndLargeEnough) {
  for (int d : {64, 128, 256}) {
    for (int seqlen_k : {1, 300, 8192}) {
      for (bool causal : {false, true}) {
        for (bool det : {false, true}) {
          for (bool gqa : {false, true}) {
            const int batch = 3, nheads = 6, nheads_kv = gqa ? 2 : nheads, seqlen_q = 1000;
            const flash3::detail::BwdWorkspaceLayout ws(batch, nheads, seqlen_q, seqlen_k, d, causal, det, nheads_kv);
            SCOPED_TRACE(::testing::Message() << "d " << d << " seqlen_k " << seqlen_k << " causal " << causal
                                              << " det " << det << " gqa " << gqa);
            const size_t bh = size_t(batch) * nheads;
            const int groups = flash3::bwd_dq_groups(det, causal, ws.n_blocks, d,
                                                     flash3::bwd_dq_copy_bytes(int64_t(bh), ws.seqlen_q_pad, d));
            EXPECT_EQ(ws.dq_groups, groups);
            EXPECT_EQ(ws.m_blocks, (seqlen_q + ws.block_m - 1) / ws.block_m);
            EXPECT_EQ(ws.n_blocks, (seqlen_k + ws.block_n - 1) / ws.block_n);
            EXPECT_EQ(ws.seqlen_q_pad, int64_t(ws.m_blocks) * ws.block_m);
            // (offset, bytes the kernels use) of every part present.
            std::vector<std::pair<size_t, size_t>> parts = {
                {ws.lse_log2, 4 * bh * ws.seqlen_q_pad},
                {ws.dpsum, 4 * bh * ws.seqlen_q_pad},
                {ws.dq_accum, 4 * bh * ws.seqlen_q_pad * d * groups}};
            EXPECT_EQ(ws.dq_store_first, flash3::bwd_dq_store_first(det, ws.n_blocks));
            if (ws.dq_store_first) parts.emplace_back(ws.dq_sem, 4 * bh * ws.m_blocks * groups);
            parts.emplace_back(ws.dq_done, 4 * bh);
            if (gqa) {
              // The default mode adds into one FP32 dK, dV per kv head; the deterministic mode
              // keeps one per query head.
              const size_t heads = det ? nheads : nheads_kv;
              EXPECT_EQ(ws.dkv_heads, int(heads));
              const size_t bytes = 4 * batch * heads * ws.seqlen_k_pad * d;
              // The TMA reduce-adds' maps span dkv_rows rows of d floats (bwd_add_dkdv_tma).
              EXPECT_EQ(size_t(ws.dkv_rows) * d * 4, bytes);
              parts.emplace_back(ws.dk_accum, bytes);
              parts.emplace_back(ws.dv_accum, bytes);
              EXPECT_GE(ws.dk_accum + ws.dkv_bytes, ws.dv_accum + bytes);  // the zeroed range covers both
            }
            std::sort(parts.begin(), parts.end());
            for (size_t i = 0; i < parts.size(); ++i) {
              EXPECT_EQ(parts[i].first % 256, 0u);
              const size_t end = parts[i].first + parts[i].second;
              EXPECT_LE(end, i + 1 < parts.size() ? parts[i + 1].first : ws.bytes);
            }
          }
        }
      }
    }
  }
}

// ---- the non-causal forward's tail split (src/common/tail_split.h) ----------------------------

TEST(TailSplit, SplitsOnlyWhereItSavesEnough) {
  // The sweep's hdim 128 shape at 16k: 2048 tiles of 94 key blocks on 132 SMs: 15 waves and 68
  // tiles; each SM's share of the tail is 49 key blocks, 45 fewer than a whole tile.
  const flash3::TailSplit s = flash3::make_tail_split(2048, 94, 132);
  EXPECT_EQ(s.full_tiles, 15 * 132);
  EXPECT_EQ(s.tail_tiles, 68);
  EXPECT_EQ(flash3::make_tail_split(2048, 24, 132).tail_tiles, 68);  // 4k: saves 24 - 13 = 11
  EXPECT_EQ(flash3::make_tail_split(2048, 12, 132).tail_tiles, 0);   // 2k: saves 12 - 7 = 5
  EXPECT_EQ(flash3::make_tail_split(2048, 47, 132).tail_tiles, 68);  // 8k: saves 47 - 25 = 22
  EXPECT_EQ(flash3::make_tail_split(1024, 103, 132).tail_tiles, 100);  // hdim 256 8k: saves 24
  EXPECT_EQ(flash3::make_tail_split(264, 94, 132).tail_tiles, 0);      // whole waves
  EXPECT_EQ(flash3::make_tail_split(264, 94, 132).full_tiles, 264);
  EXPECT_EQ(flash3::make_tail_split(15 * 132 + 128, 94, 132).tail_tiles, 0);  // saves 94 - 92 = 2
  // Fewer tiles than SMs: all tail, every tile split over the keys.
  const flash3::TailSplit small = flash3::make_tail_split(8, 47, 132);
  EXPECT_EQ(small.full_tiles, 0);
  EXPECT_EQ(small.tail_tiles, 8);
  EXPECT_EQ(flash3::make_tail_split(8, 12, 132).tail_tiles, 8);  // 12 - 1 = 11 saved
  EXPECT_EQ(flash3::make_tail_split(8, 10, 132).tail_tiles, 0);  // 10 - 1 = 9 saved: too little
  EXPECT_EQ(flash3::make_tail_split(0, 47, 132).tail_tiles, 0);
}

// Every (tail tile, key block) exactly once; each block's work within one key block of every
// other's, in at most two pieces; a cut tile's pieces are exactly those of blocks
// tail_first_block..tail_last_block, each in its own slot, which tail_slot names.
void check_split(int num_tiles, int n_blocks, int grid) {
  const flash3::TailSplit s = flash3::make_tail_split(num_tiles, n_blocks, grid);
  ASSERT_EQ(s.full_tiles + s.tail_tiles, num_tiles);
  if (s.tail_tiles == 0) return;
  ASSERT_LT(s.tail_tiles, grid);
  ASSERT_EQ(s.full_tiles % grid, 0) << "the main kernel runs whole waves";
  ASSERT_LE(s.grid, grid);
  ASSERT_EQ(s.grid, std::min(grid, s.tail_tiles * n_blocks));
  std::vector<int> seen(size_t(s.tail_tiles) * n_blocks, 0);
  std::vector<std::set<int>> holders(s.tail_tiles);
  std::vector<std::vector<std::pair<int, int>>> slots(s.tail_tiles);  // (block, slot)
  std::set<int> used_slots;
  int min_work = 1 << 30, max_work = 0;
  for (int b = 0; b < s.grid; ++b) {
    const int count = flash3::tail_piece_count(s, b);
    ASSERT_GE(count, 1) << "every tail block holds a piece";
    ASSERT_LE(count, 2);
    int work = 0;
    for (int k = 0; k < count; ++k) {
      const flash3::TailPiece p = flash3::tail_piece(s, b, k);
      ASSERT_GE(p.tile, s.full_tiles);
      ASSERT_LT(p.tile, num_tiles);
      ASSERT_GE(p.n_lo, 0);
      ASSERT_LT(p.n_lo, p.n_hi);
      ASSERT_LE(p.n_hi, n_blocks);
      const int i = p.tile - s.full_tiles;
      for (int n = p.n_lo; n < p.n_hi; ++n) ++seen[size_t(i) * n_blocks + n];
      work += p.n_hi - p.n_lo;
      holders[i].insert(b);
      EXPECT_EQ(p.part >= 0, p.n_hi - p.n_lo < n_blocks) << "only cut tiles have slots";
      if (p.part >= 0) {
        EXPECT_LT(p.part, 2);
        EXPECT_TRUE(used_slots.insert(2 * b + p.part).second) << "slot used twice";
        slots[i].push_back({b, 2 * b + p.part});
      }
    }
    min_work = std::min(min_work, work);
    max_work = std::max(max_work, work);
  }
  for (size_t x = 0; x < seen.size(); ++x) ASSERT_EQ(seen[x], 1) << "tile " << x / n_blocks << " block " << x % n_blocks;
  EXPECT_LE(max_work - min_work, 1);
  EXPECT_GE(n_blocks - max_work, flash3::kTailSplitMinSaved);
  for (int i = 0; i < s.tail_tiles; ++i) {
    const int first = flash3::tail_first_block(s, i), last = flash3::tail_last_block(s, i);
    EXPECT_EQ(*holders[i].begin(), first);
    EXPECT_EQ(*holders[i].rbegin(), last);
    EXPECT_EQ(int(holders[i].size()), last - first + 1);
    ASSERT_EQ(int(slots[i].size()), last - first + 1);
    for (const auto& [b, slot] : slots[i]) EXPECT_EQ(flash3::tail_slot(s, i, b), slot);
  }
}

TEST(TailSplit, EveryKeyBlockOnceAndSlotsConsistent) {
  for (int grid : {1, 7, 78, 132}) {
    for (int n_blocks : {1, 13, 24, 47, 94, 205, 1000}) {
      for (int num_tiles : {1, 5, 8, 64, 68, 131, 133, 200, 2048, 2752}) {
        check_split(num_tiles, n_blocks, grid);
        if (HasFatalFailure()) return;
      }
    }
  }
}

}  // namespace

namespace {
flash3::KvcacheProblem decode_problem(int batch, int seqlen_q, int nheads, int nheads_kv, int seqlen_cache,
                                      int head_dim = 128) {
  flash3::KvcacheProblem p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.nheads = nheads;
  p.nheads_kv = nheads_kv;
  p.head_dim = head_dim;
  p.seqlen_cache = seqlen_cache;
  return p;
}
}  // namespace

// One wave: 132 SMs x 2 blocks at head dim 128. Tiles = batch x nheads_kv x ceil(seqlen_q x
// group / 16).
TEST(KvcacheSplits, FillsOneWaveWithinTheBounds) {
  using flash3::kvcache_num_splits;
  // batch 1, 4 KV heads: 4 tiles; 264 / 4 = 66 splits, capped by the keys: up to 32 splits of
  // 128 keys or more, beyond that of 1024 or more, at most 64.
  EXPECT_EQ(kvcache_num_splits(decode_problem(1, 1, 32, 4, 8192), 132), 32);
  EXPECT_EQ(kvcache_num_splits(decode_problem(1, 1, 32, 4, 40960), 132), 40);
  EXPECT_EQ(kvcache_num_splits(decode_problem(1, 1, 32, 4, 65536), 132), 64);
  EXPECT_EQ(kvcache_num_splits(decode_problem(1, 1, 32, 4, 1 << 20), 132), 64);
  EXPECT_EQ(kvcache_num_splits(decode_problem(1, 1, 32, 4, 1024), 132), 8);   // 128 keys each
  EXPECT_EQ(kvcache_num_splits(decode_problem(1, 1, 32, 4, 100), 132), 1);    // under 128 keys
  EXPECT_EQ(kvcache_num_splits(decode_problem(8, 1, 32, 4, 65536), 132), 8);  // 32 tiles: 264 / 32
  // Tiles filling half a wave or more: no split.
  EXPECT_EQ(kvcache_num_splits(decode_problem(64, 1, 32, 4, 65536), 132), 1);
  EXPECT_EQ(kvcache_num_splits(decode_problem(8, 130, 32, 4, 65536), 132), 1);  // 65 row tiles per head
  // Head dim 256 (one block per SM) and 64 (three).
  EXPECT_EQ(kvcache_num_splits(decode_problem(8, 1, 32, 4, 65536, 256), 132), 4);
  EXPECT_EQ(kvcache_num_splits(decode_problem(8, 1, 32, 4, 65536, 64), 132), 12);
  // MLA: one block per SM.
  flash3::KvcacheProblem mla = decode_problem(32, 1, 16, 1, 8192, 64);
  mla.mla = true;
  mla.head_dim_v = 512;
  EXPECT_EQ(kvcache_num_splits(mla, 132), 4);  // 32 tiles: 132 / 32
  // Every shape: within [1, 64], and never more splits for a larger batch.
  for (int hd : {64, 128, 256}) {
    for (int cache : {1, 127, 128, 4096, 1 << 17}) {
      int prev = 1 << 30;
      for (int batch = 1; batch <= 256; batch *= 2) {
        const int s = kvcache_num_splits(decode_problem(batch, 1, 16, 2, cache, hd), 132);
        EXPECT_GE(s, 1);
        EXPECT_LE(s, 64);
        EXPECT_LE(s, prev) << "batch " << batch << " cache " << cache << " hdim " << hd;
        prev = s;
      }
    }
  }
}

// quotient(x, make_divisor(n)) is x / n: every divisor up to 4096 and some far larger, at the
// multiples of n, near 2^31 and at random x.
TEST(Divisor, EqualsTheDivisionForEveryDivisorAndDividend) {
  std::vector<int> sizes;
  for (int ps = 1; ps <= 4096; ++ps) sizes.push_back(ps);
  for (int ps : {5000, 65535, 65536, 65537, 1 << 20, (1 << 20) + 1, 1000000007, 1 << 30, (1 << 30) + 1, INT_MAX - 1,
                 INT_MAX}) {
    sizes.push_back(ps);
  }
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> any_pos(0, INT_MAX);
  for (int ps : sizes) {
    const flash3::Divisor d = flash3::make_divisor(ps);
    std::vector<int> positions = {0, 1, INT_MAX, INT_MAX - 1};
    for (long long q : {1LL, 2LL, 3LL, (long long)INT_MAX / ps}) {
      for (long long off : {-1LL, 0LL, 1LL}) {
        const long long pos = q * ps + off;
        if (pos >= 0 && pos <= INT_MAX) positions.push_back(int(pos));
      }
    }
    for (int i = 0; i < 64; ++i) positions.push_back(any_pos(rng));
    for (int pos : positions) {
      ASSERT_EQ(flash3::quotient(pos, d), pos / ps) << "divisor " << ps << ", dividend " << pos;
    }
  }
}
