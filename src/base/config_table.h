// The table of every knob kvferry has. Add a row here, nowhere else.
#pragma once

#include <cstdint>
#include <string_view>

#include "kvferry/config.h"

namespace kvferry::internal {

struct KnobDecl {
  std::string_view name;
  KnobType type;
  std::string_view default_value;
  std::string_view doc;
  int64_t min = 0;             // kInt only
  int64_t max = 0;             // kInt only
  std::string_view choices{};  // kString only: "a|b|c", empty = any
};

struct KnobTable {
  const KnobDecl* rows;
  int count;
};

KnobTable Knobs();

}  // namespace kvferry::internal
