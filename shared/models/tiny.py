"""The builders of tiny presets: locally built tokenizers, tiny text encoders, seeded construction, saving.

Tiny presets must be built offline, in milliseconds, and identically for a seed, so tests and the
demo load them through the very `from_pretrained` code path a real checkpoint uses. The tokenizer
is a SentencePiece-style Unigram model (what T5 and UMT5 use) made with the `tokenizers` library
from a small word list: each listed word is one piece, anything else falls back to single
characters, so no caption ever fails to tokenize. `bpe_vocab` is the same idea for the byte-pair
tokenizers (Llama, CLIP, Gemma, Qwen) the other families' presets build.

A family's preset (`presets/<family module>.py`, `parts(task)`) builds its pipeline's arguments from these
(and its own transformer and VAE at a tiny config); `ModelSpec.make_tiny` seeds the build and saves the
pipeline (`save_tiny`).
"""

from __future__ import annotations

import contextlib
import json
import math
import string
from collections.abc import Iterator
from pathlib import Path

import torch

# Words of the demo captions (the sample clips: a rabbit in a meadow, people on bikes, a man on the
# phone in a car) and of typical validation prompts. Order matters: it fixes the token ids.
TINY_WORDS = """
a an the and of in on at with by to from over under near through while is are was
man woman person people child dog cat bird rabbit bunny animal car bike bikes bicycle cyclist
cyclists street road city park forest meadow grass tree trees flower flowers sky cloud clouds
sun water river sea beach mountain field house window room phone talking talks walks walking
runs running rides riding drives driving sits sitting stands standing looks looking flies
flying smiles eating cake baking kitchen big small large little tall young old slow fast
green blue red white black yellow brown gray bright dark sunny cartoon video clip scene shot
camera close up view moving moves day night morning evening light shadow face hands head
""".split()

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5's ids: pad 0, eos 1, unk 2
FALLBACK_CHARS = string.ascii_letters + string.digits + string.punctuation


def build_t5_tokenizer(words: list[str] = TINY_WORDS, model_max_length: int = 128):
    """A T5-compatible fast tokenizer over `words` (whole-word pieces) with character fallback.

    Saved with `save_pretrained`, it loads back with `AutoTokenizer` / `T5TokenizerFast`, which is
    how LTXPipeline and WanPipeline load their tokenizer folder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    # Unigram scores are log-probabilities; whole words score far above a chain of characters, so
    # Viterbi picks a listed word as one piece. Scores depend only on list order: deterministic.
    vocab: list[tuple[str, float]] = [(tok, 0.0) for tok in SPECIAL_TOKENS]
    seen = set(SPECIAL_TOKENS)
    for rank, word in enumerate(words):
        piece = "\u2581" + word
        if piece not in seen:
            seen.add(piece)
            vocab.append((piece, -1.0 - math.log1p(rank) / 100))
    for char in "\u2581" + FALLBACK_CHARS:
        for piece in (char, "\u2581" + char):
            if piece not in seen:
                seen.add(piece)
                vocab.append((piece, -10.0))
    model = Tokenizer(models.Unigram(vocab, unk_id=SPECIAL_TOKENS.index("<unk>"), byte_fallback=False))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    model.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", SPECIAL_TOKENS.index("</s>"))]
    )
    return T5TokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=model_max_length,
    )


def bpe_vocab(words, specials, prefix: str = "", suffix: str = "") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Whole-word BPE: every listed word is one token (each prefix of it too); single characters (with
    the word prefix / end-of-word suffix variants) make any other word tokenizable."""
    vocab = {s: i for i, s in enumerate(specials)}
    merges: list[tuple[str, str]] = []
    for char in FALLBACK_CHARS:
        for piece in (char, prefix + char if prefix else char + suffix):
            vocab.setdefault(piece, len(vocab))
    if prefix:
        vocab.setdefault(prefix, len(vocab))
    for word in words:
        pieces = list(prefix + word)
        if suffix:
            pieces[-1] += suffix
        add_merge_chain(pieces, vocab, merges)
    return vocab, merges


