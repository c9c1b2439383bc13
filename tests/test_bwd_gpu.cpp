// GPU tests of flash3::bwd (to be written).
#include <gtest/gtest.h>
