"""The synthetic world the embedded tiny model grows up in.

Two kinds of documents, both generated here from a seed so that the corpus never has to be downloaded:
- simple English-like sentences ("This is a good day. The small dog likes the red ball."), with words of
  clear sentiment so that Part 1's lexicon reward has something to find;
- 2-digit additions written like `23+45=68`, so that Part 3 has a reward that can be checked exactly.

The tokenizer is word-level: a word carries its leading space (" dog"), every digit is its own token, and
`<|endoftext|>` (BOS = EOS = PAD) is the last id, as in GPT-2.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

EOS = "<|endoftext|>"
UNK = "<unk>"

# Word lists of the toy grammar. Sentiment words are listed apart so that rewards can use them.
POSITIVE = ["good", "happy", "great", "nice", "kind", "bright", "warm", "fun", "lovely", "calm"]
NEGATIVE = ["bad", "sad", "angry", "awful", "cold", "dark", "dull", "rude", "tired", "ugly"]
NEUTRAL_ADJ = ["big", "small", "red", "blue", "green", "old", "new", "little", "tall", "quiet"]
NOUNS = ["dog", "cat", "bird", "ball", "tree", "house", "car", "book", "friend", "day", "garden", "boat",
         "river", "city", "song", "child", "teacher", "window", "hat", "cake"]
VERBS = ["likes", "sees", "finds", "wants", "has", "makes", "reads", "holds", "loves", "hates"]
PLACES = ["park", "school", "road", "shop", "hill", "room", "table", "beach"]
PRONOUNS = ["I", "We", "They", "You"]
FEELINGS = ["feel", "am", "are"]


def _adjective(rng: random.Random) -> str:
    pool = rng.choice([POSITIVE, NEGATIVE, NEUTRAL_ADJ])
    return rng.choice(pool)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def make_sentence(rng: random.Random) -> str:
    """One sentence of the toy grammar, ending in a full stop."""
    adj, noun, noun2 = _adjective(rng), rng.choice(NOUNS), rng.choice(NOUNS)
    kind = rng.randrange(7)
    if kind == 0:
        return f"This is {_article(adj)} {adj} {noun}."
    if kind == 1:
        return f"The {adj} {noun} {rng.choice(VERBS)} the {noun2}."
    if kind == 2:
        pronoun = rng.choice(PRONOUNS)
        feel = "am" if pronoun == "I" and rng.random() < 0.5 else "feel" if pronoun == "I" else rng.choice(["feel", "are"])
        return f"{pronoun} {feel} {rng.choice(POSITIVE + NEGATIVE)}."
    if kind == 3:
        return f"My {noun} is {adj}."
    if kind == 4:
        return f"The {noun} is in the {rng.choice(PLACES)}."
    if kind == 5:
        return f"This {noun} is very {adj}."
    return f"It was {_article(adj)} {adj} day, and the {noun} was {_adjective(rng)}."


def make_text_document(rng: random.Random) -> str:
    """One to four sentences, the way a short paragraph reads."""
    return " ".join(make_sentence(rng) for _ in range(rng.randint(1, 4)))


# --- arithmetic -------------------------------------------------------------------------------------------

ADDITION_RANGE = range(10, 100)  # both operands have two digits
HELD_OUT_FRACTION = 0.1          # pairs never seen in pretraining or RL training: the honest test set
SPLIT_SEED = 1234                # fixes which pairs are held out, for every part of the course


def addition_pairs(split: str) -> list[tuple[int, int]]:
    """All (a, b) pairs of the split: "train" (90%) or "held_out" (10%), the same on every machine."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', not {split!r}")
    pairs = [(a, b) for a in ADDITION_RANGE for b in ADDITION_RANGE]
    random.Random(SPLIT_SEED).shuffle(pairs)
    n_held = int(len(pairs) * HELD_OUT_FRACTION)
    return sorted(pairs[:n_held]) if split == "held_out" else sorted(pairs[n_held:])


def addition_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def make_addition_document(rng: random.Random, pairs: list[tuple[int, int]]) -> str:
    a, b = rng.choice(pairs)
    return f"{addition_prompt(a, b)}{a + b}"


# --- tokenizer --------------------------------------------------------------------------------------------

# A word keeps its leading space; digits and punctuation are single tokens; a lone space is a token too.
PRETOKENIZE_PATTERN = r" ?[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]| "


def vocabulary() -> list[str]:
    """Every token the toy world can produce, in a fixed order, with EOS last."""
    words = POSITIVE + NEGATIVE + NEUTRAL_ADJ + NOUNS + VERBS + PLACES + PRONOUNS + FEELINGS
    words += ["This", "The", "My", "It", "is", "in", "the", "a", "an", "very", "was", "day", "and"]
    pieces: set[str] = set()
    for w in words:
        for form in (w, w.capitalize()):
            pieces.update({form, " " + form})
    punctuation = list(".,!?+-=:;'\"()")
    return [UNK] + [str(d) for d in range(10)] + punctuation + [" "] + sorted(pieces) + [EOS]


def build_tokenizer(save_dir: str | Path):
    """Build the word-level tokenizer, save it to `save_dir`, and return it as loaded back from there."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens carry their own spaces, so decoding is concatenation
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   unk_token=UNK, model_max_length=10_000)
    fast.save_pretrained(str(save_dir))
    return AutoTokenizer.from_pretrained(str(save_dir))  # the bridge needs one loaded from a directory


# --- scoring additions --------------------------------------------------------------------------------------

def parse_answer(completion: str) -> int | None:
    """The integer a completion states, or None if it is not just digits (e.g. '68' -> 68, '6x' -> None)."""
    text = completion.strip()
    return int(text) if text.isdigit() and len(text) <= 6 else None


@torch.no_grad()
def addition_accuracy(model, pairs: list[tuple[int, int]], batch_size: int = 512) -> float:
    """Greedy exact-match accuracy of `model` on the additions `pairs` (answer then EOS, nothing else)."""
    from utils.sampling import sample

    if not pairs:
        raise ValueError("addition_accuracy needs at least one (a, b) pair: the accuracy of no answers is undefined")
    correct = 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        out = sample(model, [addition_prompt(a, b) for a, b in chunk], max_new_tokens=5, temperature=0.0)
        correct += sum(parse_answer(t) == a + b and not trunc
                       for t, (a, b), trunc in zip(out.texts, chunk, out.truncated.tolist()))
    return correct / len(pairs)
