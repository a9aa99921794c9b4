#include "testing/bench_support.h"

#include "testing/memory_slab_store.h"
#include "tiering/copy_plan.h"

namespace kvferry {

void AppendBlockCopies(const BlockPool& from, const BlockPool& to, std::span<const BlockMove> moves,
                       std::vector<CopyDesc>& out) {
  std::vector<std::byte*> fp, tp;
  for (int32_t i = 0; i < from.num_regions(); ++i) fp.push_back(from.region(i));
  for (int32_t i = 0; i < to.num_regions(); ++i) tp.push_back(to.region(i));
  const tiering::TierView fv{&from.layout(), fp}, tv{&to.layout(), tp};
  const int64_t tpb = from.layout().dims()[kTokenAxis];
  for (const BlockMove& mv : moves) {
    tiering::AppendRunCopies(fv, mv.src, tv, mv.dst, 1, mv.tokens == 0 ? tpb : mv.tokens, out);
  }
}

std::unique_ptr<SlabStore> NewMemorySlabStore(int64_t slot_payload_bytes, int64_t max_slots) {
  return std::make_unique<tiering::MemorySlabStore>(slot_payload_bytes, max_slots);
}

}  // namespace kvferry
