// The KV model (KvShape, ParallelConfig, RankSlice) and block pools, with zero-copy views of a
// pool's regions (numpy for host memory, DLPack for GPU memory).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <fstream>

#include "bindings.h"
#include "ids.h"
#include "kvferry/kv_model.h"

namespace kvferry::py {

namespace {

MemoryKind ParseMemory(const std::string& s) {
  if (s == "device") return MemoryKind::kDevice;
  if (s == "pinned" || s == "pinned-host") return MemoryKind::kPinnedHost;
  if (s == "host") return MemoryKind::kHost;
  ThrowInvalid("memory '" + s + "': expected device|pinned|host");
  return MemoryKind::kHost;
}

std::string SliceRepr(const RankSlice& s) { return "<kvferry.RankSlice " + s.ToString() + ">"; }

// A view of `bytes` bytes at `data` that keeps `core` alive.
nb::object View(const std::shared_ptr<PoolCore>& core, std::byte* data, size_t bytes) {
  auto* keep = new std::shared_ptr<PoolCore>(core);
  nb::capsule owner(keep,
                    [](void* p) noexcept { delete static_cast<std::shared_ptr<PoolCore>*>(p); });
  size_t shape[1] = {bytes};
  const bool gpu = core->device->is_cuda() && core->pool->memory() == MemoryKind::kDevice;
  if (!gpu) {
    return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(data, 1, shape, owner));
  }
  return nb::cast(nb::ndarray<uint8_t, nb::ndim<1>>(data, 1, shape, owner, nullptr,
                                                    nb::dtype<uint8_t>(), nb::device::cuda::value,
                                                    core->device->device->info().ordinal));
}

}  // namespace

// ---- wrapping engine tensors (BlockPool::Wrap) --------------------------------------------------

namespace {

const char* DTypeCodeName(uint8_t code) {
  switch (code) {
    case 0:
      return "int";
    case 1:
      return "uint";
    case 2:
      return "float";
    case 4:
      return "bfloat";
  }
  return "other";
}

// The tensor's elements must be the shape's dtype (by width, and by kind where DLPack says it).
// The tensor's elements are the KvShape's dtype, or raw bytes (uint8: an engine that keeps each
// block as a byte page, e.g. [blocks, page_bytes], whatever the KV dtype; the layout says where
// each element lies).
void CheckDType(const nb::ndarray<>& a, DType want, size_t i) {
  const auto dt = a.dtype();
  if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) && dt.bits == 8 &&
      dt.lanes == 1) {
    return;
  }
  const int bits = dt.bits * dt.lanes;
  const bool float_kind = want == DType::kFp32 || want == DType::kFp16;
  bool ok = bits == DTypeSize(want) * 8;
  if (ok && float_kind) ok = dt.code == 2;
  if (ok && want == DType::kBf16) ok = dt.code == 4;
  if (!ok) {
    ThrowInvalid("tensor " + std::to_string(i) + " holds " + std::to_string(bits) + "-bit " +
                 DTypeCodeName(dt.code) + " elements; the KvShape's dtype is " +
                 std::string(DTypeName(want)));
  }
}

// Bytes from the tensor's first element to one past its last (strides must not be negative).
int64_t SpanBytes(const nb::ndarray<>& a, size_t i) {
  int64_t last = 0;
  for (size_t d = 0; d < a.ndim(); ++d) {
    if (a.shape(d) == 0) ThrowInvalid("tensor " + std::to_string(i) + " is empty");
    if (a.stride(d) < 0) {
      ThrowInvalid("tensor " + std::to_string(i) + " has a negative stride on axis " +
                   std::to_string(d));
    }
    last += static_cast<int64_t>(a.shape(d) - 1) * a.stride(d);
  }
  return (last + 1) * static_cast<int64_t>(a.itemsize());
}