def add_merge_chain(pieces, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Merges that join `pieces` left to right into one token, every prefix of it a token too."""
    current = pieces[0]
    for piece in pieces[1:]:
        if (current, piece) not in merges:
            merges.append((current, piece))
        current += piece
        vocab.setdefault(current, len(vocab))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with torch's global RNG seeded, then restore the caller's RNG state.

    Modules draw their initial weights from the global RNG; forking keeps the preset deterministic
    for a seed without disturbing whatever randomness the caller relies on.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_llama_tokenizer(words: list[str] = TINY_WORDS):
    """A Llama BPE tokenizer over `words`, right padded as HunyuanVideo's (the transformer's text mask
    assumes right padding; LlamaTokenizer's default is left)."""
    from transformers import LlamaTokenizer

    vocab, merges = bpe_vocab(words, ["<unk>", "<s>", "</s>", "<pad>"], prefix="\u2581")
    return LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="right",
        model_max_length=1024,
    )


def build_clip_tokenizer(words: list[str] = TINY_WORDS):
    """A CLIP BPE tokenizer over `words` (77 tokens, padded with its end-of-text token, as CLIP's)."""
    from transformers import CLIPTokenizer

    vocab, merges = bpe_vocab(words, ["<|startoftext|>", "<|endoftext|>"], suffix="</w>")
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def build_gemma_tokenizer(words: list[str] = TINY_WORDS):
    """A Gemma BPE tokenizer over `words` (each one token after a space), left padded as LTX-2 encodes."""
    from transformers import GemmaTokenizer

    vocab, merges = bpe_vocab(words, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], prefix="\u2581")
    return GemmaTokenizer(vocab=vocab, merges=merges, padding_side="left", model_max_length=1024)


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'system' %}{{ '<|vision_pad|>' * FILL }}{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen_tokenizer(system: str, header_tokens: int, words: list[str] = TINY_WORDS):
    """A byte-level BPE Qwen2 tokenizer over `words` (each one token after a space; any other text falls
    back to bytes) with a ChatML template, right padded. The `system` prompt is one added token and the
    template pads the system turn with `<|vision_pad|>` so that the system turn plus the user header is
    exactly `header_tokens` long, as with the real Qwen2.5-VL tokenizer: a pipeline's fixed crop of that
    many tokens (HunyuanVideo 1.5's 108) then leaves the caption, as it does for the real model."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(char, len(vocab))
    merges: list[tuple[str, str]] = []
    # The chat roles, then each word after a space (\u0120): every merge chain starts from its own first
    # piece, so no chain splits another word (a caption's first word, without the space, is spelt out).
    for word in ["system", "user", "assistant", *(f"\u0120{w}" for w in words)]:
        add_merge_chain(word, vocab, merges)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, padding_side="right", model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:] + [system]})
    tokenizer.chat_template = CHATML_TEMPLATE.replace("FILL", "0")
    header = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": ""}], tokenize=True, return_dict=True
    )["input_ids"]
    fill = header_tokens - (len(header) - 2)  # less the user turn's "<|im_end|>\n"
    tokenizer.chat_template = CHATML_TEMPLATE.replace("FILL", str(fill))
    return tokenizer


def tiny_t5_encoder(
    umt5: bool = False, vocab_size: int = 1000, d_model: int = 64, d_kv: int = 16, d_ff: int = 128, num_heads: int = 4
):
    """A 2-layer T5 (or UMT5) encoder at a tiny width: the text encoder of most families' presets."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config, model = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model(
        config(vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=2, num_heads=num_heads)
    )


def save_tiny(pipeline, out: Path, index_names: dict[str, list[str]] | None = None) -> Path:
    """Save a tiny preset's pipeline in diffusers layout; `index_names` renames the classes of parts it
    holds in model_index.json as the real checkpoints name them (not by the backend transformers picked here)."""
    pipeline.save_pretrained(out, safe_serialization=True)
    if index_names:
        index = json.loads((out / "model_index.json").read_text())
        index.update({name: value for name, value in index_names.items() if any(index.get(name) or ())})
        (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out
