"""The megatron-core train backend (`train.kind=megatron`): tensor, pipeline and data parallel.

- `model.py`: a Megatron `GPTModel` from an HF config (Llama, Qwen2, Qwen3 families);
- `convert.py`: HF <-> Megatron weights, tensor-parallel shard by shard, bit-exact both ways;
- `logprobs.py`: log-probs and entropy from vocabulary-parallel logits;
- `backend.py`: `MegatronBackend`, one rank of the TrainBackend (the same loss as the torch
  backend, `trainer.algorithms.policy_loss`); `trainer/cluster.py` starts the ranks on Ray;
- `compat.py`: the workarounds that let megatron-core run on a machine without CUDA (tests, CPU
  runs), installed only there.

Importing these modules imports no megatron-core; building the backend does.
"""
