// Maps core Status values to the Python exceptions of nebulite.errors.
#pragma once

#include <nanobind/nanobind.h>

#include "nebulite/status.h"

namespace nebulite::python {

// Raises the nebulite.errors exception matching `st` (no-op when OK).
void ThrowIfError(const Status& st);

template <typename T>
T ValueOrThrow(Result<T> r) {
  ThrowIfError(r.status());
  return std::move(r).value();
}

void RegisterStatus(nanobind::module_& m);
void RegisterEngine(nanobind::module_& m);
void RegisterStorage(nanobind::module_& m);
void RegisterWalk(nanobind::module_& m);
void RegisterScan(nanobind::module_& m);
void RegisterSafeStorages(nanobind::module_& m);

}  // namespace nebulite::python
