#include "transceiver/engine/peer_versions.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvferry {

VersionRange PeerVersions::RangeOf(uint8_t speaks) {
  if (speaks <= kOldestMessageVersion) return {speaks, speaks};
  return {static_cast<uint8_t>(speaks - 1), speaks};
}

PeerVersions::PeerVersions(uint8_t speaks) : ours_(RangeOf(speaks)) {}

std::optional<std::vector<std::byte>> PeerVersions::HelloFor(PeerId peer) {
  if (!negotiates()) return std::nullopt;
  Peer& p = peers_[peer];
  if (p.range || p.hello_sent) return std::nullopt;
  p.hello_sent = true;
  return EncodeVersionMsg(ours_);
}

uint8_t PeerVersions::SendVersion(PeerId peer) const {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.range) return ours_.oldest;
  return std::min(ours_.newest, it->second.range->newest);
}

std::optional<Status> PeerVersions::Refusal(PeerId peer) const {
  auto it = peers_.find(peer);
  return it == peers_.end() ? std::nullopt : it->second.refused;
}

PeerVersions::Incoming PeerVersions::Refuse(Peer& p, std::string why) {
  Incoming in;
  in.kind = Incoming::kRefused;
  in.why = Status::InvalidArgument(std::move(why));
  p.refused = in.why;
  // Tell it what we speak, once: a peer that negotiates then names us in its own refusal.
  if (negotiates() && !p.hello_sent) {
    p.hello_sent = true;
    in.reply = EncodeVersionMsg(ours_);
  }
  return in;
}

PeerVersions::Incoming PeerVersions::OnReceive(PeerId from, std::span<const std::byte> bytes,
                                               const std::string& describe) {
  // A version-10 build knows nothing of this: its decoder drops what it can't read, one message
  // at a time.
  if (!negotiates()) return {};
  Peer& p = peers_[from];
  if (p.refused) return {Incoming::kConsumed, Status::Ok(), std::nullopt};
  const uint8_t version = MessageVersionOf(bytes);
  if (negotiates() && IsVersionMsg(bytes)) {
    auto range = DecodeVersionMsg(bytes);
    if (!range.ok()) return {};  // undecodable: the decoder refuses and logs it
    p.range = *range;
    if (range->newest < ours_.oldest || range->oldest > ours_.newest) {
      return Refuse(
          p, fmt::format("peer {} speaks wire versions {}..{}; this rank speaks {}..{}: "
                         "incompatible, refused",
                         describe, range->oldest, range->newest, ours_.oldest, ours_.newest));
    }
    return {Incoming::kConsumed, Status::Ok(), std::nullopt};
  }
  if (version == 0) return {};  // not a control message: the decoder says so
  if (!ours_.Has(version)) {
    // No VERSION came first: an older rank, or a newer one that no longer serves our version's
    // messages. Either way nothing it sends can be read.
    return Refuse(p, fmt::format("peer {} sent a control message of wire version {}{}; this rank "
                                 "speaks {}..{}: incompatible, refused",
                                 describe, version,
                                 p.range ? fmt::format(" (it speaks {}..{})", p.range->oldest,
                                                       p.range->newest)
                                         : std::string(),
                                 ours_.oldest, ours_.newest));
  }
  if (!p.range) p.range = VersionRange{version, version};  // an older rank sends no VERSION
  return {};
}

}  // namespace kvferry
