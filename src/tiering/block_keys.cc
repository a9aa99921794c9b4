// The block key chain (include/kvferry/block_manager.h): RootKey, NextKey.
#include <algorithm>
#include <cstring>
#include <string>

#include "kvferry/block_manager.h"

#ifndef XXH_INLINE_ALL  // the wheel's build defines it for the whole library
#define XXH_INLINE_ALL
#endif
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
  // The bytes (parent.hi, parent.lo as LE u64, then each token as LE u32) are hashed in one call
  // where they fit a stack buffer (every usual block size): the streaming API fed 4 bytes at a
  // time cost ~20x more per key. Both give the same hash (xxhash guarantees it; the golden test
  // BlockKeys.ChainIsStableAcrossVersions pins the values).
  constexpr size_t kMaxOneShotTokens = 256;
  uint8_t buf[16 + 4 * kMaxOneShotTokens];
  for (int i = 0; i < 8; ++i) {
    buf[i] = static_cast<uint8_t>(parent.hi >> (8 * i));
    buf[8 + i] = static_cast<uint8_t>(parent.lo >> (8 * i));
  }
  auto put = [&](size_t at, int32_t t) {
    const uint32_t u = static_cast<uint32_t>(t);
    for (int i = 0; i < 4; ++i) buf[at + i] = static_cast<uint8_t>(u >> (8 * i));
  };
  if (tokens.size() <= kMaxOneShotTokens) {
    for (size_t i = 0; i < tokens.size(); ++i) put(16 + 4 * i, tokens[i]);
    return FromXxh(XXH3_128bits_withSeed(buf, 16 + 4 * tokens.size(), kKeySeed));
  }
  XXH3_state_t st;
  std::memset(&st, 0, sizeof(st));  // quiets -Wmaybe-uninitialized; reset sets every field
  XXH3_128bits_reset_withSeed(&st, kKeySeed);
  XXH3_128bits_update(&st, buf, 16);
  for (size_t at = 0; at < tokens.size(); at += kMaxOneShotTokens) {
    const size_t n = std::min(kMaxOneShotTokens, tokens.size() - at);
    for (size_t i = 0; i < n; ++i) put(4 * i, tokens[at + i]);
    XXH3_128bits_update(&st, buf, 4 * n);
  }
  return FromXxh(XXH3_128bits_digest(&st));
}

}  // namespace kvferry
