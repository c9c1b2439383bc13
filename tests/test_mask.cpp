// flash3 CPU tests of the attention mask (src/common/mask.h) against a brute-force statement of
// the rule: query i sees key j iff 0 <= j < seqlen_k and
//   i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
// (-1: unbounded; causal: right = 0). The kernels skip the blocks the mask's ranges leave out, so
// a range that misses a visible pair loses keys; the forward (n_block_range) and the backward
// (m_block_range) must agree on the set of block pairs exactly, since the deterministic dQ order
// starts each tile's chain at its first key block (bwd_dq_writer.h). The kernels without windows
// (Mask<..., false>) must follow the rule without one.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/mask.h"

namespace flash3::detail {
namespace {

struct Rule {
  int sq, sk, left, right;
  bool causal;
  bool visible(int i, int j) const {
    if (j < 0 || j >= sk) return false;
    const long long d = (long long)sk - sq, lo = i + d - left, hi = i + d + (causal ? 0 : right);
    return (left < 0 || j >= lo) && ((!causal && right < 0) || j <= hi);
  }
};

// A block range [begin, end) within [0, blocks].
::testing::AssertionResult in_bounds(int begin, int end, int blocks) {
  if (begin >= 0 && begin <= end && end <= blocks) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "range [" << begin << ", " << end << ") outside [0, " << blocks << "]";
}

template <bool kCausal, bool kWindow, int kBlockM, int kBlockN>
void check(const Rule& rule) {
  SCOPED_TRACE("sq=" + std::to_string(rule.sq) + " sk=" + std::to_string(rule.sk) + " window=(" +
               std::to_string(rule.left) + "," + std::to_string(rule.right) + ")" + (kCausal ? " causal" : "") + (kWindow ? " (window kernel)" : "") +
               " blocks " + std::to_string(kBlockM) + "x" + std::to_string(kBlockN));
  const Mask<kCausal, kWindow> mask(SeqLen{rule.sq, rule.sk}, Window{rule.left, rule.right});
  const int m_blocks = (rule.sq + kBlockM - 1) / kBlockM, n_blocks = (rule.sk + kBlockN - 1) / kBlockN;
  for (int i = 0; i < rule.sq; ++i) {
    int begin = rule.sk, end = 0;  // the visible keys of row i, as [begin, end)
    for (int j = 0; j < rule.sk; ++j) {
      if (rule.visible(i, j)) {
        begin = std::min(begin, j);
        end = j + 1;
      }
    }
    if (end > begin) {
      ASSERT_EQ(mask.key_begin(i), begin) << "row " << i;
      ASSERT_EQ(mask.key_end(i), end) << "row " << i;
    } else {
      ASSERT_LE(mask.key_end(i), mask.key_begin(i)) << "row " << i << " sees no key";
    }
  }
  std::vector<std::vector<bool>> pair(m_blocks, std::vector<bool>(n_blocks, false));
  for (int m = 0; m < m_blocks; ++m) {
    int n_begin, n_end;
    mask.template n_block_range<kBlockM, kBlockN>(m, n_begin, n_end);
    ASSERT_TRUE(in_bounds(n_begin, n_end, n_blocks)) << "query block " << m;
    for (int n = 0; n < n_blocks; ++n) {
      bool any = false, all = true;
      for (int i = m * kBlockM; i < std::min((m + 1) * kBlockM, rule.sq); ++i) {
        for (int j = n * kBlockN; j < (n + 1) * kBlockN; ++j) {
          const bool v = rule.visible(i, j);
          any |= v;
          all &= v;
        }
      }
      const bool visited = n >= n_begin && n < n_end;
      pair[m][n] = visited;
      ASSERT_EQ(visited, any) << "query block " << m << ", key block " << n
                              << (any ? ": holds a visible pair but is skipped" : ": visited but holds none");
      const bool needs = mask.template needs_masking<kBlockM, kBlockN>(m * kBlockM, n * kBlockN);
      if (visited && !needs) {
        ASSERT_TRUE(all) << "query block " << m << ", key block " << n << " left unmasked holds an invisible pair";
      }
      // The per-tile ranges the main loops test instead: the same answer for every block pair.
      ASSERT_EQ((mask.template unmasked_n_blocks<kBlockM, kBlockN>(m * kBlockM).masks(n)), needs)
          << "query block " << m << ", key block " << n << ": unmasked_n_blocks";
      ASSERT_EQ((mask.template unmasked_m_blocks<kBlockM, kBlockN>(n * kBlockN).masks(m)), needs)
          << "query block " << m << ", key block " << n << ": unmasked_m_blocks";
    }
  }
  for (int n = 0; n < n_blocks; ++n) {
    int m_begin, m_end;
    mask.template m_block_range<kBlockM, kBlockN>(n, m_begin, m_end);
    ASSERT_TRUE(in_bounds(m_begin, m_end, m_blocks)) << "key block " << n;
    for (int m = 0; m < m_blocks; ++m) {
      ASSERT_EQ(m >= m_begin && m < m_end, bool(pair[m][n]))
          << "key block " << n << ", query block " << m << ": m_block_range and n_block_range disagree";
    }
  }
}

const int kLengths[] = {1, 17, 64, 65, 128, 129, 200, 333};
const std::pair<int, int> kWindows[] = {{-1, -1}, {0, 0},  {1, 0},   {5, 3},   {100, 0},  {-1, 37},
                                        {200, 300}, {0, -1}, {63, 64}, {64, 63}, {128, 0}, {-1, 0}};

TEST(Mask, RangesAndMaskingFollowTheRule) {
  for (int sq : kLengths) {
    for (int sk : kLengths) {
      for (const auto& [left, right] : kWindows) {
        for (bool causal : {false, true}) {
          const Rule rule{sq, sk, left, right, causal};
          if (causal) {
            check<true, true, 128, 128>(rule);
            check<true, true, 192, 128>(rule);
            check<true, true, 64, 128>(rule);
          } else {
            check<false, true, 128, 176>(rule);
            check<false, true, 64, 64>(rule);
            check<false, true, 128, 192>(rule);
          }
          // The kernels without windows: the rule without one.
          if (left == -1 && right == -1) {
            if (causal) {
              check<true, false, 128, 128>(rule);
              check<true, false, 192, 128>(rule);
            } else {
              check<false, false, 128, 176>(rule);
              check<false, false, 64, 64>(rule);
            }
          }
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

// Bounds far beyond the lengths (and the lengths' 2^30 limit) stay in 32-bit arithmetic.
TEST(Mask, HugeWindowsAndLengthsDoNotOverflow) {
  const int big = 1 << 30;
  const Mask<false, true> mask(SeqLen{big, big}, Window{2147483647, 2147483647});
  int n_begin, n_end, m_begin, m_end;
  mask.n_block_range<128, 128>(big / 128 - 1, n_begin, n_end);
  EXPECT_EQ(n_begin, 0);
  EXPECT_EQ(n_end, big / 128);
  mask.m_block_range<128, 128>(0, m_begin, m_end);
  EXPECT_EQ(m_begin, 0);
  EXPECT_EQ(m_end, big / 128);
  EXPECT_FALSE((mask.needs_masking<128, 128>(big - 128, 0)));
  const Mask<true, true> causal(SeqLen{1, big}, Window{5, -1});
  causal.n_block_range<128, 128>(0, n_begin, n_end);
  EXPECT_EQ(n_end, big / 128);
  EXPECT_EQ(n_begin, (big - 1 - 5) / 128);
}

}  // namespace
}  // namespace flash3::detail
