// flash3: the one table of forward tile shapes, per head dim.
//
// NOTES: a consumer warpgroup owns 64 query rows (one m64nNk16 WGMMA tile), so kBlockM = 64 x
// the number of consumer warpgroups. Shared memory holds Q (kBlockM x d) plus kStages stages of
// K and V (kBlockN x d each); 227 KB per block is the limit. Registers: each consumer thread
// keeps O (64 x d / 128 floats) and S (64 x kBlockN / 128 floats), within the 240 registers
// that setmaxnreg gives it.
//
//   head dim | kBlockM | kBlockN | stages | smem (bf16)
//   ---------+---------+---------+--------+----------------------------
//        64  |   128   |   128   |   2    | 16 + 2 x 32 = 80 KB
//       128  |   128   |   128   |   2    | 32 + 2 x 64 = 160 KB
//       256  |   128   |    80   |   2    | 64 + 2 x 80 = 224 KB
#pragma once

namespace flash3 {

template <int kHeadDim>
struct FwdTileConfig;

template <> struct FwdTileConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2; };
template <> struct FwdTileConfig<128> { static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2; };
template <> struct FwdTileConfig<256> { static constexpr int kBlockM = 128, kBlockN = 80,  kStages = 2; };

}  // namespace flash3
