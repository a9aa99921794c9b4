"""The KV cache tensors vLLM's GPU model runner builds, read by kvferry's connector, without a GPU.

For each layer-compact KV cache layout of vLLM (LBHNC, LBNHC), KV head counts 1, 2 and 4 and bf16
and fp16, builds the per-layer views exactly as vLLM does (vllm.v1.kv_cache_interface:
create_kv_cache_views over one int8 buffer, here on the CPU), then checks that
1. the connector's _detect_layout, given those shapes and strides on a GPU ("meta" tensors stand
   in: same shape, strides and dtype, device type not "cpu"), names the kvferry layout vllm-hnd or
   vllm-nhd;
2. kvferry's Pool.wrap of the views with those byte strides is that named layout (not "custom");
3. every element vLLM's FlashAttention backend writes (flash_attn.py: kv_cache.transpose(1, 2)
   .split(head_size, -1) gives the K and the V cache, [blocks, block_size, heads, head_size])
   sits at the byte offset the strides give for (block, kv, head, token, dim).
And that a block-outermost layout (BLHNC: each block holds every layer's page) is refused: the
per-layer views interleave (kvferry has no named layout for it yet). Prints one PASS/FAIL line; exit 1 on failure.
"""

import sys

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

import kvferry
from kvferry.integrations.vllm import _detect_layout

BLOCKS, BLOCK_SIZE, HEAD_SIZE, LAYERS = 5, 16, 8, 2


def views(layout: KVCacheLayout, heads: int, dtype: torch.dtype) -> list[torch.Tensor]:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_SIZE,
                             dtype=dtype)
    page = spec.page_size_bytes
    compact = layout.is_layer_compact
    tensor = KVCacheTensor(size=page * BLOCKS * LAYERS, layers=[f"l{i}" for i in range(LAYERS)],
                           layer_stride=page * BLOCKS if compact else page,
                           block_stride=page if compact else page * LAYERS)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)


def on_gpu(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def check(layout: KVCacheLayout, heads: int, dtype: torch.dtype) -> list[str]:
    errors = []
    where = f"{layout.name} heads={heads} {dtype}"
    layers = views(layout, heads, dtype)
    kind, strides, blocks = _detect_layout(on_gpu(layers[0]), heads, BLOCK_SIZE, HEAD_SIZE)
    want = "vllm-hnd" if layout is KVCacheLayout.LBHNC or heads == 1 else "vllm-nhd"
    if kind != want or blocks != BLOCKS:
        errors.append(f"{where}: detected {kind} ({blocks} blocks), expected {want}")
    shape = kvferry.KvShape(layers=LAYERS, kv_heads=heads, head_dim=HEAD_SIZE,
                            dtype="bf16" if dtype == torch.bfloat16 else "fp16",
                            tokens_per_block=BLOCK_SIZE)
    pool = kvferry.Pool.wrap(kvferry.Device("cpu"), shape, layers, blocks=blocks,
                             byte_strides=strides, split="per-layer")
    if pool.layout.split()[0] != want:
        errors.append(f"{where}: Pool.wrap made layout '{pool.layout}', expected {want}")
    # Each element's value is its own index; vLLM's K/V views then say where each one went.
    t = layers[1]
    key, value = t.transpose(1, 2).split(HEAD_SIZE, dim=-1)  # [blocks, block_size, heads, dim]
    es = t.element_size()
    base = t.data_ptr()
    for kv, cache in enumerate((key, value)):
        b, n, h, d = torch.meshgrid(*(torch.arange(s) for s in cache.shape), indexing="ij")
        expected = b * strides[0] + kv * strides[2] + h * strides[3] + n * strides[4] + \
            d * strides[5]
        # The byte offset of every element of the view, from its own storage offset and strides.
        got = (torch.as_strided(torch.arange(t.untyped_storage().nbytes() // es),
                                cache.shape, cache.stride(), cache.storage_offset())
               * es - (base - t.untyped_storage().data_ptr()))
        if not torch.equal(got, expected):
            bad = (got != expected).nonzero()[0].tolist()
            errors.append(f"{where}: {'KV'[kv]} element (block, token, head, dim) {bad} at "
                          f"byte {int(got[tuple(bad)])}, the strides say "
                          f"{int(expected[tuple(bad)])}")
    return errors


def main() -> int:
    errors = []
    cases = 0
    for layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):
        for heads in (1, 2, 4):
            for dtype in (torch.bfloat16, torch.float16):
                errors += check(layout, heads, dtype)
                cases += 1
    # Block-outermost: one layer's blocks are L pages apart, which no named layout is.
    t = views(KVCacheLayout.BLHNC, 2, torch.bfloat16)[0]
    kind, strides, blocks = _detect_layout(on_gpu(t), 2, BLOCK_SIZE, HEAD_SIZE)
    shape = kvferry.KvShape(layers=LAYERS, kv_heads=2, head_dim=HEAD_SIZE, dtype="bf16",
                            tokens_per_block=BLOCK_SIZE)
    try:
        pool = kvferry.Pool.wrap(kvferry.Device("cpu"), shape,
                                 views(KVCacheLayout.BLHNC, 2, torch.bfloat16), blocks=blocks,
                                 byte_strides=strides, split="per-layer")
        if pool.layout.split()[0] != "custom":
            errors.append(f"BLHNC: wrapped as '{pool.layout}', expected a refusal")
    except kvferry.errors.InvalidArgumentError as e:  # the layers' views interleave
        if "overlap" not in str(e):
            errors.append(f"BLHNC: refused, but not for interleaving: {e}")
    if errors:
        print("layout_check: FAIL\n  " + "\n  ".join(errors))
        return 1
    print(f"layout_check: PASS ({cases} cases: vLLM's own CUDA KV views read as vllm-hnd/vllm-nhd "
          "with every K and V element where vLLM's FlashAttention puts it; BLHNC refused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
