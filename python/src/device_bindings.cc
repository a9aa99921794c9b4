// Devices, streams, events, the config registry and build information.
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "kvferry/build_info.h"
#include "kvferry/config.h"

namespace kvferry::py {

namespace {

nb::dict InfoDict(const DeviceInfo& info) {
  nb::dict d;
  d["platform"] = info.platform;
  d["ordinal"] = info.ordinal;
  d["name"] = info.name;
  d["memory_bytes"] = info.memory_bytes;
  d["detail"] = info.detail;
  return d;
}

const char* KnobTypeName(KnobType t) {
  switch (t) {
    case KnobType::kBool:
      return "bool";
    case KnobType::kInt:
      return "int";
    case KnobType::kString:
      return "string";
  }
  return "?";
}

const char* KnobSourceName(KnobSource s) {
  switch (s) {
    case KnobSource::kDefault:
      return "default";
    case KnobSource::kEnvironment:
      return "environment";
    case KnobSource::kSet:
      return "set";
  }
  return "?";
}

KnobView FindKnob(const std::string& name) {
  for (KnobView& k : Config::Global().List()) {
    if (k.name == name) return std::move(k);
  }
  throw StatusError(Status::NotFound("no knob named '" + name + "' (kvferry.knobs() lists them)"));
}

nb::object KnobValue(const KnobView& k) {
  switch (k.type) {
    case KnobType::kBool:
      return nb::bool_(Config::Global().Bool(k.name));
    case KnobType::kInt:
      return nb::int_(Config::Global().Int(k.name));
    case KnobType::kString:
      break;
  }
  return nb::str(Config::Global().String(k.name).c_str());
}

std::string KnobText(nb::handle value) {
  if (nb::isinstance<nb::bool_>(value)) return nb::cast<bool>(value) ? "true" : "false";
  if (nb::isinstance<nb::int_>(value)) return std::to_string(nb::cast<int64_t>(value));
  if (nb::isinstance<nb::str>(value)) return nb::cast<std::string>(value);
  ThrowInvalid("a knob value must be a str, int or bool");
  return {};
}

// The native handle of a torch.cuda.Stream / torch.cuda.Event (or an int).
void* NativeHandle(nb::handle obj, const char* attr) {
  nb::handle h = obj;
  nb::object tmp;
  if (nb::hasattr(obj, attr)) {
    tmp = obj.attr(attr);
    h = tmp;
  }
  if (!nb::isinstance<nb::int_>(h)) {
    ThrowInvalid(std::string("expected an int handle or an object with .") + attr);
  }
  return reinterpret_cast<void*>(nb::cast<uintptr_t>(h));
}

}  // namespace

void BindDevice(nb::module_& m) {
  m.def(
      "version", [] { return std::string(Version()); }, "The library's version.");
  m.def(
      "build_features",
      [] {
        nb::list out;
        for (const Feature& f : BuildFeatures()) {
          nb::dict d;
          d["name"] = f.name;
          d["present"] = f.present;
          d["version"] = f.version;
          d["note"] = f.note;
          out.append(d);
        }
        return out;
      },
      "Optional backends of this build (cuda, ucx, mpi, ...), with versions.");
  m.def("list_devices", &ListDevices, "Names of the devices present: 'cpu', then 'cuda:N'.");

  // ---- config registry ----
  m.def(
      "knobs",
      [] {
        nb::list out;
        for (const KnobView& k : Config::Global().List()) {
          nb::dict d;
          d["name"] = k.name;
          d["type"] = KnobTypeName(k.type);
          d["default"] = k.default_value;
          d["value"] = k.value;
          d["doc"] = k.doc;
          d["constraint"] = k.constraint;
          d["env_var"] = k.env_var;
          d["source"] = KnobSourceName(k.source);
          out.append(d);
        }
        return out;
      },
      "Every configuration knob: name, type, default, value, doc, constraint, env_var, source.");
  m.def(
      "get_knob", [](const std::string& name) { return KnobValue(FindKnob(name)); },
      nb::arg("name"), "A knob's current value (bool, int or str). NotFoundError if unknown.");
  m.def(
      "set_knob",
      [](const std::string& name, nb::handle value) {
        FindKnob(name);
        Check(Config::Global().Set(name, KnobText(value)));
      },
      nb::arg("name"), nb::arg("value"),
      "Sets a knob for this process (validated; errors name the constraint).");
  m.def(
      "reset_knob",
      [](const std::string& name) {
        FindKnob(name);
        Check(Config::Global().Reset(name));
      },
      nb::arg("name"), "Puts a knob back to its default.");

  // ---- events and streams ----
  nb::class_<PyEvent>(m, "Event", "A point in a stream's work (Stream.record).")
      .def(
          "query", [](PyEvent& e) { return e.core()->event->Query(); },
          "True when the recorded work has finished (or nothing was recorded).")
      .def(
          "synchronize",
          [](PyEvent& e, double timeout) {
            std::shared_ptr<EventCore> c = e.core();
            Deadline d = DeadlineAfter(timeout);
            Status s;
            {
              nb::gil_scoped_release nogil;
              s = c->event->Synchronize(d);
            }
            Check(s);
          },
          nb::arg("timeout"), "Waits for the recorded work; DeadlineExceededError at the timeout.")
      .def("close", &PyEvent::close);

  nb::class_<PyStream>(m, "Stream", "An ordered executor of copies on a device.")
      .def(
          "record",
          [](PyStream& s, PyEvent& e) { Check(s.core()->stream->Record(*e.core()->event)); },
          nb::arg("event"), "Captures the work enqueued so far into `event`.")
      .def(
          "wait", [](PyStream& s, PyEvent& e) { Check(s.core()->stream->Wait(*e.core()->event)); },
          nb::arg("event"), "Later work on this stream waits for `event`.")
      .def(
          "synchronize",
          [](PyStream& s, double timeout) {
            std::shared_ptr<StreamCore> c = s.core();
            Deadline d = DeadlineAfter(timeout);
            Status st;
            {
              nb::gil_scoped_release nogil;
              st = c->stream->Synchronize(d);
            }
            Check(st);
          },
          nb::arg("timeout"), "Waits for all work enqueued so far.")
      .def("query", [](PyStream& s) { return s.core()->stream->Query(); })
      .def("close", &PyStream::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyStream& s, nb::args) { s.close(); });

