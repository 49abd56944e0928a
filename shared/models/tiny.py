"""Helpers for tiny presets: a locally built T5-style tokenizer and seeded module construction.

Tiny presets must be built offline, in milliseconds, and identically for a seed, so tests and the
demo load them through the very `from_pretrained` code path a real checkpoint uses. The tokenizer
is a SentencePiece-style Unigram model (what T5 and UMT5 use) made with the `tokenizers` library
from a small word list: each listed word is one piece, anything else falls back to single
characters, so no caption ever fails to tokenize. `bpe_vocab` is the same idea for the byte-pair
tokenizers (Llama, CLIP, Gemma) the other families' presets build.
"""

from __future__ import annotations

import contextlib
import math
import string
from collections.abc import Iterator

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
        tokenizer_object=model, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        extra_ids=0, model_max_length=model_max_length,
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