// Named layouts are dense: each tensor must be C-contiguous (its own strides say nothing the
// layout would use).
void CheckContiguous(const nb::ndarray<>& a, size_t i) {
  int64_t expect = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expect) {
      ThrowInvalid("tensor " + std::to_string(i) + " is not contiguous (axis " + std::to_string(d) +
                   " has stride " + std::to_string(a.stride(d)) + " elements, " +
                   std::to_string(expect) +
                   " expected); a named layout needs dense tensors: pass .contiguous() memory "
                   "or byte_strides");
    }
    expect *= static_cast<int64_t>(a.shape(d));
  }
}

MemoryKind KindOf(const nb::ndarray<>& a, const DeviceCore& dev, size_t i) {
  const int ordinal = dev.device->info().ordinal;
  switch (a.device_type()) {
    case nb::device::cpu::value:
      return dev.is_cuda() ? MemoryKind::kHost : MemoryKind::kDevice;
    case nb::device::cuda_host::value:
      return dev.is_cuda() ? MemoryKind::kPinnedHost : MemoryKind::kDevice;
    case nb::device::cuda::value:
      if (!dev.is_cuda() || a.device_id() != ordinal) {
        ThrowInvalid("tensor " + std::to_string(i) +
                     " is on cuda:" + std::to_string(a.device_id()) + ", the pool's device is " +
                     dev.device->info().platform + ":" + std::to_string(ordinal));
      }
      return MemoryKind::kDevice;
  }
  ThrowInvalid("tensor " + std::to_string(i) + ": DLPack device type " +
               std::to_string(a.device_type()) + " is neither CPU nor CUDA memory");
  return MemoryKind::kHost;
}

// This process's mappings (/proc/self/maps: [start, end) in address order, writable or not).
// kvferry writes into a wrapped pool (a generation side fetches into it, tiering onboards into
// it), so host memory outside writable mappings is refused at wrap time: a tensor over a
// read-only mmap would otherwise crash the progress thread.
struct Mapping {
  uintptr_t start, end;
  bool writable;
};
std::vector<Mapping> ReadMappings() {
  std::vector<Mapping> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long start = 0, end = 0;  // NOLINT(runtime/int): sscanf's %lx
    char perms[5] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &start, &end, perms) == 3) {
      out.push_back({start, end, perms[1] == 'w'});
    }
  }
  return out;
}

// Whether [base, base + bytes) lies wholly in writable mappings (an unmapped gap is not).
bool Writable(const std::vector<Mapping>& maps, uintptr_t base, uintptr_t bytes) {
  uintptr_t at = base;
  const uintptr_t end = base + bytes;
  for (const Mapping& m : maps) {
    if (m.end <= at) continue;
    if (m.start > at || !m.writable) return false;
    at = m.end;
    if (at >= end) return true;
  }
  return false;
}

// Keeps the memory under tensor `i` where the pool points (bindings.h, "Wrapped memory").
WrappedTensor Pin(nb::object obj, const void* base, size_t i) {
  WrappedTensor w;
  w.address = reinterpret_cast<uintptr_t>(base);
  if (nb::hasattr(obj, "untyped_storage") && nb::hasattr(obj, "data_ptr")) {  // torch
    w.keep = obj.attr("untyped_storage")();
    w.data_ptr = obj.attr("data_ptr");
    const auto at = nb::cast<uintptr_t>(w.data_ptr());
    if (at != w.address) {
      ThrowInvalid("tensor " + std::to_string(i) + ": data_ptr() " + std::to_string(at) +
                   " differs from its DLPack address " + std::to_string(w.address));
    }
  } else {
    // numpy, if loaded: a weak reference to every array of the base chain keeps numpy from
    // resizing (reallocating) any of them.
    nb::object np = nb::module_::import_("sys").attr("modules").attr("get")("numpy");
    if (!np.is_none()) {
      nb::handle ndarray = np.attr("ndarray");
      nb::object weakref = nb::module_::import_("weakref").attr("ref");
      nb::list refs;
      for (nb::object a = obj; nb::isinstance(a, ndarray); a = a.attr("base")) {
        refs.append(weakref(a));
      }
      w.keep = std::move(refs);
    }
  }
  w.object = std::move(obj);
  return w;
}

