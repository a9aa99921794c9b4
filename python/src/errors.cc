// Status -> Python exception: StatusError and ClosedError become the kvferry.errors classes.
#include <Python.h>

#include "bindings.h"

namespace kvferry::py {

namespace {

void Raise(const char* code, const char* message) {
  try {
    nb::object make = nb::module_::import_("kvferry.errors").attr("error_for");
    nb::object exc = make(code, message);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  } catch (nb::python_error& e) {
    // kvferry.errors not importable (the bare extension module, e.g. in stub generation).
    e.restore();
  }
}

}  // namespace

void BindErrors(nb::module_&) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      std::string code(StatusCodeName(e.status().code()));
      std::string message(e.status().message());
      Raise(code.c_str(), message.c_str());
    } catch (const ClosedError& e) {
      Raise("CLOSED", e.what());
    }
  });
}

}  // namespace kvferry::py
