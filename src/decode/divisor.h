// flash3: division by a number fixed for a whole launch without a division instruction (the
// decoding kernel's page lookups and its rows' query heads).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace flash3 {

// x / n as (x * mul) >> shr for every 0 <= x < 2^31 and n in [1, 2^31): shr = 31 + k with
// k = ceil(log2(n)), mul = ceil(2^shr / n) (below 2^32). Write mul = (2^shr + e) / n with
// 0 <= e < n: (x * mul) / 2^shr is x / n plus x e / (n 2^shr) < 2^31 / 2^shr = 2^-k <= 1 / n, and
// x / n is at most 1 / n below the next integer, so the floor is exact.
struct Divisor {
  uint32_t mul = 0;
  int shr = 0;
};

inline Divisor make_divisor(int n) {
  Divisor d;
  int k = 0;
  while ((int64_t(1) << k) < n) ++k;
  d.shr = 31 + k;
  d.mul = uint32_t(((uint64_t(1) << d.shr) + uint64_t(n) - 1) / uint64_t(n));
  return d;
}

FLASH3_HD int quotient(int x, Divisor d) { return int((uint64_t(uint32_t(x)) * d.mul) >> d.shr); }

}  // namespace flash3
