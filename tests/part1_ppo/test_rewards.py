"""The reward functions: reward_char_count, reward_sentiment_lexicon and reward_classifier (a probability, padding
that changes no score); and the provided load_sentiment_classifier (offline, and a .bin-only model)."""

import pytest
import torch

from solutions import part1_ppo as ref
from tests.part1_ppo import mistakes_rewards as mistakes
from tests.support import aside, assert_close, assert_inputs_unchanged, calling, exercise, expect


# --- reward_char_count -------------------------------------------------------------------------------------

@exercise("reward_char_count")
def test_reward_char_count(impl):
    texts = ["A dog. A cat.", "", "no stop", "...", "a,b,c", "Mr. Brown.\nYes."]
    got = calling(impl.reward_char_count, texts, what="reward_char_count(texts)")
    assert_close(got, torch.tensor([2.0, 0.0, 0.0, 3.0, 0.0, 3.0]), "reward_char_count(texts)")
    assert_close(impl.reward_char_count(texts, char=","), torch.tensor([0.0, 0, 0, 0, 2, 0]),
                 "reward_char_count(texts, char=',')")
    assert_close(impl.reward_char_count(["banana", "a a", "b"], char="a"), torch.tensor([3.0, 2.0, 0.0]),
                 "reward_char_count(['banana', 'a a', 'b'], char='a')")


@exercise("reward_char_count")
def test_reward_char_count_leaves_the_texts_alone(impl):
    texts = ["b. a.", "a."]
    assert_inputs_unchanged(impl.reward_char_count, texts, what="reward_char_count(texts)")


# --- reward_sentiment_lexicon ------------------------------------------------------------------------------

@exercise("reward_sentiment_lexicon")
def test_reward_sentiment_lexicon(impl):
    texts = ["This is a happy dog.", "Happy! Happy, sad.", "The unhappy dog is dull.", "", "good bad",
             "A great, nice and KIND day", "Sad sad sad.", "badly goodness", "calm\ncold"]
    got = calling(impl.reward_sentiment_lexicon, texts, what="reward_sentiment_lexicon(texts)")
    assert_close(got, torch.tensor([1.0, 1.0, -1.0, 0.0, 0.0, 3.0, -3.0, 0.0, 0.0]),
                 "reward_sentiment_lexicon(texts)",
                 hint="a text's reward is (number of positive words) - (number of negative words), counting every "
                      "occurrence of a whole word, in lower case, punctuation stripped")
    assert_inputs_unchanged(impl.reward_sentiment_lexicon, texts, what="reward_sentiment_lexicon(texts)")


