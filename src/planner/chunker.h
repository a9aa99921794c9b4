// The chunker of the transfer planner (planner.cc): the ordered pieces of one (context rank,
// generation rank) pair become chunks. Contiguous pieces of at least DirectMin go pool to pool, one
// row per direct chunk; the rest is packed into chunks of at most chunk_bytes, a row larger than a
// chunk split by bytes, a piece of planes placed whole or plane by plane (PlacePlanes). Consecutive
// pieces that still form one 2-D piece merge first (TryMerge). Bounded by kMaxChunksPerPair, the
// plan's chunk cap and its memory bound (planner.h). Pure; internal to the planner layer.
#pragma once

#include <cstdint>
#include <optional>

#include "planner/planner.h"

namespace kvferry {

// Merges `next` into `p` when the result is still one 2-D piece covering exactly both.
// With `one_layer`, pieces of different layers stay apart.
bool TryMerge(Piece& p, const Piece& next, bool one_layer);

// Turns the ordered pieces of one pair into chunks.
class Chunker {
 public:
  // `plan_bytes`: the memory the plan's chunks and pieces take so far, all pairs together;
  // `chunks_left`: how many chunks this pair may still make under in.max_chunks.
  Chunker(const PlanInput& in, PairPlan& out, int64_t& plan_bytes, int64_t chunks_left);

  // True when the pair needs more than kMaxChunksPerPair chunks (the plan is then refused).
  bool too_many() const { return too_many_; }
  // True when the plan needs more than max_plan_bytes of memory (the plan is then refused).
  bool too_big() const { return too_big_; }
  // True when the plan needs more than in.max_chunks chunks (the plan is then refused).
  bool over_cap() const { return over_cap_; }
  // The bytes of a per-block scale group too large for one chunk with its scale (the plan is then
  // refused: a group's scale is computed from all of its values, so it is never cut); 0 if none.
  int64_t group_too_big() const { return group_too_big_; }
  // True when the plan is refused already (the rest of the pieces need not be enumerated).
  bool failed() const { return too_many_ || too_big_ || over_cap_ || group_too_big_ > 0; }

  // The next piece in plan order (held back one piece, to merge with the one after it).
  void Add(const Piece& p);
  // Places the piece held back and closes the open chunk.
  void Finish();

 private:
  // A piece goes direct (row by row), into the open chunk, or over several chunks.
  void Place(Piece p);

  // A piece of several planes goes into the open chunk whole when each of its planes would go
  // there as a packed piece, one after the other; otherwise its planes are placed one by one as
  // pieces of their own until the rest fits whole. The chunks are then the same as if the planes
  // had come as separate pieces.
  void PlacePlanes(const Piece& p);
  // A piece whose planes get per-block scales at the generation side (Piece::dst_scale_at): whole
  // planes only, each costing its rows and its 4-byte scale, in chunk_bytes less 16 (the scales'
  // alignment).
  void PlaceScaled(const Piece& p);

  // False (and too_many_, over_cap_ or too_big_ set) when one more chunk would exceed
  // kMaxChunksPerPair, the plan's chunk cap or its memory bound.
  bool Room();

  // Counts `bytes` more of plan memory; false when that passes max_plan_bytes.
  bool Charge(int64_t bytes);

  // Opens a packed chunk, reserving room for as many pieces like `p` as fit; false when the pair
  // has too many chunks already.
  // The reservation is small and a closed chunk gives back what it did not use: a peer's
  // chunk_bytes and direct_min_bytes (a FETCH's) can make up to kMaxChunksPerPair chunks of one
  // piece each, and thousands of reserved pieces per chunk would be gigabytes.
  bool Open(const Piece& p);

  // Ends the open chunk, giving back what its reservation did not use.
  void Close();
  // Adds `part` to the open chunk, charging its memory.
  void Append(const Piece& part);

  const int64_t chunk_bytes_;
  const int64_t direct_min_;
  const bool one_layer_;
  const int64_t max_plan_bytes_;
  const int64_t chunks_left_;
  PairPlan& out_;
  int64_t& plan_bytes_;
  std::optional<Piece> pending_;
  bool too_many_ = false;
  bool too_big_ = false;
  bool over_cap_ = false;
  int64_t group_too_big_ = 0;
  Chunk* open_ = nullptr;  // the packed chunk being filled (always out_.chunks.back())
};

}  // namespace kvferry
