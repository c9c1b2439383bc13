// flash3 tests: the check that a call throws flash3::Error with a message that starts with an
// operation's prefix ("flash3::fwd: ") and contains each of the given parts.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "flash3/flash3.h"

namespace flash3::testing {

template <class Call>
::testing::AssertionResult throws_error(Call&& call, const std::string& prefix,
                                        std::initializer_list<std::string> parts) {
  try {
    call();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind(prefix, 0) != 0) return ::testing::AssertionFailure() << "bad prefix: " << msg;
    for (const std::string& part : parts) {
      if (msg.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << part << "\"";
      }
    }
    return ::testing::AssertionSuccess() << msg;
  }
  return ::testing::AssertionFailure() << "validation did not throw";
}

}  // namespace flash3::testing
