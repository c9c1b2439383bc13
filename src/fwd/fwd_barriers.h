// flash3: the named barriers of the forward kernel (id 0 is __syncthreads): the consumers'
// epilogue (and the tail combine), and one per consumer warpgroup for the pingpong turns.
#pragma once

namespace flash3::detail {

enum : int { kFwdBarrierEpilogue = 1, kFwdBarrierPingpongBase = 2 };

}  // namespace flash3::detail
