#include "kvferry/device.h"

#include <fmt/format.h>

#include <charconv>

#include "device/cuda_entry.h"

namespace kvferry {

std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kDevice:
      return "device";
    case MemoryKind::kPinnedHost:
      return "pinned-host";
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kFile:
      return "file";
  }
  return "?";
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    owner_ = o.owner_;
    data_ = o.data_;
    size_ = o.size_;
    kind_ = o.kind_;
    o.owner_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void Buffer::Reset() {
  if (data_ != nullptr && owner_ != nullptr) owner_->Free(data_, size_, kind_);
  owner_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

StatusOr<std::unique_ptr<Stream>> Device::WrapStream(void* native) {
  return Status::InvalidArgument(
      fmt::format("WrapStream({}): device {} has no native streams", native, info().name));
}

StatusOr<std::unique_ptr<Event>> Device::WrapEvent(void* native) {
  return Status::InvalidArgument(
      fmt::format("WrapEvent({}): device {} has no native events", native, info().name));
}

StatusOr<std::unique_ptr<Device>> OpenDevice(std::string_view name) {
  if (name == "cpu") return OpenCpuDevice();
  if (name == "cuda" || name.starts_with("cuda:")) {
    int ordinal = 0;
    if (name.size() > 5) {
      std::string_view num = name.substr(5);
      auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), ordinal);
      if (ec != std::errc() || p != num.data() + num.size() || ordinal < 0) {
        return Status::InvalidArgument(fmt::format("bad device name '{}'; expected cuda:N", name));
      }
    }
    return internal::OpenCudaDevice(ordinal);
  }
  return Status::InvalidArgument(
      fmt::format("unknown device '{}'; expected cpu, cuda or cuda:N", name));
}

std::vector<std::string> ListDevices() {
  std::vector<std::string> out{"cpu"};
  for (int i = 0; i < internal::CudaDeviceCount(); ++i) out.push_back(fmt::format("cuda:{}", i));
  return out;
}

}  // namespace kvferry
