"""A CLIP tokenizer that needs no download, for runs on machines without network access.

``build_offline_clip_tokenizer()`` writes a small byte-level BPE vocabulary (the 256 byte symbols, their end-of-word
``</w>`` forms, merges for a short list of common caption words, then ``<|startoftext|>`` and ``<|endoftext|>``, in the
layout of OpenAI's CLIP vocabulary) to a temporary folder and loads it with ``transformers.CLIPTokenizer``. The
result is a genuine ``CLIPTokenizer``: the diffusers ``StableDiffusionPipeline`` accepts it, and ``save_pretrained``
/ ``from_pretrained`` round-trip it like the real one. Every byte has a symbol, so no text maps to an unknown token;
the ids are deterministic (no randomness, no dependence on the machine) and all lie below ``OFFLINE_VOCAB_SIZE``,
which fits the tiny text encoder's vocabulary as well as CLIP-L's 49408.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

START_TOKEN = "<|startoftext|>"
END_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 77
"""CLIP's context length: Stable Diffusion 1.x text encoders have 77 position embeddings."""

# Words that get merges, so that typical mock and DreamBooth captions spend one token per word rather than one per
# character. Lower-case ASCII: the CLIP tokenizer lower-cases its input, and ASCII bytes are their own byte symbols.
CAPTION_WORDS = (
    "the", "of", "in", "on", "with", "and", "at", "by", "an", "photo", "picture", "painting", "drawing", "image",
    "close", "up", "view", "sks", "dog", "cat", "bird", "car", "house", "tree", "flower", "person", "man", "woman",
    "mountain", "beach", "city", "forest", "river", "field", "sky", "background", "style", "red", "green", "blue",
    "yellow", "black", "white", "orange", "purple", "gray", "small", "large", "bright", "dark", "sunny", "night",
)


def _bpe_pieces(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Applies BPE merges to ``symbols``: repeatedly joins the adjacent pair with the lowest merge rank."""
    pieces = list(symbols)
    while len(pieces) > 1:
        ranked = [(ranks[pair], i) for i, pair in enumerate(zip(pieces, pieces[1:])) if pair in ranks]
        if not ranked:
            break
        _, i = min(ranked)
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def offline_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Returns the vocabulary (token to id) and the ordered merge list of the offline tokenizer."""
    from tokenizers.pre_tokenizers import ByteLevel

    byte_symbols = sorted(ByteLevel.alphabet())  # the 256 printable stand-ins for raw bytes
    tokens = byte_symbols + [s + "</w>" for s in byte_symbols]
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in CAPTION_WORDS:
        # Merge whatever the existing merges leave of this word left to right. New merges rank after all older ones,
        # so words merged earlier still encode to a single token.
        pieces = _bpe_pieces(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        joined = pieces[0]
        for piece in pieces[1:]:
            ranks[(joined, piece)] = len(merges)
            merges.append((joined, piece))
            joined += piece
            if joined not in tokens:
                tokens.append(joined)
    tokens += [START_TOKEN, END_TOKEN]
    return {token: i for i, token in enumerate(tokens)}, merges


OFFLINE_VOCAB_SIZE = len(offline_vocabulary()[0])


def write_offline_tokenizer_files(folder: str | Path) -> Path:
    """Writes ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` of the offline tokenizer into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = offline_vocabulary()
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    # The first line of a CLIP merges file is a header that the loaders skip.
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    config = {"model_max_length": MODEL_MAX_LENGTH, "bos_token": START_TOKEN, "eos_token": END_TOKEN,
              "unk_token": END_TOKEN, "pad_token": END_TOKEN, "tokenizer_class": "CLIPTokenizer",
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def build_offline_clip_tokenizer():
    """Returns a ``transformers.CLIPTokenizer`` over the offline vocabulary, padding with the end token to 77."""
    from transformers import CLIPTokenizer

    # The tokenizer reads its files while loading, so the folder can go right after.
    with tempfile.TemporaryDirectory() as tmp:
        return CLIPTokenizer.from_pretrained(write_offline_tokenizer_files(tmp))


def is_offline_tokenizer(tokenizer) -> bool:
    """Whether ``tokenizer`` holds the offline vocabulary (e.g. one saved into a pipeline folder by an earlier run)."""
    return len(tokenizer) == OFFLINE_VOCAB_SIZE and tokenizer.get_vocab() == offline_vocabulary()[0]
