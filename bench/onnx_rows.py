"""The issue-67 table's ONNX rows, for ``bench/cpu_runtimes.py``: ONNX Runtime on a graph exported
(``torch.onnx.export``'s dynamo exporter) from the PyTorch model, its batches sorted as
sentence-transformers sorts them, and fastembed on the same graph (its own batches, unsorted).
Neither is a chunkq dependency; each row is measured where its packages are importable:

    pip install onnxruntime onnx onnxscript fastembed   # or --target a folder put on PYTHONPATH

(sentence-transformers' own ``backend="onnx"`` needs optimum-onnx, whose releases on this index
require transformers < 4.58: not installable beside transformers 5, hence the graph exported here.)
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

ONNX_FILE = "model.onnx"
FASTEMBED_NAME = "chunkq-bench/all-minilm-l6-v2"
# What the folder fastembed reads needs beside the graph: the tokenizer's files and the config.
_TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)

Encode = Callable[[list[str]], Any]


def available() -> dict[str, bool]:
    has = {
        name: importlib.util.find_spec(name) is not None
        for name in ("onnxruntime", "onnx", "onnxscript", "fastembed")
    }
    graph = has["onnx"] and has["onnxscript"]
    return {"onnxruntime": graph and has["onnxruntime"], "fastembed": graph and has["fastembed"]}


def export(model: Any, folder: Path, source: str) -> Path:
    """The sentence-transformer's transformer as an ONNX graph (the dynamo exporter, dynamic batch
    and length) in ``folder``, with the tokenizer's files copied from ``source``."""
    import torch
    from transformers import AutoModel

    folder.mkdir(parents=True, exist_ok=True)
    transformer = AutoModel.from_pretrained(source).eval()
    sample = model.tokenize(["an example", "another, longer example text"])
    if "token_type_ids" not in sample:
        raise SystemExit("bench/onnx_rows.py exports BERT-shaped models (input ids, mask, token types)")
    names = ["input_ids", "attention_mask", "token_type_ids"]

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = transformer

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            found = self.inner(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            return found.last_hidden_state

    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens")
    with torch.no_grad():
        torch.onnx.export(
            Hidden(),
            tuple(sample[n] for n in names),
            str(folder / ONNX_FILE),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_shapes={n: {0: batch, 1: tokens} for n in names},
            opset_version=18,
            dynamo=True,
            external_data=False,
        )
    for name in _TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, folder / name)
    # fastembed truncates at the tokenizer's model_max_length (512 here); the sentence-transformer at
    # its own max_seq_length (256): the same texts, cut where the sentence-transformer cuts them.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = model.max_seq_length
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def onnxruntime_encoder(model: Any, folder: Path, threads: int, batch: int) -> Encode:
    """ONNX Runtime on the exported graph; tokenised, sorted, mean-pooled and normalised as the
    sentence-transformer does (all-MiniLM-L6-v2: mean pooling, then unit length)."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(folder / ONNX_FILE), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}

    def encode(texts: list[str]) -> Any:
        order = np.argsort([-len(t) for t in texts], kind="stable")
        out = np.empty((len(texts), model.get_embedding_dimension()), dtype=np.float32)
        for start in range(0, len(texts), batch):
            taken = order[start : start + batch]
            features = model.tokenize([texts[i] for i in taken])
            feed = {k: v.numpy() for k, v in features.items() if k in wanted}
            hidden = session.run(None, feed)[0]
            mask = feed["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.clip(mask.sum(1), 1e-9, None)
            out[taken] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return out

    return encode


def fastembed_encoder(folder: Path, threads: int, batch: int) -> Encode:
    """fastembed's ``TextEmbedding`` on the same graph, as a custom model read from the folder."""
    import numpy as np
    from fastembed import TextEmbedding
    from fastembed.common.model_description import ModelSource, PoolingType

    known = {m["model"] for m in TextEmbedding.list_supported_models()}
    if FASTEMBED_NAME not in known:
        TextEmbedding.add_custom_model(
            model=FASTEMBED_NAME,
            pooling=PoolingType.MEAN,
            normalization=True,
            sources=ModelSource(hf=FASTEMBED_NAME),
            dim=json.loads((folder / "config.json").read_text())["hidden_size"],
            model_file=ONNX_FILE,
        )
    embedder = TextEmbedding(model_name=FASTEMBED_NAME, specific_model_path=str(folder), threads=threads)

    def encode(texts: list[str]) -> Any:
        return np.stack(list(embedder.embed(texts, batch_size=batch)))

    return encode
