"""Tiny presets of the metric models: the real transformers classes (CLIPModel, SiglipModel, Dinov2Model, ClapModel)
at tiny sizes with random weights from a seed, their processors and tokenizers built locally (shared/models/tiny.py's
whole-word BPE), saved with `save_pretrained` so `AutoModel` / `AutoProcessor` load them as they load a hub checkpoint.
Each folder is laid out as its real counterpart (openai/clip-vit-base-patch32, google/siglip2-base-patch16-224,
facebook/dinov2-base, laion/clap-htsat-unfused), at 32 x 32 pixels; CLAP keeps the real feature extractor (48 kHz,
10 s, 64 mel bins), so its audio tower keeps its input size (256) at a tiny width.

    python scripts/make_tiny_metric_models.py runs/models/metrics-tiny
"""

from __future__ import annotations

from pathlib import Path

from vt.shared.models.tiny import TINY_WORDS, add_merge_chain, bpe_vocab, build_clip_tokenizer, seeded

IMAGE = 32  # pixels
TOWER = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2)


def _clip():
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = build_clip_tokenizer()
    text = dict(TOWER, vocab_size=len(tokenizer), max_position_embeddings=77)
    text.update(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    config = CLIPConfig(text_config=text, vision_config=dict(TOWER, image_size=IMAGE, patch_size=8), projection_dim=16)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size=IMAGE), tokenizer=tokenizer
    )
    return CLIPModel(config), processor


def _siglip():
    from transformers import GemmaTokenizer, SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor

    vocab, merges = bpe_vocab(TINY_WORDS, ["<pad>", "<eos>", "<bos>", "<unk>"], prefix="\u2581")
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, padding_side="right", model_max_length=64)
    text = dict(TOWER, vocab_size=len(tokenizer), max_position_embeddings=64)
    text.update(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config = SiglipConfig(text_config=text, vision_config=dict(TOWER, image_size=IMAGE, patch_size=8))
    image_processor = SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE})
    return SiglipModel(config), SiglipProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _dinov2():
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    processor = BitImageProcessor(  # facebook/dinov2-base's: resize the short side, center crop, ImageNet statistics
        size={"shortest_edge": IMAGE + 4},
        crop_size={"height": IMAGE, "width": IMAGE},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    return Dinov2Model(Dinov2Config(**TOWER, image_size=IMAGE, patch_size=8)), processor


def _clap():
    from tokenizers import pre_tokenizers
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor, RobertaTokenizer

    vocab = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):  # byte-level BPE, as RoBERTa's
        vocab.setdefault(char, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in TINY_WORDS:
        add_merge_chain("\u0120" + word, vocab, merges)
    tokenizer = RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    text = dict(TOWER, vocab_size=len(vocab), max_position_embeddings=80, pad_token_id=1, bos_token_id=0)
    text["eos_token_id"] = 2
    audio = dict(hidden_size=32, patch_embeds_hidden_size=16, depths=[1, 1], num_attention_heads=[2, 2])
    config = ClapConfig(text_config=text, audio_config=audio, projection_dim=16)
    extractor = ClapFeatureExtractor(truncation="rand_trunc", padding="repeatpad")  # clap-htsat-unfused's
    return ClapModel(config), ClapProcessor(feature_extractor=extractor, tokenizer=tokenizer)


BUILDERS = {"clip": _clip, "siglip": _siglip, "dinov2": _dinov2, "clap": _clap}


def make_tiny_metric_models(out: Path, seed: int = 0) -> dict[str, Path]:
    """Each tiny metric model in `out/<name>` (clip, siglip, dinov2, clap); returns name -> folder."""
    folders = {}
    for name, build in BUILDERS.items():
        with seeded(seed):
            model, processor = build()
        folders[name] = Path(out) / name
        model.save_pretrained(folders[name])
        processor.save_pretrained(folders[name])
    return folders
