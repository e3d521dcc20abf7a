// Opening a store from its root, as Python names it: a local path, or the URL of an object
// store (nebulite.stores makes the client). Call with the GIL held.
#pragma once

#include <memory>
#include <string>

#include "nebulite/status.h"
#include "nebulite/storage.h"

namespace nebulite::python {

// True for "<scheme>://..." other than file://.
bool IsStoreUrl(const std::string& root);

// A posix store at `root` (with `options`), or the object store it names (read-only when
// options.read_only; the other options are the posix driver's). A URL that nebulite.stores
// refuses raises its InvalidArgumentError.
Result<std::shared_ptr<Storage>> OpenStoreAt(const std::string& root, const PosixOptions& options);

}  // namespace nebulite::python
