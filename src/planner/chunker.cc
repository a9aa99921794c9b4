#include "planner/chunker.h"

#include <algorithm>

#include "model/coalesce.h"
#include "planner/plan_input.h"

namespace kvferry {

static_assert(kPlanChunkCharge >= static_cast<int64_t>(sizeof(Chunk) + sizeof(Piece)),
              "a chunk's charge covers its memory at least");

bool TryMerge(Piece& p, const Piece& next, bool one_layer) {
  if (one_layer && p.layer != next.layer) return false;
  if (p.planes > 1 || next.planes > 1) return false;
  if (p.src_scale != next.src_scale || p.dst_scale != next.dst_scale) return false;
  if (p.src_scale_at >= 0 || p.dst_scale_at >= 0) return false;  // one scale group each
  if (!MergeRuns(p, next, RunMerge::kStrided)) return false;
  p.layer = std::max(p.layer, next.layer);
  return true;
}

namespace {
// Planes [q, q + count) of `p` as one piece, each plane one row when its rows are contiguous on
// both sides (`flat`).
Piece WholePlanes(const Piece& p, int64_t q, int64_t count, bool flat) {
  Piece part = p.Planes(q, count);
  if (p.rows > 1 && flat) {
    part.bytes *= part.rows;
    part.rows = 1;
    part.src_pitch = part.dst_pitch = 0;
  }
  return part;
}
}  // namespace

Chunker::Chunker(const PlanInput& in, PairPlan& out, int64_t& plan_bytes, int64_t chunks_left)
    : chunk_bytes_(in.chunk_bytes),
      direct_min_(DirectMin(in)),
      one_layer_(in.layer_wise),
      max_plan_bytes_(in.max_plan_bytes),
      chunks_left_(chunks_left),
      out_(out),
      plan_bytes_(plan_bytes) {}

void Chunker::Add(const Piece& p) {
  if (failed()) return;
  if (pending_ && TryMerge(*pending_, p, one_layer_)) return;
  if (pending_) Place(*pending_);
  pending_ = p;
}

void Chunker::Finish() {
  if (pending_) Place(*pending_);
  pending_.reset();
  Close();
}

void Chunker::Place(Piece p) {
  if (p.dst_scale_at >= 0) {
    PlaceScaled(p);
    return;
  }
  if (p.planes > 1) {
    PlacePlanes(p);
    return;
  }
  if (p.rows > 1 && p.src_pitch == p.bytes && p.dst_pitch == p.bytes) {
    p.bytes *= p.rows;
    p.rows = 1;
  }
  out_.bytes += p.total();
  if (p.bytes >= direct_min_) {  // each row is contiguous on both sides and big: direct
    Close();
    for (int64_t r = 0; r < p.rows; ++r) {
      if (!Room()) return;
      Chunk& c = out_.chunks.emplace_back();
      c.direct = true;
      c.last_layer = p.layer;
      c.bytes = p.bytes;
      Piece& row = c.pieces.emplace_back(p);
      row.rows = 1;
      row.src_offset += r * p.src_pitch;
      row.dst_offset += r * p.dst_pitch;
      row.src_pitch = row.dst_pitch = 0;
    }
    return;
  }
  if (open_ && p.total() <= chunk_bytes_ - open_->bytes) {  // the common case: it fits
    Append(p);
    return;
  }
  int64_t row = 0;
  while (row < p.rows) {
    const int64_t room = open_ ? chunk_bytes_ - open_->bytes : 0;
    if (p.bytes <= room) {
      Piece part = p;
      part.rows = std::min(p.rows - row, room / p.bytes);
      part.src_offset += row * p.src_pitch;
      part.dst_offset += row * p.dst_pitch;
      if (part.rows == 1) part.src_pitch = part.dst_pitch = 0;
      Append(part);
      row += part.rows;
    } else if (p.bytes <= chunk_bytes_) {
      if (!Open(p)) return;
    } else {  // a row larger than a chunk: split it by bytes
      for (int64_t off = 0; off < p.bytes;) {
        if ((!open_ || open_->bytes == chunk_bytes_) && !Open(p)) return;
        Piece part = p;
        part.rows = 1;
        part.src_pitch = part.dst_pitch = 0;
        part.src_offset += row * p.src_pitch + off;
        part.dst_offset += row * p.dst_pitch + off;
        part.bytes = std::min(p.bytes - off, chunk_bytes_ - open_->bytes);
        Append(part);
        off += part.bytes;
      }
      ++row;
    }
  }
}

void Chunker::PlacePlanes(const Piece& p) {
  const bool flat = p.rows == 1 || (p.src_pitch == p.bytes && p.dst_pitch == p.bytes);
  const int64_t plane = p.bytes * p.rows;
  if ((flat ? plane : p.bytes) >= direct_min_) {  // rows big enough to go direct
    for (int64_t q = 0; q < p.planes && !failed(); ++q) Place(p.Plane(q));
    return;
  }
  // As many whole planes as the open chunk has room for, as one piece; a new chunk when none fits.
  for (int64_t q = 0; q < p.planes && !failed();) {
    const int64_t room = open_ ? chunk_bytes_ - open_->bytes : 0;
    const int64_t fit = std::min(p.planes - q, room / plane);
    if (fit > 0) {
      const Piece part = WholePlanes(p, q, fit, flat);
      out_.bytes += part.total();
      Append(part);
      q += fit;
    } else if (plane <= chunk_bytes_) {
      if (!Open(p)) return;
    } else {  // a plane larger than a chunk: split by rows
      Place(p.Plane(q++));
    }
  }
}

void Chunker::PlaceScaled(const Piece& p) {
  // Room for the scales' 16-byte alignment after the rows (Chunk::packed_bytes).
  const int64_t capacity = chunk_bytes_ - 16;
  const int64_t plane = p.bytes * p.rows + 4;
  if (plane > capacity) {
    group_too_big_ = plane - 4;
    return;
  }
  const bool flat = p.rows == 1 || (p.src_pitch == p.bytes && p.dst_pitch == p.bytes);
  for (int64_t q = 0; q < p.planes && !failed();) {
    const int64_t room = open_ ? capacity - open_->bytes - open_->scale_bytes : 0;
    const int64_t fit = std::min(p.planes - q, room / plane);
    if (fit == 0) {
      if (!Open(p)) return;
      continue;
    }
    const Piece part = WholePlanes(p, q, fit, flat);
    out_.bytes += part.total();
    open_->scale_bytes += 4 * fit;
    Append(part);
    q += fit;
  }
}

bool Chunker::Room() {
  if (static_cast<int64_t>(out_.chunks.size()) >= kMaxChunksPerPair) {
    too_many_ = true;
  } else if (static_cast<int64_t>(out_.chunks.size()) >= chunks_left_) {
    over_cap_ = true;
  } else if (!Charge(kPlanChunkCharge)) {
    too_big_ = true;
  } else {
    return true;
  }
  open_ = nullptr;
  return false;
}

bool Chunker::Charge(int64_t bytes) {
  plan_bytes_ += bytes;
  return max_plan_bytes_ <= 0 || plan_bytes_ <= max_plan_bytes_;
}

bool Chunker::Open(const Piece& p) {
  if (!Room()) return false;
  Close();
  open_ = &out_.chunks.emplace_back();
  open_->pieces.reserve(static_cast<size_t>(std::min<int64_t>(chunk_bytes_ / p.total() + 1, 64)));
  return true;
}

void Chunker::Close() {
  if (open_ && open_->pieces.capacity() > 2 * open_->pieces.size()) open_->pieces.shrink_to_fit();
  open_ = nullptr;
}

void Chunker::Append(const Piece& part) {
  // The first piece of a chunk was charged with it (Room).
  if (!open_->pieces.empty() && !Charge(sizeof(Piece))) too_big_ = true;
  if (open_->pieces.empty()) open_->last_layer = part.layer;
  open_->last_layer = std::max(open_->last_layer, part.layer);
  open_->bytes += part.total();
  open_->pieces.push_back(part);
}

}  // namespace kvferry
