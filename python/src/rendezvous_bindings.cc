// The rendezvous: what instances exchange (rank addresses, the instance secret, handles), over a
// RendezvousServer run by any one process, across hosts over TCP.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "bindings.h"
#include "kvferry/rendezvous.h"

namespace kvferry::py {

namespace {

RendezvousKey KeyFrom(const nb::bytes& b, const char* what) {
  RendezvousKey k{};
  if (b.size() != k.size()) {
    ThrowInvalid(std::string(what) + " has " + std::to_string(b.size()) + " bytes; exactly " +
                 std::to_string(k.size()) + " are needed (kvferry.random_key())");
  }
  std::memcpy(k.data(), b.c_str(), k.size());
  return k;
}

nb::bytes ToBytes(const std::vector<std::byte>& v) { return nb::bytes(v.data(), v.size()); }

std::span<const std::byte> Span(const nb::bytes& b) {
  return {reinterpret_cast<const std::byte*>(b.c_str()), b.size()};
}

class PyServer {
 public:
  explicit PyServer(std::unique_ptr<RendezvousServer> s) : server_(std::move(s)) {}
  RendezvousServer& get() const {
    if (!server_) throw ClosedError("RendezvousServer");
    return *server_;
  }
  void close() {
    nb::gil_scoped_release nogil;
    server_.reset();
  }

 private:
  std::unique_ptr<RendezvousServer> server_;
};

template <typename F>
auto NoGil(F&& f) {
  nb::gil_scoped_release nogil;
  return f();
}

}  // namespace

void BindRendezvous(nb::module_& m) {
  m.def(
      "random_key",
      [] {
        RendezvousKey k = RandomKey();
        return nb::bytes(k.data(), k.size());
      },
      "16 random bytes (the OS's random source): a rendezvous key or an instance secret.");

  nb::class_<PyServer>(m, "RendezvousServer",
                       "The default rendezvous server: in memory, one thread, TCP. Run it in any "
                       "one process; every rank connects with Rendezvous(address, key).")
      .def(
          "__init__",
          [](PyServer* self, const std::string& host, uint16_t port, const nb::bytes& key) {
            RendezvousKey k = KeyFrom(key, "key");
            auto s = NoGil([&] { return RendezvousServer::Start(host, port, k); });
            new (self) PyServer(Take(std::move(s)));
          },
          nb::arg("host") = "127.0.0.1", nb::arg("port") = 0, nb::arg("key"))
      .def_prop_ro(
          "address", [](PyServer& s) { return s.get().address(); }, "'host:port' for clients.")
      .def_prop_ro(
          "refused", [](PyServer& s) { return s.get().refused(); },
          "Requests refused so far (wrong key, garbage).")
      .def_prop_ro(
          "accepted", [](PyServer& s) { return s.get().accepted(); },
          "Connections accepted so far (a client keeps its connections between calls).")
      .def("close", &PyServer::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyServer& s, nb::args) { s.close(); });

  nb::class_<PyRendezvous>(m, "Rendezvous",
                           "A client of a RendezvousServer; every call takes a timeout (s).")
      .def(
          "__init__",
          [](PyRendezvous* self, const std::string& address, const nb::bytes& key) {
            RendezvousKey k = KeyFrom(key, "key");
            std::unique_ptr<Rendezvous> r = Take(ConnectRendezvous(address, k));
            new (self) PyRendezvous(std::shared_ptr<Rendezvous>(std::move(r)));
          },
          nb::arg("address"), nb::arg("key"))
      .def(
          "put",
          [](PyRendezvous& r, const std::string& key, const nb::bytes& value, double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            Check(NoGil([&] { return rv->Put(key, Span(value), d); }));
          },
          nb::arg("key"), nb::arg("value"), nb::arg("timeout") = 10.0)
      .def(
          "get",
          [](PyRendezvous& r, const std::string& key, double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            return ToBytes(Take(NoGil([&] { return rv->Get(key, d); })));
          },
          nb::arg("key"), nb::arg("timeout") = 10.0,
          "The value under `key`, waiting for it to appear (DeadlineExceededError).")
      .def(
          "erase",
          [](PyRendezvous& r, const std::string& key, double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            Check(NoGil([&] { return rv->Erase(key, d); }));
          },
          nb::arg("key"), nb::arg("timeout") = 10.0)
      .def(
          "publish_rank_address",
          [](PyRendezvous& r, const std::string& instance, uint64_t instance_id, int32_t rank,
             const std::string& address, double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            Check(NoGil(
                [&] { return PublishRankAddress(*rv, instance, instance_id, rank, address, d); }));
          },
          nb::arg("instance"), nb::arg("instance_id"), nb::arg("rank"), nb::arg("address"),
          nb::arg("timeout") = 10.0)
      .def(
          "gather_rank_addresses",
          [](PyRendezvous& r, const std::string& instance, uint64_t instance_id, int32_t ranks,
             double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            return Take(
                NoGil([&] { return GatherRankAddresses(*rv, instance, instance_id, ranks, d); }));
          },
          nb::arg("instance"), nb::arg("instance_id"), nb::arg("ranks"), nb::arg("timeout") = 10.0,
          "Addresses of ranks 0..ranks-1, waiting for all; a stale instance id is refused.")
      .def(
          "publish_instance_secret",
          [](PyRendezvous& r, const std::string& instance, uint64_t instance_id,
             const nb::bytes& secret, double timeout) {
            auto rv = r.get();
            RendezvousKey s = KeyFrom(secret, "secret");
            Deadline d = DeadlineAfter(timeout);
            Check(NoGil([&] { return PublishInstanceSecret(*rv, instance, instance_id, s, d); }));
          },
          nb::arg("instance"), nb::arg("instance_id"), nb::arg("secret"), nb::arg("timeout") = 10.0)
      .def(
          "fetch_instance_secret",
          [](PyRendezvous& r, const std::string& instance, uint64_t instance_id, double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            auto s =
                Take(NoGil([&] { return FetchInstanceSecret(*rv, instance, instance_id, d); }));
            return nb::bytes(s.data(), s.size());
          },
          nb::arg("instance"), nb::arg("instance_id"), nb::arg("timeout") = 10.0)
      .def(
          "publish_handle",
          [](PyRendezvous& r, uint64_t request_id, const nb::bytes& handle, double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            Check(NoGil([&] { return PublishHandle(*rv, request_id, Span(handle), d); }));
          },
          nb::arg("request_id"), nb::arg("handle"), nb::arg("timeout") = 10.0)
      .def(
          "fetch_handle",
          [](PyRendezvous& r, uint64_t request_id, double timeout) {
            auto rv = r.get();
            Deadline d = DeadlineAfter(timeout);
            return ToBytes(Take(NoGil([&] { return FetchHandle(*rv, request_id, d); })));
          },
          nb::arg("request_id"), nb::arg("timeout") = 10.0,
          "The context handle of a request, waiting for it to be published.")
      .def("close", &PyRendezvous::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyRendezvous& r, nb::args) { r.close(); });
}

}  // namespace kvferry::py
