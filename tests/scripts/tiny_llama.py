"""A tiny Llama, its tokenizer and a text dataset on disk, for training CLIs that load everything by path.

    tiny_llama.py FOLDER    # writes FOLDER/model (config, weights, tokenizer) and FOLDER/data/train.jsonl

Built from a config with a fixed seed, with nothing downloaded, so that a third-party CLI can run offline.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = "zero stage three shards every parameter across ranks and gathers it before each module runs".split()


def texts(rows: int = 256) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (24,), generator=g)) for _ in range(rows)]


def main(folder: Path) -> None:
    rows = texts()
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(rows, trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<pad>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="</s>", model_max_length=64)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
