// flash3: host check that the FP8 transposer's shared-memory addresses (FwdFp8Transpose::src and
// ::dst) equal the CuTe layouts SmemLayoutV and SmemLayoutVt at every unit, lane, warp and stage.
//   nvcc -std=c++17 --expt-relaxed-constexpr -Iinclude -Isrc -Ithird_party/cutlass/include tools/check_fp8_transpose_layout.cu
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
        const int st_row = 2 * (lane % 8) + lane / 16, st_col = 16 * ((lane / 8) % 2);
        for (int j = 0; j < X::kChunksPerWarp; ++j)
          for (int g = 0; g < X::kGroups; ++g, ++units) {
            const int c = warp + X::kWarps * j;
            if (int(X::src(ad, j, g, stage)) != int(lv(32 * g + lane, 16 * c, stage))) ++bad;
            if (int(X::dst(ad, j, g, stage)) != int(lt(16 * c + st_row, 32 * g + st_col, stage))) ++bad;
          }
      }
  printf("head dim %d: %d lane-units, %d mismatches\n", D, units, bad);
  return bad;
}

int main() { return (check<64>() + check<128>() + check<256>()) != 0; }
