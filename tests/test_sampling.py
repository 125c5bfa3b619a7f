"""Sampler filters and seeds, sampling-parameter validation, duration parsing, detokenizer."""
from __future__ import annotations

import json

import pytest
import torch

from duetserve.config import EngineConfig, parse_duration
from duetserve.engine.detokenizer import IncrementalDetokenizer
from duetserve.engine.sampler import Sampler, _top_p
from duetserve.sampling import ParamError, SamplingParams


def _kept(logits: torch.Tensor, params: list[SamplingParams]) -> list[set[int]]:
    """Tokens each row can produce: sample many times with fresh generators."""
    sampler = Sampler(torch.device("cpu"))
    batch = sampler.prepare(list(range(len(params))), params, logits.shape[-1])
    seen = [set() for _ in params]
    for _ in range(400):
        for row, tok in enumerate(sampler.sample(logits, batch).tolist()):
            seen[row].add(tok)
    return seen


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 0.0, 5.0, 1.0]])
    assert _kept(logits, [SamplingParams(top_k=2), SamplingParams(top_k=1)]) == [{1, 2}, {2}]


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125: top_p=0.6 needs the first two; 0.5 needs only the first.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.125, 0.5, 0.125, 0.25]]))
    assert _kept(logits, [SamplingParams(top_p=0.6), SamplingParams(top_p=0.5)]) == [{0, 1}, {1}]
    masked = _top_p(logits, torch.tensor([[0.6], [0.5]]))
    assert torch.isinf(masked).tolist() == [[False, False, True, True], [True, False, True, True]]


def test_vanishing_top_p_and_temperature_fall_back_to_the_most_likely_token():
    # top_p 1e-300 is 0 in float32 and temperature 1e-45 would overflow the logits: both must
    # still give the argmax (they were returning arbitrary tokens), like top_p 0.001 does.
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]))
    params = [SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=1e-45)]
    assert _kept(logits, params) == [{1}, {0}]
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-4).greedy
    assert torch.isinf(_top_p(logits, torch.zeros(2, 1))).tolist() == [[True, False, True], [False, True, True]]


def test_greedy_and_seeded_sampling_repeat():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    assert sampler(logits, [0, 1, 2], [greedy] * 3) == logits.argmax(-1).tolist()
    seeded = SamplingParams(temperature=1.0, seed=123)
    a = [Sampler(torch.device("cpu"))(logits[:1], [5], [seeded])[0] for _ in range(3)]
    assert len(set(a)) == 1
    # The same seeded request gives the same token whatever batch it is in.
    b = Sampler(torch.device("cpu"))(logits, [9, 5, 8], [greedy, seeded, greedy])[1]
    assert b == Sampler(torch.device("cpu"))(logits[1:2], [5], [seeded])[0]


def test_race_on_logits_picks_the_probability_race_token():
    """``argmax(z - log E)`` on the scaled, filtered logits picks, draw for draw, the token of the
    textbook race ``argmax(softmax(z) / E)`` (same ``E`` from the same seed)."""
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20)] * 32
    got = Sampler(torch.device("cpu"), seed=11)(logits, list(range(64)), params)
    z = logits / torch.tensor([0.7, 1.3] * 32)[:, None]
    kth = z.sort(dim=-1, descending=True).values[:, 19:20]
    z[1::2] = z[1::2].masked_fill(z[1::2] < kth[1::2], float("-inf"))
    race = torch.empty_like(z).exponential_(generator=torch.Generator().manual_seed(11))
    expected = (z.softmax(dim=-1) / race).argmax(dim=-1)
    assert got == expected.tolist()
    assert len(set(got)) > 20  # random draws, not the argmax everywhere
    assert got != logits.argmax(-1).tolist()


def test_sampling_follows_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    tokens = torch.tensor(sampler(logits, list(range(4000)), [SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.1), ("temperature", 2.5),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("seed", 2**63),
                                         ("seed", -1), ("stop", [""]), ("stop", ["ok", "\ud800"])])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ParamError) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.param == field


