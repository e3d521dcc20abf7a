// The nebulite._core extension module: thin bindings over the framework-free core.
#include <nanobind/nanobind.h>

#include "status_binding.h"

NB_MODULE(_core, m) {
  m.doc() = "nebulite C++ core";
  nebulite::python::RegisterStatus(m);
  nebulite::python::RegisterEngine(m);
  nebulite::python::RegisterStorage(m);
  nebulite::python::RegisterWalk(m);
  nebulite::python::RegisterScan(m);
  nebulite::python::RegisterSafeStorages(m);
}
