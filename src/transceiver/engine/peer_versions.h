// PeerVersions: which control-message version a rank speaks with each peer (docs/design.md,
// "Mixed versions"; docs/wire_format.md, "Versions").
//
// Why: instances are upgraded one at a time, so a rank meets peers one wire version older. Each
// pair speaks the older of the two versions, learned at first contact: a rank that speaks
// version 11 sends VERSION (its range) before its first message to a peer it has not heard
// from, and sends that first message in the oldest version it serves, which a rank one version
// older decodes. What a peer speaks is then known from its VERSION or, for a rank of version 10
// (which sends none), from the header of its first message. A peer whose range does not meet
// ours is refused, by name, with both ranges: it is told by our VERSION (a rank that negotiates
// then refuses at once), and the side fails whatever it has with that peer.
//
// A rank configured to speak the previous version (transfer.wire_version=10) behaves as a
// version-10 build: it sends no VERSION, encodes and decodes version 10 only, and drops each
// message it can't decode (a VERSION, any of version 11) with a warning, refusing nobody.
//
// Thread-compatible: the side's progress thread owns it (sends and received messages both run
// there).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

class PeerVersions {
 public:
  // `speaks`: kMessageVersion (negotiates, serves kOldestMessageVersion too) or
  // kOldestMessageVersion (a version-10 build: that version only, no VERSION messages). Tests
  // pretend other builds: below 10, one version and no VERSION (as builds before 11); above 11,
  // that version and the one before, negotiating (a later build).
  explicit PeerVersions(uint8_t speaks);
  // The range a rank of version `speaks` speaks (as above).
  static VersionRange RangeOf(uint8_t speaks);

  VersionRange ours() const { return ours_; }
  bool negotiates() const { return ours_.newest > ours_.oldest; }

  // Before the first message to `peer`: the VERSION to send first, when we negotiate and have
  // not heard from it (once per peer).
  std::optional<std::vector<std::byte>> HelloFor(PeerId peer);
  // The version of a message to `peer`: the pair's once known, else the oldest we serve.
  uint8_t SendVersion(PeerId peer) const;
  // The version a pair with `peer` speaks, for behaviour that differs between versions: the
  // older of both once known, else the oldest we serve.
  uint8_t PairVersion(PeerId peer) const { return SendVersion(peer); }

  // What to do with a control message from `from`.
  struct Incoming {
    enum Kind { kDeliver, kConsumed, kRefused } kind = kDeliver;
    // kRefused: why, naming the peer (by `describe`) and both ranges. Set once per peer: later
    // messages of a refused peer are kConsumed silently.
    Status why;
    // Bytes to send back (our VERSION: the peer learns why, and refuses by name too).
    std::optional<std::vector<std::byte>> reply;
  };
  // Looks at a message's header before it is decoded: a VERSION is taken here (kConsumed, or
  // kRefused when its range does not meet ours); a message of a version we do not serve is
  // kRefused; anything else is kDeliver (decode it with ours()), and its version tells what a
  // peer that sent no VERSION speaks.
  Incoming OnReceive(PeerId from, std::span<const std::byte> bytes, const std::string& describe);

  // Why `peer` was refused, when it was (its messages are dropped, nothing is sent to it).
  std::optional<Status> Refusal(PeerId peer) const;

 private:
  struct Peer {
    std::optional<VersionRange> range;  // what it speaks, once known
    bool hello_sent = false;
    std::optional<Status> refused;
  };
  Incoming Refuse(Peer& p, std::string why);

  const VersionRange ours_;
  std::unordered_map<PeerId, Peer> peers_;
};

}  // namespace kvferry
