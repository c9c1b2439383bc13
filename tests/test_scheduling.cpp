// flash3: CPU tests of the causal forward tile order (src/fwd/causal_order.h): every tile is
// handed out once, longest first within each section, sections within the L2 budget, and a last
// section that fills the GPU at least once. And the backward workspace (src/bwd/bwd_config.h):
// the deterministic mode's dQ copies and a layout whose parts hold them without overlap.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include "bwd/bwd_config.h"
#include "fwd/causal_order.h"

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

// ---- backward workspace ------------------------------------------------------------------------

// Deterministic mode: two copies of the dQ accumulator where the chain of key blocks adding into
// a tile is long (>= 8 key blocks without a mask, >= 64 causal: measured, docs/perf-log.md B24),
// one otherwise and always one in the default mode.
TEST(BwdWorkspace, DeterministicCopiesWhereTheChainIsLong) {
  EXPECT_EQ(flash3::bwd_dq_groups(false, false, 1000), 1);
  EXPECT_EQ(flash3::bwd_dq_groups(false, true, 1000), 1);
  EXPECT_EQ(flash3::bwd_dq_groups(true, false, 7), 1);
  EXPECT_EQ(flash3::bwd_dq_groups(true, false, 8), 2);
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 63), 1);
  EXPECT_EQ(flash3::bwd_dq_groups(true, true, 64), 2);
}

// The first add into a dQ tile is a store (no clear) always in the deterministic mode; in the
// default mode where the head has at most 32 key blocks, but not at non-causal head dim 256
// (docs/perf-log.md B25, B28).
TEST(BwdWorkspace, StoreFirstWhereKeyBlockZeroLeads) {
  for (int n : {1, 32, 33, 1000}) {
    for (int d : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        EXPECT_TRUE(flash3::bwd_dq_store_first(true, causal, d, n));
        const bool leads = causal || d != 256;
        EXPECT_EQ(flash3::bwd_dq_store_first(false, causal, d, n), leads && n <= 32)
            << "d " << d << " causal " << causal << " n_blocks " << n;
      }
    }
  }
}

// Every part 256-byte aligned, large enough for what the kernels index, disjoint, inside bytes.
TEST(BwdWorkspace, PartsAreAlignedDisjointAndLargeEnough) {
  for (int d : {64, 128, 256}) {
    for (int seqlen_k : {1, 300, 8192}) {
      for (bool causal : {false, true}) {
        for (bool det : {false, true}) {
          for (bool gqa : {false, true}) {
            const int batch = 3, nheads = 5, seqlen_q = 1000;
            const flash3::BwdWorkspaceLayout ws(batch, nheads, seqlen_q, seqlen_k, d, causal, det, gqa);
            SCOPED_TRACE(::testing::Message() << "d " << d << " seqlen_k " << seqlen_k << " causal " << causal
                                              << " det " << det << " gqa " << gqa);
            const size_t bh = size_t(batch) * nheads;
            const int groups = flash3::bwd_dq_groups(det, causal, ws.n_blocks);
            EXPECT_EQ(ws.dq_groups, groups);
            EXPECT_EQ(ws.m_blocks, (seqlen_q + ws.block_m - 1) / ws.block_m);
            EXPECT_EQ(ws.n_blocks, (seqlen_k + ws.block_n - 1) / ws.block_n);
            EXPECT_EQ(ws.seqlen_q_pad, int64_t(ws.m_blocks) * ws.block_m);
            // (offset, bytes the kernels use) of every part present.
            std::vector<std::pair<size_t, size_t>> parts = {
                {ws.lse_log2, 4 * bh * ws.seqlen_q_pad},
                {ws.dpsum, 4 * bh * ws.seqlen_q_pad},
                {ws.dq_accum, 4 * bh * ws.seqlen_q_pad * d * groups}};
            EXPECT_EQ(ws.dq_store_first, flash3::bwd_dq_store_first(det, causal, d, ws.n_blocks));
            if (ws.dq_store_first) parts.emplace_back(ws.dq_sem, 4 * bh * ws.m_blocks * groups);
            if (gqa) {
              parts.emplace_back(ws.dk_accum, 4 * bh * ws.seqlen_k_pad * d);
              parts.emplace_back(ws.dv_accum, 4 * bh * ws.seqlen_k_pad * d);
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

}  // namespace
