// Helpers shared by the GoogleTest suites (included by *_test.cc files only).
#pragma once

#include <gtest/gtest.h>

#include <utility>

#include "nebulite/status.h"

namespace nebulite {

// Unwraps a Result in a test, failing the test (and returning T{}) on an error.
template <typename T>
T Val(Result<T> r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : T{};
}

}  // namespace nebulite
