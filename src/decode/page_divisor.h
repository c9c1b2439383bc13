// flash3: a cache position's page without a division (the decoding kernel's page lookups).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace flash3 {

// pos / page_size as (pos x mul) >> shr for every 0 <= pos < 2^31 and page size in [1, 2^31):
// shr = 31 + k with k = ceil(log2(page_size)), mul = ceil(2^shr / page_size) (below 2^32). Write
// mul = (2^shr + e) / page_size with 0 <= e < page_size: (pos x mul) / 2^shr is pos / page_size
// plus pos e / (page_size 2^shr) < 2^31 / 2^shr = 2^-k <= 1 / page_size, and pos / page_size is
// at most 1 / page_size below the next integer, so the floor is exact.
struct PageDivisor {
  uint32_t mul = 0;
  int shr = 0;
};

inline PageDivisor page_divisor(int page_size) {
  PageDivisor d;
  int k = 0;
  while ((int64_t(1) << k) < page_size) ++k;
  d.shr = 31 + k;
  d.mul = uint32_t(((uint64_t(1) << d.shr) + uint64_t(page_size) - 1) / uint64_t(page_size));
  return d;
}

FLASH3_HD int page_of(int pos, PageDivisor d) { return int((uint64_t(uint32_t(pos)) * d.mul) >> d.shr); }

}  // namespace flash3
