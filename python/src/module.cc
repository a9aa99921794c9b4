// kvferry._kvferry: the extension module. The package kvferry (python/kvferry/__init__.py)
// re-exports it with documentation; see bindings.h for the ownership and GIL rules.
#include "bindings.h"

NB_MODULE(_kvferry, m) {
  m.doc() = "kvferry: move LLM KV caches (C++ core; use the kvferry package)";
  kvferry::py::BindErrors(m);
  kvferry::py::BindDevice(m);
  kvferry::py::BindPool(m);
  kvferry::py::BindTransceiver(m);
  kvferry::py::BindTiering(m);
  kvferry::py::BindRendezvous(m);
  kvferry::py::BindMetrics(m);
}
