"""A tiny random Llama with a real BPE tokenizer, written to disk with no download.

``python tiny_llama.py OUT_DIR [--vocab 2048]`` (or ``write_tiny_llama``): trains a
byte-level BPE tokenizer on this repository's Markdown (deterministic), wraps it as a
Llama tokenizer with ``<s>``/``</s>`` (BOS added to every prompt, as Llama's is), 256
reserved special tokens (as Llama 3 has) and a plain chat template, and saves a 2-layer
random ``LlamaForCausalLM`` beside it (head_dim 64: vLLM's CPU attention has no kernel
for very small heads).  vLLM serves the folder like any Hugging Face model.

The weights are noise, and the LM head's rows for the reserved tokens are scaled up, so
greedy decoding picks special tokens most of the time: vLLM streams each of them as a
chunk with empty text.  That is the stream of the reported server (most chunks empty),
the one a client must time right.
"""

from __future__ import annotations

import argparse
from pathlib import Path

_REPO = Path(__file__).resolve().parents[3]
_RESERVED = 256
_SPECIAL_GAIN = 2.5  # LM-head scale of the reserved tokens' rows: most greedy picks are special
_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")


def _corpus() -> list[str]:
    files = sorted([_REPO / "README.md", *(_REPO / "docs").glob("*.md")])
    return [line for f in files if f.is_file() for line in f.read_text(errors="replace").splitlines() if line.strip()]


def write_tokenizer(out: Path, vocab: int = 2048) -> Path:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    reserved = [f"<|reserved_special_token_{i}|>" for i in range(_RESERVED)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>", *reserved],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=reserved)
    fast.chat_template = _CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def write_tiny_llama(out: Path, vocab: int = 2048, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    write_tokenizer(out, vocab)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        ids = tok.convert_tokens_to_ids([f"<|reserved_special_token_{i}|>" for i in range(_RESERVED)])
        model.lm_head.weight[ids] *= _SPECIAL_GAIN
    model.save_pretrained(str(out))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--tokenizer-only", action="store_true")
    a = ap.parse_args()
    (write_tokenizer if a.tokenizer_only else write_tiny_llama)(a.out, a.vocab)
    print(a.out)
