// Internal helpers shared by the storage drivers (not part of the public API).
#pragma once

#include <string>

#include "nebulite/status.h"

namespace nebulite::internal {

// Validates a '/'-separated relative path: every component must pass
// ValidatePathComponent(). The empty path (the store's root) is accepted only when
// `allow_root` is true. Returns InvalidArgument naming `what` otherwise.
Status ValidateRelativePath(const std::string& path, const char* what, bool allow_root);

}  // namespace nebulite::internal
