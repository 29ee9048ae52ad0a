"""Build the tiny local model the real-vLLM tests and `benchmarks/e2e_vllm.py` serve.

    .venv-vllm/bin/python scripts/build_tiny_model.py [--out .cache/tiny-llama]

Nothing is downloaded (run with HF_HUB_OFFLINE=1). Into `--out` it writes:

- a byte-level BPE tokenizer (vocab 2048) trained with `tokenizers` on the repository's
  own Markdown (README.md, docs/), with a post-processor that prepends `<|bos|>` when
  special tokens are added (as Llama's does: `/v1/completions` gets a BOS, chat does not,
  its template writes `bos_token` itself), wrapped as `PreTrainedTokenizerFast` and saved
  by transformers, which writes the chat template to `chat_template.jinja` (transformers
  5) rather than into `tokenizer_config.json`;
- a random-weight `LlamaForCausalLM` (hidden 512, 6 layers, 8 heads, MLP 1024, vocab
  2048: about 18 M parameters, seed 0) as safetensors, in float32.

The chat template uses what a real one does: `bos_token`, `tools | tojson`,
`strftime_now`, `raise_exception`, and the message content as a string (so vLLM
normalizes content-part arrays to text before rendering).

Cached: a stamp (`.built`) holds a digest of this file; a second run returns at once. Prints the model directory.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".cache" / "tiny-llama"
VOCAB = 2048
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|tool|>", "<|end|>"]  # fmt: skip
CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
CHAT_TEMPLATE = """\
{%- if messages | length == 0 %}{{ raise_exception('no messages') }}{% endif %}
{{- bos_token }}
{%- if tools %}<|system|>Today is {{ strftime_now('%Y') }}. Tools: {{ tools | tojson }}<|end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\
{{ raise_exception('unknown role ' + message['role']) }}{% endif %}
<|{{ message['role'] }}|>{{ message['content'] }}<|end|>
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}
"""


def training_text() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p.read_text("utf-8") for p in files if p.is_file()]


def inputs_digest() -> str:
    """Rebuild when this script changes (not when the docs do: the tests need a tokenizer
    that tokenizes like the engine's, not one trained on today's docs)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def build(out: Path, texts: list[str]) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **CONFIG,
        bos_token_id=bos,
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"build_tiny_model: {params / 1e6:.1f} M parameters in {out}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    digest = inputs_digest()
    stamp = args.out / ".built"
    if not (stamp.is_file() and stamp.read_text() == digest):
        build(args.out, training_text())
        if not (args.out / "chat_template.jinja").is_file():
            print("build_tiny_model: transformers wrote no chat_template.jinja", file=sys.stderr)
            return 1
        stamp.write_text(digest)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
