#include "ids.h"

#include <nanobind/ndarray.h>

#include <limits>
#include <string>

namespace kvferry::py {

namespace {

// A CPU integer array, or false for anything else (lists and tuples go element by element).
bool AsIntArray(nb::handle obj, nb::ndarray<nb::ro>* out, const char* what) {
  if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)) return false;
  nb::ndarray<nb::ro> any;
  if (!nb::try_cast(obj, any, /*convert=*/false)) return false;
  if (any.device_type() != nb::device::cpu::value) {
    ThrowInvalid(std::string(what) + ": a GPU array; block and token ids must be on the CPU");
  }
  const auto dt = any.dtype();
  const bool integer = dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) ||
                       dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt);
  if (!integer || dt.lanes != 1 ||
      (dt.bits != 8 && dt.bits != 16 && dt.bits != 32 && dt.bits != 64)) {
    ThrowInvalid(std::string(what) + ": an array of " + std::to_string(dt.bits) +
                 "-bit non-integer elements; integer ids are needed");
  }
  *out = std::move(any);
  return true;
}

// The element `offset_elems` elements (strides are in elements) past an integer array's first one.
int64_t At(const nb::ndarray<nb::ro>& a, int64_t offset_elems) {
  const auto* p = static_cast<const std::byte*>(a.data()) + offset_elems * a.itemsize();
  const bool is_signed = a.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int);
  switch (a.dtype().bits) {
    case 8:
      return is_signed ? *reinterpret_cast<const int8_t*>(p) : *reinterpret_cast<const uint8_t*>(p);
    case 16:
      return is_signed ? *reinterpret_cast<const int16_t*>(p)
                       : *reinterpret_cast<const uint16_t*>(p);
    case 32:
      return is_signed ? *reinterpret_cast<const int32_t*>(p)
                       : *reinterpret_cast<const uint32_t*>(p);
    default: {
      if (is_signed) return *reinterpret_cast<const int64_t*>(p);
      const uint64_t u = *reinterpret_cast<const uint64_t*>(p);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        ThrowInvalid("id " + std::to_string(u) + " does not fit in int64");
      }
      return static_cast<int64_t>(u);
    }
  }
}

template <typename T>
std::vector<T> Ids(nb::handle obj, const char* what) {
  std::vector<T> out;
  auto keep = [&](int64_t v) {
    if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
      ThrowInvalid(std::string(what) + ": " + std::to_string(v) + " is out of range");
    }
    out.push_back(static_cast<T>(v));
  };
  nb::ndarray<nb::ro> a;
  if (AsIntArray(obj, &a, what)) {
    if (a.ndim() != 1) {
      ThrowInvalid(std::string(what) + ": a " + std::to_string(a.ndim()) +
                   "-D array; a 1-D one is needed");
    }
    out.reserve(a.shape(0));
    for (size_t i = 0; i < a.shape(0); ++i) keep(At(a, static_cast<int64_t>(i) * a.stride(0)));
    return out;
  }
  if (!nb::isinstance<nb::sequence>(obj) || nb::isinstance<nb::str>(obj)) {
    ThrowInvalid(std::string(what) + ": a sequence of ints or a 1-D integer array is needed");
  }
  out.reserve(nb::len(obj));
  for (nb::handle item : obj) {
    int64_t v = 0;
    if (!nb::try_cast(item, v)) {
      ThrowInvalid(std::string(what) + ": " + nb::repr(item).c_str() + " is not an int");
    }
    keep(v);
  }
  return out;
}

}  // namespace

std::vector<int64_t> Int64Ids(nb::handle obj, const char* what) { return Ids<int64_t>(obj, what); }
std::vector<int32_t> Int32Ids(nb::handle obj, const char* what) { return Ids<int32_t>(obj, what); }

std::vector<BlockMove> ParseMoves(nb::handle moves) {
  std::vector<BlockMove> out;
  nb::ndarray<nb::ro> a;
  if (AsIntArray(moves, &a, "moves")) {
    if (a.ndim() != 2 || (a.shape(1) != 2 && a.shape(1) != 3)) {
      ThrowInvalid(
          "moves: an array of shape N x 2 (src, dst) or N x 3 (src, dst, tokens) is "
          "needed");
    }
    out.reserve(a.shape(0));
    for (size_t i = 0; i < a.shape(0); ++i) {
      const int64_t row = static_cast<int64_t>(i) * a.stride(0);
      BlockMove mv(At(a, row), At(a, row + a.stride(1)));
      if (a.shape(1) == 3) {
        const int64_t t = At(a, row + 2 * a.stride(1));
        if (t < 0 || t > std::numeric_limits<int32_t>::max()) {
          ThrowInvalid("moves: tokens " + std::to_string(t) + " is out of range");
        }
        mv.tokens = static_cast<int32_t>(t);
      }
      out.push_back(mv);
    }
    return out;
  }
  for (nb::handle item : moves) {
    if (!nb::isinstance<nb::tuple>(item) && !nb::isinstance<nb::list>(item)) {
      ThrowInvalid("a move is a tuple (src, dst) or (src, dst, tokens)");
    }
    const size_t n = nb::len(item);
    if (n < 2 || n > 3) ThrowInvalid("a move is (src, dst) or (src, dst, tokens)");
    BlockMove mv;
    mv.src = nb::cast<int64_t>(item[0]);
    mv.dst = nb::cast<int64_t>(item[1]);
    if (n == 3) mv.tokens = nb::cast<int32_t>(item[2]);
    out.push_back(mv);
  }
  return out;
}

nb::object Int64Array(std::vector<int64_t> ids) {
  auto* owned = new std::vector<int64_t>(std::move(ids));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  size_t shape[1] = {owned->size()};
  return nb::cast(nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(owned->data(), 1, shape, owner));
}

}  // namespace kvferry::py
