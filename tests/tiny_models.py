"""Small models of each kind, built offline with random weights and the bundled model's tokenizer
(or a BPE tokenizer trained here), saved as sentence-transformers saves them: what the kind tests,
the model-identity tests and the kind checks run on."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from tests.helpers import WORDS

# A GPU host may carry all-MiniLM-L6-v2's folder without the bundled package (tests/gpu/conftest.py):
# the tokenizer the small models share is then that folder's.
GPU_TEST_MODEL_ENV = "CHUNKQ_GPU_TEST_MODEL"


def tokenizer_source() -> str:
    """Where the BERT tokenizer of the small models comes from: the bundled model's folder."""
    return os.environ.get(GPU_TEST_MODEL_ENV) or resolve_model(BUNDLED_MODEL)


def cross_encoder(folder: Path, labels: int, save_as_st: bool) -> Path:
    """A two-layer BERT sequence classifier with random weights and the bundled model's tokenizer:
    as transformers saves it (how sentence-transformers 2-4 cross-encoders look), or re-saved by
    CrossEncoder (sentence-transformers 5+: modules.json, model_type "CrossEncoder")."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(labels)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        num_labels=labels,
    )
    raw = folder / "raw"
    BertForSequenceClassification(config).save_pretrained(raw)
    AutoTokenizer.from_pretrained(tokenizer_source()).save_pretrained(raw)
    if not save_as_st:
        return raw
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(raw), device="cpu").save(str(folder / "st"))
    return folder / "st"


def splade_encoder(folder: Path) -> Path:
    """A SPLADE-shaped sparse encoder with random weights: a two-layer BERT masked-LM head over the
    bundled model's vocabulary, max-pooled by SpladePooling, saved by SparseEncoder."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    torch.manual_seed(7)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    BertForMaskedLM(config).save_pretrained(folder / "raw")
    AutoTokenizer.from_pretrained(tokenizer_source()).save_pretrained(folder / "raw")
    model = SparseEncoder(modules=[MLMTransformer(str(folder / "raw")), SpladePooling("max")], device="cpu")
    model.save(str(folder / "st"))
    return folder / "st"


def colbert_encoder(folder: Path) -> Path:
    """A ColBERT-shaped multi-vector encoder with random weights: a two-layer BERT, a 32-wide
    projection of each token, the late-interaction mask and normalisation, saved by MultiVectorEncoder."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(11)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    BertModel(config).save_pretrained(folder / "raw")
    AutoTokenizer.from_pretrained(tokenizer_source()).save_pretrained(folder / "raw")
    modules = [
        Transformer(str(folder / "raw")),
        Dense(
            64, 32, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings"
        ),
        MultiVectorMask(),
        Normalize(module_input_name="token_embeddings"),
    ]
    MultiVectorEncoder(modules=modules, device="cpu").save(str(folder / "st"))
    return folder / "st"


def tiny_clip(folder: Path) -> Path:
    """A CLIP-shaped model with random weights (two-layer text and vision towers, 16-wide shared
    space), its BPE tokenizer trained here on a few words, saved by SentenceTransformer."""
    import torch
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizerFast

    end = "<|endoftext|>"  # CLIP's end, padding and unknown token
    bpe = Tokenizer(models.BPE(unk_token=end, end_of_word_suffix="</w>"))
    bpe.normalizer, bpe.pre_tokenizer = normalizers.Lowercase(), pre_tokenizers.Whitespace()
    bpe.decoder = decoders.BPEDecoder(suffix="</w>")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>"
    )
    bpe.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    special = {"bos_token": "<|startoftext|>", "eos_token": end, "pad_token": end, "unk_token": end}
    tokenizer = CLIPTokenizerFast(tokenizer_object=bpe, model_max_length=32, **special)
    bos, eos = bpe.token_to_id("<|startoftext|>"), bpe.token_to_id("<|endoftext|>")
    torch.manual_seed(13)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={
            **small,
            "vocab_size": bpe.get_vocab_size(),
            "max_position_embeddings": 32,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": eos,
        },
        vision_config={**small, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    CLIPModel(config).save_pretrained(folder / "raw")
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder / "raw")
    SentenceTransformer(str(folder / "raw"), device="cpu").save(str(folder / "st"))
    return folder / "st"


def bundled_copy(folder: Path, **config: Any) -> Path:
    """A copy of the bundled model whose config_sentence_transformers.json also says ``config``
    (``prompts``, ``default_prompt_name``...)."""
    shutil.copytree(tokenizer_source(), folder)
    path = folder / "config_sentence_transformers.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def perturb_weights(folder: Path, scale: float = 0.05, seed: int = 0) -> None:
    """Replace ``folder``'s model.safetensors by weights moved by noise of ``scale``: another model
    under the same name, the file of the same size (what a retrained checkpoint copied over looks like)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    moved = {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        if tensor.is_floating_point()
        else tensor
        for name, tensor in weights.items()
    }
    save_file(moved, str(path), metadata={"format": "pt"})


def bare_bert(folder: Path) -> Path:
    """A two-layer BERT with random weights as transformers saves it (no module list, no head): what
    sentence-transformers reads as a dense model with mean pooling, and any other kind only by
    building weights the files do not have."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(5)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    BertModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_source()).save_pretrained(folder)
    return folder


def static_embedding(folder: Path, dim: int = 256) -> Path:
    """A static-embedding model (sentence-transformers' StaticEmbedding: a token lookup and a mean,
    model2vec-style) over the bundled model's tokenizer, with random weights, saved. Its forward
    costs almost nothing: a run's speed with it is the speed of everything around the forward."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer

    torch.manual_seed(11)
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_source()) / "tokenizer.json"))
    model = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=dim)], device="cpu")
    model.save(str(folder))
    return folder


def model2vec_folder(folder: Path, dim: int = 64, normalize: bool = True) -> Path:
    """A model as model2vec's own ``save_pretrained`` writes it (model2vec/hf_utils.py): the token
    vectors as ``embeddings`` in model.safetensors at the folder's top, tokenizer.json, its
    config.json (model_type "model2vec"), and a modules.json naming sentence-transformers'
    StaticEmbedding at "." and, where the config normalises, Normalize. Random vectors over the
    bundled model's tokenizer."""
    import json

    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_source()) / "tokenizer.json"))
    vectors = np.random.default_rng(12).standard_normal((tokenizer.get_vocab_size(), dim)).astype(np.float32)
    save_file({"embeddings": vectors}, str(folder / "model.safetensors"))
    tokenizer.save(str(folder / "tokenizer.json"), pretty=False)
    config = {
        "model_type": "model2vec",
        "architectures": ["StaticModel"],
        "hidden_dim": dim,
        "normalize": normalize,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    modules = [{"idx": 0, "name": "0", "path": ".", "type": "sentence_transformers.models.StaticEmbedding"}]
    if normalize:
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules, indent=4))
    return folder


def decoder_embedding(folder: Path) -> Path:
    """A decoder embedding model of Qwen3-Embedding's shape with random weights: a two-layer Qwen3
    decoder (grouped-query attention, rotary positions), the last token's hidden state
    (``lasttoken`` pooling), unit length; the bundled model's tokenizer padding on the left, as
    Qwen3-Embedding's does (its own tokenizer cannot be fetched offline)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    torch.manual_seed(13)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source())
    tokenizer.padding_side = "left"
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    Qwen3Model(config).save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    word = Transformer(str(folder / "hf"), max_seq_length=256)
    pooling = Pooling(word.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(modules=[word, pooling, Normalize()], device="cpu").save(str(folder / "st"))
    return folder / "st"
