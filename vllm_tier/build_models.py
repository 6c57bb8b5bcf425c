"""Build tiny Llama checkpoints for the real-vLLM tier, with no hub access.

    .venv-vllm/bin/python vllm_tier/build_models.py OUT [--revisions 2]

Writes ``OUT/base`` (the model vLLM boots with: config, tokenizer, weights of seed 0)
and ``OUT/rev-1`` .. ``OUT/rev-N`` (the same architecture, weights of seed K, each with
``revision.txt``), then ``OUT/.built`` naming this script's format version, so a later
run with the same version does nothing.

The model is as small as the CPU backend allows: head size 32 (16 crashes vLLM's CPU
attention at the first request), 2 layers, a 512-token byte-level BPE vocabulary trained
here on a fixed text with ``tokenizers``. Weights are random but seeded, so each revision
is the same bytes on every machine and greedy (temperature 0) outputs differ between
revisions. Runs under the vLLM venv's Python (torch, transformers, tokenizers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

FORMAT = "tiny-llama-3"  # bump when the files written here change
VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the trainer takes a turn on the gpu and the sampler waits for its weights to load "
    "sleep wake reload serve release park restore checkpoint revision prompt token model "
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "one two three four five six seven eight nine ten eleven twelve hello world question "
)


def _corpus() -> list[str]:
    words = _WORDS.split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4


def build_tokenizer(out: Path) -> int:
    """Train a byte-level BPE tokenizer, save it as a transformers fast tokenizer; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(fast)


def build_model(out: Path, seed: int, vocab_size: int) -> None:
    """Save a 2-layer Llama with head size 32 and random weights drawn with `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Larger than the default init, so greedy outputs vary strongly with the weights.
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    """Build the base model and the revisions under OUT (idempotent)."""
    p = argparse.ArgumentParser(prog="build_models")
    p.add_argument("out", type=Path)
    p.add_argument("--revisions", type=int, default=2)
    args = p.parse_args(argv)
    out: Path = args.out
    stamp = out / ".built"
    want = json.dumps({"format": FORMAT, "revisions": args.revisions})
    if stamp.exists() and stamp.read_text() == want:
        print(f"models in {out} are current")
        return 0
    if out.exists():
        shutil.rmtree(out)
    base = out / "base"
    base.mkdir(parents=True)
    vocab = build_tokenizer(base)
    build_model(base, 0, vocab)
    for k in range(1, args.revisions + 1):
        rev = out / f"rev-{k}"
        rev.mkdir()
        build_model(rev, k, vocab)
        for f in base.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, rev / f.name)
        (rev / "revision.txt").write_text(f"rev-{k}")
    stamp.write_text(want)
    print(f"built base and {args.revisions} revisions in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