RegionSplit ParseSplit(const std::string& s) {
  if (s == "one") return RegionSplit::kNone;
  if (s == "per-layer") return RegionSplit::kPerLayer;
  if (s == "per-kv") return RegionSplit::kPerKv;
  if (s == "per-layer-kv") return RegionSplit::kPerLayerKv;
  ThrowInvalid("split '" + s + "': expected one|per-layer|per-kv|per-layer-kv");
  return RegionSplit::kNone;
}

PyPool WrapTensors(PyDevice& device, const KvShape& shape, nb::handle tensors,
                   const ParallelConfig& parallel, int32_t rank, const std::string& layout,
                   int64_t blocks, std::optional<std::vector<int64_t>> byte_strides,
                   const std::string& split) {
  const std::shared_ptr<DeviceCore>& dev = device.core();
  std::vector<nb::object> objects;
  if (nb::isinstance<nb::list>(tensors) || nb::isinstance<nb::tuple>(tensors)) {
    for (nb::handle t : tensors) objects.push_back(nb::borrow(t));
  } else {
    objects.push_back(nb::borrow(tensors));
  }
  if (objects.empty()) ThrowInvalid("wrap needs at least one tensor");
  std::vector<nb::ndarray<>> arrays;
  std::vector<ExternalRegion> regions;
  std::vector<Mapping> maps;
  for (size_t i = 0; i < objects.size(); ++i) {
    nb::ndarray<> a;
    if (!nb::try_cast(objects[i], a)) {
      nb::ndarray<nb::ro> ro;
      if (nb::try_cast(objects[i], ro)) {
        ThrowInvalid("tensor " + std::to_string(i) +
                     " is read-only (numpy: flags.writeable is False); kvferry writes into a "
                     "wrapped pool (fetches, onboarding): wrap writable memory");
      }
      ThrowInvalid("tensor " + std::to_string(i) + " (" +
                   nb::cast<std::string>(nb::str(nb::type_name(objects[i].type()))) +
                   ") does not export DLPack (a torch tensor or numpy array is needed)");
    }
    CheckDType(a, shape.dtype, i);
    if (!byte_strides.has_value()) CheckContiguous(a, i);
    ExternalRegion r;
    r.base = static_cast<std::byte*>(a.data_handle()) + a.byte_offset();
    r.bytes = SpanBytes(a, i);
    r.memory = KindOf(a, *dev, i);
    r.device = a.device_type() == nb::device::cuda::value ? a.device_id() : 0;
    if (i > 0 && r.memory != regions[0].memory) {
      ThrowInvalid("tensor " + std::to_string(i) + " is " + std::string(MemoryKindName(r.memory)) +
                   " memory, tensor 0 is " + std::string(MemoryKindName(regions[0].memory)));
    }
    if (a.device_type() != nb::device::cuda::value) {
      if (maps.empty()) maps = ReadMappings();
      if (!Writable(maps, reinterpret_cast<uintptr_t>(r.base), static_cast<uintptr_t>(r.bytes))) {
        ThrowInvalid("tensor " + std::to_string(i) +
                     " lies in memory this process may not write (a read-only mapping or "
                     "buffer); kvferry writes into a wrapped pool (fetches, onboarding): wrap "
                     "writable memory");
      }
    }
    regions.push_back(r);
    arrays.push_back(std::move(a));
  }
  PoolSpec spec{shape, parallel, rank, LayoutKind::kBlockMajor, regions[0].memory, blocks};
  auto core = std::make_shared<PoolCore>();
  core->device = dev;
  if (byte_strides.has_value()) {
    if (byte_strides->size() != kNumAxes) {
      ThrowInvalid("byte_strides has " + std::to_string(byte_strides->size()) +
                   " entries; one per axis (block, layer, kv, head, token, dim) is needed");
    }
    PoolStrides s{};
    std::copy(byte_strides->begin(), byte_strides->end(), s.begin());
    RankSlice slice = Take(SliceOf(shape, parallel, rank));
    PoolLayout l = Take(PoolLayout::FromByteStrides(RankPoolDims(shape, slice, blocks), s,
                                                    ParseSplit(split), shape.ElementBytes()));
    core->pool.emplace(Take(BlockPool::Wrap(*dev->device, spec, l, regions)));
  } else {
    spec.layout = Take(ParseLayoutKind(layout));
    core->pool.emplace(Take(BlockPool::Wrap(*dev->device, spec, regions)));
  }
  for (size_t i = 0; i < objects.size(); ++i) {
    core->wrapped.push_back(Pin(std::move(objects[i]), regions[i].base, i));
  }
  return PyPool(std::move(core));
}

}  // namespace

