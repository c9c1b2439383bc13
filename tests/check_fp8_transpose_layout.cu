// flash3: host check that the FP8 transposer's shared-memory addresses (FwdFp8Transpose::src and
// ::dst) equal the CuTe layouts SmemLayoutV and SmemLayoutVt at every unit, lane, warp and stage,
// and that the eight rows of each stmatrix matrix (and of each ldmatrix matrix) fall in eight
// distinct 16-byte bank groups (one wavefront per matrix).
// A CTest test (Fp8TransposeLayout).
#include <cstdio>

#include "fwd/fwd_fp8_traits.h"

using namespace flash3::detail;

template <int D>
int check() {
  using T = FwdFp8Traits<D, false>;
  using X = FwdFp8Transpose<T>;
  auto lv = typename T::SmemLayoutV{};
  auto lt = typename T::SmemLayoutVt{};
  int bad = 0, units = 0;
  for (int stage = 0; stage < X::kStages; ++stage)
    for (int warp = 0; warp < X::kWarps; ++warp)
      for (int lane = 0; lane < 32; ++lane) {
        const auto ad = X::addresses(0, 0, warp, lane);
        const int st_row = X::st_row(lane), st_col = X::st_col(lane);
        for (int j = 0; j < X::kChunksPerWarp; ++j)
          for (int g = 0; g < X::kGroups; ++g, ++units) {
            const int c = warp + X::kWarps * j;
            if (int(X::src(ad, j, g, stage)) != int(lv(32 * g + lane, 16 * c, stage))) ++bad;
            if (int(X::dst(ad, j, g, stage)) != int(lt(16 * c + st_row, 32 * g + st_col, stage))) ++bad;
          }
      }
  // Bank groups: matrix m of a unit is addressed by lanes 8m..8m+7.
  int conflicts = 0;
  for (int stage = 0; stage < X::kStages; ++stage)
    for (int warp = 0; warp < X::kWarps; ++warp)
      for (int j = 0; j < X::kChunksPerWarp; ++j)
        for (int g = 0; g < X::kGroups; ++g)
          for (int m = 0; m < 4; ++m) {
            unsigned st = 0, ld = 0;
            for (int lane = 8 * m; lane < 8 * m + 8; ++lane) {
              const auto ad = X::addresses(0, 0, warp, lane);
              st |= 1u << ((X::dst(ad, j, g, stage) % 128) / 16);
              ld |= 1u << ((X::src(ad, j, g, stage) % 128) / 16);
            }
            conflicts += (st != 0xffu) + (ld != 0xffu);
          }
  printf("head dim %d: %d lane-units, %d mismatches, %d matrices with bank conflicts\n", D, units, bad, conflicts);
  return bad + conflicts;
}

int main() { return (check<64>() + check<128>() + check<256>()) != 0; }
