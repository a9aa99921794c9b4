// One transport made of two: one-sided operations (RegisterMemory, Put, Get, Flush) over one,
// control messages and tagged data (SendControl, PollControl, Send, Recv) over the other. Used
// for `--transport nixl` with `nixl.control=ucx`: NIXL moves the KV, kvferry's UCX transport
// carries the control plane (UCX active messages, with a wakeup fd) instead of NIXL
// notifications (docs/nixl.md).
//
// Address: "<one-sided address>+<messages address>" (neither contains '+'). A peer is a pair of
// the two transports' peers: Connect connects both; a peer that connected to us is learned from
// its first control message, which carries its address (the messages transport alone would not
// say which one-sided peer it is). Control message bytes, on the messages transport:
//   u8 0, the message; or u8 1, u32 L, L bytes of the sender's address, the message
// (the second form the first time a sender writes to a peer).
//
// Thread-compatible, as every transport: one thread drives it.
#pragma once

#include <memory>

#include "kvferry/transport.h"

namespace kvferry {

// `one_sided` must have caps().one_sided. Its caps: one_sided's name, one-sided operations and
// GPU memory for them; the messages transport's tag bits, wakeup fd, tagged GPU memory and
// control size (less the address a first message carries); crashed peers detected when either
// detects them.
std::unique_ptr<Transport> MakeSplitTransport(std::unique_ptr<Transport> one_sided,
                                              std::unique_ptr<Transport> messages);

}  // namespace kvferry
