"""Convert a model into a folder vLLM can load: safetensors weights, a plain config, the tokenizer.

vLLM 0.32 cannot load GGUF files on CPU (its GGUF plugin's dequantization kernels need CUDA), and a folder saved from
a GGUF-loaded transformers model needs two fixes before vLLM reads it right: ``config.json`` must name the model class
in ``architectures`` (it is null there), and a tied embedding must be stored as ``model.embed_tokens.weight`` (saved
only as ``lm_head.weight``, vLLM loads no embedding and emits token 0 at every step). :func:`convert_for_vllm` loads
any model :func:`vase.hf.models.load_model` can (the embedded model, a GGUF file, a transformers folder, a hub id)
and writes such a folder. Run it in an environment with transformers >= 5.24 (``vase convert``); the folder is then
read by vLLM in its own environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .models import ModelLoadError, load_model

MARKER = "vase-convert.json"


def convert_for_vllm(source: str | None, out: str | Path, dtype: str = "bfloat16") -> Path:
    """Write ``source`` as a folder vLLM loads: ``config.json`` (``architectures`` set, no quantization config),
    ``model.safetensors`` (a tied embedding under ``model.embed_tokens.weight``, no ``lm_head.weight``), the
    tokenizer files and ``vase-convert.json`` (what it was made from).

    Args:
        source: None or ``smollm2`` (the embedded model), ``gemma3-270m``, a ``.gguf`` file, a transformers folder
            or a hub id (see :func:`vase.hf.models.load_model`).
        out: the folder to write (created; files of an earlier conversion are replaced).
        dtype: the weights' dtype: bfloat16 (default: what vLLM serves a float32 folder in, on CPU and GPU, so the
            served weights are the stored ones, loaded without a cast per tensor), float32 or float16. A float32
            engine (``dtype="float32"``, as the tests run) widens bfloat16 weights exactly.

    Returns:
        The folder.

    Raises:
        ModelLoadError: the model cannot be loaded, or ``out`` is a file.
    """
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ModelLoadError(f"{out} is a file; give a folder to write the converted model into")
    lm = load_model(source, dtype=dtype, device="cpu")
    model, tok = lm.model, lm.tokenizer
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = str(lm.dtype).removeprefix("torch.")
    state = model.state_dict()
    tied = bool(getattr(model.config.get_text_config(decoder=True), "tie_word_embeddings", False))
    embed = model.get_input_embeddings().weight
    shared = (k for k, v in state.items() if k != "lm_head.weight" and v.data_ptr() == embed.data_ptr())
    embed_name = next(shared, "model.embed_tokens.weight")
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue  # vLLM ties the output layer to the embedding itself
        weights[name] = tensor.detach().to("cpu").contiguous().clone()
    weights.setdefault(embed_name, embed.detach().contiguous().clone())
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)  # stale until every file is written
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({"source": lm.name, "dtype": config["dtype"], "tied": tied}))
    return out