  // ---- devices ----
  nb::class_<PyDevice>(m, "Device",
                       "A device by name: 'cpu', 'cuda' or 'cuda:N'. Owns its streams' and "
                       "pools' memory; close() (or leaving a with block) releases it once no "
                       "pool or side uses it any more.")
      .def(
          "__init__",
          [](PyDevice* self, const std::string& name) {
            std::unique_ptr<Device> dev = Take(OpenDevice(name));
            new (self) PyDevice(std::make_shared<DeviceCore>(DeviceCore{std::move(dev)}));
          },
          nb::arg("name") = "cpu")
      .def_prop_ro(
          "info", [](PyDevice& d) { return InfoDict(d.core()->device->info()); },
          "platform, ordinal, name, memory_bytes, detail.")
      .def_prop_ro("platform", [](PyDevice& d) { return d.core()->device->info().platform; })
      .def_prop_ro("closed", &PyDevice::closed)
      .def("create_stream",
           [](PyDevice& d) {
             const std::shared_ptr<DeviceCore>& c = d.core();
             auto s = Take(c->device->CreateStream());
             return PyStream(
                 std::make_shared<StreamCore>(StreamCore{c, std::move(s), nb::object()}));
           })
      .def("create_event",
           [](PyDevice& d) {
             const std::shared_ptr<DeviceCore>& c = d.core();
             std::shared_ptr<Event> e = Take(c->device->CreateEvent());
             return PyEvent(std::make_shared<EventCore>(EventCore{c, std::move(e), nb::object()}));
           })
      .def(
          "wrap_stream",
          [](PyDevice& d, nb::object native) {
            const std::shared_ptr<DeviceCore>& c = d.core();
            auto s = Take(c->device->WrapStream(NativeHandle(native, "cuda_stream")));
            auto core = std::make_shared<StreamCore>(StreamCore{c, std::move(s)});
            core->native = native;
            return PyStream(std::move(core));
          },
          nb::arg("native"),
          "Wraps the engine's stream (torch.cuda.Stream or a cudaStream_t as int), not owned: "
          "kvferry's work enqueued on it orders with the engine's. Keep the native stream alive.")
      .def(
          "wrap_event",
          [](PyDevice& d, nb::object native) {
            const std::shared_ptr<DeviceCore>& c = d.core();
            std::shared_ptr<Event> e =
                Take(c->device->WrapEvent(NativeHandle(native, "cuda_event")));
            auto core = std::make_shared<EventCore>(EventCore{c, std::move(e)});
            core->native = native;
            return PyEvent(std::move(core));
          },
          nb::arg("native"),
          "Wraps the engine's event (torch.cuda.Event or a cudaEvent_t as int), not owned, e.g. "
          "for ContextSide.mark_layer_ready_on. Keep the native event alive until the request "
          "is terminal.")
      .def("close", &PyDevice::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyDevice& d, nb::args) { d.close(); })
      .def("__repr__", [](PyDevice& d) {
        if (d.closed()) return std::string("<kvferry.Device closed>");
        const DeviceInfo& i = d.core()->device->info();
        return "<kvferry.Device " + i.platform + ":" + std::to_string(i.ordinal) + " " + i.name +
               ">";
      });
}

}  // namespace kvferry::py
