"""Callbacks that add Castor to a framework's training loop.

- `worker_lib.integrations.lightning.CastorCallback`: PyTorch Lightning (`pip install castor[lightning]`).
- `worker_lib.integrations.transformers.CastorCallback`: the Hugging Face `Trainer`
  (`pip install castor[transformers]`).

Each module imports its framework when it is imported itself; `import worker_lib` never does.
"""