void PoolCore::CheckWrapped() const {
  for (size_t i = 0; i < wrapped.size(); ++i) {
    const WrappedTensor& w = wrapped[i];
    if (!w.data_ptr.is_valid()) continue;
    std::string now;
    try {
      const auto at = nb::cast<uintptr_t>(w.data_ptr());
      if (at == w.address) continue;
      now = "now points at " + std::to_string(at);
    } catch (const nb::python_error& e) {
      now = "now fails data_ptr() (" + std::string(e.what()) + ")";
    }
    ThrowInvalid("wrapped tensor " + std::to_string(i) + " moved: it " + now + ", the pool wraps " +
                 std::to_string(w.address) +
                 " (resize_() or set_() after Pool.wrap). kvferry keeps the wrapped storage "
                 "alive but copies nothing through a pool whose tensors moved: wrap them again");
  }
}

void BindPool(nb::module_& m) {
  nb::class_<KvShape>(m, "KvShape", "The shape of a model's KV cache, independent of its split.")
      .def(
          "__init__",
          [](KvShape* self, int32_t layers, int32_t kv_heads, int32_t head_dim,
             const std::string& dtype, int32_t kv_factor, int32_t tokens_per_block) {
            KvShape s;
            s.layers = layers;
            s.kv_heads = kv_heads;
            s.head_dim = head_dim;
            s.dtype = Take(ParseDType(dtype));
            s.kv_factor = kv_factor;
            s.tokens_per_block = tokens_per_block;
            Check(s.Validate());
            new (self) KvShape(s);
          },
          nb::arg("layers"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("dtype") = "bf16",
          nb::arg("kv_factor") = 2, nb::arg("tokens_per_block") = 32)
      .def_ro("layers", &KvShape::layers)
      .def_ro("kv_heads", &KvShape::kv_heads)
      .def_ro("head_dim", &KvShape::head_dim)
      .def_prop_ro("dtype", [](const KvShape& s) { return std::string(DTypeName(s.dtype)); })
      .def_ro("kv_factor", &KvShape::kv_factor)
      .def_ro("tokens_per_block", &KvShape::tokens_per_block)
      .def_prop_ro("element_bytes", &KvShape::ElementBytes)
      .def_prop_ro("bytes_per_token", &KvShape::BytesPerToken)
      .def("__eq__", [](const KvShape& a, const KvShape& b) { return a == b; })
      .def("__repr__", [](const KvShape& s) { return "<kvferry.KvShape " + s.ToString() + ">"; });

  nb::class_<ParallelConfig>(m, "ParallelConfig",
                             "How an instance is split: TP, PP (stage_layers per stage; empty = "
                             "even split), attention DP size and the DP group of a request.")
      .def(
          "__init__",
          [](ParallelConfig* self, int32_t tp, int32_t pp, std::vector<int32_t> stage_layers,
             int32_t dp_size, int32_t dp_rank) {
            new (self) ParallelConfig{tp, pp, std::move(stage_layers), dp_size, dp_rank};
          },
          nb::arg("tp") = 1, nb::arg("pp") = 1, nb::arg("stage_layers") = std::vector<int32_t>{},
          nb::arg("dp_size") = 1, nb::arg("dp_rank") = 0)
      .def_ro("tp", &ParallelConfig::tp)
      .def_ro("pp", &ParallelConfig::pp)
      .def_ro("stage_layers", &ParallelConfig::stage_layers)
      .def_ro("dp_size", &ParallelConfig::dp_size)
      .def_ro("dp_rank", &ParallelConfig::dp_rank)
      .def_prop_ro("world_size", &ParallelConfig::world_size)
      .def("__eq__", [](const ParallelConfig& a, const ParallelConfig& b) { return a == b; })
      .def("__repr__",
           [](const ParallelConfig& p) { return "<kvferry.ParallelConfig " + p.ToString() + ">"; });

  nb::class_<RankSlice>(m, "RankSlice", "What one rank holds: global layer and KV-head ranges.")
      .def_ro("rank", &RankSlice::rank)
      .def_ro("tp_rank", &RankSlice::tp_rank)
      .def_ro("pp_rank", &RankSlice::pp_rank)
      .def_ro("dp_group", &RankSlice::dp_group)
      .def_ro("layer_begin", &RankSlice::layer_begin)
      .def_ro("layer_count", &RankSlice::layer_count)
      .def_ro("head_begin", &RankSlice::head_begin)
      .def_ro("head_count", &RankSlice::head_count)
      .def("__repr__", &SliceRepr);
  m.def(
      "slice_of",
      [](const KvShape& shape, const ParallelConfig& parallel, int32_t rank) {
        return Take(SliceOf(shape, parallel, rank));
      },
      nb::arg("shape"), nb::arg("parallel"), nb::arg("rank"),
      "The global layers and KV heads that `rank` holds.");

  nb::class_<PyPool>(m, "Pool",
                     "One rank's KV blocks: allocated by kvferry (Pool.allocate) or wrapping the "
                     "engine's own tensors (Pool.wrap). close() releases this object's reference; "
                     "the memory is freed once no side, manager or region view uses it.")
      .def_static(
          "allocate",
          [](PyDevice& device, const KvShape& shape, const ParallelConfig& parallel, int32_t rank,
             const std::string& layout, const std::string& memory, int64_t blocks,
             bool block_scales) {
            const std::shared_ptr<DeviceCore>& dev = device.core();
            const LayoutSpec chosen = Take(LayoutSpec::Parse(layout));
            PoolSpec spec{shape, parallel, rank, chosen.kind, ParseMemory(memory), blocks};
            spec.block_scales = block_scales;
            const RankSlice slice = Take(SliceOf(shape, parallel, rank));
            const PoolDims span = Take(InstancePoolDims(shape, parallel, blocks));
            const PoolLayout pool_layout =
                Take(chosen.Make(RankPoolDims(shape, slice, blocks), span, shape.ElementBytes()));
            auto core = std::make_shared<PoolCore>();
            core->device = dev;
            core->pool.emplace(Take(BlockPool::Create(*dev->device, spec, pool_layout)));
            return PyPool(std::move(core));
          },
          nb::arg("device"), nb::arg("shape"), nb::arg("parallel") = ParallelConfig{},
          nb::arg("rank") = 0, nb::arg("layout") = "block-major", nb::arg("memory") = "device",
          nb::arg("blocks"), nb::arg("block_scales") = false,
          "Allocates a pool of `blocks` blocks; layout a named one ('block-major' (TensorRT-LLM), "
          "'per-layer' (vLLM, one region per layer), ...) or custom strides "
          "'custom:SPLIT:AXES[:pad=N]' (e.g. 'custom:one:block,kv,layer,head,token,dim:pad=64', "
          "packed over the instance's largest rank so every rank has the same strides); memory "
          "'device', 'pinned' or 'host'. block_scales (fp8 pools only): with per-block scales, "
          "one fp32 per (block, layer, K/V, head) of this rank beside the blocks "
          "(Pool.block_scales).")
      .def_static(
          "wrap", &WrapTensors, nb::arg("device"), nb::arg("shape"), nb::arg("tensors"),
          nb::arg("parallel") = ParallelConfig{}, nb::arg("rank") = 0,
          nb::arg("layout") = "per-layer-kv", nb::arg("blocks"),
          nb::arg("byte_strides") = nb::none(), nb::arg("split") = "per-layer-kv",
          "Wraps the engine's own tensors (torch, numpy: anything with __dlpack__; CPU or CUDA), "
          "zero copy: one tensor per region of the layout, in region order (layer * kv regions + "
          "kv). `layout` names the engine layout ('per-layer-kv': a K and a V tensor per layer, "
          "[block][token][head][dim]; 'per-layer', 'per-layer-hnd', 'per-layer-kv-hnd', "
          "'flashinfer', 'flashinfer-hnd', 'block-major', 'block-major-nhd', 'vllm-cpu', "
          "'vllm-hnd', 'vllm-nhd'); dense tensors are "
          "needed then. Or give byte_strides over (block, layer, kv, head, token, dim) and the "
          "region split ('one', 'per-layer', 'per-kv', 'per-layer-kv') for any strides (a custom "
          "pool transfers too: handles carry its strides; every rank of an instance must have "
          "the same ones). The pool keeps the tensors' memory alive (a "
          "torch "
          "tensor's storage; numpy arrays cannot be resized while wrapped); a torch tensor "
          "resize_()d or set_() after wrap is refused by every later transfer. Read-only memory "
          "is refused. uint8 tensors are taken as raw bytes whatever the KvShape's dtype (an "
          "engine's "
          "byte page per block, e.g. [blocks, block_bytes] with layout 'block-major').")
      .def_prop_ro("blocks", [](PyPool& p) { return p.pool().blocks(); })
      .def_prop_ro("num_regions", [](PyPool& p) { return p.pool().num_regions(); })
      .def_prop_ro("region_bytes", [](PyPool& p) { return p.pool().layout().region_bytes(); })
      .def_prop_ro("block_bytes", [](PyPool& p) { return p.pool().layout().block_bytes(); })
      .def_prop_ro(
          "layout", [](PyPool& p) { return p.pool().layout().ToString(); },
          "The layout in (blk,L,kv,h,t,d)=dims:strides notation.")
      .def_prop_ro(
          "dims",
          [](PyPool& p) {
            const PoolDims& d = p.pool().layout().dims();
            return std::vector<int64_t>(d.begin(), d.end());
          },
          "Sizes along (block, layer, kv, head, token, dim), local to this rank.")
      .def_prop_ro(
          "strides",
          [](PyPool& p) {
            const PoolStrides& s = p.pool().layout().strides();
            return std::vector<int64_t>(s.begin(), s.end());
          },
          "Element strides along (block, layer, kv, head, token, dim).")
      .def_prop_ro("shape", [](PyPool& p) { return p.pool().shape(); })
      .def_prop_ro("parallel", [](PyPool& p) { return p.pool().spec().parallel; })
      .def_prop_ro("slice", [](PyPool& p) { return p.pool().slice(); })
      .def_prop_ro("memory",
                   [](PyPool& p) { return std::string(MemoryKindName(p.pool().memory())); })
      .def_prop_ro(
          "wrapped", [](PyPool& p) { return p.pool().wrapped(); },
          "True when the memory is the engine's (Pool.wrap).")
      .def_prop_ro("closed", &PyPool::closed)
      .def(
          "region",
          [](PyPool& p, int32_t i) {
            const std::shared_ptr<PoolCore>& c = p.core();
            if (i < 0 || i >= c->pool->num_regions()) {
              ThrowInvalid("region " + std::to_string(i) + " outside [0, " +
                           std::to_string(c->pool->num_regions()) + ")");
            }
            c->CheckWrapped();
            return View(c, c->pool->region(i),
                        static_cast<size_t>(c->pool->layout().region_bytes()));
          },
          nb::arg("index"),
          "A zero-copy uint8 view of region `index` (numpy for host memory; an object with "
          "__dlpack__ for GPU memory: torch.from_dlpack(view)). Keeps the memory alive.")
      .def_prop_ro(
          "block_scales",
          [](PyPool& p) -> nb::object {
            const std::shared_ptr<PoolCore>& c = p.core();
            if (c->pool->block_scales() == nullptr) return nb::none();
            c->CheckWrapped();
            return View(c, reinterpret_cast<std::byte*>(c->pool->block_scales()),
                        static_cast<size_t>(c->pool->block_scale_count()) * sizeof(float));
          },
          "The per-block scales, or None: a zero-copy uint8 view of block_scale_count fp32 "
          "values laid out [block][layer][kv][head] over this rank's layers and heads "
          "(numpy: .view(numpy.float32); GPU: torch.from_dlpack(view).view(torch.float32)). A "
          "scale s says the block's fp8 codes q of that layer, K/V and head stand for q * s; "
          "transfers into the pool write them, the engine writes its own as it quantizes.")
      .def_prop_ro("block_scale_count", [](PyPool& p) { return p.pool().block_scale_count(); })
      .def(
          "block_scale_index",
          [](PyPool& p, int64_t block, int64_t layer, int64_t kv, int64_t head) {
            return p.pool().BlockScaleIndex(block, layer, kv, head);
          },
          nb::arg("block"), nb::arg("layer"), nb::arg("kv"), nb::arg("head"),
          "Index into block_scales (as fp32) of (block, local layer, K/V, local head).")
      .def(
          "attach_block_scales",
          [](PyPool& p, nb::object tensor) {
            const std::shared_ptr<PoolCore>& c = p.core();
            nb::ndarray<> a;
            if (!nb::try_cast(tensor, a)) {
              ThrowInvalid("block scales: a writable torch tensor or numpy array is needed");
            }
            if (a.dtype() != nb::dtype<float>()) {
              ThrowInvalid("block scales must be float32");
            }
            int64_t expect = 1;  // C-contiguous: the scales are read as one array
            for (size_t d = a.ndim(); d-- > 0;) {
              if (a.shape(d) != 1 && a.stride(d) != expect) {
                ThrowInvalid("block scales must be one contiguous float32 tensor (axis " +
                             std::to_string(d) + " has stride " + std::to_string(a.stride(d)) +
                             ", " + std::to_string(expect) + " expected)");
              }
              expect *= static_cast<int64_t>(a.shape(d));
            }
            ExternalRegion r;
            r.base = static_cast<std::byte*>(a.data_handle()) + a.byte_offset();
            r.bytes = SpanBytes(a, 0);
            r.memory = KindOf(a, *c->device, 0);
            r.device = a.device_type() == nb::device::cuda::value ? a.device_id() : 0;
            if (a.device_type() != nb::device::cuda::value &&
                !Writable(ReadMappings(), reinterpret_cast<uintptr_t>(r.base),
                          static_cast<uintptr_t>(r.bytes))) {
              ThrowInvalid(
                  "block scales lie in memory this process may not write; transfers "
                  "into the pool write them");
            }
            Check(c->pool->AttachBlockScales(r));
            c->wrapped.push_back(Pin(std::move(tensor), r.base, c->wrapped.size()));
          },
          nb::arg("tensor"),
          "Gives a wrapped fp8 pool the engine's per-block scales (zero copy, kept alive): a "
          "contiguous float32 tensor of at least block_scale_count values in the pool's memory, "
          "[block][layer][kv][head] (block_scale_index).")
      .def(
          "block_extents",
          [](PyPool& p, nb::handle block_ids) {
            std::vector<int64_t> blocks = Int64Ids(block_ids, "blocks");
            std::vector<Extent> ext = Take(p.pool().BlockExtents(blocks));
            nb::list out;
            for (const Extent& e : ext) out.append(nb::make_tuple(e.region, e.offset, e.bytes));
            return out;
          },
          nb::arg("blocks"), "(region, byte offset, bytes) of whole blocks, coalesced.")
      .def("close", &PyPool::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyPool& p, nb::args) { p.close(); })
      .def("__repr__", [](PyPool& p) {
        if (p.closed()) return std::string("<kvferry.Pool closed>");
        return "<kvferry.Pool " + std::to_string(p.pool().blocks()) + " blocks " +
               std::string(MemoryKindName(p.pool().memory())) + " " + p.pool().layout().ToString() +
               ">";
      });
}

}  // namespace kvferry::py