def test_parse_duration():
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_duration("0.1s") == pytest.approx(0.1)
    assert parse_duration("250us") == pytest.approx(250e-6)
    assert parse_duration("2") == 2.0
    assert parse_duration("2min") == 120.0
    assert parse_duration("100", bare_unit="ms") == pytest.approx(0.1)
    for bad in ("fast", "-5ms", "10 minutes"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_engine_config_names_the_flag():
    with pytest.raises(ValueError, match="--policy"):
        EngineConfig(policy="fastest")
    for size in (0, 12, 512, 10**9):  # 10**9 tokens a block had no upper bound
        with pytest.raises(ValueError, match=r"^--block-size must be one of 1, 8, 16, 32, 64, 128, 256$"):
            EngineConfig(block_size=size)
    with pytest.raises(ValueError, match="--cpu-kv-cache-gb"):
        EngineConfig(cpu_kv_cache_bytes=0)
    with pytest.raises(ValueError, match="--num-decode-steps"):
        EngineConfig(num_decode_steps=0)


class CharTokenizer:
    """Token i is chr(i); ids 0xE9 and 0x301 form an 'é' only together (like a split UTF-8 byte pair)."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(i) for i in ids)
        return text.replace(chr(0xE000), "\ufffd")


def test_detokenizer_streams_deltas_and_stops():
    det = IncrementalDetokenizer(CharTokenizer(), [ord("x")], stop=["END"])
    deltas = [det.add([ord(c)]) for c in "abcEN"]
    # "END" is 3 characters: the last 2 are held back until they cannot start a stop string.
    assert "".join(d for d, _ in deltas) == "abc"
    assert det.add([ord("D")]) == ("", "END") and det.text == "abc"


def test_detokenizer_keeps_the_stop_string_when_asked():
    det = IncrementalDetokenizer(CharTokenizer(), [], stop=["N!", "END"], include_stop=True)
    deltas = [det.add([ord(c)]) for c in "abcEND"]
    # "END" ends the text right after it: held-back characters up to its end are emitted
    assert "".join(d for d, _ in deltas) == "abcEND" and det.text == "abcEND"
    assert [hit for _, hit in deltas] == [None] * 5 + ["END"]
    # a stop string split over two tokens, the text after it in the same token cut off
    det = IncrementalDetokenizer(CharTokenizer(), [], stop=["N!"], include_stop=True)
    assert det.add([ord("N")]) == ("", None) and det.add([ord("!"), ord("x")]) == ("N!", "N!")


@pytest.mark.parametrize("stop", [["n", "a"], ["a", "n"]])
@pytest.mark.parametrize("include_stop, text", [(False, "-"), (True, "-a")])
def test_detokenizer_stops_at_the_stop_string_that_ends_first_whatever_the_list_order(stop, include_stop, text):
    """One token completing two stop strings ("-an"): the text ends at the earlier one ("a"),
    whichever the list names first; the list order once cut "-an" at "n", leaving "a" in the text."""
    det = IncrementalDetokenizer(CharTokenizer(), [], stop=stop, include_stop=include_stop)
    assert det.add([ord(c) for c in "-an"]) == (text, "a") and det.text == text
    # a longer stop string that starts earlier but ends later loses to one inside it
    det = IncrementalDetokenizer(CharTokenizer(), [], stop=["abc", "b"], include_stop=include_stop)
    assert det.add([ord(c) for c in "xabc"]) == ("xab" if include_stop else "xa", "b")


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def fast_tokenizer(request):
    """A fast tokenizer (transformers over a ``tokenizers`` BPE trained here, ``<eos>`` special):
    byte-level (GPT-2, Qwen: emoji, CJK and accents split into byte tokens), or metaspace with
    byte fallback (Llama, SmolLM: a word's leading space is part of its token, and the decoder
    drops it at the start of a text, so the first output token needs the prompt as context)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the capital of France is Paris. the cat sat on the mat."] * 20
    tk = Tokenizer(models.BPE())
    if request.param == "byte-level":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace()
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
        tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["<eos>"]))
        spec = json.loads(tk.to_str())  # add the 256 byte pieces and turn byte fallback on
        vocab = spec["model"]["vocab"]
        vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
        spec["model"]["byte_fallback"] = True
        tk = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


class _WindowOnly:
    """A tokenizer seen without its ``tokenizers`` backend: the detokenizer's window path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("text", ["the cat sat on the mat.", " Paris, naïve — 你好 🙂🙂 end", "a\n\n  b\t🙂<eos> c"])
def test_detokenizer_stream_and_window_give_the_decoded_text_token_by_token(fast_tokenizer, text):
    """A fast tokenizer streams through ``DecodeStream``; the window path stays for others. Fed one
    token at a time after a prompt, both emit exactly the text the whole decode adds to the
    prompt's (special tokens skipped, the first token's leading space kept), and hold a character
    split over byte tokens back whole."""
    tok = fast_tokenizer
    prompt, out = tok("France is")["input_ids"], tok(text)["input_ids"]
    want = tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt)):]
    if "🙂" in text:  # the emoji's bytes span several tokens
        assert any(tok.decode(out[:i]).endswith("\ufffd") for i in range(1, len(out)))
    for tokenizer in (tok, _WindowOnly(tok)):
        det = IncrementalDetokenizer(tokenizer, prompt, stop=[])
        assert (det.stream is not None) == (tokenizer is tok)
        deltas = [det.add([t])[0] for t in out]
        assert "".join(deltas) + det.finish() == want
        assert all("\ufffd" not in d for d in deltas)  # no half character ever goes out


def test_detokenizer_holds_incomplete_characters():
    det = IncrementalDetokenizer(CharTokenizer(), [], stop=[])
    assert det.add([0xE000]) == ("", None)      # decodes to U+FFFD: wait for more
    delta, _ = det.add([ord("z")])
    assert delta == "\ufffdz"
    assert det.finish() == ""
    assert det.text == "\ufffdz"