# --- reward_classifier -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_classifier():
    """A randomly initialised DistilBERT classifier built from a config, with the tiny model's tokenizer (the real
    sentiment classifier needs the Hub, which tests never wait on)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from utils.models import load_tiny_hf

    _, tokenizer = load_tiny_hf()
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                              max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, num_labels=3,
                              initializer_range=0.2)  # probabilities spread over (0, 1), not saturated; 3 labels
    return DistilBertForSequenceClassification(config).eval(), tokenizer


CLASSIFIER_TEXTS = ["This is a happy dog.", "The cat.", "We are sad and the day is dark and cold."]


@exercise("reward_classifier")
def test_reward_classifier_probabilities(impl, small_classifier):
    classifier, tokenizer = small_classifier
    got = calling(impl.reward_classifier, CLASSIFIER_TEXTS, classifier, tokenizer,
                     what="reward_classifier(texts, classifier, tokenizer)")
    assert_close(got, ref.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer),
                 "reward_classifier(texts, classifier, tokenizer)",
                 hint="the reward is softmax(logits)[:, positive_label] of the classifier, which gets the padded "
                      "batch with its attention mask")


@exercise("reward_classifier")
def test_reward_classifier_positive_label(impl, small_classifier):
    classifier, tokenizer = small_classifier
    for label in (0, 2):
        assert_close(impl.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer, positive_label=label),
                     ref.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer, positive_label=label),
                     f"reward_classifier(..., positive_label={label})")


@exercise("reward_classifier")
def test_reward_classifier_is_a_probability(impl, small_classifier):
    """Whatever the label, a reward is a probability, and the rewards of all the labels of a text sum to 1."""
    classifier, tokenizer = small_classifier
    per_label = [impl.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer, positive_label=k) for k in range(3)]
    if not all(isinstance(r, torch.Tensor) and r.shape == (3,) for r in per_label):
        return  # the value tests say what is wrong with the shape
    everything = torch.stack(per_label).detach().float()
    low, high = everything.min().item(), everything.max().item()
    with torch.no_grad():  # the classifier's logits, [label, text]: what the likely wrong answers are made of
        inputs = tokenizer(CLASSIFIER_TEXTS, padding=True, truncation=True, return_tensors="pt")
        logits = classifier(**inputs).logits.float().T
    ways = {"the classifier's raw logits": logits, "its log-probabilities (log_softmax)": logits.log_softmax(0),
            "1 where the label is the argmax, 0 elsewhere": (logits == logits.max(0).values).float()}
    same = {name: bool(torch.allclose(everything, value, atol=1e-4)) for name, value in ways.items()}
    named = next((name for name, equal in same.items() if equal), None)
    expect(low >= 0 and high <= 1, "the range of reward_classifier's rewards",
           f"rewards from {low:.4g} to {high:.4g}, but a probability lies in [0, 1]"
           + (f". They are {named}, where the reward is softmax(logits)[:, positive_label]" if named else aside(
               "Common causes: the raw logits or the log-probabilities (log_softmax) returned rather than "
               "softmax(logits).")), observed=(low, high))
    hard = bool(((everything == 0) | (everything == 1)).all())
    expect(not hard, "the values of reward_classifier's rewards", "every reward is exactly 0 or 1, where the "
           "probability softmax(logits)[:, positive_label] lies strictly between"
           + (f": they are {named}" if named else aside("Common cause: a hard decision (argmax == positive_label) "
                                                        "rather than the probability.")), observed=hard)
    assert_close(everything.sum(0), torch.ones(3), "the rewards of labels 0, 1 and 2 summed, for each text",
                 hint="they are the probabilities of all the labels, so they sum to 1: softmax over the labels "
                      "(dim=-1), indexed with positive_label")


@exercise("reward_classifier")
def test_reward_classifier_padding_does_not_change_a_score(impl, small_classifier):
    classifier, tokenizer = small_classifier
    alone = torch.cat([impl.reward_classifier([t], classifier, tokenizer) for t in CLASSIFIER_TEXTS])
    together = assert_inputs_unchanged(impl.reward_classifier, CLASSIFIER_TEXTS, classifier, tokenizer,
                                       what="reward_classifier(texts, classifier, tokenizer)")
    assert_close(together, alone, "the scores of a padded batch, compared with each text scored alone",
                 resembles={"the classifier gets the padded batch without its attention mask (pass everything the "
                            "tokenizer returns: classifier(**inputs))":
                            mistakes._classifier_no_attention_mask(CLASSIFIER_TEXTS, classifier, tokenizer)},
                 hint="padding must not change a text's score")


@exercise("reward_classifier")
def test_reward_classifier_cuts_a_text_longer_than_the_tokenizers_limit(impl, small_classifier):
    """A text of more tokens than the classifier has positions is cut to the tokenizer's limit (set here to those
    positions, as a classifier's tokenizer has it), not passed whole (which indexes past the position embeddings)."""
    import copy

    classifier, tokenizer = small_classifier
    limited = copy.copy(tokenizer)
    limited.model_max_length = classifier.config.max_position_embeddings
    texts = ["This is a happy dog. " * 40, "The cat."]  # about 240 tokens, and one short text
    got = calling(impl.reward_classifier, texts, classifier, limited,
                  what=f"reward_classifier(texts, classifier, tokenizer) with a text of "
                       f"{len(limited(texts[0]).input_ids)} tokens, the tokenizer's limit being "
                       f"{limited.model_max_length}")
    assert_close(got, ref.reward_classifier(texts, classifier, limited),
                 "reward_classifier(...) on a text longer than the tokenizer's limit, which it cuts to that limit")


# --- load_sentiment_classifier (provided, not an exercise: checked once here) ------------------------------

def test_sentiment_classifier_offline_fails_fast_with_an_alternative(monkeypatch):
    from utils.models import ModelUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("utils.models._is_cached", lambda name: False)
    with pytest.raises(ModelUnavailableError, match="sentiment"):
        ref.load_sentiment_classifier()


def test_sentiment_classifier_loads_a_bin_only_model(monkeypatch, tmp_path, small_classifier):
    """Many Hub classifiers have only pytorch_model.bin: loading must fall back to it (with weights_only=True)."""
    classifier, tokenizer = small_classifier
    classifier.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    torch.save(classifier.state_dict(), tmp_path / "pytorch_model.bin")
    monkeypatch.setattr("utils.models._is_cached", lambda name: True)
    loaded, loaded_tokenizer = ref.load_sentiment_classifier(str(tmp_path), device="cpu")
    texts = ["This is a happy dog.", "The cat."]
    torch.testing.assert_close(ref.reward_classifier(texts, loaded, loaded_tokenizer),
                               ref.reward_classifier(texts, classifier, tokenizer))
