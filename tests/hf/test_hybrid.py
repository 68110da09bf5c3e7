"""Hybrid models: evicting full-attention layers beside sliding-window and linear-attention layers.

Tiny random configs of gpt-oss (sliding window + full, learned sinks, eager only), Gemma 2 (sliding + global, logit
soft-capping, eager only), Gemma 3 (sliding + global, ``query_pre_attn_scalar`` scaling, RoPE per layer type), Gemma 4
(global layers with their own head dim and KV heads, keys shared with values, scaling 1), OLMo 3 (three sliding
layers, then a full one), Qwen3 with ``use_sliding_window`` (full layers first, sliding ones after
``max_window_layers``), Qwen3.5 and Qwen3-Next (gated-delta-net linear attention + full attention), built locally.
Checked:

* budget >= length: logits (so greedy tokens, 100 steps) equal the model's default cache exactly, and the kept layers'
  state (sliding keys/values, convolution and recurrent states) equals the default cache's;
* with eviction: a replay through transformers' default cache, where each full-attention layer's attention is masked
  (per row and KV head) to the tokens vase held at that step, gives the same logits; the evicting layers hold exactly
  those tokens' keys and values, and the kept layers hold what the reference's default cache holds;
* ragged batches equal their rows generated alone; memory stats count both kinds of layers; unsupported layer kinds
  get a clear error.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import vase
from tests.conftest import VOCAB
from vase.hf import hybrid
from vase.hf.cache import check_model_supported
from vase.hf.compat import cache_kwargs
from vase.hf.layer import EvictingLayer

FAMILIES = ("gpt_oss", "gemma2", "gemma3", "gemma4", "olmo3", "qwen3_sliding", "qwen3_5", "qwen3_next")
EAGER_ONLY = ("gpt_oss", "gemma2")  # transformers has no sdpa for these (learned sinks; soft-capping)
WINDOW = 8  # sliding window of the tiny models (tokens)
# weight scale per family: random weights of this size give varied greedy tokens (not one token repeated)
INIT = {"gemma2": 0.02, "gemma3": 0.02, "gemma4": 0.02}


def hybrid_config(family: str, attn: str | None = None, layers: int = 4):
    """A tiny config of ``family`` (4 layers, hidden 64, 4 query heads, 2 KV heads of dim 16, vocab 128)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=INIT.get(family, 0.1),
        attn_implementation=attn or ("eager" if family in EAGER_ONLY else "sdpa"),
    )
    linear = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    if family == "gpt_oss":  # sliding, full, sliding, full; learned sinks; no sdpa in transformers
        return GptOssConfig(**common, head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)
    if family == "gemma2":  # sliding, full, sliding, full; soft-capped attention logits (a small cap: it matters)
        return Gemma2Config(
            **common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=2.0
        )
    if family == "gemma3":  # sliding, full, sliding, full; scaling by query_pre_attn_scalar ** -0.5
        return Gemma3TextConfig(
            **common, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=32
        )
    if family == "gemma4":  # sliding, full, sliding, full; global layers: 1 KV head of dim 32, values = keys
        return Gemma4TextConfig(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
        )
    if family == "olmo3":  # sliding x 3, full
        return Olmo3Config(**common, sliding_window=WINDOW)
    if family == "qwen3_sliding":  # full, full, sliding, sliding
        return Qwen3Config(**common, head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    if family == "qwen3_5":  # linear x 3, full
        return Qwen3_5TextConfig(**common, head_dim=16, **linear)
    if family == "qwen3_next":  # linear x 3, full; mixture of experts
        return Qwen3NextConfig(
            **common,
            head_dim=16,
            **linear,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    raise ValueError(family)


MODEL_CLASSES = {
    "gpt_oss": GptOssForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    "olmo3": Olmo3ForCausalLM,
    "qwen3_sliding": Qwen3ForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}


def hybrid_model(family: str, attn: str | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = MODEL_CLASSES[family](hybrid_config(family, attn)).eval()
    if family == "gemma2":  # attention logits large enough for the soft-cap to change the greedy tokens (most of them)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8.0)
                layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def ids_of(n: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, n, cache=None, **kw):
    extra = {} if cache is None else cache_kwargs(cache)
    return model.generate(
        input_ids=ids,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **extra,
        **kw,
    )


def kept_state(layer) -> list[torch.Tensor]:
    """The tensors a kept transformers layer holds: keys/values of a sliding window, conv/recurrent states."""
    if isinstance(layer, LinearAttentionLayer):
        return [layer.conv_states[0], layer.recurrent_states[0]]
    return [layer.keys, layer.values]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


# ------------------------------------------------------------------------------------------ nothing dropped
def _attn_cases():
    for fam in FAMILIES:
        yield fam, None
        if fam not in EAGER_ONLY:
            yield fam, "eager"


@pytest.mark.parametrize("fam,attn", list(_attn_cases()))
def test_no_eviction_equals_default_cache(fam, attn):
    """Budget >= prompt + 100 new tokens: the logits of every step equal the default cache's exactly, and so does the
    state of every kept layer; only the full-attention layers are vase's."""
    model = hybrid_model(fam, attn)
    ids = ids_of(20)
    default = DynamicCache(config=model.config)
    ref = greedy(model, ids, 100, default)
    cache = vase.EvictingCache(model, budget=128, buffer=8)
    out = greedy(model, ids, 100, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))
    assert len(set(ref.sequences[0, 20:].tolist())) > 10  # varied tokens, not one repeated
    types = model.config.layer_types
    for i, (mine, theirs) in enumerate(zip(cache.layers, default.layers)):
        if types[i] == "full_attention":
            assert isinstance(mine, EvictingLayer)
            f = cache.fill[0]
            assert torch.equal(mine.keys[:, :, :f], theirs.keys) and torch.equal(mine.values[:, :, :f], theirs.values)
        else:
            assert type(mine) is type(theirs) and type(mine) in (DynamicSlidingWindowLayer, LinearAttentionLayer)
            for a, b in zip(kept_state(mine), kept_state(theirs)):
                assert torch.equal(a, b)
    st = cache.stats()
    assert st.evictions == 0 and st.tokens_seen == 119 and st.slots_held == 119
    assert st.layers == types.count("full_attention") and st.other_layers == len(types) - st.layers


# ---------------------------------------------------------------------------------- masked-dense reference
class MaskedDense:
    """transformers' default cache, eager attention, each full-attention layer masked per (row, KV head) to a given
    set of logical positions: what attention over vase's held tokens must equal."""

    NAME = "vase_test_masked_dense"

    def __init__(self, model):
        self.allowed: dict[int, torch.Tensor] = {}  # layer -> [B, kv_heads, kv_len] bool, for the next forward
        self.model = model
        modeling = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
        base = modeling.eager_attention_forward

        def attention(module, query, key, value, attention_mask, **kwargs):
            allowed = self.allowed.get(module.layer_idx)
            if allowed is not None:
                assert allowed.shape[-1] == key.shape[2]
                groups = query.shape[1] // key.shape[1]
                m = allowed.repeat_interleave(groups, dim=1)[:, :, None, :]
                attention_mask = torch.zeros(m.shape, dtype=query.dtype).masked_fill(~m, torch.finfo(query.dtype).min)
            return base(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(self.NAME, attention)
        AttentionMaskInterface.register(self.NAME, eager_mask)
        model.set_attn_implementation(self.NAME)


def run_with_eviction(model, ids, steps, **cache_kw):
    """Greedy decoding with an EvictingCache; returns (cache, logits per step, tokens, held positions per step)."""
    cache = vase.EvictingCache(model, **cache_kw)
    evicting = [i for i, layer in enumerate(cache.layers) if isinstance(layer, EvictingLayer)]

    def held():
        f = cache.fill[0]
        return {i: cache.layers[i].positions[0, :, :f].clone() for i in evicting}

    logits, tokens, helds = [], [], []
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1]
        for _ in range(steps):
            helds.append(held())
            tok = out.argmax(-1, keepdim=True)
            tokens.append(tok)
            out = model(input_ids=tok, **cache_kwargs(cache)).logits[:, -1]
            logits.append(out)
    return cache, logits, torch.cat(tokens, 1), helds


@pytest.mark.parametrize("fam", FAMILIES)
def test_eviction_matches_masked_dense_reference(fam):
    """Budget 16 + buffer 8 over 20 + 60 tokens (several evictions): every decode step's logits equal a dense replay
    whose full-attention layers attend only to the tokens vase held (per KV head) plus the new one; after the run the
    evicting layers hold exactly those tokens' keys and values, and the kept layers hold the reference's state."""
    model = hybrid_model(fam)
    ids = ids_of(20)
    steps = 60
    cache, logits, tokens, helds = run_with_eviction(model, ids, steps, policy="vase", budget=16, buffer=8)
    assert cache.stats().evictions >= 5
    # scoring uses each layer's own scaling: Gemma 2/3: query_pre_attn_scalar ** -0.5, Gemma 4: 1, else head_dim ** -0.5
    scaling = {"gemma2": 32**-0.5, "gemma3": 32**-0.5, "gemma4": 1.0}.get(fam, 16**-0.5)
    assert all(layer.scaling == scaling for layer in cache.layers if isinstance(layer, EvictingLayer))

    ref_model = hybrid_model(fam)  # same seed, same weights
    ref = MaskedDense(ref_model)
    default = DynamicCache(config=ref_model.config)
    full = [i for i, t in enumerate(ref_model.config.layer_types) if t == "full_attention"]
    with torch.no_grad():
        ref_model(input_ids=ids, **cache_kwargs(default))
        for t in range(steps):
            seen = ids.shape[1] + t
            ref.allowed = {}
            for i in full:
                pos = helds[t][i]  # [kv_heads, fill] positions held before this step
                allowed = torch.zeros((1, pos.shape[0], seen + 1), dtype=torch.bool)
                allowed[0].scatter_(1, pos, True)
                allowed[..., seen] = True  # the new token
                ref.allowed[i] = allowed
            out = ref_model(input_ids=tokens[:, t : t + 1], **cache_kwargs(default)).logits[:, -1]
            torch.testing.assert_close(out, logits[t], rtol=1e-4, atol=1e-5)

    seen = ids.shape[1] + steps
    assert any(helds[-1][i].shape[1] < seen for i in full)  # tokens were dropped
    f = cache.fill[0]
    for i, (mine, theirs) in enumerate(zip(cache.layers, default.layers)):
        if i in full:
            pos = mine.positions[0, :, :f]  # [kv_heads, f]
            dense_k = theirs.keys[0].gather(1, pos.unsqueeze(-1).expand(-1, -1, theirs.keys.shape[-1]))
            dense_v = theirs.values[0].gather(1, pos.unsqueeze(-1).expand(-1, -1, theirs.values.shape[-1]))
            torch.testing.assert_close(mine.keys[0, :, :f], dense_k, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mine.values[0, :, :f], dense_v, rtol=1e-4, atol=1e-5)
        else:
            for a, b in zip(kept_state(mine), kept_state(theirs)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ ragged batches
@pytest.mark.parametrize("fam", ["gpt_oss", "olmo3", "qwen3_5"])
def test_ragged_rows_equal_rows_alone(fam):
    """Rows of 30, 12 and 5 prompt tokens (left-padded; longer and shorter than the sliding window and the budget),
    40 greedy steps with eviction: each row's tokens equal that row generated alone with its own seed."""
    model = hybrid_model(fam)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (30, 12, 5)]
    seeds = [5, 9, 13]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    batch = vase.EvictingCache(model, budget=16, buffer=8, seed=seeds)
    out = greedy(model, ids, 40, batch, attention_mask=mask).sequences[:, width:]
    assert batch.stats().evictions > 0
    for i, (r, s) in enumerate(zip(rows, seeds)):
        alone = greedy(model, r.view(1, -1), 40, vase.EvictingCache(model, budget=16, buffer=8, seed=[s]))
        assert torch.equal(out[i], alone.sequences[0, len(r) :]), f"row {i}"


@pytest.mark.parametrize("fam", ["gpt_oss", "qwen3_5"])
def test_multi_token_continuation_equals_token_by_token(fam):
    """Teacher-forced chunks of several tokens (vase.harness.fidelity.replay, chunks ending where the cache evicts) give
    the log-probabilities of token-by-token decoding: the kept layers take several new tokens beside the evicting
    ones."""
    from vase.harness.fidelity import replay

    model = hybrid_model(fam)
    prompt, cont = ids_of(20)[0], ids_of(50, seed=4)[0]
    chunked = replay(model, prompt, cont, "snapkv", 16, 8)
    cache = vase.EvictingCache(model, policy="snapkv", budget=16, buffer=8)
    with torch.no_grad():
        steps = [model(input_ids=prompt.view(1, -1), **cache_kwargs(cache)).logits[0, -1:]]
        steps += [model(input_ids=t.view(1, 1), **cache_kwargs(cache)).logits[0] for t in cont[:-1]]
    torch.testing.assert_close(chunked, torch.log_softmax(torch.cat(steps).float(), -1), rtol=1e-4, atol=1e-4)
    assert cache.stats().evictions >= 5


# --------------------------------------------------------------------------------------------------- stats
@pytest.mark.parametrize("fam", ["gpt_oss", "qwen3_5"])
def test_stats_count_both_kinds_of_layers(fam):
    """bytes_other = what the kept layers hold; bytes_full = what the default cache holds after the same tokens;
    bytes_held = the evicting buffers + bytes_other."""
    model = hybrid_model(fam)
    ids = ids_of(20)
    default = DynamicCache(config=model.config)
    greedy(model, ids, 50, default)
    cache = vase.EvictingCache(model, budget=16, buffer=8)
    greedy(model, ids, 50, cache)
    st = cache.stats()
    kept = [i for i, t in enumerate(model.config.layer_types) if t != "full_attention"]
    other = sum(hybrid.state_bytes(default.layers[i]) for i in kept)
    assert other > 0 and st.bytes_other == other
    assert st.bytes_full == sum(hybrid.state_bytes(layer) for layer in default.layers)
    n_full = len(model.config.layer_types) - len(kept)
    assert st.bytes_held == n_full * 2 * 2 * (16 + 8) * 16 * 4 + other  # layers x (K,V) x heads x slots x dim x fp32
    assert st.compression > 1


def test_reset_starts_kept_layers_afresh():
    """After reset() the cache takes another batch size; the kept layers start empty, as a new default cache."""
    model = hybrid_model("qwen3_5")
    cache = vase.EvictingCache(model, budget=16, buffer=8)
    greedy(model, ids_of(12), 10, cache)
    cache.reset()
    ids = ids_of(12, batch=2)
    out = greedy(model, ids, 10, cache)
    assert torch.equal(out.sequences, greedy(model, ids, 10, DynamicCache(config=model.config)).sequences)


# ---------------------------------------------------------------------------------------- refused models
def _qwen3(**kw):
    return Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, **kw
    )


def test_supported_and_refused_layer_kinds():
    check_model_supported(hybrid_config("gpt_oss"))
    check_model_supported(_qwen3(use_sliding_window=True, sliding_window=16, max_window_layers=2))
    plan = hybrid.plan_layers(hybrid_config("olmo3"))
    assert [p.evicts for p in plan] == [False, False, False, True]
    assert plan[0].kwargs == {"sliding_window": WINDOW} and (plan[3].kv_heads, plan[3].head_dim) == (2, 16)
    plan = hybrid.plan_layers(hybrid_config("gemma4"))  # global layers' own KV heads and head dim
    assert [(p.evicts, p.kv_heads, p.head_dim) for p in plan[:2]] == [(False, None, None), (True, 1, 32)]

    with pytest.raises(ValueError, match="no full-attention layer .*sliding_attention.*default cache"):
        check_model_supported(_qwen3(use_sliding_window=True, sliding_window=16, max_window_layers=0))
    types = ["full_attention", "chunked_attention", "hybrid", "full_attention"]
    with pytest.raises(ValueError, match=r"chunked_attention \(layers 1\): chunked.*hybrid \(layers 2\): .*growing"):
        check_model_supported(_qwen3(layer_types=types))


def test_kv_sharing_refused():
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    with pytest.raises(ValueError, match="shares keys and values between layers"):
        check_model_supported(cfg)


# ------------------------------------------------------------------------------------------------ --model
def byte_tokenizer():
    """A byte-level tokenizer built locally: 3 special tokens, then the 256 byte symbols (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("fam", ["gpt_oss", "qwen3_5"])
def test_cli_model_folder(fam, tmp_path):
    """``vase generate --model <folder>`` on a hybrid checkpoint: loads (gpt-oss: eager, as transformers has no sdpa
    for it), evicts, and prints the stats line; load_model gives the model back with the same weights."""
    from typer.testing import CliRunner

    from vase.cli import app
    from vase.hf.models import load_model

    tok = byte_tokenizer()
    cfg = hybrid_config(fam)
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    model = MODEL_CLASSES[fam](cfg).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="eager") if fam == "gpt_oss" else contextlib.nullcontext():
        lm = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert lm.model.config._attn_implementation == ("eager" if fam == "gpt_oss" else "sdpa")
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(greedy(lm.model, ids, 8).sequences, greedy(model, ids, 8).sequences)

    args = ["generate", "Hello hybrid world", "--model", str(tmp_path), "--device", "cpu", "-n", "40"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gpt-oss: eager instead of sdpa, checked above
        result = CliRunner().invoke(app, args + ["--budget", "16", "--buffer", "8", "--min-new-tokens", "40"])
    assert result.exit_code == 0, result.output
    assert "evictions" in result.output and "policy vase" in result.output

    # vase inspect measures the full-attention layers only (the ones vase evicts), under their model indices
    from vase.harness.magnitudes import collect_kv, magnitude_table
    from vase.hf.hybrid import plan_layers

    full = [p.index for p in plan_layers(cfg) if p.evicts]
    assert 0 < len(full) < cfg.num_hidden_layers
    token_ids, keys, values, layers = collect_kv(lm, "Hello hybrid world")
    assert layers == full and len(keys) == len(values) == len(full)
    assert keys[0].shape[1] == len(token_ids)
    assert sorted({r["layer"] for r in magnitude_table(keys, values, 2, layers)}) == full
