#include "transport/ucx_address.h"

#include <algorithm>
#include <array>

namespace kvferry {
namespace {

constexpr std::string_view kScheme = "ucx1:";

uint32_t Fnv1a(const uint8_t* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

void PutU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
}  // namespace

uint32_t LoadU32Le(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

std::string EncodeUcxAddress(const void* addr, size_t len) {
  std::vector<uint8_t> raw;
  PutU32(raw, static_cast<uint32_t>(len));
  const auto* p = static_cast<const uint8_t*>(addr);
  raw.insert(raw.end(), p, p + len);
  PutU32(raw, Fnv1a(p, len));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kScheme);
  for (uint8_t b : raw) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

StatusOr<std::vector<uint8_t>> DecodeUcxAddress(std::string_view text) {
  auto bad = [&](std::string_view why) {
    std::string shown(text.substr(0, 48));
    return Status::InvalidArgument("not a ucx address ('" + shown +
                                   (text.size() > 48 ? "...'" : "'") + "): " + std::string(why));
  };
  if (text.substr(0, kScheme.size()) != kScheme) return bad("missing 'ucx1:' prefix");
  std::string_view hex = text.substr(kScheme.size());
  if (hex.size() % 2 != 0 || hex.size() < 16) return bad("bad length");
  std::vector<uint8_t> raw(hex.size() / 2);
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < raw.size(); ++i) {
    int hi = nib(hex[2 * i]), lo = nib(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return bad("not lowercase hex");
    raw[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  const uint32_t n = LoadU32Le(raw.data());
  if (size_t{n} + 8 != raw.size()) return bad("length field does not match");
  if (Fnv1a(raw.data() + 4, n) != LoadU32Le(raw.data() + 4 + n)) return bad("checksum mismatch");
  return std::vector<uint8_t>(raw.begin() + 4, raw.begin() + 4 + n);
}

std::string EncodeUcxWorkerAddresses(const UcxWorkerAddresses& a) {
  std::vector<uint8_t> raw;
  PutU32(raw, static_cast<uint32_t>(a.control.size()));
  raw.insert(raw.end(), a.control.begin(), a.control.end());
  raw.insert(raw.end(), a.data.begin(), a.data.end());
  return EncodeUcxAddress(raw.data(), raw.size());
}

StatusOr<UcxWorkerAddresses> DecodeUcxWorkerAddresses(std::string_view text) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, DecodeUcxAddress(text));
  const size_t c = raw.size() >= 4 ? LoadU32Le(raw.data()) : 0;
  if (raw.size() < 4 || c == 0 || c >= raw.size() - 4) {
    return Status::InvalidArgument("not a ucx transport address: " + std::to_string(raw.size()) +
                                   " payload bytes, control worker address of " +
                                   std::to_string(c));
  }
  UcxWorkerAddresses a;
  a.control.assign(raw.begin() + 4, raw.begin() + 4 + static_cast<std::ptrdiff_t>(c));
  a.data.assign(raw.begin() + 4 + static_cast<std::ptrdiff_t>(c), raw.end());
  return a;
}

}  // namespace kvferry

namespace kvferry {
namespace {

// UCX 1.22, src/ucp/wireup/address.c (address versions 1 and 2, non-unified mode).
constexpr uint8_t kVersionMask = 0x0f;
constexpr uint8_t kVersionV1 = 0, kVersionV2 = 1;
constexpr uint8_t kHeaderDebugInfo = 1, kHeaderWorkerUuid = 2, kHeaderClientId = 4;
constexpr uint8_t kHeaderKnown = 0x0f;  // debug info, worker uuid, client id, AM only
constexpr uint8_t kNullResource = 0xff;
constexpr uint8_t kMdEmptyDev = 0x80, kMdMask = 0x7f;
constexpr uint8_t kDevLast = 0x80, kDevNumPaths = 0x40, kDevSysDevice = 0x20, kDevLenMask = 0x1f;
constexpr uint8_t kIfaceLast = 0x80, kIfaceHasEp = 0x40, kIfaceLenMask = 0x3f;
constexpr uint8_t kLaneLast = 0x80;
constexpr size_t kMaxResources = 128, kMaxLanes = 64;

// A bounded reader over the address bytes; every read past the end fails the walk.
class Walk {
 public:
  explicit Walk(std::span<const uint8_t> b) : b_(b) {}
  bool Byte(uint8_t& v) {
    if (pos_ >= b_.size()) return false;
    v = b_[pos_++];
    return true;
  }
  bool Skip(size_t n) {
    if (n > b_.size() - pos_) return false;
    pos_ += n;
    return true;
  }
  // A value in the low bits of one byte, or (version 2) in the next byte when those bits are
  // all set.
  bool Extended(uint8_t first, uint8_t mask, uint8_t& v) {
    v = first & mask;
    return !v2_ || v != mask || Byte(v);
  }
  void set_v2(bool v2) { v2_ = v2; }
  size_t pos() const { return pos_; }
  size_t left() const { return b_.size() - pos_; }

