"""generate() and training steps in turn, as TRL's GRPO/RLOO/online-DPO trainers run them under ZeRO-3.

    generate_train.py OUT MODE [--checkpointing] [--modules-to-save]   # MODE: stock | workaround | guarded; writes OUT/MODE.rank<R>.json

A tiny Llama with peft LoRA adapters; with --checkpointing, non-reentrant gradient checkpointing over the
frozen base weights; with --modules-to-save, `modules_to_save=["lm_head"]` (peft trains a copy of the
output projection beside the frozen original). Each step trains on a batch,
then generates inside DeepSpeed's `unwrap_model_for_generation` (hooks removed, weights gathered; on exit
the hooks are registered again, which numbers every module anew). On DeepSpeed 0.15.4-0.19.1 the next
training forward raises `IndexError: pop from an empty deque`. "workaround" is what TRL >= 1.5 does after
adding the hooks back (invalidate the coordinator's trace) and, with checkpointing, no persistent
parameters (`stage3_param_persistence_threshold: 0`): DeepSpeed 0.15.4-0.19.2 (at least) leave a
persistent parameter released while the first step's backward recomputes a checkpointed layer, and the
recompute's shapes then differ (torch.utils.checkpoint.CheckpointError).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

STEPS = 5


def main(out: Path, mode: str, checkpointing: bool, modules_to_save: bool) -> None:
    if mode == "guarded":
        import z3guard

        z3guard.install()
    import deepspeed
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    lm = LlamaForCausalLM(config)
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.enable_input_require_grads()
    model = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                          lora_dropout=0.0, task_type="CAUSAL_LM",
                                          modules_to_save=["lm_head"] if modules_to_save else None))
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(trained, lr=1e-2), model_parameters=trained,
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 3, **({"stage3_param_persistence_threshold": 0}
                                                     if mode == "workaround" and checkpointing else {})},
                "zero_allow_untested_optimizer": True})
    result: dict = {"losses": {}, "generated": {}, "crash": None}
    g = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(1, STEPS + 1):
            ids = torch.randint(2, 128, (2, 12), generator=g)
            engine.train()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            # The step ends by gathering the persistent parameters as async gloo all-gathers and waits for the
            # last one only (DeepSpeed through 0.19.8 at least); gloo runs them on two threads, so generate()
            # could read a parameter still being written, in stock and z3guard alike. A gloo barrier waits
            # for every earlier collective first.
            torch.distributed.barrier()
            result["losses"][str(step)] = loss.item()
            with unwrap_model_for_generation(engine) as unwrapped:
                unwrapped.module.eval()
                with torch.no_grad():
                    tokens = unwrapped.module.generate(input_ids=ids[:, :4], max_new_tokens=4, do_sample=False)
            if mode == "workaround":
                coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
                if not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
            result["generated"][str(step)] = tokens.tolist()
    except Exception as exc:  # noqa: BLE001 - the crash is the result
        result["crash"] = f"{type(exc).__name__}: {exc}"
    if mode == "guarded":
        result["summary"] = z3guard.summary(engine)
    # The trained weights as the optimizer holds them (a crashed run may end without the barrier above).
    from deepspeed.utils import safe_get_full_fp32_param

    masters = [safe_get_full_fp32_param(p).detach().float() for p in trained]
    result["adapters"] = hashlib.sha256(b"".join(m.numpy().tobytes() for m in masters)).hexdigest()
    (out / f"{mode}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "--checkpointing" in sys.argv[3:], "--modules-to-save" in sys.argv[3:])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo/shm threads can abort there after a clean run
