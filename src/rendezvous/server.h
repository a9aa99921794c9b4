// The TCP rendezvous server (server.cc), started by RendezvousServer::Start.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kvferry/rendezvous.h"
#include "rendezvous/socket.h"

namespace kvferry::rendezvous {

// What one connection that has not yet sent a request under the group key can make the server
// hold: its greeting in, a CHALLENGE or a refusal out. At most 256 such connections are open, so
// peers without the key hold at most 256 × kMaxUnverifiedBytes (128 KiB).
inline constexpr size_t kMaxUnverifiedBytes = 512;

// Serves on `listener` (listening, non-blocking) from a thread of its own until destroyed; a byte
// on `wake_write` wakes it to stop.
std::unique_ptr<RendezvousServer> StartServer(Fd listener, Fd wake_read, Fd wake_write,
                                              std::string address, const RendezvousKey& key);

}  // namespace kvferry::rendezvous
