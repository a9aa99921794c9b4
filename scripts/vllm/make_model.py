"""Writes a tiny random-weight Llama for vLLM tests into DIR (nothing is downloaded).

Weights come from transformers' own initializer, seeded, with initializer_range=0.1: large enough
that a wrong KV block changes greedy outputs (vLLM's load_format="dummy" weights are ~1e-3 and
do not). No tokenizer: the tests pass token ids with skip_tokenizer_init=True.

    python make_model.py DIR
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def main(out_dir: str) -> None:
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    print(f"make_model: {sum(p.numel() for p in model.parameters())} parameters in {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