 private:
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
  bool v2_ = false;
};

Status Malformed(const Walk& w, std::string_view what) {
  return Status::InvalidArgument("ucx worker address refused at byte " + std::to_string(w.pos()) +
                                 ": " + std::string(what));
}

// Version 1: one header byte (version, flags << 4), 16 bytes of interface attributes, no extended
// lengths. Version 2: version and release byte, flags byte, 10 bytes of attributes, extended
// lengths. Either may carry one more attribute byte (a resource index).
Status WalkAddress(std::span<const uint8_t> a, size_t attr_bytes) {
  Walk w(a);
  uint8_t header = 0, flags = 0;
  if (!w.Byte(header)) return Malformed(w, "empty");
  const uint8_t version = header & kVersionMask;
  if (version == kVersionV1) {
    flags = header >> 4;
  } else if (version == kVersionV2) {
    w.set_v2(true);
    if (!w.Byte(flags)) return Malformed(w, "shorter than its header");
  } else {
    return Malformed(w, "unknown address version");
  }
  if ((flags & ~kHeaderKnown) != 0) return Malformed(w, "unknown header flags");
  if ((flags & kHeaderWorkerUuid) && !w.Skip(8)) return Malformed(w, "truncated worker uuid");
  if ((flags & kHeaderClientId) && !w.Skip(8)) return Malformed(w, "truncated client id");
  if (flags & kHeaderDebugInfo) {
    uint8_t n = 0;
    if (!w.Byte(n) || !w.Skip(n)) return Malformed(w, "truncated worker name");
  }
  uint8_t b = 0;
  if (!w.Byte(b)) return Malformed(w, "no device list");
  if (b == kNullResource) {
    return w.left() == 0 ? Status::Ok() : Malformed(w, "bytes after an empty device list");
  }
  size_t ifaces = 0;
  for (bool last_dev = false; !last_dev;) {
    // md index (extended), then the device address length with its flags (extended).
    uint8_t md = 0, len_byte = 0, dev_len = 0;
    const bool empty_dev = (b & kMdEmptyDev) != 0;
    if (!w.Extended(b, kMdMask, md)) return Malformed(w, "truncated md index");
    if (!w.Byte(len_byte) || !w.Extended(len_byte, kDevLenMask, dev_len))
      return Malformed(w, "truncated device address length");
    last_dev = (len_byte & kDevLast) != 0;
    if ((len_byte & kDevNumPaths) && !w.Skip(1)) return Malformed(w, "truncated path count");
    if ((len_byte & kDevSysDevice) && !w.Skip(1)) return Malformed(w, "truncated system device");
    if (!w.Skip(dev_len)) return Malformed(w, "device address runs past the end");
    for (bool last_iface = empty_dev; !last_iface;) {
      if (++ifaces > kMaxResources) return Malformed(w, "more than 128 interfaces");
      uint8_t tl = 0, iface_len = 0;
      if (!w.Skip(2 + attr_bytes)) return Malformed(w, "truncated interface attributes");
      if (!w.Byte(tl) || !w.Extended(tl, kIfaceLenMask, iface_len))
        return Malformed(w, "truncated interface address length");
      last_iface = (tl & kIfaceLast) != 0;
      if (!w.Skip(iface_len)) return Malformed(w, "interface address runs past the end");
      size_t eps = 0;
      for (bool last_ep = (tl & kIfaceHasEp) == 0; !last_ep;) {
        if (++eps > kMaxLanes) return Malformed(w, "more than 64 endpoint addresses");
        uint8_t ep_len = 0, lane = 0;
        if (!w.Byte(ep_len) || !w.Skip(ep_len) || !w.Byte(lane))
          return Malformed(w, "truncated endpoint address");
        last_ep = (lane & kLaneLast) != 0;
      }
    }
    if (!last_dev && !w.Byte(b)) return Malformed(w, "truncated device list");
  }
  return w.left() == 0 ? Status::Ok()
                       : Malformed(w, std::to_string(w.left()) + " bytes after the last device");
}

}  // namespace

StatusOr<UcxAddressShape> UcxAddressShape::Learn(std::span<const uint8_t> own) {
  for (size_t attr : {size_t{16}, size_t{17}, size_t{10}, size_t{11}}) {
    if (own.empty() || !WalkAddress(own, attr).ok()) continue;
    UcxAddressShape s;
    s.checks_ = true;
    s.header_bytes_ = (own[0] & kVersionMask) == kVersionV2 ? 2 : 1;
    std::copy_n(own.begin(), s.header_bytes_, s.header_.begin());
    s.attr_bytes_ = attr;
    return s;
  }
  return Status::Unavailable(
      "this UCX's worker address is not in a layout kvferry checks (UCX "
      "1.22 address version 1 or 2, non-unified mode)");
}

Status UcxAddressShape::Check(std::span<const uint8_t> address) const {
  if (!checks_) return Status::Ok();
  if (address.size() < header_bytes_ ||
      !std::equal(header_.begin(), header_.begin() + header_bytes_, address.begin())) {
    return Status::InvalidArgument(
        "ucx worker address refused: its header is not this UCX build's (another UCX release, or "
        "not a worker address)");
  }
  return WalkAddress(address, attr_bytes_);
}

}  // namespace kvferry
