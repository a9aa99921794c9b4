// `kvferry rendezvous`: the rendezvous server as a command of its own, for instances started as
// separate commands (`kvferry instance`) on this host or others.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "kvferry/rendezvous.h"
#include "selftest/selftest.h"
#include "tools/kvferry/commands.h"

namespace kvferry::tools {
namespace {

struct RendezvousFlags {
  std::string bind = "127.0.0.1:0";
  std::string key_file;
};

// The group key in `path`: read when the file exists, else a fresh one written there (0600, never
// through a link), so the first command of a run makes it and the others read it.
StatusOr<RendezvousKey> KeyFromFile(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd >= 0) {
    const RendezvousKey key = RandomKey();
    const std::string hex = RendezvousKeyHex(key) + "\n";
    const bool ok = write(fd, hex.data(), hex.size()) == static_cast<ssize_t>(hex.size());
    close(fd);
    if (!ok) return Status::Internal(fmt::format("writing the group key to {} failed", path));
    return key;
  }
  if (errno != EEXIST) {
    return Status::InvalidArgument(fmt::format("--key-file {}: {}", path, std::strerror(errno)));
  }
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return ParseRendezvousKeyHex(text);
}

int RunRendezvous(const RendezvousFlags& f) {
  const size_t colon = f.bind.rfind(':');
  const std::string port_text = colon == std::string::npos ? "" : f.bind.substr(colon + 1);
  char* end = nullptr;
  const long port = std::strtol(port_text.c_str(), &end, 10);
  if (colon == std::string::npos || colon == 0 || port_text.empty() || *end != '\0' || port < 0 ||
      port > 65535) {
    fmt::print(stderr, "kvferry rendezvous: --bind '{}': expected HOST:PORT (PORT 0: any)\n",
               f.bind);
    return 2;
  }
  StatusOr<RendezvousKey> key = KeyFromFile(f.key_file);
  if (!key.ok()) {
    fmt::print(stderr, "kvferry rendezvous: {}\n", key.status().ToString());
    return 2;
  }
  // SIGINT and SIGTERM end the server: taken synchronously below. They get a handler all the
  // same: as PID 1 of a PID namespace (a container, `unshare --pid`) a signal left at its default
  // action is discarded, even blocked.
  struct sigaction ignore_handler {};
  ignore_handler.sa_handler = [](int) {};
  sigaction(SIGINT, &ignore_handler, nullptr);
  sigaction(SIGTERM, &ignore_handler, nullptr);
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  sigprocmask(SIG_BLOCK, &stop, nullptr);
  auto server = RendezvousServer::Start(f.bind.substr(0, colon), static_cast<uint16_t>(port), *key);
  if (!server.ok()) {
    fmt::print(stderr, "kvferry rendezvous: {}\n", server.status().ToString());
    return 1;
  }
  fmt::print("kvferry rendezvous: serving on {} (group key in {})\n", (*server)->address(),
             f.key_file);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  fmt::print("kvferry rendezvous: {}; {} connections accepted, {} requests refused\n",
             sig == SIGINT ? "interrupted" : "terminated", (*server)->accepted(),
             (*server)->refused());
  return 0;
}

}  // namespace

void AddRendezvousCommand(CLI::App& app) {
  auto f = std::make_shared<RendezvousFlags>();
  auto* cmd = app.add_subcommand(
      "rendezvous",
      "serve the rendezvous where instances started as separate commands (kvferry instance) "
      "meet; until SIGINT or SIGTERM");
  cmd->add_option("--bind", f->bind,
                  "HOST:PORT to listen on (PORT 0: any free port, printed); an address the other "
                  "hosts reach")
      ->capture_default_str();
  cmd->add_option("--key-file", f->key_file,
                  "the group key (32 hex digits): read if the file exists, else a fresh key is "
                  "written there (mode 0600)")
      ->required();
  cmd->callback([f] { std::exit(RunRendezvous(*f)); });
}

}  // namespace kvferry::tools
