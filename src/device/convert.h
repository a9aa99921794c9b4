// Element conversion on the host (Stream::ConvertBatch of the CPU device, and the reference the
// GPU kernel is tested against). The arithmetic is convert_core.h's.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstddef>
#include <span>

#include "kvferry/device.h"

namespace kvferry {

// Converts `count` elements from `src` (as conversion.from) to `dst` (as conversion.to).
void ConvertElements(void* dst, const void* src, size_t count, Conversion conversion);

// The loops a conversion can run on: plain C++ (any machine), x86-64 AVX2 with F16C, AVX-512
// (F, BW, VL). ConvertElements takes the widest this CPU runs; all give the same bytes.
enum class ConvertPath { kPortable, kAvx2, kAvx512 };
// ConvertElements on `path`; false (nothing written) when this CPU can't run it or from == to.
bool ConvertElementsWith(ConvertPath path, void* dst, const void* src, size_t count,
                         Conversion conversion);

// ConvertElementsScaled on `path`; false (nothing written) when this CPU can't run it.
bool ConvertElementsScaledWith(ConvertPath path, void* dst, const void* src, size_t count,
                               Conversion conversion, float src_scale, float dst_scale);

// The amax of per-block scales on `path`: the largest finite |value| of `rows` rows of `count`
// elements of `format`, `pitch` bytes apart, as fp32 bits (NaN and infinity left out) into *out;
// false (nothing written) when this CPU can't run `path`.
bool PlaneMaxMagnitudeWith(ConvertPath path, ElementFormat format, const void* src, size_t rows,
                           size_t pitch, size_t count, uint32_t* out);

// ConvertElements with scales (CopyDesc::src_scale, dst_scale); from == to allowed.
void ConvertElementsScaled(void* dst, const void* src, size_t count, Conversion conversion,
                           float src_scale, float dst_scale);

// One element's bits (low ElementFormatSize bytes of the value), for tests and references.
uint32_t ConvertElement(uint32_t bits, Conversion conversion, float src_scale = 1.0f,
                        float dst_scale = 1.0f);

// Stream::ConvertBatch on the host: every descriptor, plane by plane, row by row.
void ConvertHostBatch(std::span<const CopyDesc> copies, Conversion conversion);

// Why a ConvertBatch can't run (a format out of range, a row that is not whole elements on both
// sides, a scale that is not finite and positive), or OK.
Status CheckConversion(std::span<const CopyDesc> copies, Conversion conversion);

}  // namespace kvferry
