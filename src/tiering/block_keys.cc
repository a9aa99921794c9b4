// The block key chain (include/kvferry/block_manager.h): RootKey, NextKey.
#include <cstring>
#include <string>

#include "kvferry/block_manager.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvferry {

namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutI64(std::string& out, int64_t v) { PutU64(out, static_cast<uint64_t>(v)); }

BlockKey FromXxh(XXH128_hash_t h) { return BlockKey{h.high64, h.low64}; }

constexpr uint64_t kKeySeed = 0x6b7666657272794bULL;  // "Kyrrefvk": format version 1 of keys

}  // namespace

BlockKey RootKey(const CacheIdentity& id) {
  // Every field explicitly, little-endian, length-prefixed where variable.
  std::string b = "kvferry-block-key-v1";
  PutU64(b, id.model_id.size());
  b += id.model_id;
  const KvShape& s = id.shape;
  for (int64_t v :
       {int64_t{s.layers}, int64_t{s.kv_heads}, int64_t{s.head_dim},
        int64_t{static_cast<int>(s.dtype)}, int64_t{s.kv_factor}, int64_t{s.tokens_per_block}}) {
    PutI64(b, v);
  }
  const ParallelConfig& p = id.parallel;
  for (int64_t v : {int64_t{p.tp}, int64_t{p.pp}, int64_t{p.dp_size}}) PutI64(b, v);
  PutU64(b, p.stage_layers.size());
  for (int32_t l : p.stage_layers) PutI64(b, l);
  const RankSlice& r = id.slice;
  for (int64_t v :
       {int64_t{r.tp_rank}, int64_t{r.pp_rank}, int64_t{r.dp_group}, int64_t{r.layer_begin},
        int64_t{r.layer_count}, int64_t{r.head_begin}, int64_t{r.head_count}}) {
    PutI64(b, v);
  }
  PutU64(b, id.salt);
  return FromXxh(XXH3_128bits_withSeed(b.data(), b.size(), kKeySeed));
}

BlockKey NextKey(const BlockKey& parent, std::span<const int32_t> tokens) {
  XXH3_state_t st;
  std::memset(&st, 0, sizeof(st));  // quiets -Wmaybe-uninitialized; reset sets every field
  XXH3_128bits_reset_withSeed(&st, kKeySeed);
  uint8_t pb[16];
  for (int i = 0; i < 8; ++i) {
    pb[i] = static_cast<uint8_t>(parent.hi >> (8 * i));
    pb[8 + i] = static_cast<uint8_t>(parent.lo >> (8 * i));
  }
  XXH3_128bits_update(&st, pb, sizeof(pb));
  for (int32_t t : tokens) {
    uint8_t tb[4];
    for (int i = 0; i < 4; ++i) tb[i] = static_cast<uint8_t>(static_cast<uint32_t>(t) >> (8 * i));
    XXH3_128bits_update(&st, tb, 4);
  }
  return FromXxh(XXH3_128bits_digest(&st));
}

}  // namespace kvferry
