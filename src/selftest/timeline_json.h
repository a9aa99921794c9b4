// A request's timeline (kvferry/metrics.h) as JSON and back: how rank processes report their
// slowest and median requests to the parent, and how the CLI prints them.
#pragma once

#include <nlohmann/json.hpp>

#include "kvferry/metrics.h"

namespace kvferry {

// Fields request_id, state, code, bytes, chunks, fetch_s, first_byte_s, last_byte_s, end_s.
nlohmann::json TimelineToJson(const RequestTimeline& t);
// Missing fields keep RequestTimeline's defaults (-1 for the phases).
RequestTimeline TimelineFromJson(const nlohmann::json& j);

}  // namespace kvferry
